"""Factories that take a tensor: `new_*` of a batched tensor is batched (so in-place
writes of batched values into it work, as in torch.func)."""

import torch

from ..batched_tensor import VMAP_RULES

aten = torch.ops.aten


def _new_sized(op):
    def rule(interp, x, size, **kwargs):
        return interp.wrap(op(x._value, (interp.batch_size, *size), **kwargs))

    return rule


for _op in (aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default):
    VMAP_RULES.set(_op, _new_sized(_op))


@VMAP_RULES.register(aten.new_full.default)
def _new_full(interp, x, size, fill_value, **kwargs):
    return interp.wrap(x._value.new_full((interp.batch_size, *size), fill_value, **kwargs))


@VMAP_RULES.register(aten.new_empty_strided.default)
def _new_empty_strided(interp, x, size, stride, **kwargs):
    # Each element laid out with the strides asked for, in its own slice of the storage:
    # autograd's CopySlices reads its views back with `as_strided` (vmap's rule counts
    # offsets from each element's slice), so the layout must be the one it asked for.
    extent = 0 if any(s == 0 for s in size) else 1 + sum((s - 1) * st for s, st in zip(size, stride))
    physical = x._value.new_empty_strided((interp.batch_size, *size), (extent, *stride), **kwargs)
    return interp.wrap(physical)
