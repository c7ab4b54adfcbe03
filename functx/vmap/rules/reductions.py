"""Reductions, scans, softmax and sorting: the batch dim is moved out of the way of the
reduced dims (`batch_all_rule`); reductions over everything reduce all logical dims."""

import math

import torch

from ..batched_tensor import VMAP_RULES
from ..templates import batch_all_rule, materialize

aten = torch.ops.aten

for _op in (
    aten.sum.dim_IntList,
    aten.nansum.default,
    aten.mean.dim,
    aten.nanmean.default,
    aten.amax.default,
    aten.amin.default,
    aten.aminmax.default,
    aten.argmax.default,
    aten.argmin.default,
    aten.prod.dim_int,
    aten.var.correction,
    aten.std.correction,
    aten.var_mean.correction,
    aten.std_mean.correction,
    aten.var.dim,
    aten.std.dim,
    aten.logsumexp.default,
    aten.max.dim,
    aten.min.dim,
    aten.median.dim,
    aten.nanmedian.dim,
    aten.mode.default,
    aten.kthvalue.default,
    aten.all.dim,
    aten.all.dims,
    aten.any.dim,
    aten.any.dims,
    aten.linalg_vector_norm.default,
    aten.norm.ScalarOpt_dim,
    aten.norm.ScalarOpt_dim_dtype,
    aten.count_nonzero.dim_IntList,
    aten.count_nonzero.default,
    aten._softmax.default,
    aten.softmax.int,
    aten.log_softmax.int,
    aten._log_softmax.default,
    aten._softmax_backward_data.default,
    aten._log_softmax_backward_data.default,
    aten.cumsum.default,
    aten.cumsum_.default,
    aten.cumprod.default,
    aten.cummax.default,
    aten.cummin.default,
    aten.logcumsumexp.default,
    aten.sort.default,
    aten.sort.stable,
    aten.argsort.default,
    aten.argsort.stable,
    aten.topk.default,
    aten.msort.default,
):
    VMAP_RULES.set(_op, batch_all_rule(_op, empty_means_all=True))


def _full_reduction(dim_op, pick=None):
    """Rule for a reduction over every element: flatten the logical dims, reduce dim 1."""

    def rule(interp, x, *args, **kwargs):
        # explicit sizes: a -1 next to a batch size of 0 is ambiguous to torch
        flat = x._value.reshape(interp.batch_size, math.prod(x.shape))
        out = dim_op(flat, 1, *args, **kwargs)
        return interp.wrap(out if pick is None else out[pick])

    return rule


def _register_full(op, dim_op, pick=None):
    VMAP_RULES.set(op, _full_reduction(dim_op, pick))


_register_full(aten.sum.default, lambda t, d, dtype=None: aten.sum.dim_IntList(t, [d], dtype=dtype))
_register_full(aten.mean.default, lambda t, d, dtype=None: aten.mean.dim(t, [d], dtype=dtype))
_register_full(aten.prod.default, lambda t, d, dtype=None: aten.prod.dim_int(t, d, dtype=dtype))
_register_full(aten.max.default, lambda t, d: aten.amax.default(t, [d]))
_register_full(aten.min.default, lambda t, d: aten.amin.default(t, [d]))
_register_full(aten.all.default, lambda t, d: aten.all.dim(t, d))
_register_full(aten.any.default, lambda t, d: aten.any.dim(t, d))
_register_full(aten.median.default, lambda t, d: aten.median.dim(t, d), pick=0)
_register_full(aten.nanmedian.default, lambda t, d: aten.nanmedian.dim(t, d), pick=0)
_register_full(aten.norm.Scalar, lambda t, d, p=2: aten.linalg_vector_norm.default(t, p, [d]))
_register_full(aten.var.default, lambda t, d, unbiased=True: aten.var.correction(t, [d], correction=int(unbiased)))
_register_full(aten.std.default, lambda t, d, unbiased=True: aten.std.correction(t, [d], correction=int(unbiased)))


# -- spectral transforms and hashing: dim lists, shifted past the batch dim --------------
for _op in (aten._fft_r2c.default, aten._fft_c2c.default, aten._fft_c2r.default):
    VMAP_RULES.set(_op, batch_all_rule(_op, empty_means_all=False))
VMAP_RULES.set(aten.hash_tensor.default, batch_all_rule(aten.hash_tensor.default, empty_means_all=True))


