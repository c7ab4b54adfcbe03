"""Indexing and scatter ops: advanced indexing (`x[idx]`, `x[idx] = v`), gather/scatter,
the `index_*` family, take/put, masked_scatter and embedding.

Two techniques carry the family:
- *an arange index for the batch*: `x[idx]` with a batched `idx` becomes one `aten.index`
  call on the physical value with `arange(B)` as an extra advanced index for the batch dim
  (shaped to broadcast with the others), so batch element b reads only from its own slice;
- *a 1-D index along `dim` becomes a scatter/gather index*: with a batched index, the
  `index_*` ops (one index per position along `dim`) turn into their scatter/gather
  counterparts, whose index has one entry per element and can differ per batch element.
Everything else is shifting `dim` past the batch dim. No rule loops over the batch.
"""

from __future__ import annotations

import math

import torch

from ...core.custom_function import apply_original as _apply_original
from ...core.level_tensor import is_physical
from ...core.op_facts import writes_argument
from ..batched_tensor import UNDER_DIRECT_GRAD, VMAP_RULES
from ..templates import materialize, normalize_dim, pad_to_rank, raise_unbatched_inplace
from .data_dependent import _data_dependent_rule

aten = torch.ops.aten
Tensor = torch.Tensor
_MASK_DTYPES = (torch.bool, torch.uint8)


# -- small helpers ---------------------------------------------------------------------
def _batch_arange(interp, like: Tensor, rank: int) -> Tensor:
    """arange(B) shaped (B, 1, ..., 1) with `rank` trailing ones: the batch's own index."""
    batch = interp.batch_size
    return torch.arange(batch, device=like.device).view(batch, *((1,) * rank))


def _phys_at_least_1d(interp, x) -> Tensor:
    """Physical value (batch first, unbatched expanded) with logical 0-dim promoted to 1-dim:
    the dim-addressed ops treat a 0-dim tensor as a 1-element 1-dim one. For a batched x
    this is `x._value` or a view of it, so in-place ops on it write into x."""
    value = materialize(interp, x)
    return value.unsqueeze(1) if x.dim() == 0 else value


def _check_inplace_target(interp, op, self):
    if not interp.is_batched(self):
        raise_unbatched_inplace(op, self)


def _unbatched_masks_to_indices(interp, op, self, indices):
    """Replace each boolean mask in an index list by the long indices of its True entries
    (what torch does itself). A mask batched at this level would give every batch element
    a different number of selected entries, so it is data-dependent: raise."""
    expanded = []
    for index in indices:
        if index is not None and index.dtype in _MASK_DTYPES:
            if interp.is_batched(index):
                _data_dependent_rule(op)(interp)
            if index.dim() == 0:  # torch's own front end turns x[True] into x[None]
                expanded.append(index)
                continue
            start = len(expanded)
            dims = tuple(self.shape[start : start + index.dim()])
            if dims != tuple(index.shape):
                raise IndexError(
                    f"The shape of the mask {list(index.shape)} at index {start} does not match "
                    f"the shape of the indexed tensor {list(self.shape)}"
                )
            expanded.extend(index.nonzero().unbind(1))
        else:
            expanded.append(index)
    if len(expanded) > self.dim():
        raise IndexError(f"too many indices for tensor of dimension {self.dim()} (got {len(expanded)})")
    return expanded


class _IndexPlan:
    """How to run a logical `self[indices]` as one physical `aten.index`.

    `indices` is the physical index list for `value` (batch dim 0 of `value` included);
    the physical result equals the logical, batch-first result after
    `result.movedim(src, dst)` (and the logical `values` of an `index_put` become physical
    through the inverse move). torch puts the broadcast shape S of the advanced indices in
    place of the indexed dims when those are adjacent, and in front otherwise: the moves
    undo the difference that the batch dim's own index (or None) makes.
    """

    __slots__ = ("value", "indices", "src", "dst", "logical_rank")

    def __init__(self, value, indices, src=(), dst=(), logical_rank=0):
        self.value, self.indices, self.src, self.dst = value, indices, list(src), list(dst)
        self.logical_rank = logical_rank

    def to_logical(self, result: Tensor) -> Tensor:
        return result.movedim(self.src, self.dst) if self.src else result

    def to_physical(self, values: Tensor) -> Tensor:
        return values.movedim(self.dst, self.src) if self.src else values


