"""Views and shape ops. Every rule returns a view of the batched value, so writes
through a view inside vmap land in the tensor it views."""

import functools
import math

import torch
from torch._prims_common import infer_size

from ..batched_tensor import VMAP_RULES
from ..templates import (
    batch_all_rule,
    logical_memory_format,
    materialize,
    normalize_dim,
    raise_unbatched_inplace,
)

aten = torch.ops.aten

# Views addressed by dimension arguments: shift the dims past the batch dim.
for _op in (
    aten.select.int,
    aten.slice.Tensor,
    aten.narrow.default,
    aten.diagonal.default,
    aten.transpose.int,
    aten.movedim.int,
    aten.movedim.intlist,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.unsafe_split.Tensor,
    aten.unsafe_split_with_sizes.default,
    aten.tensor_split.sections,
    aten.tensor_split.indices,
    aten.chunk.default,
    aten.unsafe_chunk.default,
    aten.unbind.int,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.unflatten.int,
    aten.flatten.using_ints,
    aten.unfold.default,
    aten.select_scatter.default,
    aten.slice_scatter.default,
    aten.diagonal_scatter.default,
    aten.flip.default,
    aten.transpose_.default,
    aten.swapdims_.default,
    aten.swapaxes_.default,
    aten.squeeze_.dim,
    aten.squeeze_.dims,
):
    VMAP_RULES.set(_op, batch_all_rule(_op))

for _op in (aten.unsqueeze.default, aten.unsqueeze_.default, aten.diag_embed.default):
    VMAP_RULES.set(_op, batch_all_rule(_op, rank_offset=1))


@VMAP_RULES.register(aten.permute.default)
def _permute(interp, x, dims):
    rank = x.dim()
    return interp.wrap(x._value.permute(0, *(normalize_dim(d, rank) + 1 for d in dims)))


def _per_sample(x, size):
    """`size` with its -1 resolved against one sample: next to a batch size of 0 torch
    cannot resolve it."""
    return infer_size(size, math.prod(x.shape)) if -1 in size else size


@VMAP_RULES.register(aten.view.default)
def _view(interp, x, size):
    return interp.wrap(x._value.view(interp.batch_size, *_per_sample(x, size)))


@VMAP_RULES.register(aten._unsafe_view.default, aten.reshape.default)
def _reshape(interp, x, size):
    # _unsafe_view only ever follows a fresh result, which is contiguous in eager torch;
    # the batched value may not be (the batch dim can sit anywhere in memory), so copy
    # when a view is impossible.
    return interp.wrap(x._value.reshape(interp.batch_size, *_per_sample(x, size)))


@VMAP_RULES.register(aten._reshape_alias.default)
def _reshape_alias(interp, x, size, stride):
    return interp.wrap(x._value.view(interp.batch_size, *size))


@VMAP_RULES.register(aten.view.dtype)
def _view_dtype(interp, x, dtype):
    return interp.wrap(x._value.view(dtype))


@VMAP_RULES.register(aten.expand.default)
def _expand(interp, x, size, implicit=False):
    value = x._value
    logical = x.dim()
    new = len(size) - logical
    if new < 0:
        raise RuntimeError(
            f"expand: the number of sizes provided ({len(size)}) must be greater or equal to the "
            f"number of dimensions in the tensor ({logical})"
        )
    if new:
        value = value.view(value.shape[0], *((1,) * new), *value.shape[1:])
    return interp.wrap(value.expand(value.shape[0], *size))


@VMAP_RULES.register(aten.squeeze.default)
def _squeeze(interp, x):
    dims = [d + 1 for d, s in enumerate(x.shape) if s == 1]
    return interp.wrap(x._value.squeeze(dims) if dims else x._value.view_as(x._value))


@VMAP_RULES.register(aten.squeeze_.default)
def _squeeze_(interp, x):
    dims = [d + 1 for d, s in enumerate(x.shape) if s == 1]
    if dims:
        x._value.squeeze_(dims)
    return x


@VMAP_RULES.register(aten.t_.default)
def _t_(interp, x):
    if x.dim() == 2:
        x._value.transpose_(1, 2)
    return x


@VMAP_RULES.register(aten.as_strided_.default)
def _as_strided_(interp, x, size, stride, storage_offset=None):
    value = x._value
    offset = value.storage_offset() if storage_offset is None else storage_offset
    value.as_strided_([value.shape[0], *size], [value.stride(0), *stride], offset)
    return x


@VMAP_RULES.register(aten.detach_.default)
def _detach_(interp, x):
    x._value.detach_()
    return x


@VMAP_RULES.register(torch.ops.prims.broadcast_in_dim.default)
def _broadcast_in_dim(interp, x, shape, broadcast_dimensions):
    value = x._value
    return interp.wrap(
        torch.ops.prims.broadcast_in_dim.default(
            value, [value.shape[0], *shape], [0, *(d + 1 for d in broadcast_dimensions)]
        )
    )


@VMAP_RULES.register(aten.t.default, aten.numpy_T.default)
def _t(interp, x):
    value = x._value
    return interp.wrap(value.transpose(1, 2) if x.dim() == 2 else value.view_as(value))


