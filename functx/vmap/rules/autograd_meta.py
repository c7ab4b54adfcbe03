"""Ops torch's autograd itself calls on tensors to manage forward gradients (tangents).

A jvp level above a vmap (`jacfwd` = vmap of jvp) keeps batched values under its
wrappers. When torch attaches a tangent to a primal whose layout it cannot share (the
jvp level answers torch's layout checks itself), it allocates a zero tangent laid out
like the primal and copies into it; under vmap that allocation is batched, and per batch
element laid out like the primal (a batched tensor's storage is its physical storage
split in `batch_size` equal parts).
"""

import torch

from ...core.level_tensor import LevelTensor
from ..batched_tensor import SPECIAL_RULES, VMAP_RULES, BatchedTensor, metadata_question

aten = torch.ops.aten


def _span(t: torch.Tensor) -> int:
    """The elements of storage `t`'s layout reaches (its offset included)."""
    if t.numel() == 0:
        return t.storage_offset()
    return t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1


def _storage_numel(t: torch.Tensor) -> int:
    """The elements of `t`'s storage. A grad or jvp level's wrapper is laid out like its value,
    but its own storage is a placeholder just long enough for that layout (a column of a 3x3
    matrix: 7 elements, not 9): the value's storage is the real one."""
    while isinstance(t, LevelTensor) and type(t) is not BatchedTensor:
        t = t._value
    return t.untyped_storage().nbytes() // t.element_size()


@VMAP_RULES.register(aten._new_zeros_with_same_feature_meta.default)
def _new_zeros_with_same_feature_meta(interp, x, other, self_num_batch_dims=0):
    # Batched (it becomes the tangent of a batched primal, or receives a batched tangent),
    # and per batch element laid out like `other`, so views of the primal apply to it. Made
    # with `new_zeros` of `other`'s value: a fresh buffer of every level below (a tangent
    # written in place later may carry their derivatives: jacfwd of jacfwd).
    lead = x.shape[:self_num_batch_dims]
    below = interp.unwrap(other)
    if interp.is_batched(other) and not self_num_batch_dims:
        # laid out like `other`'s physical value (in_dims=1 leaves it strided; a chunk of a
        # batch along a later dim is not even dense, where zeros_like would lay it out
        # contiguously), so a view's tangent is the same view of the base's tangent
        # (an expanded value, whose elements share memory, gets zeros of its own: a tangent
        # laid out like it could not hold a value per element)
        if any(s == 0 and n > 1 for n, s in zip(below.shape, below.stride())):
            return interp.wrap(torch.zeros_like(below, dtype=x.dtype))
        zeros = below.new_zeros(_span(below), dtype=x.dtype)
        return interp.wrap(zeros.as_strided(below.shape, below.stride(), below.storage_offset()))
    if interp.is_batched(other) or self_num_batch_dims:
        shape = (interp.batch_size, *lead, *other.shape)
        return interp.wrap(below.new_zeros(shape, dtype=x.dtype))
    per_sample = _storage_numel(other)
    storage = below.new_zeros(interp.batch_size * per_sample, dtype=x.dtype)
    physical = storage.as_strided((interp.batch_size, *other.shape), (per_sample, *other.stride()), other.storage_offset())
    return interp.wrap(physical)


@VMAP_RULES.register(aten.detach.default)
def _detach(interp, x):
    # A user's `detach` stops derivatives at every level: detach the physical value (the
    # levels below see a detach of their own). (torch's autograd detaching a saved output is
    # answered before the rules: VmapInterpreter.process.)
    return interp.wrap(x._value.detach())


@VMAP_RULES.register(aten._make_dual.default)
def _make_dual(interp, primal, tangent, level):
    # A jvp level above attaches a tangent to this alias of `primal` (wrapped_forward.py):
    # a new object of this level (or below, where `primal` is not batched here) over the
    # same value. Not a view torch tracks: torch makes the result a view of `primal` itself,
    # one that forward AD must not treat as a view (the tangent is laid out as it comes).
    if interp.is_batched(primal):
        return interp.wrap(primal._value)
    with torch._C._AutoDispatchBelowADInplaceOrView():
        return aten.alias.default(primal)


@VMAP_RULES.register(aten._fw_primal.default)
def _fw_primal(interp, x, level):
    # The primal a jvp level above takes back from its dual: an alias without that tangent.
    return interp.wrap(x._value)


@VMAP_RULES.register(aten.is_same_size.default)
def _is_same_size(interp, a, b):
    return a.shape == b.shape


SPECIAL_RULES[aten.is_same_size.default] = metadata_question(_is_same_size)


def _element_storage_numel(interp, x):
    """The storage size of one batch element: a batched tensor's physical storage is its
    elements' storages side by side (what the rule above makes, and every view of it) when
    its batch stride times the batch size spans it; None for any other layout."""
    if not interp.is_batched(x):
        return _storage_numel(x)
    value = x._value
    total = _storage_numel(value)
    if interp.batch_size == 1:  # one element: its storage is all of it (a size-1 dim's
        return total  # stride is arbitrary: `view` gives it any value)
    if value.stride(0) * interp.batch_size != total:
        return None
    return value.stride(0)


@VMAP_RULES.register(aten._has_same_storage_numel.default)
def _has_same_storage_numel(interp, a, b):
    # torch asks before attaching a tangent whether its layout matches the primal's, per
    # batch element; where unsure, no (torch then copies the tangent into zeros laid out
    # like the primal, the rule above). Two batched tensors laid out alike in memory (same
    # batch stride, same physical storage size) have alike elements, wherever the batch dim
    # lies in memory (in_dims=1 gives batch stride 1): answering no there made torch's
    # forward AD assert on a write into a view ("the tangent have the same layout as primal").
    if interp.is_batched(a) and interp.is_batched(b):
        value_a, value_b = a._value, b._value
        if value_a.stride(0) == value_b.stride(0) and _storage_numel(value_a) == _storage_numel(value_b):
            return True
        # a tangent made laid out like the primal (the rule above) reaches as far into its
        # storage as the primal does into its own: what a view of either needs
        if value_a.stride() == value_b.stride() and _span(value_a) == _span(value_b):
            return True
    numel_a = _element_storage_numel(interp, a)
    return numel_a is not None and numel_a == _element_storage_numel(interp, b)


SPECIAL_RULES[aten._has_same_storage_numel.default] = metadata_question(_has_same_storage_numel)