def _index_plan(interp, self, indices, *, self_may_stay_unbatched: bool) -> _IndexPlan:
    """Plan for long (or None) `indices`; `self_may_stay_unbatched`: reads may index a
    shared self directly instead of its expansion (writes need the expansion)."""
    positions = [i for i, t in enumerate(indices) if t is not None]
    if not positions:
        return _IndexPlan(materialize(interp, self), [None, *indices], logical_rank=self.dim())
    first = positions[0]
    adjacent = positions[-1] - first + 1 == len(positions)
    rank = max(indices[i].dim() for i in positions)  # rank of the broadcast index shape S
    logical_rank = rank + self.dim() - len(positions)
    any_index_batched = any(interp.is_batched(indices[i]) for i in positions)

    def padded(t):
        return pad_to_rank(t._value, t.dim(), rank) if interp.is_batched(t) else t

    if not any_index_batched:
        # Leave the batch dim alone (None): physical result is (B, ..., S, ...) when the
        # advanced indices are adjacent, (S, B, sliced...) when they are not.
        plan = _IndexPlan(materialize(interp, self), [None, *indices], logical_rank=logical_rank)
        if not adjacent:
            plan.src, plan.dst = [rank], [0]
        return plan
    if self_may_stay_unbatched and not interp.is_batched(self):
        # Batched indices into a shared tensor: the batch rides along in S, no expand of self.
        plan = _IndexPlan(self, [padded(t) if t is not None else None for t in indices], logical_rank=logical_rank)
        if adjacent and first > 0:
            plan.src, plan.dst = [first], [0]
        return plan
    # Batch dim indexed by arange(B): physical result is (B, S, sliced...) always.
    plan = _IndexPlan(
        materialize(interp, self),
        [_batch_arange(interp, self, rank), *(padded(t) if t is not None else None for t in indices)],
        logical_rank=logical_rank,
    )
    if adjacent and first > 0:
        plan.src = list(range(1, 1 + rank))
        plan.dst = list(range(1 + first, 1 + first + rank))
    return plan


# -- advanced indexing: x[indices] -------------------------------------------------------
def _index_rule(op):
    def rule(interp, self, indices):
        indices = _unbatched_masks_to_indices(interp, op, self, list(indices))
        plan = _index_plan(interp, self, indices, self_may_stay_unbatched=True)
        return interp.wrap(plan.to_logical(op(plan.value, plan.indices)))

    return rule


for _op in (aten.index.Tensor, aten.index.Tensor_hacked_twin, aten._unsafe_index.Tensor):
    VMAP_RULES.set(_op, _index_rule(_op))


# -- advanced assignment: x[indices] = values ---------------------------------------------
def _physical_values(interp, values, plan: _IndexPlan) -> Tensor:
    """`values` (broadcastable to the logical indexing result) laid out like the physical one."""
    value = values._value if interp.is_batched(values) else values.unsqueeze(0)
    if values.dim() > plan.logical_rank:  # torch rejects extra dims; let it say so
        return value
    return plan.to_physical(pad_to_rank(value, values.dim(), plan.logical_rank))


def _mask_put_as_where(interp, self, indices, values, accumulate):
    """`x[mask] = v` as `where(mask, v, x)`, or None where that is not the same thing.

    It is whenever v does not vary along the selected entries (a scalar, or a row put
    into every selected entry): then the number of selected entries never matters, so a
    mask batched at this level (or any level) stays fixed-shape and no `nonzero` runs."""
    masks = [i for i, t in enumerate(indices) if t is not None]
    if len(masks) != 1 or indices[masks[0]].dtype not in _MASK_DTYPES or indices[masks[0]].dim() == 0:
        return None
    p = masks[0]
    mask = indices[p]
    if tuple(self.shape[p : p + mask.dim()]) != tuple(mask.shape):
        raise IndexError(
            f"The shape of the mask {list(mask.shape)} at index {p} does not match the shape of "
            f"the indexed tensor {list(self.shape)}"
        )
    rest = self.dim() - p - mask.dim()
    rank = p + 1 + rest  # logical rank of self[mask]: (*leading, count, *rest)
    if values.dim() > rank:
        return None
    value = pad_to_rank(materialize(interp, values), values.dim(), rank)
    if value.shape[1 + p] != 1:
        return None
    value = value.view(*value.shape[: 1 + p], *((1,) * mask.dim()), *value.shape[2 + p :])
    mask_value = mask._value if interp.is_batched(mask) else mask.unsqueeze(0)
    mask_value = mask_value.view(-1, *((1,) * p), *mask.shape, *((1,) * rest)).bool()
    target = materialize(interp, self)
    chosen = target + value if accumulate else value
    return torch.where(mask_value, chosen.to(target.dtype), target)


