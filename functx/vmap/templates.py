"""Templates: a batching rule written once per *shape* of op, instantiated per op.

Every rule has the signature `rule(interp, *args, **kwargs)` — the op's own arguments,
where this level's tensors are `BatchedTensor`s — and returns the op's result with
batched outputs wrapped by `interp.wrap`. Inside a rule, `interp.unwrap(x)` gives the
physical value (batch dim at 0) of a batched tensor and leaves anything else alone.

The templates:
- `pointwise_rule(op)`: broadcasting elementwise ops (picked up automatically from
  `torch.Tag.pointwise`), in-place variants included;
- `batch_all_rule(op, ...)`: ops that act on each batch element independently once every
  tensor argument has the batch dim in front (reductions, scans, softmax, sort, gather,
  linear algebra, ...); dimension arguments named in the schema are shifted by one;
- `fold_batch_rule(op)`: NN ops with a leading sample dim N: fold (B, N) into B*N.
"""

from __future__ import annotations

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

from ..core.errors import op_name
from .batched_tensor import BatchedTensor

Tensor = torch.Tensor


# -- small helpers shared by rules ----------------------------------------------------
def logical_rank(x) -> int:
    """Rank user code sees (for a BatchedTensor, the wrapper's own rank)."""
    return x.dim()


def normalize_dim(dim: int, rank: int, op=None) -> int:
    """Wrap a possibly negative logical dim into [0, rank) (rank 0 accepts 0 and -1)."""
    bound = max(rank, 1)
    if not -bound <= dim < bound:
        where = f" in {op_name(op)}" if op is not None else ""
        raise IndexError(
            f"Dimension out of range (expected to be in range of [{-bound}, {bound - 1}], but got {dim}){where}"
        )
    return dim + bound if dim < 0 else dim


def physical_dim(dim: int, rank: int, op=None) -> int:
    """Physical position of logical `dim` in a value whose batch dim is 0."""
    return normalize_dim(dim, rank, op) + 1


def materialize(interp, x):
    """Physical value with the batch dim in front; unbatched tensors are expanded (a view)."""
    if interp.is_batched(x):
        return x._value
    return x.expand(interp.batch_size, *x.shape)


def pad_to_rank(value: Tensor, logical: int, rank: int) -> Tensor:
    """Insert size-1 dims after the batch dim so a batched value broadcasts at `rank`."""
    if logical >= rank:
        return value
    shape = value.shape
    return value.view(shape[0], *((1,) * (rank - logical)), *shape[1:])


def _is_write(argument) -> bool:
    info = argument.alias_info
    return info is not None and info.is_write


def raise_unbatched_inplace(op, target):
    raise RuntimeError(
        f"vmap: {op_name(op)} writes in place into a tensor that is not batched at this vmap "
        f"level (shape {tuple(target.shape)}), but a value it writes is batched: each batch "
        f"element would need its own copy of that tensor. Write into a batched tensor instead, "
        f"e.g. use the out-of-place op or clone a batched tensor first "
        f"(`x = x.expand(...).clone()` / `torch.zeros_like(batched)`)."
    )


# -- pointwise ------------------------------------------------------------------------
_DEFAULT_PROMOTION = ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT


