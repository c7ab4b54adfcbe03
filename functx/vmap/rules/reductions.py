"""Reductions, scans, softmax and sorting: the batch dim is moved out of the way of the
reduced dims (`batch_all_rule`); reductions over everything reduce all logical dims."""

import torch

from ..batched_tensor import VMAP_RULES
from ..templates import batch_all_rule

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
    aten._softmax.default,
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
        flat = x._value.reshape(interp.batch_size, -1)
        out = dim_op(flat, 1, *args, **kwargs)
        return interp.wrap(out if pick is None else out[pick])

    return rule


def _register_full(op, dim_op, pick=None):
    VMAP_RULES.set(op, _full_reduction(dim_op, pick))


_register_full(aten.sum.default, lambda t, d, dtype=None: aten.sum.dim_IntList(t, [d], dtype=dtype))
_register_full(aten.nansum.default, lambda t, d, dtype=None: aten.nansum.default(t, [d], dtype=dtype))
_register_full(aten.mean.default, lambda t, d, dtype=None: aten.mean.dim(t, [d], dtype=dtype))
_register_full(aten.prod.default, lambda t, d, dtype=None: aten.prod.dim_int(t, d, dtype=dtype))
_register_full(aten.max.default, lambda t, d: aten.amax.default(t, [d]))
_register_full(aten.min.default, lambda t, d: aten.amin.default(t, [d]))
_register_full(aten.all.default, lambda t, d: aten.all.dim(t, d))
_register_full(aten.any.default, lambda t, d: aten.any.dim(t, d))
_register_full(aten.count_nonzero.default, lambda t, d: aten.count_nonzero.dim_IntList(t, [d]))
_register_full(aten.median.default, lambda t, d: aten.median.dim(t, d), pick=0)
_register_full(aten.nanmedian.default, lambda t, d: aten.nanmedian.dim(t, d), pick=0)
_register_full(aten.norm.Scalar, lambda t, d, p=2: aten.linalg_vector_norm.default(t, p, [d]))
_register_full(aten.var.default, lambda t, d, unbiased=True: aten.var.correction(t, [d], correction=int(unbiased)))
_register_full(aten.std.default, lambda t, d, unbiased=True: aten.std.correction(t, [d], correction=int(unbiased)))