def _index_put_rule(op, *, inplace: bool):
    def rule(interp, self, indices, values, accumulate=False, *rest):
        if inplace:
            _check_inplace_target(interp, op, self)
        indices = list(indices)
        if any(t is not None and t.dtype in _MASK_DTYPES for t in indices):
            out = _mask_put_as_where(interp, self, indices, values, accumulate)
            if out is not None:
                if inplace:
                    self._value.copy_(out)
                    return self
                return interp.wrap(out)
        indices = _unbatched_masks_to_indices(interp, op, self, indices)
        plan = _index_plan(interp, self, indices, self_may_stay_unbatched=False)
        out = op(plan.value, plan.indices, _physical_values(interp, values, plan), accumulate, *rest)
        return self if inplace else interp.wrap(out)

    return rule


for _op in (aten.index_put.default, aten.index_put.hacked_twin, aten._unsafe_index_put.default):
    VMAP_RULES.set(_op, _index_put_rule(_op, inplace=False))
for _op in (
    aten.index_put_.default,
    aten.index_put_.hacked_twin,
    aten._index_put_impl_.default,
    aten._index_put_impl_.hacked_twin,
):
    VMAP_RULES.set(_op, _index_put_rule(_op, inplace=True))


# -- gather / scatter: self, index and src share a logical rank ---------------------------
def _gather_scatter_rule(op, *, output_like: int):
    """gather, scatter*, scatter_add, scatter_reduce: every tensor gets the batch dim in
    front (unbatched ones expanded, a view) and `dim` moves past it. torch lets a 0-dim
    tensor meet 1-dim ones here, so 0-dim values are promoted and the result is squeezed
    back when the argument it takes its shape from (`output_like`) was 0-dim."""
    inplace = writes_argument(op._schema.arguments[0])

    def rule(interp, self, dim, *args, **kwargs):
        if inplace:
            _check_inplace_target(interp, op, self)
        dim = normalize_dim(dim, self.dim(), op) + 1
        like = (self, None, *args)[output_like]
        physical = [_phys_at_least_1d(interp, a) if isinstance(a, Tensor) else a for a in args]
        out = op(_phys_at_least_1d(interp, self), dim, *physical, **kwargs)
        if inplace:
            return self
        return interp.wrap(out.squeeze(1) if like.dim() == 0 else out)

    return rule


VMAP_RULES.set(aten.gather.default, _gather_scatter_rule(aten.gather.default, output_like=2))
for _op in (
    aten.scatter.src,
    aten.scatter.value,
    aten.scatter.reduce,
    aten.scatter.value_reduce,
    aten.scatter_.src,
    aten.scatter_.value,
    aten.scatter_.reduce,
    aten.scatter_.value_reduce,
    aten.scatter_add.default,
    aten.scatter_add_.default,
    aten.scatter_reduce.two,
    aten.scatter_reduce_.two,
):
    VMAP_RULES.set(_op, _gather_scatter_rule(_op, output_like=0))


# -- the index_* family: a 1-D index along dim --------------------------------------------
def _index_as_scatter_index(index: Tensor, like: Tensor, dim: int) -> Tensor:
    """A batched 1-D (or 0-dim) index along physical `dim`, (B, n), as a gather/scatter index
    shaped like `like` (B, ..., n, ...): one entry per element, as those ops want."""
    batch = index.shape[0]
    index = index.reshape(batch, math.prod(index.shape[1:])).long()
    shape = [batch] + [1] * (like.dim() - 1)
    shape[dim] = index.shape[1]
    target = list(like.shape)
    target[dim] = index.shape[1]
    return index.view(shape).expand(target)


