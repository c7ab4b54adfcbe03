"""Pointwise ops: every `Tag.pointwise` op through one template, plus the untagged ones
that broadcast the same way (copies, casts, fills)."""

import torch

from ..batched_tensor import VMAP_RULES
from ..templates import (
    inplace_from_functional_rule,
    is_elementwise_prim,
    is_inplace_with_functional,
    is_pointwise,
    logical_memory_format,
    materialize,
    pad_to_rank,
    pointwise_rule,
    prim_elementwise_rule,
    raise_unbatched_inplace,
)

aten = torch.ops.aten

_NOT_POINTWISE = {aten.equal.default, aten.rrelu.default}  # data-dependent / random: see their files

VMAP_RULES.add_template(lambda op: is_pointwise(op) and op not in _NOT_POINTWISE, pointwise_rule)
# Elementwise prims reach vmap from torch._refs-based decompositions.
VMAP_RULES.add_template(is_elementwise_prim, prim_elementwise_rule)
# `foo_` whose functional `foo` has a rule (eq_, cumprod_, copysign_, ...): run `foo`'s
# rule and write into self, instead of a decomposition into prims or the loop.
VMAP_RULES.add_template(is_inplace_with_functional(VMAP_RULES), inplace_from_functional_rule(VMAP_RULES))

for _op in (
    aten._to_copy.default,
    aten.clone.default,
    aten.detach.default,
    aten.alias.default,
    aten.lift_fresh.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.empty_like.default,
    aten.full_like.default,
    aten.fill.Scalar,
    aten.fill_.Scalar,
    aten.zero_.default,
    aten.zero.default,
    aten.copy_.default,
    aten.masked_fill_.Scalar,
    aten.where.self,
    aten.where.ScalarSelf,
    aten.where.ScalarOther,
    aten.where.Scalar,
    aten.lerp.Tensor,
    aten.clamp.Tensor,
    aten.logical_not.default,
    aten.bitwise_not.default,
    aten.conj_physical.default,
    aten.resolve_conj.default,
    aten.resolve_neg.default,
    aten.abs.default,
    aten.isnan.default,
    aten.signbit.default,
    aten.sgn.default,
    aten.nan_to_num.default,
    aten.positive.default,
    aten.view_as_real.default,
    aten.view_as_complex.default,
    aten.real.default,
    aten.imag.default,
    aten.angle.default,
    aten.polar.default,
    aten.complex.default,
    aten.logit.default,
    aten.heaviside.default,
    aten.floor_divide.default,
    aten.floor_divide.Scalar,
    aten.relu.default,
    aten.hardswish.default,
    aten.hardswish_backward.default,
    aten.elu_backward.default,
    aten.leaky_relu_backward.default,
    aten.hardtanh_backward.default,
    aten.softplus_backward.default,
    aten.hardsigmoid_backward.default,
    aten.mish_backward.default,
    aten.softshrink_backward.default,
    aten.hardshrink_backward.default,
):
    if _op not in VMAP_RULES.rules:
        VMAP_RULES.set(_op, logical_memory_format(_op, pointwise_rule(_op)))


_META = torch.device("meta")


# `to` returns `self` itself when nothing changes, so the rule returns the same wrapper.
def _to_rule(op):
    def rule(interp, x, *args, **kwargs):
        if kwargs.get("device") == _META and op is aten.to.dtype_layout:
            # torch's ZeroTensor arithmetic (a tangent that is zero) asks for a result's shape
            # by running the op on `.to("meta")` copies: the logical metadata is enough, and
            # the zeros it then makes need no batch dim.
            return torch.empty_strided(x.shape, x.stride(), dtype=kwargs.get("dtype") or x.dtype, device=_META)
        value = x._value
        out = op(value, *args, **kwargs)
        return x if out is value else interp.wrap(out)

    return logical_memory_format(op, rule)


for _name in aten.to.overloads():
    VMAP_RULES.set(getattr(aten.to, _name), _to_rule(getattr(aten.to, _name)))


