"""Python numbers where an op takes a Tensor, for `OpOverload.redispatch`.

`x + 1` reaches `__torch_dispatch__` as `aten.add.Tensor(x, 1)`: torch turns the
"wrapped number" tensor it made for `1` back into a Python number. Calling the op again
(`op(x, 1)`) makes a wrapped number of it once more, but `op.redispatch(keys, x, 1)`, which
the functionalize level needs (level.py), refuses numbers for Tensor arguments, and Python
cannot make a wrapped number. So such a call is rewritten before it is redispatched:

- to the op's overload that takes a Scalar there, if there is one (`add.Scalar(x, 1)`:
  the same computation, and `make_fx` records the number as torch.func's graphs do);
- otherwise the number becomes a 0-dim tensor whose dtype gives the result dtype a wrapped
  number would (a wrapped number takes part in type promotion after 0-dim tensors).

    >>> import torch
    >>> rewrite_numbers(torch.ops.aten.add.Tensor, (torch.ones(2), 1), {"alpha": 2})
    (<OpOverload(op='aten.add', overload='Scalar')>, [tensor([1., 1.]), 1, 2], {})
"""

from __future__ import annotations

import torch

_NUMBERS = (bool, int, float, complex)
_tensor_slots: dict = {}
_scalar_overloads: dict = {}


def _is_tensor_type(t) -> bool:
    return isinstance(t, torch.TensorType) or (
        isinstance(t, torch.OptionalType) and isinstance(t.getElementType(), torch.TensorType)
    )


def tensor_slots(op):
    """Positions and keyword names of `op`'s (optional) Tensor arguments."""
    try:
        return _tensor_slots[op]
    except KeyError:
        arguments = op._schema.arguments
        slots = (
            tuple(i for i, a in enumerate(arguments) if not a.kwarg_only and _is_tensor_type(a.type)),
            tuple(a.name for a in arguments if a.kwarg_only and _is_tensor_type(a.type)),
        )
        _tensor_slots[op] = slots
        return slots


def has_numbers(op, args, kwargs) -> bool:
    """Whether a Python number sits where `op` takes a Tensor."""
    positions, names = tensor_slots(op)
    for i in positions:
        if i < len(args) and type(args[i]) in _NUMBERS:
            return True
    for name in names:
        if type(kwargs.get(name)) in _NUMBERS:
            return True
    return False


def _scalar_overload(op, numbered: frozenset):
    """The overload of `op` with the same arguments, but Scalar ones for those in `numbered`."""
    key = (op, numbered)
    if key in _scalar_overloads:
        return _scalar_overloads[key]
    found = None
    own = op._schema.arguments
    packet = op.overloadpacket
    for name in packet.overloads():
        candidate = getattr(packet, name)
        theirs = candidate._schema.arguments
        if candidate is op or [a.name for a in theirs] != [a.name for a in own]:
            continue
        if candidate._schema.returns.__len__() != op._schema.returns.__len__():
            continue
        if all(
            (isinstance(b.type, torch.NumberType) if a.name in numbered else str(b.type) == str(a.type))
            for a, b in zip(own, theirs)
        ):
            found = candidate
            break
    _scalar_overloads[key] = found
    return found


def _category(dtype_or_number) -> int:
    if isinstance(dtype_or_number, torch.dtype):
        d = dtype_or_number
        return 3 if d.is_complex else 2 if d.is_floating_point else 0 if d is torch.bool else 1
    return {bool: 0, int: 1, float: 2, complex: 3}[type(dtype_or_number)]


def _complex_of(dtype: torch.dtype) -> torch.dtype:
    return {torch.float16: torch.complex32, torch.float64: torch.complex128}.get(dtype, torch.complex64)


def wrapped_dtype(number, like: torch.Tensor | None) -> torch.dtype:
    """A dtype for a 0-dim tensor standing for `number`, that promotes with `like` (the op's
    first tensor) as the wrapped number would."""
    default = torch.get_default_dtype()
    natural = {0: torch.bool, 1: torch.int64, 2: default, 3: _complex_of(default)}[_category(number)]
    if like is None:
        return natural
    if _category(number) <= _category(like.dtype):
        return like.dtype
    if _category(number) == 3 and like.dtype.is_floating_point:
        return _complex_of(like.dtype)
    return natural


def rewrite_numbers(op, args, kwargs):
    """`(op, args, kwargs)` with no Python number where a Tensor is taken (see the module
    docstring); `args` comes back as a list."""
    positions, names = tensor_slots(op)
    numbered = frozenset(
        [op._schema.arguments[i].name for i in positions if i < len(args) and type(args[i]) in _NUMBERS]
        + [n for n in names if type(kwargs.get(n)) in _NUMBERS]
    )
    scalar_op = _scalar_overload(op, numbered)
    if scalar_op is not None:
        by_name = {a.name: v for a, v in zip(op._schema.arguments, args)}
        by_name.update(kwargs)
        new_args, new_kwargs = [], {}
        for a in scalar_op._schema.arguments:
            if a.name not in by_name:
                break  # a default from here on: positional defaults stay unset
            if a.kwarg_only:
                new_kwargs[a.name] = by_name[a.name]
            else:
                new_args.append(by_name[a.name])
        for a in scalar_op._schema.arguments:  # keyword-only arguments after a gap
            if a.kwarg_only and a.name in by_name:
                new_kwargs[a.name] = by_name[a.name]
        return scalar_op, new_args, new_kwargs
    like = next(
        (a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)),
        None,
    )
    new_args = list(args)
    for i in positions:
        if i < len(args) and type(args[i]) in _NUMBERS:
            new_args[i] = torch.scalar_tensor(args[i], dtype=wrapped_dtype(args[i], like))
    new_kwargs = dict(kwargs)
    for n in names:
        if type(kwargs.get(n)) in _NUMBERS:
            new_kwargs[n] = torch.scalar_tensor(kwargs[n], dtype=wrapped_dtype(kwargs[n], like))
    return op, new_args, new_kwargs