def _along_dim(interp, op, self, dim):
    """(physical dim, physical self promoted to >= 1-dim) for the index_* ops; for a
    batched self the value is `self._value` itself (or a view), so in-place ops write there."""
    return normalize_dim(dim, self.dim(), op) + 1, _phys_at_least_1d(interp, self)


@VMAP_RULES.register(aten.index_select.default)
def _index_select(interp, self, dim, index):
    pdim, value = _along_dim(interp, aten.index_select.default, self, dim)
    if not interp.is_batched(index):
        out = aten.index_select(value, pdim, index)
    elif not interp.is_batched(self):
        # A shared table, batched indices: one index_select with the batch folded into n.
        table = self.unsqueeze(0) if self.dim() == 0 else self
        flat = aten.index_select(table, pdim - 1, index._value.reshape(-1))
        out = flat.unflatten(pdim - 1, (interp.batch_size, math.prod(index.shape))).movedim(pdim - 1, 0)
    else:
        out = aten.gather(value, pdim, _index_as_scatter_index(index._value, value, pdim))
    return interp.wrap(out.squeeze(1) if self.dim() == 0 else out)


def _index_source_rule(op, scatter_op, *, prepare_source=None):
    """index_add / index_copy / index_reduce (and their in-place forms): with an unbatched
    index, shift dim; with a batched one, scatter the source along dim instead."""
    inplace = writes_argument(op._schema.arguments[0])

    def rule(interp, self, dim, index, source, *args, **kwargs):
        if inplace:
            _check_inplace_target(interp, op, self)
        pdim, value = _along_dim(interp, op, self, dim)
        src = _phys_at_least_1d(interp, source)
        if interp.is_batched(index):
            scatter_index = _index_as_scatter_index(index._value, src, pdim)
            if prepare_source is not None:
                src, args, kwargs = prepare_source(src, args, kwargs)
            out = scatter_op(value, pdim, scatter_index, src, *args, **kwargs)
        else:
            out = op(value, pdim, index, src, *args, **kwargs)
        if inplace:
            return self
        return interp.wrap(out.squeeze(1) if self.dim() == 0 else out)

    return rule


def _alpha_into_source(src, args, kwargs):
    """scatter_add has no alpha: fold it into the source."""
    alpha = kwargs.pop("alpha", 1)
    return (src if alpha == 1 else src * alpha), args, kwargs


for _op, _scatter, _prepare in (
    (aten.index_add.default, aten.scatter_add.default, _alpha_into_source),
    (aten.index_add_.default, aten.scatter_add_.default, _alpha_into_source),
    (aten.index_copy.default, aten.scatter.src, None),
    (aten.index_copy_.default, aten.scatter_.src, None),
    (aten.index_reduce.default, aten.scatter_reduce.two, None),
    (aten.index_reduce_.default, aten.scatter_reduce_.two, None),
):
    VMAP_RULES.set(_op, _index_source_rule(_op, _scatter, prepare_source=_prepare))


def _index_fill_rule(op, *, inplace: bool):
    """index_fill with a batched index or a batched fill value: a scatter of the value
    (index_fill accepts negative indices, scatter does not: wrap them first)."""

    def rule(interp, self, dim, index, value):
        if inplace:
            _check_inplace_target(interp, op, self)
        pdim, target = _along_dim(interp, op, self, dim)
        if not interp.is_batched(index) and not interp.is_batched(value):
            out = op(target, pdim, index, value)
        else:
            index = materialize(interp, index)
            index = torch.where(index < 0, index + target.shape[pdim], index)
            scatter_index = _index_as_scatter_index(index, target, pdim)
            if isinstance(value, Tensor):
                fill = materialize(interp, value).to(target.dtype)
                fill = fill.view(-1, *((1,) * (target.dim() - 1))).expand(scatter_index.shape)
                scatter = aten.scatter_.src if inplace else aten.scatter.src
            else:
                fill = value
                scatter = aten.scatter_.value if inplace else aten.scatter.value
            out = scatter(target, pdim, scatter_index, fill)
        if inplace:
            return self
        return interp.wrap(out.squeeze(1) if self.dim() == 0 else out)

    return rule


