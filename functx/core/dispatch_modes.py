"""A user's `TorchDispatchMode` around a transform sees the computation, as under torch.func.

torch calls the modes on its dispatch-mode stack before any tensor subclass: a mode around
`functx.vmap(f)(x)` (a FLOP counter, a memory tracker, a logging mode) would get every op on
functx's wrapper tensors, with their logical (per-sample) shapes, and call it with itself
popped, so the plain-tensor ops functx then runs would reach no mode at all. It also broke:
functx restores the dispatch state of its caller for the levels below
(`_RestorePythonTLSSnapshot`), and with the mode popped, a factory call there ("no tensor
args") hit torch's internal assert "Hit Python dispatch key but no arguments had
PyInterpreter".

torch.func's transforms sit above the Python dispatch key, so its users' modes see only the
plain ops: the real shapes, each op once. Here, while transforms run, each user mode on the
stack is stood in for by `PlainTensorsOnly`, which declines ops on functx's wrappers
(NotImplemented: torch then calls the wrapper's `__torch_dispatch__`, with the stand-in still
on the stack) and hands ops on plain tensors to the user's mode. torch's own tracing modes
(fake tensors, make_fx: "infra" modes, which decline unknown subclasses themselves) are left
alone, and so is a stack that holds one of them.

A mode entered *inside* a transformed function is stood in for only by the transforms called
within its block; the ops of the transformed function itself reach it as wrapper ops first
(torch gives functx no say before that). It may run them, seeing per-sample shapes, or, where
torch asserts, `ModeInsideTransformError` says to enter the mode around the transform call.

    >>> import torch, functx
    >>> from torch.utils.flop_counter import FlopCounterMode
    >>> w, xs = torch.randn(8, 8), torch.randn(4, 8)
    >>> with FlopCounterMode(display=False) as counter:
    ...     _ = functx.vmap(lambda x: w @ x)(xs)
    >>> counter.get_total_flops()  # one (4, 8) @ (8, 8) product: 2 * 4 * 8 * 8
    512
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack, _pop_mode, _push_mode

from .patches import way_in

_modes_on_stack = torch._C._len_torch_dispatch_stack


class PlainTensorsOnly(TorchDispatchMode):
    """Stands in for a user's mode while transforms run: ops on functx's wrappers go on to the
    wrappers, ops on plain tensors to the user's mode."""

    def __init__(self, mode: TorchDispatchMode):
        super().__init__()
        self.mode = mode

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in types:
            if getattr(t, "is_functx_level_tensor", False):  # LevelTensor's subclasses (level_tensor.py)
                return NotImplemented
        return self.mode.__torch_dispatch__(func, types, args, kwargs)

    def __repr__(self):
        return f"PlainTensorsOnly({self.mode!r})"


way_in(
    "a user's TorchDispatchMode around a transform",
    PlainTensorsOnly,
    "stood in for while transforms run: the user's mode sees the ops on plain tensors only",
)


class ModeInsideTransformError(RuntimeError):
    """A TorchDispatchMode entered inside a transformed function met functx's wrappers."""


# torch's assert when functx, called by such a mode, makes a tensor from no tensor arguments
_MODE_POPPED = "Hit Python dispatch key but no arguments had PyInterpreter"


def explain_mode_inside_transform(error: RuntimeError) -> RuntimeError:
    """`error`, or the error that says what happened when it is torch's assert above."""
    if isinstance(error, ModeInsideTransformError) or _MODE_POPPED not in str(error):
        return error
    return ModeInsideTransformError(
        "functx: a TorchDispatchMode entered inside a transformed function met functx's wrapper "
        "tensors, which it cannot run (torch asserted: no tensor arguments for the Python dispatch "
        "key). Enter the mode around the transform call instead (`with mode: functx.vmap(f)(x)`): "
        "there it sees the plain-tensor ops functx runs, as under torch.func."
    )


def user_modes_see_plain_tensors():
    """A context in which the user's dispatch modes on the stack are stood in for by
    `PlainTensorsOnly` (the stack restored on exit, also after an exception); None when there
    is nothing to do (the common case, checked in ~0.1 us)."""
    if not _modes_on_stack():
        return None
    modes = _get_current_dispatch_mode_stack()
    if all(type(m) is PlainTensorsOnly for m in modes) or any(m.is_infra_mode() for m in modes):
        return None
    return _standing_in(len(modes))


@contextlib.contextmanager
def _standing_in(n: int):
    popped = [_pop_mode() for _ in range(n)]  # innermost first
    pushed = 0
    try:
        for mode in reversed(popped):
            _push_mode(mode if type(mode) is PlainTensorsOnly else PlainTensorsOnly(mode))
            pushed += 1
        yield
    finally:
        for _ in range(pushed):
            _pop_mode()
        for mode in reversed(popped):
            _push_mode(mode)
