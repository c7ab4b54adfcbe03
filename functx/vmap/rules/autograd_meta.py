"""Ops torch's autograd itself calls on tensors to manage forward gradients (tangents).

A jvp level above a vmap (`jacfwd` = vmap of jvp) keeps batched values under its
wrappers. When torch attaches a tangent to a primal whose layout it cannot share (the
jvp level answers torch's layout checks itself), it allocates a zero tangent laid out
like the primal and copies into it; under vmap that allocation is batched, and per batch
element laid out like the primal (a batched tensor's storage is its physical storage
split in `batch_size` equal parts).
"""

import torch

from ..batched_tensor import VMAP_RULES

aten = torch.ops.aten


def _storage_numel(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes() // t.element_size()


@VMAP_RULES.register(aten._new_zeros_with_same_feature_meta.default)
def _new_zeros_with_same_feature_meta(interp, x, other, self_num_batch_dims=0):
    # Batched (it becomes the tangent of a batched primal, or receives a batched tangent),
    # and per batch element laid out like `other`, so views of the primal apply to it.
    lead = x.shape[:self_num_batch_dims]
    if interp.is_batched(other) or self_num_batch_dims:
        shape = (interp.batch_size, *lead, *other.shape)
        return interp.wrap(torch.zeros(shape, dtype=x.dtype, device=x.device))
    per_sample = _storage_numel(other)
    storage = torch.zeros(interp.batch_size * per_sample, dtype=x.dtype, device=x.device)
    physical = storage.as_strided((interp.batch_size, *other.shape), (per_sample, *other.stride()), other.storage_offset())
    return interp.wrap(physical)


@VMAP_RULES.register(aten.detach.default)
def _detach(interp, x):
    # With a grad or jvp level running on this level's physical tensors
    # (ad/physical_level.py), user code's `detach` is at that level: cut its gradient or
    # tangent only, not the outer levels'.
    value = x._value
    level = interp.physical_grad
    if level is not None and level.stops_gradient_at(interp) and value.requires_grad:
        return interp.wrap(level.stop_gradient(value))
    level = interp.physical_jvp
    if level is not None and level.stops_tangent_at(interp):
        return interp.wrap(level.drop_tangent(value))
    return interp.wrap(value.detach())