for _op in (aten.index_fill.int_Scalar, aten.index_fill.int_Tensor):
    VMAP_RULES.set(_op, _index_fill_rule(_op, inplace=False))
for _op in (aten.index_fill_.int_Scalar, aten.index_fill_.int_Tensor):
    VMAP_RULES.set(_op, _index_fill_rule(_op, inplace=True))


# -- take / put: self seen as flat ---------------------------------------------------------
def _unravel(flat_index: Tensor, shape) -> list:
    """Coordinates of flat (row-major) indices in `shape`. Floor division keeps torch's
    negative-index meaning: an index in [-N, -1] gives a negative first coordinate that
    aten.index wraps, and every out-of-range index an out-of-range first coordinate."""
    coords = []
    stride = math.prod(shape)
    for size in shape:
        stride //= size if size else 1
        coord = torch.div(flat_index, stride, rounding_mode="floor") if stride != 1 else flat_index
        coords.append(coord if not coords else coord.remainder(size))
    return coords


def _flat_plan(interp, self, index):
    """(physical self promoted to >= 1-dim, physical index list) for take/put."""
    value = _phys_at_least_1d(interp, self)
    coords = _unravel(interp.unwrap(index), value.shape[1:])
    return value, [_batch_arange(interp, value, index.dim()), *coords]


@VMAP_RULES.register(aten.take.default)
def _take(interp, self, index):
    if not interp.is_batched(self):
        return interp.wrap(aten.take(self, index._value))
    value, indices = _flat_plan(interp, self, index)
    return interp.wrap(aten.index.Tensor(value, indices))


def _put_rule(op, *, inplace: bool):
    def rule(interp, self, index, source, accumulate=False):
        if inplace:
            _check_inplace_target(interp, op, self)
        if source.numel() != index.numel():
            raise RuntimeError(
                f"put_(): Expected source and index to have the same number of elements, but got "
                f"source.numel() = {source.numel()}, index.numel() = {index.numel()}"
            )
        value, indices = _flat_plan(interp, self, index)
        if interp.is_batched(source):
            values = source._value.reshape(interp.batch_size, *index.shape)
        else:
            values = source.reshape(index.shape)
        put = aten.index_put_.default if inplace else aten.index_put.default
        out = put(value, indices, values, accumulate)
        if inplace:
            return self
        return interp.wrap(out.squeeze(1) if self.dim() == 0 else out)

    return rule


VMAP_RULES.set(aten.put.default, _put_rule(aten.put.default, inplace=False))
VMAP_RULES.set(aten.put_.default, _put_rule(aten.put_.default, inplace=True))


# -- masked_scatter: the k-th True position takes source's k-th element --------------------
def _broadcast_physical(interp, *tensors):
    """Physical values (batch first) of tensors broadcast together at their logical rank."""
    rank = max(t.dim() for t in tensors)
    values = [pad_to_rank(materialize(interp, t), t.dim(), rank) for t in tensors]
    return torch.broadcast_tensors(*values)


def _masked_scatter_values(interp, self, mask, source):
    """masked_scatter as fixed-shape ops: the running count of True entries says which
    source element each position takes (cumsum), a gather fetches it, `where` places it."""
    if mask.dtype is not torch.bool:  # as torch checks (its meta kernel does not)
        raise RuntimeError(f"masked_scatter_ only supports boolean masks, but got mask with dtype {mask.dtype}")
    target, mask_value = _broadcast_physical(interp, self, mask)
    batch = interp.batch_size
    flat_mask = mask_value.reshape(batch, math.prod(mask_value.shape[1:]))
    order = (flat_mask.cumsum(1) - 1).clamp(min=0)
    flat_source = materialize(interp, source).reshape(batch, math.prod(source.shape))
    if flat_source.shape[1] == 0:
        flat_source = flat_source.new_zeros(batch, 1)  # nothing to take: mask must be all False
    taken = flat_source.gather(1, order).view(target.shape)
    return torch.where(mask_value, taken, target)


