"""Views and shape ops. Every rule returns a view of the batched value, so writes
through a view inside vmap land in the tensor it views."""

import torch

from ..batched_tensor import VMAP_RULES
from ..templates import batch_all_rule, normalize_dim

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
    aten.squeeze_.dim,
):
    VMAP_RULES.set(_op, batch_all_rule(_op))

for _op in (aten.unsqueeze.default, aten.unsqueeze_.default, aten.diag_embed.default):
    VMAP_RULES.set(_op, batch_all_rule(_op, rank_offset=1))


@VMAP_RULES.register(aten.permute.default)
def _permute(interp, x, dims):
    rank = x.dim()
    return interp.wrap(x._value.permute(0, *(normalize_dim(d, rank) + 1 for d in dims)))


@VMAP_RULES.register(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view(interp, x, size):
    return interp.wrap(x._value.view(interp.batch_size, *size))


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


@VMAP_RULES.register(aten.t.default, aten.numpy_T.default)
def _t(interp, x):
    value = x._value
    return interp.wrap(value.transpose(1, 2) if x.dim() == 2 else value.view_as(value))


@VMAP_RULES.register(aten.as_strided.default)
def _as_strided(interp, x, size, stride, storage_offset=None):
    value = x._value
    offset = value.storage_offset() if storage_offset is None else storage_offset
    return interp.wrap(value.as_strided([value.shape[0], *size], [value.stride(0), *stride], offset))


@VMAP_RULES.register(aten.roll.default)
def _roll(interp, x, shifts, dims=()):
    value = interp.unwrap(x) if interp.is_batched(x) else x.expand(interp.batch_size, *x.shape)
    if len(dims) == 0:  # roll the flattened tensor
        flat = value.reshape(value.shape[0], -1)
        return interp.wrap(flat.roll(shifts, 1).view(value.shape))
    rank = x.dim()
    return interp.wrap(value.roll(shifts, [normalize_dim(d, rank) + 1 for d in dims]))
