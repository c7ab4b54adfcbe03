"""functx/kernels/triton_kernels.py: the Triton ghost-norm kernel, run on CPU tensors in
Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported: a fresh process),
against the materialised per-sample gradients' norms; float32 and float64; tiles on and off
the diagonal, ragged edges, one step; and the operator's CUDA kernel function choosing it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import torch
from functx.kernels import ops, triton_kernels
assert triton_kernels.available
torch.manual_seed(0)
shapes = [(2, 5, 3, 4), (3, 40, 7, 9), (1, 1, 2, 2), (2, 33, 40, 5), (1, 16, 16, 16), (2, 17, 1, 20)]
for dtype, tol in ((torch.float32, 1e-4), (torch.float64, 1e-10)):
    for batch, steps, d_in, d_out in shapes:
        a = torch.randn(batch, steps, d_in, dtype=dtype)
        g = torch.randn(batch, steps, d_out, dtype=dtype)
        expected = torch.einsum("bto,bti->boi", g, a).flatten(1).pow(2).sum(1)
        for block_t, block_d in ((16, 16), (32, 16)):
            got = triton_kernels.ghost_norms_sq(a, g, block_t=block_t, block_d=block_d)
            assert got.dtype == dtype
            torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
        # the operator's CUDA kernel function: Triton where the ghost norm pays, torch otherwise
        torch.testing.assert_close(ops.linear_weight_norms_sq_cuda(a, g), expected, rtol=tol, atol=tol)
print("ok")
"""


def test_ghost_norm_kernel_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