@VMAP_RULES.register(aten.masked_scatter.default)
def _masked_scatter(interp, self, mask, source):
    return interp.wrap(_masked_scatter_values(interp, self, mask, source))


@VMAP_RULES.register(aten.masked_scatter_.default)
def _masked_scatter_(interp, self, mask, source):
    _check_inplace_target(interp, aten.masked_scatter_.default, self)
    out = _masked_scatter_values(interp, self, mask, source)
    self._value.copy_(out)
    return self


@VMAP_RULES.register(aten.masked_scatter_backward.default)
def _masked_scatter_backward(interp, grad_output, mask, sizes):
    """Source's gradient: the selected entries of grad in order, zeros after. Each entry
    is scattered to its running count; unselected ones to a spare column dropped after."""
    grad, mask_value = _broadcast_physical(interp, grad_output, mask)
    batch, numel = interp.batch_size, math.prod(sizes)
    flat_mask = mask_value.reshape(batch, math.prod(mask_value.shape[1:]))
    column = torch.where(flat_mask, flat_mask.cumsum(1) - 1, numel)
    out = grad.new_zeros(batch, numel + 1).scatter(1, column, grad.reshape(batch, math.prod(grad.shape[1:])))
    return interp.wrap(out[:, :numel].reshape(batch, *sizes))


# -- embedding ------------------------------------------------------------------------------
def _offset_indices(interp, indices, num_weights: int) -> Tensor:
    """Indices into the batch's weights stacked as one (B * num_weights, D) table."""
    value = materialize(interp, indices)
    offsets = _batch_arange(interp, value, indices.dim()) * num_weights
    return value + offsets


class BatchedEmbedding(torch.autograd.Function):
    """A VJP override for the per-element lookup under a direct grad level (`vmap(grad(f))`
    through nn.Embedding: torch's autograd records the physical ops, ad/direct_reverse.py).
    The level gives the shared table its batch dim as an expand, (B, V, D) with stride 0:
    stacking it into one (B * V, D) table for a lookup at offset indices copies it B times
    (64 MB per call for B=64, V=4000, D=64). Here the lookup reads the one table, and the
    backward scatters each element's rows into its own (V, D) gradient, as the batched
    `embedding_dense_backward` does. Its backward is one differentiable op, so a gradient
    built with create_graph=True differentiates through it."""

    # forward(ctx, ...) without setup_context: torch binds a setup_context Function's
    # arguments with inspect.signature on every apply (~20 µs)
    @staticmethod
    def forward(ctx, table, offset_indices, indices, padding_idx):
        ctx.save_for_backward(offset_indices)
        ctx.table_shape = table.shape
        ctx.padding_idx = padding_idx
        if table.stride(0) == 0 and table.shape[0]:  # one table for every element
            return aten.embedding(table[0], indices)
        batch, num_weights = table.shape[:2]
        return aten.embedding(table.reshape(batch * num_weights, *table.shape[2:]), offset_indices)

    @staticmethod
    def backward(ctx, grad):
        (offset_indices,) = ctx.saved_tensors
        batch, num_weights, dim = ctx.table_shape
        out = aten.embedding_dense_backward(grad, offset_indices, batch * num_weights, -1, False)
        out = out.view(batch, num_weights, dim)
        if ctx.padding_idx >= 0:  # "this row gets no gradient", in every element's table
            out = out.index_fill(1, torch.tensor([ctx.padding_idx], device=out.device), 0)
        return out, None, None, None


