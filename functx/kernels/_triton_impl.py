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
        # ieee: fp32 products in full precision, as torch's own matmuls by default (Triton's default
        # for fp32 is TF32, a relative error of ~1e-3)
        tile += tl.dot(left.to(ACC), tl.trans(right.to(ACC)), input_precision="ieee")
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


@triton.jit
def _layer_norm_affine_kernel(
    x_ptr, g_ptr, weight_ptr, bias_ptr, rows, width, eps,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """One (sample, row block): each row's mean and variance, x̂, then Σ g ⊙ x̂ and Σ g over
    the block's rows, added into the sample's (width,) sums. x, g: contiguous (B, rows, width)."""
    b = tl.program_id(0)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    mask = (t[:, None] < rows) & (d[None, :] < width)
    offsets = b * rows * width + t[:, None] * width + d[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(ACC)
    g = tl.load(g_ptr + offsets, mask=mask, other=0.0).to(ACC)
    mean = tl.sum(x, axis=1) / width
    centred = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) / width + eps)
    weight = tl.sum(g * centred * rstd[:, None], axis=0)
    bias = tl.sum(g, axis=0)
    tl.atomic_add(weight_ptr + b * width + d, weight, mask=d < width)
    tl.atomic_add(bias_ptr + b * width + d, bias, mask=d < width)


@triton.jit
def _embedding_norms_kernel(
    ids_ptr, order_ptr, g_ptr, out_ptr, steps, dim, padding_idx, g_sb, g_st, g_sd,
    BLOCK_D: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """One (sample, feature block): walk the sample's tokens sorted by id, summing each id's
    rows; at the end of an id's run add the sum's squared norm (over this block of features:
    the squared norm is a sum over features, so blocks add up). Padding tokens add nothing."""
    b = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    run = tl.zeros((BLOCK_D,), dtype=ACC)
    total = tl.sum(run, axis=0)
    for t in range(0, steps):
        token = tl.load(ids_ptr + b * steps + t)
        following = tl.load(ids_ptr + b * steps + tl.minimum(t + 1, steps - 1))
        source = tl.load(order_ptr + b * steps + t)
        row = tl.load(g_ptr + b * g_sb + source * g_st + d * g_sd, mask=d < dim, other=0.0).to(ACC)
        run += tl.where(token != padding_idx, row, 0.0)
        last = (token != following) | (t == steps - 1)
        total += tl.where(last, tl.sum(run * run, axis=0), 0.0)
        run = tl.where(last, 0.0, run)
    tl.atomic_add(out_ptr + b, total)
