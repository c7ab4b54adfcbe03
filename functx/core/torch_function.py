"""The one door for users' torch calls: a single TorchFunctionMode per thread.

Some of what a level must see never reaches the dispatcher through one of its tensors:
factories (`torch.randn(3)`, `torch.zeros(3)` take no tensor), random calls on plain
tensors, `torch.autograd.grad`, writes into captured tensors under a direct level (no
wrapper at all), Python-level composites a level takes whole. Levels see those as torch
calls, through handlers: `with handler:` (a `CallHandler`) makes its `torch_function(func,
types, args, kwargs)` live for the block, innermost last. The mode, on torch's stack while any handler is live, calls
the live handlers innermost first; a handler returns NotImplemented to let the call on to
the next one (and, after the outermost, to torch), or the call's result.

Inside a handler, as inside a TorchFunctionMode's `__torch_function__`, the handlers at and
inside its own level are off, and so are the outer ones unless asked for:
`call_outer(func, types, args, kwargs)` continues the call with the outer handlers (a
handler that looks at a result: lifting a factory's, marking what the function made),
`seen_by_outer()` lets every torch call in a block reach them (a handler that draws one
sample per batch element: an outer vmap's policy applies to that draw as well), and
`seen_here_and_outer()` lets the handler's own level see them too (running a torch function
written in Python whose body must be handled call by call).

One mode with a list instead of one mode per level: a torch call under three levels costs
one Python call into the mode and three handler calls, instead of three rounds through
torch's mode stack (about 0.8 µs each).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from torch.overrides import TorchFunctionMode

from .patches import way_in

Handler = Callable[[Any, tuple, tuple, dict], Any]


# torch calls functx runs as the Python they mean, before any handler sees them, with every
# live handler seeing the torch calls inside (core/control_flow.py: torch's control-flow
# operators, whose bodies are the user's functions; vmap/rules/nn_rnn.py: recurrent layers
# under vmap): {func: implementation}; an implementation returning NotImplemented declines
RUN_AS_PYTHON: dict = {}


class _UserCalls(TorchFunctionMode):
    """The mode (one per thread): the handlers live now, outermost first."""

    def __init__(self):
        super().__init__()
        self.handlers: list[Handler] = []
        self.depth = 0  # handlers[:depth] see the calls made now
        self.on_stack = False  # on torch's stack of modes now (torch takes it off for a call)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.on_stack = False
        try:
            run = RUN_AS_PYTHON.get(func)
            if run is not None:
                with seen_by_outer():
                    out = run(*args, **({} if kwargs is None else kwargs))
                if out is not NotImplemented:
                    return out
            return self.through_handlers(func, types, args, {} if kwargs is None else kwargs)
        finally:
            self.on_stack = True

    def through_handlers(self, func, types, args, kwargs):
        """The call through the handlers `handlers[:depth]`, innermost first, then torch."""
        depth = self.depth
        try:
            handlers = self.handlers
            i = depth
            while i:
                i -= 1
                self.depth = i  # a handler's own calls see the outer handlers only
                out = handlers[i](func, types, args, kwargs)
                if out is not NotImplemented:
                    return out
            return func(*args, **kwargs)
        finally:
            self.depth = depth


way_in(
    "a user's torch call (factories, random calls, torch.autograd.grad, writes into captured tensors)",
    _UserCalls,
    "what never reaches the dispatcher through a level's tensor; one mode per thread calls the "
    "live levels' handlers (CallHandler), innermost first",
)


class _PerThread(threading.local):
    def __init__(self):
        self.mode = _UserCalls()


_per_thread = _PerThread()


def call_outer(func, types, args, kwargs):
    """From inside a handler: the call, handled by the handlers outside the running one."""
    mode = _per_thread.mode
    if not mode.depth:
        return func(*args, **kwargs)
    return mode.through_handlers(func, types, args, kwargs)


def _put_on_stack(mode) -> bool:
    """Put the mode on torch's stack unless it is there; whether it was put."""
    if mode.on_stack:
        return False
    mode.__enter__()
    mode.on_stack = True
    return True


def _take_off_stack(mode) -> None:
    mode.__exit__(None, None, None)
    mode.on_stack = False


def _add(handler) -> bool:
    mode = _per_thread.mode
    mode.handlers.insert(mode.depth, handler)
    mode.depth += 1
    return _put_on_stack(mode)


def _remove(handler, pushed: bool) -> None:
    mode = _per_thread.mode
    if pushed:
        _take_off_stack(mode)
    handlers = mode.handlers
    for i in range(len(handlers) - 1, -1, -1):
        if handlers[i] is handler:
            del handlers[i]
            if i < mode.depth:
                mode.depth -= 1
            break


class seen_by_outer:
    """From inside a handler: the torch calls of the block go to the outer handlers."""

    __slots__ = ("_pushed", "_depth", "_extra")

    def __init__(self, _extra: int = 0):
        self._extra = _extra

    def __enter__(self):
        mode = _per_thread.mode
        self._depth = mode.depth
        mode.depth += self._extra
        self._pushed = _put_on_stack(mode)
        return self

    def __exit__(self, *exc):
        mode = _per_thread.mode
        if self._pushed:
            _take_off_stack(mode)
        mode.depth = self._depth


def seen_here_and_outer() -> seen_by_outer:
    """From inside a handler: the torch calls of the block go to its own handler and the outer ones."""
    return seen_by_outer(_extra=1)


class run_as_python_only(seen_by_outer):
    """The block's torch calls: those in `RUN_AS_PYTHON` run as their Python, no handler sees
    any. For a checkpoint's recomputation that runs inside a handler (functx's handling of
    `torch.autograd.grad`), where the mode is off torch's stack, and must choose as the first
    run chose (ad/norms_in_ops.py) without the levels that saw the first run, long returned."""

    __slots__ = ()

    def __enter__(self):
        mode = _per_thread.mode
        self._depth, mode.depth = mode.depth, 0
        self._pushed = _put_on_stack(mode)
        return self


def live_handlers() -> tuple:
    """The handlers that see a torch call made now, innermost last."""
    mode = _per_thread.mode
    return tuple(mode.handlers[: mode.depth])


class CallHandler:
    """Base of a level's handler of torch calls: `with handler:` makes its `torch_function`
    live for the block (the level's way in for users' torch calls)."""

    def torch_function(self, func, types, args, kwargs):  # pragma: no cover - abstract
        return NotImplemented

    def __enter__(self):
        self.mode = _per_thread.mode  # (a handler is live in the thread that entered it)
        self._live = self.torch_function  # (one bound method: `_remove` finds it by identity)
        self._pushed = _add(self._live)
        return self

    def __exit__(self, *exc):
        _remove(self._live, self._pushed)
        self._live = None  # (the bound method refers back to the handler: no cycle left behind)
