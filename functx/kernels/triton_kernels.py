"""Triton kernels of the per-sample operators (functx/kernels/ops.py), the CUDA path.

`ghost_norms_sq(a, g)`: per sample b, Σ_{t,s} (a_bt·a_bs)(g_bt·g_bs) = ‖Σ_t g_bt a_btᵀ‖², the
ghost norm of a linear layer on sequences, as one kernel: each program takes a (sample,
row block, column block) tile of the T×T products, builds both tiles from blocks of the
features (never the T×T matrices in memory), multiplies them and adds the tile's sum into
the sample's norm; only tiles on or above the diagonal are computed, the others counted
twice (the products are symmetric).

Without `triton` installed, `available` is False and the operators' CUDA inputs take the
torch code. The kernels also run on CPU tensors with `TRITON_INTERPRET=1` set before
`triton` is imported (tests/kernels/test_triton.py, small shapes: ~1500x slower than torch).
"""

from __future__ import annotations

import torch

import importlib.util

import torch

available = importlib.util.find_spec("triton") is not None  # an optional dependency (the `triton` extra)


def ghost_norms_sq(a: torch.Tensor, g: torch.Tensor, block_t: int = 32, block_d: int = 32) -> torch.Tensor:
    """(B, T, d_in), (B, T, d_out) -> (B,): ‖Σ_t g_bt a_btᵀ‖² per sample, by the Triton kernel."""
    if not available:
        raise RuntimeError("functx.kernels.triton_kernels: triton is not installed (pip install triton)")
    import triton
    import triton.language as tl

    from ._triton_impl import _ghost_norms_kernel

    batch, length, d_in = a.shape
    accumulate = torch.float64 if g.dtype == torch.float64 else torch.float32
    out = torch.zeros(batch, dtype=accumulate, device=a.device)
    blocks = triton.cdiv(length, block_t)
    _ghost_norms_kernel[(batch, blocks, blocks)](
        a, g, out, length, d_in, g.shape[2],
        a.stride(0), a.stride(1), a.stride(2), g.stride(0), g.stride(1), g.stride(2),
        BLOCK_T=block_t, BLOCK_D=block_d, ACC=tl.float64 if accumulate == torch.float64 else tl.float32,
    )  # fmt: skip
    return out.to(g.dtype)
