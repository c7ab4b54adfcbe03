import os

import pytest
import torch


def pytest_configure(config):
    """FUNCTX_TEST_DEVICE=cuda runs the suite with CUDA as torch's default device (tensors the
    tests make without a device land there): scripts/gpu_check.py's CUDA pass. Unset, CPU."""
    device = os.environ.get("FUNCTX_TEST_DEVICE")
    if device:
        torch.set_default_device(device)


@pytest.fixture(autouse=True)
def _seed_and_clean_stack():
    """Every test starts from a fixed seed and must leave the interpreter stack empty."""
    from functx.core import current_stack

    torch.manual_seed(0)
    yield
    assert current_stack() == (), "a transform left its interpreter on the stack"
