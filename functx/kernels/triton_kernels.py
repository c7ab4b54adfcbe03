"""Triton kernels of the per-sample operators (functx/kernels/ops.py), the CUDA path.

`ghost_norms_sq(a, g)`: per sample b, Σ_{t,s} (a_bt·a_bs)(g_bt·g_bs) = ‖Σ_t g_bt a_btᵀ‖², the
ghost norm of a linear layer on sequences, as one kernel: each program takes a (sample,
row block, column block) tile of the T×T products, builds both tiles from blocks of the
features (never the T×T matrices in memory), multiplies them and adds the tile's sum into
the sample's norm; only tiles on or above the diagonal are computed, the others counted
twice (the products are symmetric).

`layer_norm_affine_grads(x, g, normalized_ndim, eps)`: each sample's LayerNorm weight and
bias gradients in one pass: per block of rows the statistics, x̂ and both sums (x̂ never
in memory); a row must fit one block (`fits_one_block`).

`embedding_norms_sq(ids, g, num_embeddings, padding_idx)`: each sample's embedding-gradient
norm from its tokens sorted by id (torch's sort), one walk per (sample, feature block)
summing each id's rows, no (B, V, D) and no per-(sample, id) table.

The other operators' CUDA inputs run the torch code, on cuBLAS/cuDNN/index_add: the weighted
sums are one GEMM or one scatter, the per-sample convolution gradients a cuDNN grouped
convolution.

Without `triton` installed, `available` is False and the operators' CUDA inputs take the
torch code. The kernels also run on CPU tensors with `TRITON_INTERPRET=1` set before
`triton` is imported (tests/kernels/test_triton.py, small shapes: ~1500x slower than torch).
"""

from __future__ import annotations

import importlib.util

import torch

available = importlib.util.find_spec("triton") is not None  # an optional dependency (the `triton` extra)


def ghost_norms_sq(a: torch.Tensor, g: torch.Tensor, block_t: int = 32, block_d: int = 32) -> torch.Tensor:
    """(B, T, d_in), (B, T, d_out) -> (B,): ‖Σ_t g_bt a_btᵀ‖² per sample, by the Triton kernel."""
    triton = _require_triton()
    from ._triton_impl import _ghost_norms_kernel

    batch, length, d_in = a.shape
    accumulate, acc = _accumulator(g.dtype)
    out = torch.zeros(batch, dtype=accumulate, device=a.device)
    blocks = triton.cdiv(length, block_t)
    _ghost_norms_kernel[(batch, blocks, blocks)](
        a, g, out, length, d_in, g.shape[2],
        a.stride(0), a.stride(1), a.stride(2), g.stride(0), g.stride(1), g.stride(2),
        BLOCK_T=block_t, BLOCK_D=block_d, ACC=acc,
    )  # fmt: skip
    return out.to(g.dtype)


def _require_triton():
    if not available:
        raise RuntimeError("functx.kernels.triton_kernels: triton is not installed (pip install triton)")
    import triton

    return triton


def _accumulator(dtype):
    """The sums' dtype, as torch's and as Triton's: float64 for float64 inputs, else float32."""
    import triton.language as tl

    wide = dtype == torch.float64
    return (torch.float64 if wide else torch.float32), (tl.float64 if wide else tl.float32)


MAX_ROW_BLOCK = 8192  # elements of one program's (rows × width) block of a normalised input


def fits_one_block(x: torch.Tensor, normalized_ndim: int) -> bool:
    width = 1
    for size in x.shape[x.dim() - normalized_ndim :]:
        width *= size
    return 0 < width <= MAX_ROW_BLOCK


def layer_norm_affine_grads(x: torch.Tensor, g: torch.Tensor, normalized_ndim: int, eps: float):
    """(B, *, *N), same shape -> (B, *N) twice: Σ g ⊙ x̂ and Σ g per sample, by the Triton kernel."""
    triton = _require_triton()

    from ._triton_impl import _layer_norm_affine_kernel

    normalized = x.shape[x.dim() - normalized_ndim :]
    batch = x.shape[0]
    x3, g3 = x.reshape(batch, -1, normalized.numel()).contiguous(), g.reshape(batch, -1, normalized.numel()).contiguous()
    rows, width = x3.shape[1], x3.shape[2]
    block_d = triton.next_power_of_2(width)
    block_t = max(1, min(triton.next_power_of_2(max(rows, 1)), MAX_ROW_BLOCK // block_d))
    accumulate, acc = _accumulator(g.dtype)
    weight = torch.zeros(batch, width, dtype=accumulate, device=x.device)
    bias = torch.zeros_like(weight)
    if rows:
        _layer_norm_affine_kernel[(batch, triton.cdiv(rows, block_t))](
            x3, g3, weight, bias, rows, width, eps, BLOCK_T=block_t, BLOCK_D=block_d, ACC=acc
        )
    shape = (batch, *normalized)
    return weight.to(g.dtype).view(shape), bias.to(g.dtype).view(shape)


def embedding_norms_sq(ids: torch.Tensor, g: torch.Tensor, num_embeddings: int, padding_idx, block_d: int = 64):
    """(B, T) ids, (B, T, D) -> (B,): the squared norm of each sample's embedding gradient."""
    triton = _require_triton()

    from ._triton_impl import _embedding_norms_kernel

    batch, steps = ids.shape
    accumulate, acc = _accumulator(g.dtype)
    out = torch.zeros(batch, dtype=accumulate, device=g.device)
    if steps and batch:
        sorted_ids, order = ids.sort(dim=1)
        _embedding_norms_kernel[(batch, triton.cdiv(g.shape[2], block_d))](
            sorted_ids.contiguous(), order.contiguous(), g, out, steps, g.shape[2],
            -1 if padding_idx is None else padding_idx, g.stride(0), g.stride(1), g.stride(2),
            BLOCK_D=block_d, ACC=acc,
        )  # fmt: skip
    return out.to(g.dtype)
