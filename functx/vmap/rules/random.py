"""Random ops on batched tensors, under the level's randomness policy.

"different": each batch element draws its own numbers (run the op on the batched value).
"same": every element sees the same draw (draw for one element, broadcast it).
"error": raise. Random ops on unbatched values are handled by `randomness.RandomnessMode`.
"""

import torch

from ..batched_tensor import VMAP_RULES
from ..randomness import random_op_error
from ..templates import pointwise_rule

aten = torch.ops.aten

# Ops whose draws depend only on the shape of the batched tensor (plus scalar params).
_SHAPE_ONLY = (
    aten.rand_like.default,
    aten.randn_like.default,
    aten.randint_like.default,
    aten.randint_like.low_dtype,
    aten.randint_like.Tensor,
    aten.randint_like.generator,
    aten.randint_like.low_generator_dtype,
    aten.uniform_.default,
    aten.normal_.default,
    aten.random_.default,
    getattr(aten.random_, "from"),
    aten.random_.to,
    aten.exponential_.default,
    aten.geometric_.default,
    aten.cauchy_.default,
    aten.log_normal_.default,
    aten.bernoulli_.float,
    aten.bernoulli.p,
    aten.uniform.default,
)
# Ops whose draws depend on the batched tensor's values (probabilities, means, rates).
_VALUE_DEPENDENT = (
    aten.bernoulli.default,
    aten.normal.Tensor_float,
    aten.normal.float_Tensor,
    aten.normal.Tensor_Tensor,
    aten.poisson.default,
    aten.binomial.default,
    aten._standard_gamma.default,
    aten._sample_dirichlet.default,
    aten.multinomial.default,
    aten.native_dropout.default,
    aten.rrelu_with_noise.default,
)


def _shape_only_rule(op):
    inplace = op._schema.name.endswith("_")
    broadcasting = pointwise_rule(op)

    def rule(interp, x, *args, **kwargs):
        if interp.randomness == "error":
            raise random_op_error()
        if interp.randomness == "different":
            return broadcasting(interp, x, *args, **kwargs)
        value = x._value
        one = op(value[0].clone() if inplace else value[0], *args, **kwargs)
        if inplace:
            value.copy_(one.expand_as(value))
            return x
        return interp.wrap(one.expand_as(value))

    return rule


def _value_dependent_rule(op):
    different = pointwise_rule(op) if op is not aten.multinomial.default else None

    def rule(interp, *args, **kwargs):
        if interp.randomness == "error":
            raise random_op_error()
        if interp.randomness == "same":
            raise RuntimeError(
                f"vmap: randomness='same' is not supported for {op._schema.name} with a batched "
                f"input: its draws depend on per-element values. Use randomness='different', or "
                f"draw uniform numbers once (torch.rand_like) and compare against your values."
            )
        if op is aten.multinomial.default:
            return _multinomial(interp, *args, **kwargs)
        if op is aten.native_dropout.default:
            return interp.wrap_all(op(args[0]._value, *args[1:], **kwargs))
        return different(interp, *args, **kwargs)

    return rule


def _multinomial(interp, probs, num_samples, replacement=False, *, generator=None):
    value = probs._value
    flat = value.reshape(-1, value.shape[-1])
    out = aten.multinomial.default(flat, num_samples, replacement, generator=generator)
    return interp.wrap(out.view(*value.shape[:-1], num_samples))


for _op in _SHAPE_ONLY:
    VMAP_RULES.set(_op, _shape_only_rule(_op))
for _op in _VALUE_DEPENDENT:
    VMAP_RULES.set(_op, _value_dependent_rule(_op))


def _bernoulli_p_tensor_rule(op):
    """bernoulli(x, p) / x.bernoulli_(p): the draws depend on the values of `p` and only on
    the shape of `x`. With `p` not batched here every element draws with the same
    probabilities, so randomness="same" is well defined (one draw, expanded)."""
    shape_only, value_dependent = _shape_only_rule(op), _value_dependent_rule(op)

    def rule(interp, x, p, **kwargs):
        if interp.is_batched(p):
            return value_dependent(interp, x, p, **kwargs)
        return shape_only(interp, x, p, **kwargs)

    return rule


for _op in (aten.bernoulli.Tensor, aten.bernoulli_.Tensor):
    VMAP_RULES.set(_op, _bernoulli_p_tensor_rule(_op))
