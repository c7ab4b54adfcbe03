"""Pointwise ops: every `Tag.pointwise` op through one template, plus the untagged ones
that broadcast the same way (copies, casts, fills)."""

import torch

from ..batched_tensor import VMAP_RULES
from ..templates import is_pointwise, pointwise_rule

aten = torch.ops.aten

_NOT_POINTWISE = {aten.equal.default, aten.rrelu.default}  # data-dependent / random: see their files

VMAP_RULES.add_template(lambda op: is_pointwise(op) and op not in _NOT_POINTWISE, pointwise_rule)

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
    aten.fill.Tensor,
    aten.fill_.Scalar,
    aten.fill_.Tensor,
    aten.zero_.default,
    aten.zero.default,
    aten.copy_.default,
    aten.copy.default,
    aten.masked_fill.Tensor,
    aten.masked_fill_.Tensor,
    aten.masked_fill_.Scalar,
    aten.where.self,
    aten.where.ScalarSelf,
    aten.where.ScalarOther,
    aten.where.Scalar,
    aten.lerp.Tensor,
    aten.clamp.Tensor,
    aten.logical_not.default,
    aten.bitwise_not.default,
    aten._conj.default,
    aten._neg_view.default,
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
        VMAP_RULES.set(_op, pointwise_rule(_op))