# -- searching sorted sequences -------------------------------------------------------------
def _searchsorted_batched(interp, boundaries, values, sorter=None, **flags):
    """searchsorted with `boundaries` of any logical rank, at least one argument batched.

    1-d boundaries are shared by every value of an element: with only the values batched
    they stay 1-d (one call over all values); otherwise each element's values are
    flattened to one row against that element's row of boundaries. N-d boundaries
    already pair their leading dims with the values' leading dims, batch dim included.
    """
    scalar_value = not isinstance(values, torch.Tensor)
    if boundaries.dim() > 1:
        out = aten.searchsorted.Tensor(
            materialize(interp, boundaries),
            materialize(interp, values),
            sorter=None if sorter is None else materialize(interp, sorter),
            **flags,
        )
        return interp.wrap(out)
    if not interp.is_batched(boundaries) and not interp.is_batched(sorter):
        if scalar_value:  # nothing batched at this level: cannot happen, but stay correct
            return aten.searchsorted.Scalar(boundaries, values, sorter=sorter, **flags)
        return interp.wrap(aten.searchsorted.Tensor(boundaries, values._value, sorter=sorter, **flags))
    batch = interp.batch_size
    if scalar_value:
        rows = torch.full((batch, 1), values, dtype=torch.result_type(boundaries, values), device=boundaries.device)
        shape = ()
    else:
        rows = materialize(interp, values).reshape(batch, math.prod(values.shape))
        shape = values.shape
    out = aten.searchsorted.Tensor(
        materialize(interp, boundaries),
        rows,
        sorter=None if sorter is None else materialize(interp, sorter),
        **flags,
    )
    return interp.wrap(out.reshape(batch, *shape))


@VMAP_RULES.register(aten.searchsorted.Tensor, aten.searchsorted.Scalar)
def _searchsorted(interp, sorted_sequence, values, *, sorter=None, **flags):
    return _searchsorted_batched(interp, sorted_sequence, values, sorter, **flags)


@VMAP_RULES.register(aten.bucketize.Tensor, aten.bucketize.Scalar)
def _bucketize(interp, values, boundaries, **flags):
    return _searchsorted_batched(interp, boundaries, values, **flags)


# prims reductions (from torch._refs-based decompositions): `dims=None` is every dim,
# `dims=[]` reduces nothing.
for _op in (
    torch.ops.prims.sum.default,
    torch.ops.prims.prod.default,
    torch.ops.prims.amax.default,
    torch.ops.prims.amin.default,
    torch.ops.prims.var.default,
    torch.ops.prims.xor_sum.default,
):
    VMAP_RULES.set(_op, batch_all_rule(_op, empty_means_all=False))


# -- histc: torch's binning arithmetic, per element, in one scatter_add ---------------------
@VMAP_RULES.register(aten.histc.default)
def _histc(interp, x, bins=100, min=0, max=0):
    """Same arithmetic as ATen's histc kernel (linear interpolation between the outer
    edges, computed in the input dtype; the top edge falls in the last bin; values outside
    the edges and NaNs are ignored), with each element's own edges when min == max."""
    value = materialize(interp, x).reshape(interp.batch_size, math.prod(x.shape))
    dtype = value.dtype
    if min == max:  # data range per element (0, 0 for empty elements), widened if flat
        if value.shape[1]:
            low, high = value.amin(1).double(), value.amax(1).double()
        else:
            low = high = value.new_zeros(value.shape[0], dtype=torch.float64)
    else:
        low = value.new_full((value.shape[0],), min, dtype=torch.float64)
        high = value.new_full((value.shape[0],), max, dtype=torch.float64)
    if type(value) is torch.Tensor and not bool(torch.isfinite(low).all() & torch.isfinite(high).all()):
        raise RuntimeError(f"torch.histc: range of [{min}, {max}] is not finite")  # as torch does
    flat = low == high
    low, high = torch.where(flat, low - 1, low).to(dtype)[:, None], torch.where(flat, high + 1, high).to(dtype)[:, None]
    inside = (value >= low) & (value <= high)
    position = ((value - low) * bins / (high - low)).nan_to_num(0).clamp(0, bins - 1).to(torch.int64)
    counts = value.new_zeros(value.shape[0], bins)
    return interp.wrap(counts.scatter_add_(1, position, inside.to(dtype)))