def _masked_fill_tensor_rule(op):
    """masked_fill needs a 0-dim `value`; a batched one (one fill value per element) turns
    into a `where` with the value broadcast over each element's padded dims."""
    inplace = op is aten.masked_fill_.Tensor
    broadcasting = pointwise_rule(op)

    def rule(interp, x, mask, value):
        if not interp.is_batched(value):
            return broadcasting(interp, x, mask, value)
        if inplace and not interp.is_batched(x):
            raise_unbatched_inplace(op, x)
        rank = max(x.dim(), mask.dim())
        fill = value._value.to(x.dtype).view(-1, *((1,) * rank))
        self_value = pad_to_rank(interp.unwrap(x), x.dim(), rank) if interp.is_batched(x) else x
        mask_value = pad_to_rank(interp.unwrap(mask), mask.dim(), rank) if interp.is_batched(mask) else mask
        out = torch.where(mask_value, fill, self_value)
        if inplace:
            x._value.copy_(out.expand_as(x._value))
            return x
        return interp.wrap(out)  # out-of-place masked_fill broadcasts self and mask, as where does

    return rule


for _op in (aten.masked_fill.Tensor, aten.masked_fill_.Tensor):
    VMAP_RULES.set(_op, _masked_fill_tensor_rule(_op))


def _fill_tensor_rule(op):
    """fill needs a 0-dim `value`; a batched one (one fill value per element) is written as
    that value broadcast over each element's dims."""
    inplace = op is aten.fill_.Tensor
    broadcasting = pointwise_rule(op)

    def rule(interp, x, value):
        if not interp.is_batched(value):
            return broadcasting(interp, x, value)
        if inplace and not interp.is_batched(x):
            raise_unbatched_inplace(op, x)
        out = x._value if inplace else torch.empty_like(materialize(interp, x))
        out.copy_(value._value.view(-1, *((1,) * x.dim())).expand_as(out))
        return x if inplace else interp.wrap(out)

    return rule


for _op in (aten.fill.Tensor, aten.fill_.Tensor):
    VMAP_RULES.set(_op, _fill_tensor_rule(_op))


@VMAP_RULES.register(aten.copy.default)
def _copy(interp, x, src, non_blocking=False):
    """Functional copy: a new tensor of `x`'s shape and dtype holding `src` broadcast; it
    is batched when either is (an unbatched `x` only gives the shape)."""
    batch = interp.batch_size
    if interp.is_batched(src):
        values = pad_to_rank(src._value, src.dim(), x.dim())
        return interp.wrap(values.to(x.dtype).expand(batch, *x.shape).clone())
    return interp.wrap(aten.copy.default(x._value, src, non_blocking))


# Lazy conjugate/negative views are materialized: kernels called from a rule run with
# torch's Conjugate/Negative dispatch keys excluded (we are inside __torch_dispatch__), so
# a conj/neg bit on a physical value would be silently ignored; and a wrapper without the
# bit would make torch's C++ code skip resolve_conj before kernels that ignore it.
@VMAP_RULES.register(aten._conj.default)
def _conj(interp, x):
    out = interp.wrap(aten.conj_physical.default(x._value))
    out._conj_view = not x.is_conj()  # what `is_conj()` of one sample's conj view says
    return out
VMAP_RULES.set(aten._neg_view.default, lambda interp, x: interp.wrap(aten.neg.default(x._value)))


@VMAP_RULES.register(aten.gelu_backward.default)
def _gelu_backward(interp, grad, x, approximate="none"):
    """Operands broadcast to one physical shape first: oneDNN's float32 CPU kernel of
    gelu_backward fails on broadcasting operands ("could not create a primitive descriptor
    for the reorder primitive"), which plain autograd never passes it but a batched
    cotangent against an unbatched input (`jacrev(F.gelu)`) does."""
    rank = max(grad.dim(), x.dim())
    grad_value, x_value = torch.broadcast_tensors(
        pad_to_rank(materialize(interp, grad), grad.dim(), rank), pad_to_rank(materialize(interp, x), x.dim(), rank)
    )
    return interp.wrap(aten.gelu_backward.default(grad_value, x_value, approximate=approximate))