@UNDER_DIRECT_GRAD.register(aten.embedding.default)
def _embedding_recorded(direct, interp, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    """A batched lookup as a `BatchedEmbedding` where the direct grad level differentiates
    the table (2-d, dense, not scaled by frequency)."""
    if scale_grad_by_freq or sparse or weight.dim() != 2 or not interp.is_batched(weight):
        return NotImplemented
    table = materialize(interp, weight)
    if not is_physical(table) or not table.requires_grad or not torch.is_grad_enabled():
        return NotImplemented
    value = materialize(interp, indices)
    if not is_physical(value):
        return NotImplemented
    offsets = _batch_arange(interp, value, indices.dim()) * weight.shape[0]
    out = _apply_original(BatchedEmbedding, table, value + offsets, value, padding_idx)
    return interp.wrap(out)


@VMAP_RULES.register(aten.embedding.default)
def _embedding(interp, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    if not interp.is_batched(weight) and not scale_grad_by_freq:
        return interp.wrap(aten.embedding(weight, indices._value, padding_idx, scale_grad_by_freq, sparse))
    # An ensemble of tables: one lookup into the stacked tables. Per-element counts
    # (scale_grad_by_freq) stay right because the offset indices never collide; that is
    # also why a shared table is stacked (copied) when it scales by frequency.
    batch, num_weights = interp.batch_size, weight.shape[0]
    weights = materialize(interp, weight)
    table = weights.reshape(batch * num_weights, *weight.shape[1:])
    out = aten.embedding(table, _offset_indices(interp, indices, num_weights), -1, scale_grad_by_freq, sparse)
    if padding_idx < 0:
        return interp.wrap(out)
    # padding_idx means "this row gets no gradient"; it is one row per batch element now.
    # Read those rows through an embedding whose padding row is them, then place them.
    rows = weights[:, padding_idx].reshape(1, -1)
    pad_rows = aten.embedding(rows, torch.zeros(1, dtype=torch.long, device=rows.device), 0)
    pad_rows = pad_rows.view(batch, *((1,) * indices.dim()), *weight.shape[1:])
    is_pad = (materialize(interp, indices) == padding_idx).unsqueeze(-1)
    return interp.wrap(torch.where(is_pad, pad_rows, out))


@VMAP_RULES.register(aten.embedding_dense_backward.default)
def _embedding_dense_backward(interp, grad_output, indices, num_weights, padding_idx, scale_grad_by_freq):
    batch = interp.batch_size
    if not interp.is_batched(indices):
        # Shared indices: fold the batch into the embedding dim, (*, B * D).
        grad = grad_output._value.movedim(0, -2)
        grad = grad.reshape(*grad.shape[:-2], batch * grad_output.shape[-1])
        out = aten.embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq)
        return interp.wrap(out.view(num_weights, batch, grad_output.shape[-1]).movedim(1, 0))
    grad = materialize(interp, grad_output)
    stacked = _offset_indices(interp, indices, num_weights)
    out = aten.embedding_dense_backward(grad, stacked, batch * num_weights, -1, scale_grad_by_freq)
    out = out.view(batch, num_weights, grad_output.shape[-1])
    if padding_idx >= 0:
        out = out.index_fill(1, torch.tensor([padding_idx], device=out.device), 0)
    return interp.wrap(out)


@VMAP_RULES.register(aten.embedding_renorm_.default)
def _embedding_renorm_(interp, weight, indices, max_norm, norm_type):
    """Rescale, in place, each referenced row whose norm exceeds max_norm (as torch does:
    scale = max_norm / (norm + 1e-7)), with a per-element mask of referenced rows.

    A shared (unbatched) table with batched indices is renormalized at the union of the
    batch's rows: a row's rescaling does not depend on the other rows and a rescaled row
    is not rescaled again, so this is exactly the state (and the lookups) that a loop over
    the batch leaves. That keeps `nn.Embedding(max_norm=...)` usable under per-sample vmap.
    """
    if not interp.is_batched(weight):
        return aten.embedding_renorm_(weight, indices._value.reshape(-1), max_norm, norm_type)
    table = weight._value
    batch = interp.batch_size
    flat = materialize(interp, indices).reshape(batch, math.prod(indices.shape)).long()
    referenced = torch.zeros(table.shape[:2], dtype=torch.bool, device=table.device)
    referenced = referenced.scatter(1, flat, True)
    norms = torch.linalg.vector_norm(table, norm_type, dim=-1)
    scale = torch.where(referenced & (norms > max_norm), max_norm / (norms + 1e-7), 1.0)
    table.mul_(scale.unsqueeze(-1).to(table.dtype))
    return weight
