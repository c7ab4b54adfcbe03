"""Forward mode's level: torch's forward AD on this level's wrappers.

A jvp level mirrors a grad level (design A in DESIGN.md, applied to forward mode): its
wrappers are `GradTensor`s and the tangent of each rides on the wrapper as torch's
forward gradient ("dual tensor"). torch then computes every op's output tangent with
its own forward formula, on wrappers of this level, and those ops dispatch down through
the lower levels like any other. So the whole forward-derivative table of torch (and an
`autograd.Function`'s `jvp`) works at every level, and forward mode nests: torch itself
has a single dual level, but each functx level keeps its tangents on its own wrapper
objects, so levels never see each other's tangents.

    >>> import torch
    >>> from functx.core.interpreter import interpreting
    >>> with dual_level(), interpreting(JvpInterpreter()) as level:
    ...     x = make_dual(level, torch.tensor(0.0), torch.tensor(2.0))
    ...     primal, tangent = unpack_dual(level, torch.exp(x))
    >>> primal.item(), tangent.item()
    (1.0, 2.0)
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.autograd.forward_ad as fwAD

from .arguments import unwrap_level
from .grad_level import GradInterpreter, GradTensor

_lock = threading.Lock()
_users = 0  # functx transforms inside the dual level they (or the user) entered
_entered_by_functx = False


class JvpInterpreter(GradInterpreter):
    """One `jvp` level. Processes ops exactly like a grad level (values one level down,
    autograd restored there); only what its wrappers carry differs: a tangent."""

    kind = "jvp"
    __slots__ = ()


@contextlib.contextmanager
def dual_level():
    """Be inside torch's (single, process-wide) forward-AD level. The outermost functx
    forward transform enters it and the last one to leave exits it, which clears every
    tangent; a dual level the user entered is reused and left alone."""
    global _users, _entered_by_functx
    with _lock:
        if _users == 0:
            _entered_by_functx = fwAD._current_level < 0
            if _entered_by_functx:
                fwAD.enter_dual_level()
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0 and _entered_by_functx:
                fwAD.exit_dual_level()


def make_dual(level: JvpInterpreter, primal: torch.Tensor, tangent: torch.Tensor) -> GradTensor:
    """A wrapper of `level` for `primal` that carries `tangent`."""
    return fwAD.make_dual(GradTensor(primal, level), GradTensor(tangent, level))


def unpack_dual(level: JvpInterpreter, x: torch.Tensor):
    """`(primal, tangent)` of a result of `level`, both unwrapped; the tangent is None
    when `x` does not depend on the level's inputs."""
    primal, tangent = fwAD.unpack_dual(x)
    return unwrap_level(primal, level), None if tangent is None else unwrap_level(tangent, level)
