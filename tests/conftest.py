import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_and_clean_stack():
    """Every test starts from a fixed seed and must leave the interpreter stack empty."""
    from functx.core import current_stack

    torch.manual_seed(0)
    yield
    assert current_stack() == (), "a transform left its interpreter on the stack"
