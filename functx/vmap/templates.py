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
"""

from __future__ import annotations

import math

import torch
import torch._prims  # noqa: F401  (is_elementwise_prim reads its factories)
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

from ..core.errors import op_name, raise_unbatched_inplace  # noqa: F401  (rules import it from here)
from ..core.op_facts import is_inplace_view, writes_argument
from .batched_tensor import BatchedTensor
from .per_sample_check import meta_like

Tensor = torch.Tensor


# -- small helpers shared by rules ----------------------------------------------------
def normalize_dim(dim: int, rank: int, op=None) -> int:
    """Wrap a possibly negative logical dim into [0, rank) (rank 0 accepts 0 and -1)."""
    bound = max(rank, 1)
    if not -bound <= dim < bound:
        where = f" in {op_name(op)}" if op is not None else ""
        raise IndexError(
            f"Dimension out of range (expected to be in range of [{-bound}, {bound - 1}], but got {dim}){where}"
        )
    return dim + bound if dim < 0 else dim


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


def _argument_types(op):
    return [(a.name, str(a.type)) for a in op._schema.arguments]


def _functional_counterpart(op):
    """`aten.foo.overload` for the in-place `aten.foo_.overload` (or the overload of
    `aten.foo` with the same arguments: `floor_divide_.Tensor` -> `floor_divide.default`)."""
    name = op._schema.name.split("::")[-1]
    if not name.endswith("_") or name.endswith("__"):
        return None
    packet = getattr(getattr(torch.ops, op.namespace), name[:-1], None)
    if packet is None:
        return None
    if op._overloadname in packet.overloads():
        return getattr(packet, op._overloadname)
    wanted = _argument_types(op)
    for overload in packet.overloads():
        candidate = getattr(packet, overload)
        if _argument_types(candidate) == wanted:
            return candidate
    return None


def is_inplace_with_functional(table):
    """Predicate: an in-place op (not a view op) whose functional form `table` handles
    with a rule or template."""

    def predicate(op):
        if torch.Tag.inplace not in op.tags or is_inplace_view(op):
            return False
        functional = _functional_counterpart(op)
        return functional is not None and table.how(functional) in ("rule", "template")

    return predicate


def inplace_from_functional_rule(table):
    """Template factory: run the functional op's rule, then write its result into `self`
    (batched self only; torch's casting and shape rules for in-place results apply)."""

    def factory(op):
        functional = _functional_counterpart(op)

        def rule(interp, x, *args, **kwargs):
            out = table.handler(functional)(interp, x, *args, **kwargs)
            if not interp.is_batched(x):
                raise_unbatched_inplace(op, x)
            if tuple(out.shape) != tuple(x.shape):
                raise RuntimeError(
                    f"output with shape {list(x.shape)} doesn't match the broadcast shape {list(out.shape)}"
                )
            if not torch.can_cast(out.dtype, x.dtype):
                raise RuntimeError(f"result type {out.dtype} can't be cast to the desired output type {x.dtype}")
            x._value.copy_(materialize(interp, out))
            return x

        rule.__name__ = f"inplace_{op.__name__}"
        return rule

    return factory


def prim_elementwise_rule(op):
    """Rule for an elementwise prim: prims do not broadcast (refs broadcast before calling
    them), so every tensor argument is expanded to the full physical shape."""

    def rule(interp, *args, **kwargs):
        shape = torch.broadcast_shapes(*(a.shape for a in args if isinstance(a, Tensor)))
        batch = interp.batch_size

        def full(a):
            if not isinstance(a, Tensor):
                return a
            if interp.is_batched(a):
                return pad_to_rank(a._value, a.dim(), len(shape)).expand(batch, *shape)
            return a.expand(batch, *shape)

        return interp.wrap_all(op(*[full(a) for a in args], **kwargs))

    rule.__name__ = f"prim_elementwise_{op.__name__}"
    return rule


def is_elementwise_prim(op) -> bool:
    """prims ops made by torch._prims' elementwise factories (refs call them after
    broadcasting), prims.where and prims.convert_element_type."""
    if op.namespace != "prims":
        return False
    if op._schema.name in ("prims::where", "prims::convert_element_type"):
        return True
    meta = getattr(op, "prim_meta_impl", None)
    return getattr(meta, "func", None) is getattr(torch._prims, "_prim_elementwise_meta", object())


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
    inplace = bool(schema.arguments) and writes_argument(schema.arguments[0]) and not schema.arguments[0].kwarg_only
    if _is_unary(schema):
        return _unary_pointwise_rule(op, inplace)

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


_TENSOR_TYPE = torch._C.TensorType.get()


def _is_unary(schema) -> bool:
    """One Tensor argument (the first) and one Tensor result: nothing to broadcast."""
    tensors = [a for a in schema.arguments if a.type.isSubtypeOf(_TENSOR_TYPE) or "Tensor" in str(a.type)]
    return (
        len(tensors) == 1
        and schema.arguments[0] is tensors[0]
        and len(schema.returns) == 1
        and schema.returns[0].type.isSubtypeOf(_TENSOR_TYPE)
    )


def _unary_pointwise_rule(op, inplace):
    """The hot path: a unary elementwise op runs on the batched value as it is."""
    if inplace:

        def inplace_rule(interp, x, *args, **kwargs):
            op(x._value, *args, **kwargs)
            return x

        return inplace_rule

    def rule(interp, x, *args, **kwargs):
        return BatchedTensor(op(x._value, *args, **kwargs), interp)

    return rule


def is_pointwise(op) -> bool:
    return torch.Tag.pointwise in op.tags and torch.Tag.out not in op.tags


# -- memory formats -------------------------------------------------------------------
_CHANNELS_LAST_RANK = {torch.channels_last: 4, torch.channels_last_3d: 5}


def _memory_format_slot(op):
    """(positional index or None, is kwarg-only) of the op's `memory_format` argument."""
    for i, argument in enumerate(op._schema.arguments):
        if argument.name == "memory_format":
            return (None if argument.kwarg_only else i), argument.kwarg_only
    return None, False


def logical_memory_format(op, rule):
    """Wrap `rule` of an op taking `memory_format` (copies, `*_like` factories, `to`):
    channels_last asks for a layout of the *logical* rank-4/5 tensor, which the physical
    value (one dim more) cannot be asked for directly. Run with contiguous_format, then
    move the channel dim innermost behind the batch dim: the logical strides are then
    exactly channels_last's."""
    index, kwarg_only = _memory_format_slot(op)
    if index is None and not kwarg_only:
        return rule

    def wrapped(interp, *args, **kwargs):
        if kwarg_only:
            fmt = kwargs.get("memory_format")
        else:
            fmt = args[index] if index < len(args) else kwargs.get("memory_format")
        rank = _CHANNELS_LAST_RANK.get(fmt)
        if rank is None:
            return rule(interp, *args, **kwargs)
        if args[0].dim() != rank:
            raise RuntimeError(f"required rank {rank} tensor to use {str(fmt).split('.')[-1]} format")
        if kwarg_only or index >= len(args):
            kwargs = {**kwargs, "memory_format": torch.contiguous_format}
        else:
            args = (*args[:index], torch.contiguous_format, *args[index + 1 :])
        out = rule(interp, *args, **kwargs)
        if interp.is_batched(out):
            return interp.wrap(out._value.movedim(2, -1).contiguous().movedim(-1, 2))
        return out

    wrapped.__name__ = getattr(rule, "__name__", "rule")
    return wrapped


# -- batch all: independent per element after moving every batch dim to the front -----
_DIM_ARG_NAMES = ("dim", "dim0", "dim1", "dim2", "dims", "dimension", "start_dim", "end_dim", "source", "destination")
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
    rank) and shifted past the batch dim. `dim=None` means every logical dim (for a
    single optional int dim: the flattened tensor); `dim=[]` too where `empty_means_all`
    (default: ops tagged as reductions). For in-place view ops (`transpose_`) the
    dispatcher then fixes the wrapper's own shape and strides (core.rules).
    """
    dims, keepdim = _schema_dims(op)
    if empty_means_all is None:
        empty_means_all = torch.Tag.reduction in op.tags
    arguments = op._schema.arguments
    inplace = bool(arguments) and writes_argument(arguments[0]) and not arguments[0].kwarg_only

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
        # A 0-dim logical input runs as a 1-element 1-d one; remember the shapes the op
        # gives for the real 0-dim arguments, to reshape the outputs to (before the
        # physical arguments replace the logical ones).
        scalar_shapes = _logical_output_shapes(op, args, kwargs) if scalar else None

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
                if value is None:  # `int? dim=None`: the op works on the flattened tensor
                    if type(args[0]) is list:
                        continue
                    args[0] = args[0].reshape(args[0].shape[0], math.prod(args[0].shape[1:]))
                    new = 1
                    kd = _keepdim_value(args, kwargs, keepdim)
                    flatten_then_keep = rank if kd else None
                else:
                    new = normalize_dim(value, effective_rank, op) + 1
            else:  # `int[]? dims=None` means every dim; `[]` only where `empty_means_all`
                if value is None or (len(value) == 0 and empty_means_all):
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
        return _wrap_batch_all(interp, out, scalar_shapes, flatten_then_keep)

    rule.__name__ = f"batch_all_{op.__name__}"
    return rule


def _keepdim_value(args, kwargs, keepdim):
    if keepdim is None:
        return False
    index, default = keepdim
    if "keepdim" in kwargs:
        return kwargs["keepdim"]
    return args[index] if index < len(args) else default


def _logical_output_shapes(op, args, kwargs):
    """Shapes of the op's tensor outputs for one batch element (run on meta tensors of the
    logical shapes), as a flat list; None if the op has no meta kernel."""
    try:
        out = op(*meta_like(list(args)), **{k: meta_like(v) for k, v in kwargs.items()})
    except Exception:
        return None
    if isinstance(out, Tensor):
        return [out.shape]
    shapes = []
    for o in out if type(out) is tuple or type(out) is list else ():
        if type(o) is list:
            shapes.extend(t.shape for t in o)
        elif isinstance(o, Tensor):
            shapes.append(o.shape)
    return shapes


def _wrap_batch_all(interp, out, scalar_shapes, keep_rank):
    """Wrap batch_all outputs; outputs computed from a 0-dim input run as 1-element 1-d
    are reshaped to the shapes the op gives for the 0-dim input (`scalar_shapes`)."""
    shapes = iter(scalar_shapes) if scalar_shapes is not None else None

    def fix(t):
        if not isinstance(t, Tensor):
            return t
        if keep_rank is not None:
            t = t.reshape(t.shape[0], *((1,) * keep_rank))
        elif shapes is not None:
            shape = next(shapes, None)
            if shape is not None and t.numel() == t.shape[0] * shape.numel():
                t = t.reshape(t.shape[0], *shape)
        return interp.wrap(t)

    if isinstance(out, Tensor):
        return fix(out)
    if type(out) is tuple or type(out) is list:
        return type(out)(([fix(e) for e in o] if type(o) is list else fix(o)) for o in out)
    return out
