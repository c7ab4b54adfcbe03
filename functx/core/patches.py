"""Every change functx makes to torch itself, in one list: nothing is patched that is not
registered here, with where and why (the design's contract; `tests/core/test_patches.py`
reads the source for assignments to torch's attributes and kernel registrations outside
it).

Two kinds of change, each registered by the module it serves (next to its machinery), and
installed here, once:

- `patch(owner, attribute, replacement, why)`: `owner.attribute` becomes functx's
  replacement (`Function.apply`, `torch.autograd.backward`, torch.library's autograd kernel
  maker, the non-reentrant checkpoint generator; dynamo's rule map when dynamo is
  imported; in tensordict's modules, once vmap meets a TensorDict, the names of torch.func's
  per-tensor vmap functions, routed to functx's for functx's levels: core/container_kinds.py). Installing the same replacement again changes nothing; `undo(entry)` puts
  torch's original back, `install(entry)` reinstalls it.
- `kernels(name, make, why, reset)`: kernels functx registers at torch's dispatch keys
  through a `torch.library.Library` (lazy_bits' Conjugate/Negative/ZeroTensor kernels; the
  forward-aware autograd kernels of torch.library operators and of the ATen operators whose
  forward formula torch gets wrong, ad/library_ops.py), made by `make()` once; `undo`
  destroys the library (torch's kernels answer again) where the maker says how to forget
  it (`reset`); the forward-aware kernels put into an operator's *own* library (a
  `custom_op` made before functx's import) go with that operator and are not undone.

The ways into functx that change nothing in torch are listed here too, one dispatcher each:
`way_in(what, dispatcher, why)` (the level tensors' `__torch_dispatch__`, the one
TorchFunctionMode per thread for users' torch calls, the stand-in for users' dispatch
modes); the test reads the source for any other `__torch_dispatch__` or mode class.

The import hook that installs functx's dynamo support when something imports `torch._dynamo`
is functx's own finder in `sys.meta_path` (`staging/__init__.py`), not a change to torch.

Example:
    >>> import functx
    >>> from functx.core.patches import PATCHES, installed
    >>> all(installed(entry) for entry in PATCHES if entry.kind == "attribute")
    True
    >>> {"_checkpoint_without_reentrant_generator", "apply"} <= {entry.attribute for entry in PATCHES}
    True
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable


@dataclasses.dataclass(eq=False)
class Patch:
    """One change to torch: an attribute replaced (`kind="attribute"`) or kernels registered
    through a library (`kind="kernels"`, `attribute` names them, `make` registers them and
    returns the library)."""

    kind: str
    owner: Any
    attribute: str
    replacement: Any
    why: str
    installed_by: str
    original: Any = None
    make: Callable | None = None
    reset: Callable | None = None
    library: Any = None


PATCHES: list = []


@dataclasses.dataclass(eq=False)
class WayIn:
    """One way into functx that is not a change to torch, and its one dispatcher (a class
    with `__torch_dispatch__`, or a mode functx puts on torch's stacks)."""

    what: str
    dispatcher: type
    why: str
    installed_by: str


WAYS_IN: list = []


def way_in(what: str, dispatcher: type, why: str) -> None:
    """Register `dispatcher` as the one door for `what` (called beside its definition)."""
    if any(entry.what == what or entry.dispatcher is dispatcher for entry in WAYS_IN):
        raise RuntimeError(f"functx: a second dispatcher for {what!r}: one door per way in")
    WAYS_IN.append(WayIn(what, dispatcher, why, _caller_module()))


def _caller_module() -> str:
    return sys._getframe(2).f_globals.get("__name__", "?")  # who called patch() / kernels()


def _find(owner, attribute):
    for entry in PATCHES:
        if entry.owner is owner and entry.attribute == attribute:
            return entry
    return None


def patch(owner, attribute: str, replacement, why: str):
    """Replace `owner.attribute` by `replacement`, once (registered in `PATCHES`); returns
    torch's original. Calling it again with the same replacement changes nothing."""
    entry = _find(owner, attribute)
    if entry is None:
        entry = Patch("attribute", owner, attribute, replacement, why, _caller_module(), _current(owner, attribute))
        PATCHES.append(entry)
    elif entry.replacement is not replacement:
        raise RuntimeError(f"functx: {attribute} is patched twice, by {entry.installed_by} and {_caller_module()}")
    install(entry)
    return entry.original


def kernels(name: str, make: Callable, why: str, reset: Callable | None = None):
    """Register kernels at torch's dispatch keys, once under `name`: `make()` registers them
    and returns the `torch.library.Library` holding them (more kernels may go into it
    later); `reset()`, if given, makes the maker's module forget them when undone."""
    entry = _find(None, name)
    if entry is None:
        entry = Patch("kernels", None, name, None, why, _caller_module(), make=make, reset=reset)
        PATCHES.append(entry)
    install(entry)
    return entry.library


def _current(owner, attribute):
    """What `owner.attribute` holds (a class's own entry: a classmethod, not a bound method)."""
    if isinstance(owner, type) and attribute in vars(owner):
        return vars(owner)[attribute]
    return getattr(owner, attribute)


def install(entry: Patch) -> None:
    """Put `entry`'s change in place (nothing if it is)."""
    if entry.kind == "attribute":
        if _current(entry.owner, entry.attribute) is not entry.replacement:
            setattr(entry.owner, entry.attribute, entry.replacement)
    elif entry.library is None:
        entry.library = entry.make()


def undo(entry: Patch) -> None:
    """torch's own again: the original attribute, or the library's kernels destroyed."""
    if entry.kind == "attribute":
        setattr(entry.owner, entry.attribute, entry.original)
        return
    if entry.reset is None:
        raise RuntimeError(f"functx: the kernels '{entry.attribute}' cannot be undone (they live in other libraries)")
    if entry.library is not None:
        entry.library._destroy()
        entry.library = None
        entry.reset()


def installed(entry: Patch) -> bool:
    """Whether `entry`'s change is in place."""
    if entry.kind == "attribute":
        return _current(entry.owner, entry.attribute) is entry.replacement
    return entry.library is not None


__all__ = ["PATCHES", "Patch", "install", "installed", "kernels", "patch", "undo"]
