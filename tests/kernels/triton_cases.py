"""The Triton kernels' cases against independent references, on one device: run by
tests/kernels/test_triton.py on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1, a
fresh process) and by scripts/gpu_check.py on CUDA tensors (the compiled kernels).

The references are plain torch on the same inputs: an einsum of the materialised per-sample
weight gradients, a per-sample autograd loop through `nn.LayerNorm`, a Python loop adding
each token's gradient row into a dense (B, V, D) table. float32 at rtol 1e-4 (a kernel whose
matrix products ran in TF32 would miss it) and float64 at 1e-10."""

from __future__ import annotations

import torch

LINEAR_SHAPES = [(2, 5, 3, 4), (3, 40, 7, 9), (1, 1, 2, 2), (2, 33, 40, 5), (1, 16, 16, 16), (2, 17, 1, 20)]
LAYER_NORM_SHAPES = (((2, 3, 4), 1), ((3, 5, 2, 6), 2), ((1, 7), 1), ((2, 0, 4), 1), ((3, 33, 20), 1))
EMBEDDING_SHAPES = ((2, 5, 3, 4), (3, 9, 4, 70), (1, 1, 2, 3), (2, 0, 3, 4))


def check_kernels(device: str = "cpu", extra_linear_shapes=(), with_operators: bool = True) -> int:
    """Every case on `device`; raises AssertionError at the first mismatch, else returns the
    number of comparisons made. with_operators=False: the kernels only, not functx.kernels.ops'
    CUDA functions choosing them (importing ops imports functx)."""
    from functx.kernels import triton_kernels

    if with_operators:
        from functx.kernels import ops

    assert triton_kernels.available
    torch.manual_seed(0)
    checks = 0

    def close(got, expected, tol):
        nonlocal checks
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
        checks += 1

    for dtype, tol in ((torch.float32, 1e-4), (torch.float64, 1e-10)):
        options = {"dtype": dtype, "device": device}
        for batch, steps, d_in, d_out in [*LINEAR_SHAPES, *extra_linear_shapes]:
            a = torch.randn(batch, steps, d_in, **options)
            g = torch.randn(batch, steps, d_out, **options)
            expected = torch.einsum("bto,bti->boi", g.double(), a.double()).flatten(1).pow(2).sum(1).to(dtype)
            for block_t, block_d in ((16, 16), (32, 16)):
                got = triton_kernels.ghost_norms_sq(a, g, block_t=block_t, block_d=block_d)
                assert got.dtype == dtype and got.device == a.device
                close(got, expected, tol)
            # the operator's CUDA kernel function: Triton where the ghost norm pays, torch otherwise
            if with_operators:
                close(ops.linear_weight_norms_sq_cuda(a, g), expected, tol)
        # LayerNorm's per-sample affine gradients, against a per-sample autograd loop
        for shape, nd in LAYER_NORM_SHAPES:
            x, g = torch.randn(*shape, **options), torch.randn(*shape, **options)
            layer = torch.nn.LayerNorm(shape[len(shape) - nd :], eps=1e-5).to(**options)
            rows = [
                torch.autograd.grad(layer(x[b : b + 1]), (layer.weight, layer.bias), g[b : b + 1],
                                    allow_unused=True, materialize_grads=True)
                for b in range(shape[0])
            ]  # fmt: skip
            expected = tuple(torch.stack(parts) for parts in zip(*rows))
            close(triton_kernels.layer_norm_affine_grads(x, g, nd, 1e-5), expected, tol)
            if with_operators:
                close(ops.layer_norm_affine_grads_cuda(x, g, nd, 1e-5), expected, tol)
        # embedding norms: repeated ids, padding, feature blocks with a ragged edge, empty sequences
        for batch, steps, vocab, dim in EMBEDDING_SHAPES:
            ids, g = torch.randint(0, vocab, (batch, steps), device=device), torch.randn(batch, steps, dim, **options)
            for pad in (None, 1):
                dense = torch.zeros(batch, vocab, dim, dtype=torch.float64)
                for b in range(batch):
                    for t in range(steps):
                        if ids[b, t] != pad:
                            dense[b, ids[b, t]] += g[b, t].cpu().double()
                expected = dense.flatten(1).pow(2).sum(1).to(dtype=dtype, device=device)
                close(triton_kernels.embedding_norms_sq(ids, g, vocab, pad, block_d=32), expected, tol)
                if with_operators:
                    close(ops.embedding_norms_sq_cuda(ids, g, vocab, pad), expected, tol)
    return checks