@VMAP_RULES.register(aten.as_strided.default)
def _as_strided(interp, x, size, stride, storage_offset=None):
    """Per element, as_strided of that element's slice with offsets counted from the
    slice's own start: right for the usual use, arguments computed from `x.stride()` and
    `x.storage_offset()` (what stft and unfold-like code does), whatever the layout."""
    value = x._value
    offset = value.storage_offset() if storage_offset is None else storage_offset
    return interp.wrap(value.as_strided([value.shape[0], *size], [value.stride(0), *stride], offset))


@VMAP_RULES.register(aten.roll.default)
def _roll(interp, x, shifts, dims=()):
    value = interp.unwrap(x) if interp.is_batched(x) else x.expand(interp.batch_size, *x.shape)
    if len(dims) == 0:  # roll the flattened tensor
        flat = value.reshape(value.shape[0], math.prod(x.shape))
        return interp.wrap(flat.roll(shifts, 1).view(value.shape))
    rank = x.dim()
    return interp.wrap(value.roll(shifts, [normalize_dim(d, rank) + 1 for d in dims]))


def _is_legacy_empty(t) -> bool:
    """torch.cat skips 1-d empty tensors whatever the other inputs' ranks (legacy rule)."""
    return t.dim() == 1 and t.shape[0] == 0


@VMAP_RULES.register(aten.cat.default)
def _cat(interp, tensors, dim=0):
    kept = [t for t in tensors if not _is_legacy_empty(t)] or list(tensors[:1])
    rank = kept[0].dim()
    if rank == 0:
        raise RuntimeError("zero-dimensional tensor (at position 0) cannot be concatenated")
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
    values = [materialize(interp, t).to(dtype) for t in kept]
    return interp.wrap(aten.cat.default(values, normalize_dim(dim, rank, aten.cat.default) + 1))


@VMAP_RULES.register(aten.as_strided_scatter.default)
def _as_strided_scatter(interp, x, src, size, stride, storage_offset=None):
    """Each element scatters into its own fresh contiguous copy of `x` (like the clone in
    as_strided_scatter's definition); one strided view over all copies does every write."""
    out = materialize(interp, x).clone(memory_format=torch.contiguous_format)
    per_sample = out[0].numel() if out.shape[0] else 0
    offset = 0 if storage_offset is None else storage_offset
    view = out.as_strided([out.shape[0], *size], [per_sample, *stride], offset)
    view.copy_(materialize(interp, src))
    return interp.wrap(out)


def _resize_value(interp, x, size):
    """Resize every element to `size` in place, keeping each element's leading values in
    order (as torch.Tensor.resize_ does per tensor): the physical value is re-pointed at a
    (B, *size) tensor; the dispatcher then fixes the wrapper's metadata (inplace_view)."""
    value = x._value
    batch = value.shape[0]
    if tuple(size) == tuple(x.shape):
        return x
    old, new = x.numel(), 1
    for s in size:
        new *= s
    if old == new:
        resized = value.reshape(batch, *size)
    else:
        resized = value.new_empty((batch, *size))
        keep = min(old, new)
        resized.view(batch, new)[:, :keep] = value.reshape(batch, old)[:, :keep]
    value.set_(resized)
    return x


@VMAP_RULES.register(aten.resize_.default)
def _resize_(interp, x, size, *, memory_format=None):
    if not interp.is_batched(x):
        raise_unbatched_inplace(aten.resize_.default, x)
    return _resize_value(interp, x, size)


@VMAP_RULES.register(aten.resize_as_.default)
def _resize_as_(interp, x, template, *, memory_format=None):
    if not interp.is_batched(x):
        if tuple(x.shape) == tuple(template.shape):
            return x  # nothing to write: the batched template only gives the shape
        raise_unbatched_inplace(aten.resize_as_.default, x)
    return _resize_value(interp, x, template.shape)


def _contiguous(interp, x, *, memory_format=torch.contiguous_format):
    """Reached from decompositions (user code's .contiguous() is resolved before dispatch):
    `self` when the logical tensor already is contiguous, else a batch-outermost copy."""
    if x.is_contiguous(memory_format=memory_format):
        return x
    return interp.wrap(x._value.contiguous())


VMAP_RULES.set(aten.contiguous.default, logical_memory_format(aten.contiguous.default, _contiguous))


# Backward of views: the backward op itself on the physical tensor, with the batch dim in the
# input's shape: one op per batch (the decompositions would re-dispatch a factory and a
# scatter through the level). Not `*_scatter` into zeros: select_scatter's and
# slice_scatter's own derivatives refuse complex values (the caller's gradient through
# hessian(hessian) of an FFT's slicing raised), the backward ops' take them.
@VMAP_RULES.register(aten.select_backward.default)
def _select_backward(interp, grad, input_sizes, dim, index):
    value = materialize(interp, grad)
    dim = normalize_dim(dim, len(input_sizes))
    return interp.wrap(aten.select_backward.default(value, [interp.batch_size, *input_sizes], dim + 1, index))


@VMAP_RULES.register(aten.slice_backward.default)
def _slice_backward(interp, grad, input_sizes, dim, start, end, step):
    value = materialize(interp, grad)
    dim = normalize_dim(dim, len(input_sizes))
    return interp.wrap(aten.slice_backward.default(value, [interp.batch_size, *input_sizes], dim + 1, start, end, step))
