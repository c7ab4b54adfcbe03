"""Rules for the ops torch's functionalization gets wrong here: `rule(level, op, args, kwargs)`
returns the op's result, or NotImplemented to let torch's Functionalize kernel run.

torch's functionalization is built for autograd *above* it (AOTAutograd differentiates
functional tensors). Here a level below may differentiate the values (`grad(functionalize(f))`,
`jvp(...)`): the out-of-place ops torch substitutes must then have the right derivatives.
Two do not, and one in-place op has no Functionalize kernel at all:

- `copy_` becomes `aten.copy`, which has no derivative (reverse or forward);
- `rrelu_with_noise_` becomes `rrelu_with_noise_functional`, whose derivative reads the
  `noise` argument as it was before the op filled it (uninitialized memory: silently wrong
  gradients);
- `polygamma_` has no Functionalize kernel (torch.func fails): its out-of-place op, with the
  same arguments, then a copy (so for any in-place op without a kernel).
Each rule runs its ops through the level (`level.process`), so they are functionalized too.
"""

from __future__ import annotations

import torch
import torch.utils._mode_utils

from ..core.level_tensor import LevelTensor

aten = torch.ops.aten
_restore_outside = torch._C._RestorePythonTLSSnapshot
_unpack_dual = torch._VF._unpack_dual

RULES: dict = {}  # op -> rule(level, op, args, kwargs) (None: torch's kernel)


def register(*ops):
    def decorate(rule):
        for op in ops:
            RULES[op] = rule
        return rule

    return decorate


def rule_for(op):
    """The rule of `op`, or None (cached: in-place ops without a Functionalize kernel get
    `_out_of_place_then_copy` when an out-of-place op with their arguments exists)."""
    try:
        return RULES[op]
    except KeyError:
        pass
    rule = None
    if op._schema.is_mutable and not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Functionalize"):
        variant = _functional_variant(op)
        if variant is not None:
            rule = _out_of_place_then_copy(variant)
    RULES[op] = rule
    return rule


def differentiated(value) -> bool:
    """Whether some level below (a functx level, torch's autograd or forward AD) may
    differentiate through `value` (call with the dispatch state of outside restored)."""
    if isinstance(value, LevelTensor) or value.requires_grad:
        return True
    if torch.autograd.forward_ad._current_level < 0:
        return False
    with torch.utils._mode_utils.no_dispatch():  # its primal alias is no op of the function
        return _unpack_dual(value, 0)[1] is not None


# -- copy_ --------------------------------------------------------------------------------------
@register(aten.copy_.default)
def copy_(level, op, args, kwargs):
    """`target.copy_(src)` where a level below differentiates: the new value is made with ops
    that have derivatives (expand_copy, _to_copy, clone) and installed as the Functionalize
    kernels install theirs (replace, commit, sync). Where nothing below differentiates, torch's
    kernel runs (`aten.copy`, as in torch.func's graphs)."""
    target, src = args[0], args[1]
    functional = target._value
    with _restore_outside():  # syncs run ops one level down: autograd must see them
        like = level.current(functional)
        value = level.values_below(src)
        if not (differentiated(like) or differentiated(value)):
            return NotImplemented
        copied = value.shape != like.shape
        if copied:
            value = aten.expand_copy.default(value, list(like.shape))
        if value.dtype != like.dtype or value.device != like.device:
            value = aten._to_copy.default(value, dtype=like.dtype, device=like.device)
        elif not copied:
            value = aten.clone.default(value)
        level.install(functional, value)
    return target


# -- rrelu ----------------------------------------------------------------------------------------
_RRELU_ARGUMENTS = ("self", "noise", "lower", "upper", "training", "generator")


@register(aten.rrelu_with_noise_.default, aten.rrelu_with_noise.default)
def rrelu_with_noise(level, op, args, kwargs):
    """In training, rrelu multiplies each negative element by a random slope it writes into
    `noise` (1 for the others): the slopes are drawn with torch's functional op, then `self`
    is multiplied by them, which differentiates right."""
    call = dict(zip(_RRELU_ARGUMENTS, args), **kwargs)
    if not call.get("training", False):
        return NotImplemented
    with _restore_outside():
        if not differentiated(level.values_below(call["self"])):
            return NotImplemented
    draw = [call["self"], call["noise"], call.get("lower", 0.125), call.get("upper", 1.0 / 3.0), True]
    if call.get("generator") is not None:
        draw.append(call["generator"])
    _, slopes = level.process(aten.rrelu_with_noise_functional.default, draw, {})
    level.process(aten.copy_.default, (call["noise"], slopes), {})
    multiply = aten.mul_.Tensor if op is aten.rrelu_with_noise_.default else aten.mul.Tensor
    return level.process(multiply, (call["self"], slopes), {})


# -- in-place ops without a Functionalize kernel ----------------------------------------------------
def _functional_variant(op):
    """For an in-place op `foo_(self, ...)`, the overload of `foo` that takes the same
    arguments (in any order) and returns one new tensor; None if there is none."""
    name = op._schema.name.split("::")[-1]
    if not name.endswith("_") or not op._schema.arguments or op._schema.arguments[0].name != "self":
        return None
    packet = getattr(torch.ops.aten, name[:-1], None)
    if packet is None:
        return None
    own = {a.name: str(a.type) for a in op._schema.arguments}
    for overload in packet.overloads():
        candidate = getattr(packet, overload)
        schema = candidate._schema
        theirs = {a.name: str(a.type) for a in schema.arguments}
        if theirs == own and len(schema.returns) == 1 and not schema.is_mutable:
            return candidate
    return None


def _out_of_place_then_copy(variant):
    """`polygamma_(self, n)`: `polygamma(n, self)`, then a (functionalized) copy into self."""

    def rule(level, op, args, kwargs):
        by_name = {a.name: v for a, v in zip(op._schema.arguments, args)}
        by_name.update(kwargs)
        out = level.process(variant, [by_name[a.name] for a in variant._schema.arguments if a.name in by_name], {})
        return level.process(aten.copy_.default, (args[0], out), {})

    return rule
