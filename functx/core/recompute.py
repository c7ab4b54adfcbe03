"""What a recomputation must see again: the contexts a checkpointed function first ran in.

Activation checkpointing runs a function a second time, in the backward pass, after the
calls around its first run may have returned. A context that changes what the function
computes must then be entered again. The one functx has: `functional_call` gives a module
the caller's parameters for the call only; torch's checkpoint recomputing `module(x)` in the
backward, after `functional_call` returned, ran on the module's own parameters, and the
gradient came out silently wrong (torch.func's `functional_call` does this in plain torch:
measured, d/db of `sum(tanh(W x + b))` 1.58 for 0.93).

A layer that owns such a context registers `capture`: called when a checkpointed function
first runs, it returns None (nothing to restore) or a function that enters the context
again (a context manager). `rerun_in_contexts(f)` is `f`, run under the captured contexts
(ad/checkpointing.py gives it to torch's checkpoint as the function to recompute).

Example:
    >>> import contextlib
    >>> from functx.core import recompute
    >>> state = {"scale": 1}
    >>> @contextlib.contextmanager
    ... def scaled(value):
    ...     old, state["scale"] = state["scale"], value
    ...     yield
    ...     state["scale"] = old
    >>> def capture():
    ...     value = state["scale"]
    ...     return (lambda: scaled(value)) if value != 1 else None
    >>> recompute.register_context(capture)
    >>> with scaled(3):
    ...     again = recompute.rerun_in_contexts(lambda: state["scale"])
    >>> again()   # the scale of the first run, not today's
    3
    >>> recompute._CAPTURES.remove(capture)
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Optional

__all__ = ["register_context", "rerun_in_contexts", "contexts_to_restore"]

_CAPTURES: list[Callable[[], Optional[Callable[[], ContextManager]]]] = []


def register_context(capture: Callable[[], Optional[Callable[[], ContextManager]]]) -> None:
    """Register a context a recomputation must enter again (module docstring)."""
    _CAPTURES.append(capture)


def contexts_to_restore() -> list[Callable[[], ContextManager]]:
    """The contexts the calling thread is in now that a recomputation must enter again."""
    return [enter for enter in (capture() for capture in _CAPTURES) if enter is not None]


def rerun_in_contexts(function: Callable) -> Callable:
    """`function`, run under the contexts the calling thread is in now (captured now), or
    `function` itself where there are none."""
    contexts = contexts_to_restore()
    if not contexts:
        return function

    def rerun(*args, **kwargs):
        with contextlib.ExitStack() as stack:
            for enter in contexts:
                stack.enter_context(enter())
            return function(*args, **kwargs)

    return rerun
