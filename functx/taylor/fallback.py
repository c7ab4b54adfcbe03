"""The jet level's last resort: an op's (or an autograd.Function's) Taylor coefficients by
nested forward mode.

For an op with no rule and no decomposition (a special function: lgamma, digamma, an
extension's operator), the output's coefficients along the path are the derivatives in t of
`op(x0 + x1 t + ... + xK t^K)` at t = 0, divided by k!: `functx.jvp` nested k deep in the
scalar t. Right for any op with forward (or double-VJP) derivatives, at about 2^k op calls
for the k-th coefficient instead of the rule's k; one `functx.PerformanceWarning` per op
names it, so the missing rule gets written. An `autograd.Function` takes this way too
(`JetLevel.apply_function`): its forward may not be torch ops (NumPy), and its own `jvp` (or
its backward, by the double-VJP identity) is the derivative its author defined.
"""

from __future__ import annotations

import math

import torch

from ..ad.forward import jvp_op_by_op
from ..core.errors import ISSUES, PerformanceWarning, op_name, warn


def nested_forward_fallback(op):
    warned = []

    def fallback(level, *args, **kwargs):
        if not warned:
            warned.append(True)
            warn(
                f"functx.jet: there is no Taylor rule for {op_name(op)}; its coefficients are "
                f"computed by nested forward mode (about 2^k calls of the op for the k-th). "
                f"Please file an issue naming this op: {ISSUES}",
                PerformanceWarning,
            )
        return taylor_by_nested_jvp(level, op, args, kwargs)

    return fallback


def _on_path(level, value, t):
    """A jet of `level` as the point of its path at `t` (its primal at `t = None`); anything
    else as it is."""
    if type(value) is list or type(value) is tuple:
        return type(value)(_on_path(level, v, t) for v in value)
    if not level.is_jet(value):
        return value
    point = value._value
    if t is None:
        return point
    for k, c in enumerate(value._series, start=1):
        if c is not None:
            point = point + c * t**k
    return point


def taylor_by_nested_jvp(level, call, args, kwargs):
    """`call(*args, **kwargs)` at the level: its floating outputs with the coefficients of
    `call` along the arguments' paths, by `functx.jvp` nested k deep in t; other outputs
    (indices, flags) as the primal call returns them."""
    primal = next(level.series_of(a)[0] for a in _flat(args, kwargs) if level.is_jet(a))
    t0 = torch.zeros((), dtype=primal.dtype, device=primal.device)
    one = torch.ones((), dtype=primal.dtype, device=primal.device)
    out = call(*_on_path(level, list(args), None), **{k: _on_path(level, v, None) for k, v in kwargs.items()})
    flat = [out] if isinstance(out, torch.Tensor) else list(out)
    moving = [i for i, o in enumerate(flat) if isinstance(o, torch.Tensor) and (o.is_floating_point() or o.is_complex())]

    def along(t):
        result = call(*_on_path(level, list(args), t), **{k: _on_path(level, v, t) for k, v in kwargs.items()})
        result = [result] if isinstance(result, torch.Tensor) else list(result)
        return tuple(result[i] for i in moving)

    coefficients = {i: [] for i in moving}
    derivative = along
    for k in range(1, level.order + 1):
        derivative = _derivative_of(derivative, one)
        for i, value in zip(moving, derivative(t0)):
            coefficients[i].append(value / math.factorial(k))
    wrapped = [level.wrap_series([o, *coefficients[i]]) if i in coefficients else o for i, o in enumerate(flat)]
    return wrapped[0] if isinstance(out, torch.Tensor) else type(out)(wrapped)


def _derivative_of(function, one):
    return lambda t: jvp_op_by_op(function, t, one)


def _flat(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if type(a) is list or type(a) is tuple:
            yield from a
        else:
            yield a
