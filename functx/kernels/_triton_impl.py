"""The Triton kernels themselves (imported on first use by triton_kernels.py: importing
triton costs ~90 ms, which `import functx` should not pay)."""

import triton
import triton.language as tl


@triton.jit
def _gram_tile(x_ptr, b, rows, cols, length, width, stride_b, stride_t, stride_d, BLOCK_D: tl.constexpr, ACC: tl.constexpr):
    """The (rows × cols) tile of X_b X_bᵀ, over the features in blocks of BLOCK_D."""
    tile = tl.zeros((rows.shape[0], cols.shape[0]), dtype=ACC)
    for start in range(0, width, BLOCK_D):
        d = start + tl.arange(0, BLOCK_D)
        base = x_ptr + b * stride_b + d[None, :] * stride_d
        left = tl.load(base + rows[:, None] * stride_t, mask=(rows[:, None] < length) & (d[None, :] < width), other=0.0)
        right = tl.load(base + cols[:, None] * stride_t, mask=(cols[:, None] < length) & (d[None, :] < width), other=0.0)
        tile += tl.dot(left.to(ACC), tl.trans(right.to(ACC)))
    return tile


@triton.jit
def _ghost_norms_kernel(
    a_ptr, g_ptr, out_ptr, length, d_in, d_out,
    a_sb, a_st, a_sd, g_sb, g_st, g_sd,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    row_block = tl.program_id(1)
    col_block = tl.program_id(2)
    if col_block >= row_block:  # the upper triangle of tiles; the lower one by symmetry
        rows = row_block * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = col_block * BLOCK_T + tl.arange(0, BLOCK_T)
        aa = _gram_tile(a_ptr, b, rows, cols, length, d_in, a_sb, a_st, a_sd, BLOCK_D, ACC)
        gg = _gram_tile(g_ptr, b, rows, cols, length, d_out, g_sb, g_st, g_sd, BLOCK_D, ACC)
        total = tl.sum(tl.sum(aa * gg, axis=1), axis=0)
        if col_block > row_block:
            total = total * 2
        tl.atomic_add(out_ptr + b, total)
