"""functx/kernels/triton_kernels.py: the Triton kernels (ghost norm, LayerNorm affine
gradients, embedding norms), run on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1,
set before triton is imported: a fresh process), against materialised per-sample gradients
and per-sample autograd loops; float32 and float64; tiles on and off the diagonal, ragged
edges, one step, empty sequences, repeated and padding ids; and the operators' CUDA kernel
functions choosing them."""

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
    # LayerNorm's per-sample affine gradients, against a per-sample autograd loop
    for shape, nd in (((2, 3, 4), 1), ((3, 5, 2, 6), 2), ((1, 7), 1), ((2, 0, 4), 1), ((3, 33, 20), 1)):
        x, g = torch.randn(*shape, dtype=dtype), torch.randn(*shape, dtype=dtype)
        layer = torch.nn.LayerNorm(shape[len(shape) - nd:], eps=1e-5).to(dtype)
        rows = [torch.autograd.grad(layer(x[b:b + 1]), (layer.weight, layer.bias), g[b:b + 1], allow_unused=True,
                                    materialize_grads=True) for b in range(shape[0])]
        expected = tuple(torch.stack(parts) for parts in zip(*rows))
        got = triton_kernels.layer_norm_affine_grads(x, g, nd, 1e-5)
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
        torch.testing.assert_close(ops.layer_norm_affine_grads_cuda(x, g, nd, 1e-5), expected, rtol=tol, atol=tol)
    # embedding norms: repeated ids, padding, feature blocks with a ragged edge, empty sequences
    for batch, steps, vocab, dim in ((2, 5, 3, 4), (3, 9, 4, 70), (1, 1, 2, 3), (2, 0, 3, 4)):
        ids, g = torch.randint(0, vocab, (batch, steps)), torch.randn(batch, steps, dim, dtype=dtype)
        for pad in (None, 1):
            dense = torch.zeros(batch, vocab, dim, dtype=dtype)
            for b in range(batch):
                for t in range(steps):
                    if ids[b, t] != pad:
                        dense[b, ids[b, t]] += g[b, t]
            expected = dense.flatten(1).pow(2).sum(1)
            torch.testing.assert_close(triton_kernels.embedding_norms_sq(ids, g, vocab, pad, block_d=32), expected, rtol=tol, atol=tol)
            torch.testing.assert_close(ops.embedding_norms_sq_cuda(ids, g, vocab, pad), expected, rtol=tol, atol=tol)
print("ok")
"""


def test_ghost_norm_kernel_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
