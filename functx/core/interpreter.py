"""The interpreter stack: one interpreter per active transform, each with a unique level.

Levels come from a process-wide counter and are never reused, so a value from a finished
transform can never be confused with one from a later transform (no perturbation
confusion). The stack itself is per thread: two threads running transforms do not see
each other's levels. Level tensors carry their interpreter object, so code that runs on
another thread for them (torch's autograd engine) finds the interpreter from the data,
not from the stack.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Any, Callable, ContextManager, Iterator

import torch

from .dispatch_modes import explain_mode_inside_transform, user_modes_see_plain_tensors

_level_counter = itertools.count(1)

functx_code = torch._C.DisableTorchFunction
"""Context for functx's own tensor code between calls into user code (moving batch dims,
making leaves, checking and exporting results). The levels' handlers of
torch calls (core/torch_function.py) are there for user code; each torch call or tensor
attribute they see costs a Python call, so functx's bookkeeping runs with torch functions off."""


class EnteredTogether:
    """A context made of several of torch's guards, made when it is entered (`guards()`: their
    arguments read then) and left in reverse order: the form of most `lower` contexts."""

    __slots__ = ("_guards",)

    def guards(self) -> tuple:  # pragma: no cover - abstract
        raise NotImplementedError

    def __enter__(self):
        self._guards = self.guards()
        for guard in self._guards:
            guard.__enter__()

    def __exit__(self, *exc):
        for guard in reversed(self._guards):
            guard.__exit__(*exc)


class _ThreadStack(threading.local):
    def __init__(self):
        self.interpreters: list[Interpreter] = []


_stack = _ThreadStack()


Handler = Callable[["Interpreter", tuple, dict], Any]
"""`handle(level, args, kwargs)`: the whole of one ATen op at one level, entering the level's
`lower()` where it computes one level down (core/rules.py makes them from rules)."""


class Interpreter:
    """Base class of a transform's interpreter: a level on the stack plus a `process` method.

    `process(op, args, kwargs)` runs one ATen op whose arguments hold level tensors of
    this level (and maybe values from lower levels); it must return the op's result
    with this level's outputs wrapped. It is `handler_of(op)(self, args, kwargs)`: the
    level's handler of the op, resolved once per op for what lies around the level (set by
    `refresh`), which enters `lower()` to compute one level down.
    """

    __slots__ = ("level", "alive", "over_dual_values", "lifted_bases", "lower", "handler_of", "__weakref__")
    level: int
    alive: bool
    over_dual_values: bool
    lifted_bases: dict | None
    lower: Callable[[], ContextManager]
    handler_of: Callable[[torch._ops.OpOverload], Handler]

    def __init__(self):
        self.level = next(_level_counter)
        self.alive = True
        # Opened inside a jvp level on values (ad/direct_forward.py, no vmap levels of its
        # own), whose tangents sit on plain tensors at torch's one dual level: torch's
        # forward AD must stay off at this level's wrappers (level_tensor.py
        # `wraps_over_dual_values`).
        self.over_dual_values = any(getattr(level, "dual_values", False) for level in _stack.interpreters)
        # id -> base: this level's tensors whose values were lifted into lower AD levels
        # through a view (level_tensor.promote_for_write); None until one is
        self.lifted_bases = None
        Interpreter.refresh(self)  # (a subclass calls its own `refresh` once its state is set)

    def process(self, op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
        """One ATen op at this level: look up its handler, which enters `lower()` and calls
        the op's rule (or answers in __torch_dispatch__'s own state, for the questions
        torch's autograd asks about this level's wrappers)."""
        return self.handler_of(op)(self, args, kwargs)

    # Whether an autograd.Function applied to plain tensors only (no level's among its
    # arguments) comes to this level's `apply_function` (the innermost such live level): a
    # level that records on plain values (a direct jvp level on values) sees them there.
    functions_on_plain_values = False

    def apply_function(self, function: type, args: tuple, kwargs: dict) -> Any:
        """Apply `function` (a `torch.autograd.Function` subclass) to `args`, where this is the
        highest level among them (or, with `functions_on_plain_values`, to plain values):
        transform the Function once for this level and apply the result one level down,
        where the next level does the same. NotImplemented: this level has no way (an
        error for a level among the arguments; torch's own apply for plain values). Called
        by one dispatcher, core/custom_function.py."""
        return NotImplemented

    def refresh(self) -> None:
        """Set `self.lower`: a zero-argument callable whose context is "one level down" for
        this level (the dispatch state its rules compute with the values in), and
        `self.handler_of`, the lookup of its handlers. Decided here, from what lies around
        the level, at creation and whenever that changes (an AD level starts or stops riding
        on a vmap level; the level lifts a base, `lifted_bases`), never per op. By default,
        outside's state restored (`torch._C._RestorePythonTLSSnapshot`) and no handlers."""
        self.lower = torch._C._RestorePythonTLSSnapshot
        self.handler_of = _no_handlers

    def pushed(self) -> None:
        """Called when the interpreter goes on the stack (set-up it needs; none by default)."""

    def popped(self) -> None:
        """Called when it leaves the stack, also after an exception (undo `pushed`)."""

    # -- after the transform returned (see level_tensor._dispatch_with_dead_levels) --
    # whether `unwrap_dead` may run with autograd restored (so what it takes keeps a graph);
    # a level whose values must be read in __torch_dispatch__'s own state says no
    dead_values_with_autograd = True

    def unwrap_dead(self, x: torch.Tensor) -> torch.Tensor:
        """What a wrapper of this (finished) level stands for one level down."""
        return x._value

    def rebox_dead(self, value: torch.Tensor) -> torch.Tensor:
        """A fresh output object for an op on dead wrappers (grad levels need one)."""
        return value

    def detach_dead(self, x: torch.Tensor) -> torch.Tensor:
        """`aten.detach` of a dead wrapper."""
        return self.unwrap_dead(x).detach()

    def __repr__(self):
        state = "" if self.alive else ", dead"
        return f"{type(self).__name__}(level={self.level}{state})"


def _no_handlers(op):  # pragma: no cover - a level that processes ops sets its own
    raise NotImplementedError(f"{op}: this level has no handlers")


def current_stack() -> tuple[Interpreter, ...]:
    """The live interpreters of this thread, innermost last."""
    return tuple(_stack.interpreters)


def top_interpreter() -> Interpreter | None:
    """The innermost live interpreter of this thread, or None outside every transform."""
    interpreters = _stack.interpreters
    return interpreters[-1] if interpreters else None


_first_transform_done = False
FIRST_TRANSFORM_HOOKS: list = []  # what functx changes in torch once a transform runs (lazy_bits)


def _first_transform():
    global _first_transform_done
    for hook in FIRST_TRANSFORM_HOOKS:
        hook()
    _first_transform_done = True


@contextlib.contextmanager
def interpreting(interpreter: Interpreter) -> Iterator[Interpreter]:
    """Push `interpreter` for the duration of the block; on any exit, pop it and mark it dead.

    The stack is restored to exactly what it was, even when the block raises.
    """
    if not _first_transform_done:
        _first_transform()
    modes = user_modes_see_plain_tensors()  # a user's TorchDispatchMode sees plain ops only
    interpreters = _stack.interpreters
    depth = len(interpreters)
    interpreters.append(interpreter)
    interpreter.pushed()
    try:
        if modes is None:
            yield interpreter
        else:
            with modes:
                yield interpreter
    except RuntimeError as error:
        explained = explain_mode_inside_transform(error)
        if explained is error:
            raise
        raise explained from error
    finally:
        interpreter.alive = False
        del interpreters[depth:]
        interpreter.popped()

