"""In-place pointwise ops that read the tensor they write (`v.mul_(v)`, `v *= v`,
`v.addcmul_(v, v)`, `v.pow_(v)`, `v[1:].mul_(v[1:])`), computed out of place and copied into
their target under the AD levels.

torch's forward-mode formulas of such ops read the operands after the write: `v.mul_(v)`
gives the tangent 2·v²·t where it is 2·v·t (plain torch's forward AD, torch.func and functx
alike returned wrong Jacobians, by finite differences). Computed as
`target.copy_(op(target.clone(), ...))` (`read_before_write`: every operand sharing the
target's memory cloned), every formula reads the operands as they were, which is what the
in-place op means for a pointwise op (each element is read before it is written); reverse
mode then differentiates it too, where plain torch refuses ("modified by an inplace
operation": the product saved the operand the write changed). Operands of the same storage count as the target (a view of it, or a disjoint
slice: for a pointwise op the rewrite is the same op there). The AD levels apply it where
the op reaches them: a wrapped level's rule table (`ad/jvp_rules.py`), a direct level's
handler of the user's torch calls (`lifting.CapturedWrites`).

    >>> import torch
    >>> out_of_place_twin(torch.ops.aten.mul_.Tensor), out_of_place_twin(torch.ops.aten.copy_.default)
    (<OpOverload(op='aten.mul', overload='Tensor')>, None)
"""

from __future__ import annotations

import torch

_IN_PLACE_DUNDERS = {
    "__iadd__": "add",
    "__isub__": "sub",
    "__imul__": "mul",
    "__itruediv__": "div",
    "__ipow__": "pow",
    "__iand__": "bitwise_and",
    "__ior__": "bitwise_or",
    "__ixor__": "bitwise_xor",
}
_op_twins: dict = {}  # ATen in-place op -> its out-of-place overload, or None
_function_twins: dict = {}  # torch function (Tensor.mul_, Tensor.__imul__) -> Tensor.mul, or None


def out_of_place_twin(op):
    """The out-of-place overload of an in-place pointwise ATen op (`mul_.Tensor` ->
    `mul.Tensor`), or None."""
    try:
        return _op_twins[op]
    except KeyError:
        pass
    twin = None
    name = op._schema.name.split("::")[-1]
    if name.endswith("_") and not name.startswith("_") and torch.Tag.pointwise in op.tags:
        packet = getattr(torch.ops.aten, name[:-1], None)
        # the overload taking the same arguments (`pow_.Tensor` is `pow.Tensor_Tensor`)
        signature = _arguments(op)
        for overload in packet.overloads() if packet is not None else ():
            if _arguments(getattr(packet, overload)) == signature:
                twin = getattr(packet, overload)
                break
    _op_twins[op] = twin
    return twin


def _arguments(op):
    return [(a.name, str(a.type), a.kwarg_only) for a in op._schema.arguments]


def function_twin(func):
    """The out-of-place form of a torch call that writes its first argument pointwise
    (`Tensor.mul_` -> `Tensor.mul`, `Tensor.__imul__` -> `Tensor.mul`), or None."""
    try:
        return _function_twins[func]
    except (KeyError, TypeError):
        pass
    twin = None
    name = getattr(func, "__name__", "")
    base = _IN_PLACE_DUNDERS.get(name) or (name[:-1] if name.endswith("_") and not name.startswith("_") else None)
    if base is not None and getattr(torch.Tensor, name, None) is func:
        aten_op = getattr(torch.ops.aten, base + "_", None)
        overloads = [getattr(aten_op, o) for o in aten_op.overloads()] if aten_op is not None else []
        if any(torch.Tag.pointwise in o.tags for o in overloads):
            twin = getattr(torch.Tensor, base, None)
    try:
        _function_twins[func] = twin
    except TypeError:  # not hashable
        pass
    return twin


def _storage_of(x):
    """The storage of the plain tensor under `x`'s wrappers (None where there is none)."""
    while hasattr(x, "_value"):
        x = x._value
    try:
        return x.untyped_storage().data_ptr() if x.numel() else None
    except (RuntimeError, NotImplementedError):  # no storage (a fake or sparse tensor)
        return None


def reads_its_target(target, operands) -> bool:
    """Whether a tensor among `operands` (other than the target in its own slot) shares the
    target's memory."""
    if not isinstance(target, torch.Tensor):
        return False
    storage = None
    for x in operands:
        if isinstance(x, torch.Tensor):
            if x is target:
                return True
            if storage is None:
                storage = _storage_of(target)
                if storage is None:
                    return False
            if _storage_of(x) == storage:
                return True
    return False


def read_before_write(args, kwargs):
    """`args` and `kwargs` of an in-place op with every tensor that shares the target's
    (`args[0]`'s) memory cloned: the operands of its out-of-place twin, which the write into
    the target then leaves as they were."""
    storage = _storage_of(args[0])

    def before(x):
        if isinstance(x, torch.Tensor) and (x is args[0] or _storage_of(x) == storage):
            return x.clone()
        return x

    return tuple(before(a) for a in args), {k: before(v) for k, v in kwargs.items()}


def written_out_of_place(func, args, kwargs, call):
    """A user's torch call `func(*args, **kwargs)` that writes its first argument pointwise
    reading it (`v.mul_(v)`), made as `target.copy_(twin(*read_before_write(...)))` with
    `call(f, args, kwargs)` (a handler's way on to the outer handlers and torch); the target.
    NotImplemented for any other call, or where the result would not fit the target (a
    broadcast: the in-place op's own error follows)."""
    twin = function_twin(func)
    if twin is None or not args or not reads_its_target(args[0], (*args[1:], *kwargs.values())):
        return NotImplemented
    target = args[0]
    before, kw_before = read_before_write(args, kwargs)
    out = call(twin, before, kw_before)
    if not isinstance(out, torch.Tensor) or out.shape != target.shape:
        return NotImplemented
    call(torch.Tensor.copy_, (target, out), {})
    return target