def _fix_zero_dim_promotion(interp, args, kwargs):
    """A logical 0-dim tensor takes part in type promotion as a scalar; its physical value
    (shape [B]) would not. Cast such values to the logically promoted dtype."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor) and a.dtype is not torch.bool]
    if len({t.dtype for t in tensors}) < 2:
        return args, kwargs
    metas = [torch.empty((1,) * min(t.dim(), 1), dtype=t.dtype, device="meta") for t in tensors]
    promoted = elementwise_dtypes(*metas, type_promotion_kind=_DEFAULT_PROMOTION)[1]

    def cast(a):
        if interp.is_batched(a) and a.dim() == 0 and a.dtype is not torch.bool and a.dtype != promoted:
            return interp.wrap(a._value.to(promoted))
        return a

    return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}


def pointwise_rule(op):
    """Rule for a broadcasting elementwise op: pad batched values to the common logical
    rank (batch dim stays in front, unbatched tensors broadcast from the right), run once."""
    schema = op._schema
    inplace = bool(schema.arguments) and _is_write(schema.arguments[0]) and not schema.arguments[0].kwarg_only

    def rule(interp, *args, **kwargs):
        rank = 0
        zero_dim_batched = False
        for a in args:
            if isinstance(a, Tensor):
                r = a.dim()
                if r > rank:
                    rank = r
                if r == 0 and type(a) is BatchedTensor and a._interp is interp:
                    zero_dim_batched = True
        for a in kwargs.values():
            if isinstance(a, Tensor) and a.dim() > rank:
                rank = a.dim()
        if zero_dim_batched:
            args, kwargs = _fix_zero_dim_promotion(interp, args, kwargs)
        if inplace:
            target = args[0]
            if not interp.is_batched(target):
                raise_unbatched_inplace(op, target)
            rank = target.dim()
        new_args = [
            pad_to_rank(a._value, a.dim(), rank) if type(a) is BatchedTensor and a._interp is interp else a
            for a in args
        ]
        if kwargs:
            kwargs = {
                k: pad_to_rank(v._value, v.dim(), rank) if type(v) is BatchedTensor and v._interp is interp else v
                for k, v in kwargs.items()
            }
        out = op(*new_args, **kwargs)
        if inplace:
            return args[0]
        return interp.wrap_all(out)

    return rule


def is_pointwise(op) -> bool:
    return torch.Tag.pointwise in op.tags and torch.Tag.out not in op.tags


# -- batch all: independent per element after moving every batch dim to the front -----
_DIM_ARG_NAMES = ("dim", "dim0", "dim1", "dim2", "dims", "source", "destination")
_KEEPDIM_NAMES = ("keepdim",)


class _DimArg:
    __slots__ = ("name", "index", "kind", "default", "kwarg_only")

    def __init__(self, argument, index):
        self.name = argument.name
        self.index = index
        text = str(argument.type)
        self.kind = "list" if "List" in text else "int"
        self.default = argument.default_value
        self.kwarg_only = argument.kwarg_only


def _schema_dims(op):
    dims = []
    keepdim = None
    for i, argument in enumerate(op._schema.arguments):
        if argument.name in _DIM_ARG_NAMES and "int" in str(argument.type).lower():
            dims.append(_DimArg(argument, i))
        elif argument.name in _KEEPDIM_NAMES:
            keepdim = (i, argument.default_value)
    return dims, keepdim


def batch_all_rule(op, *, rank_of=0, rank_offset=0, empty_means_all=None):
    """Rule for ops that map over leading dims once every tensor has the batch dim first.

    Unbatched tensor arguments are expanded (a view, no copy). Dimension arguments
    (`dim`, `dims`, `dim0`, ...) are normalized against the logical rank of argument
    `rank_of` (plus `rank_offset`: 1 for ops such as unsqueeze that address the output
    rank) and shifted past the batch dim. For reductions, `dim=None` or `dim=[]` means
    every logical dim (or, for a single optional int dim, the flattened tensor).
    """
    dims, keepdim = _schema_dims(op)
    if empty_means_all is None:
        empty_means_all = torch.Tag.reduction in op.tags
    arguments = op._schema.arguments
    n_positional = sum(1 for a in arguments if not a.kwarg_only)
    inplace = bool(arguments) and _is_write(arguments[0]) and not arguments[0].kwarg_only

    def rule(interp, *args, **kwargs):
        target = args[0]
        args = list(args)
        source = args[rank_of]
        if type(source) is list or type(source) is tuple:
            source = next((t for t in source if t.dim() > 0), source[0] if source else None)
        rank = source.dim() + rank_offset if source is not None else 0
        if inplace and not interp.is_batched(args[0]):
            raise_unbatched_inplace(op, args[0])
        scalar = rank == 0

        def phys(a):
            v = materialize(interp, a)
            return v.unsqueeze(1) if scalar else v

        for i, a in enumerate(args):
            if isinstance(a, Tensor):
                args[i] = phys(a)
            elif (type(a) is list or type(a) is tuple) and a and isinstance(a[0], Tensor):
                args[i] = [phys(t) for t in a]
        for k, v in kwargs.items():
            if isinstance(v, Tensor):
                kwargs[k] = phys(v)
        flatten_then_keep = None
        effective_rank = max(rank, 1)
        for d in dims:
            if d.kwarg_only:
                value = kwargs.get(d.name, d.default)
            elif d.index < len(args):
                value = args[d.index]
            else:
                value = d.default
            if d.kind == "int":
                if value is None:
                    if not empty_means_all:
                        continue
                    # reduce over the flattened tensor: flatten the physical self
                    args[0] = args[0].reshape(args[0].shape[0], -1)
                    new = 1
                    kd = _keepdim_value(args, kwargs, keepdim)
                    flatten_then_keep = rank if kd else None
                else:
                    new = normalize_dim(value, effective_rank, op) + 1
            else:
                if value is None or (len(value) == 0 and empty_means_all):
                    if not empty_means_all and value is None:
                        continue
                    new = list(range(1, effective_rank + 1))
                else:
                    new = [normalize_dim(v, effective_rank, op) + 1 for v in value]
            if d.kwarg_only:
                kwargs[d.name] = new
            elif d.index < len(args):
                args[d.index] = new
            else:
                while len(args) < d.index:
                    args.append(arguments[len(args)].default_value)
                args.append(new)
        out = op(*args, **kwargs)
        if inplace:
            return target
        return _wrap_batch_all(interp, out, scalar, flatten_then_keep)

    rule.__name__ = f"batch_all_{op.__name__}"
    return rule


def _keepdim_value(args, kwargs, keepdim):
    if keepdim is None:
        return False
    index, default = keepdim
    if "keepdim" in kwargs:
        return kwargs["keepdim"]
    return args[index] if index < len(args) else default


def _wrap_batch_all(interp, out, scalar, keep_rank):
    def fix(t):
        if not isinstance(t, Tensor):
            return t
        if keep_rank is not None:
            t = t.reshape(t.shape[0], *((1,) * keep_rank))
        elif scalar and t.dim() == 2:
            t = t.squeeze(1)
        return interp.wrap(t)

    if isinstance(out, Tensor):
        return fix(out)
    if type(out) is tuple or type(out) is list:
        return type(out)(([fix(e) for e in o] if type(o) is list else fix(o)) for o in out)
    return out


# -- fold the batch into the sample dim (NN ops with a leading N) ----------------------
def fold_batch_rule(op, *, feature_rank):
    """Rule for NN ops whose first argument is (N, *features) or unbatched (*features),
    with `feature_rank` feature dims, and whose other tensor arguments are unbatched
    (weights). The batch dim B becomes (part of) N: one call, no loop."""

    def rule(interp, *args, **kwargs):
        for a in (*args[1:], *kwargs.values()):
            if interp.is_batched(a):
                from .fallback import loop_fallback

                return loop_fallback(op)(interp, *args, **kwargs)
        value = args[0]._value
        if args[0].dim() == feature_rank:  # logical input has no N: B plays N
            return interp.wrap_all(op(value, *args[1:], **kwargs))
        batch, n = value.shape[0], value.shape[1]
        out = op(value.flatten(0, 1), *args[1:], **kwargs)

        def unfold(t):
            if isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == batch * n:
                return interp.wrap(t.unflatten(0, (batch, n)))
            return t

        if isinstance(out, Tensor):
            return unfold(out)
        return type(out)(unfold(o) for o in out)

    rule.__name__ = f"fold_batch_{op.__name__}"
    return rule
