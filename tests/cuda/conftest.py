"""tests/cuda runs on a CUDA device and is skipped without one. FUNCTX_CUDA_TESTS_DEVICE=cpu
runs the same tests on the CPU against the CPU (a smoke run of the tests themselves, which CI
does: the day a GPU is lent, the check must not fail for a bug of its own)."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="session")
def device() -> str:
    forced = os.environ.get("FUNCTX_CUDA_TESTS_DEVICE")
    if forced:
        return forced
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device (FUNCTX_CUDA_TESTS_DEVICE=cpu runs these tests on the CPU)")
    return "cuda"
