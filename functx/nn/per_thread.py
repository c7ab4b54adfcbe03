"""A module's parameters and buffers substituted for the calling thread only.

`functional_call` runs a module's forward with given tensors in place of its own. Swapping
them into the module (torch.func's way) is seen by every thread: two threads calling
`functional_call` on one module at once read each other's parameters (measured: 176 of 400
calls wrong with two threads). Here the substitution is per thread: while any thread is
inside `substituted(module, values)`, each submodule whose tensors it replaces has its
`_parameters` / `_buffers` dict stood in for by a `PerThreadTensors`: a dict holding the
module's own tensors that answers each thread's lookups with the values that thread gave
(innermost call first, for nested calls), and any other thread's with the module's own.
Attribute access (`self.weight`), `named_parameters()`, `state_dict()` and re-assignment
(`self.count = ...`, which lands in the calling thread's values) all go through it. The last
call out puts the module's own dict object back, with any change made to the module
meanwhile.

Still swapped into the module for the call (so seen by other threads): a given name that is
not a parameter or buffer (a plain tensor attribute, or a name the module lacks). RNN
modules cache their weights in a list on the module (`_flat_weights`), so calls on a module
that contains one are serialized (a lock per module). Under torch.compile's tracing the
tensors are swapped (dynamo replays the traced graph; it does not run this code).

Example:
    >>> import torch
    >>> from functx.nn.per_thread import substituted
    >>> lin = torch.nn.Linear(2, 1)
    >>> with substituted(lin, {"bias": torch.ones(1)}) as after:
    ...     lin.bias
    tensor([1.])
    >>> type(lin._parameters) is dict   # the module's own dict is back
    True
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Iterator

import torch
import torch.nn as nn
from torch import Tensor
from torch.nn.utils._named_member_accessor import NamedMemberAccessor

__all__ = ["PerThreadTensors", "substituted"]

_KINDS = ("_parameters", "_buffers")


class PerThreadTensors(dict):
    """A submodule's `_parameters` or `_buffers` while calls substitute its tensors. The
    dict's own entries are the module's tensors; `_local.stack` holds, per thread, the dicts
    of values its (nested) calls gave; `own` is the module's dict object it stands in for."""

    __slots__ = ("_local", "users", "own")

    def __init__(self, own: dict):
        super().__init__(own)
        self._local = threading.local()
        self.users = 0  # calls (of all threads) inside
        self.own = own

    def stack(self) -> list:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _giving(self, name):
        """The innermost of this thread's dicts that gives `name`, or None."""
        for values in reversed(getattr(self._local, "stack", ())):
            if name in values:
                return values
        return None

    def __getitem__(self, name):
        values = self._giving(name)
        return values[name] if values is not None else dict.__getitem__(self, name)

    def get(self, name, default=None):
        values = self._giving(name)
        return values[name] if values is not None else dict.get(self, name, default)

    def __setitem__(self, name, value):
        values = self._giving(name)
        if values is not None:  # a re-assignment inside this thread's call
            values[name] = value
        else:
            dict.__setitem__(self, name, value)

    def items(self):
        return [(name, self[name]) for name in dict.keys(self)]

    def values(self):
        return [self[name] for name in dict.keys(self)]

    def copy(self):
        return dict(self.items())

    def __reduce__(self):  # pickled or deep-copied mid-call: as the calling thread sees it
        return (dict, (self.copy(),))


_lock = threading.Lock()  # installs and removals of stand-ins
_serializing: "weakref.WeakKeyDictionary[nn.Module, threading.RLock]" = weakref.WeakKeyDictionary()


def _enter(module: nn.Module, kind: str) -> PerThreadTensors:
    with _lock:
        current = module.__dict__[kind]
        if type(current) is not PerThreadTensors:
            current = module.__dict__[kind] = PerThreadTensors(current)
        current.users += 1
        return current


def _leave(module: nn.Module, kind: str, stand_in: PerThreadTensors) -> None:
    with _lock:
        stand_in.users -= 1
        if stand_in.users == 0 and module.__dict__.get(kind) is stand_in:
            own = stand_in.own
            own.clear()
            own.update(dict.items(stand_in))  # what the module holds now, changes included
            module.__dict__[kind] = own


def _submodule(module: nn.Module, path: str):
    """`module.get_submodule(path)`, or None where there is none; through the modules'
    `_modules` dicts first (torch's walk, by getattr and checks, costs 10x as much)."""
    if not path:
        return module
    owner = module
    for part in path.split("."):
        owner = owner.__dict__.get("_modules", {}).get(part)
        if owner is None:
            break
    else:
        return owner
    try:  # (a module torch finds by another way: an attribute set past nn.Module.__setattr__)
        return module.get_submodule(path)
    except AttributeError:
        return None


def rnn_modules(module: nn.Module) -> list:
    """The recurrent modules (nn.RNNBase) in `module`, itself included."""
    found = [module] if isinstance(module, nn.RNNBase) else []
    for child in module.__dict__.get("_modules", {}).values():
        if child is not None:
            found.extend(rnn_modules(child))
    return found


def _split(module: nn.Module, values: dict[str, Tensor]):
    """`values` by (submodule, kind) for names of parameters and buffers; the rest apart."""
    per_dict: dict = {}
    rest: dict[str, Tensor] = {}
    for name, value in values.items():
        owner_name, _, attr = name.rpartition(".")
        owner = _submodule(module, owner_name)
        kind = next((k for k in _KINDS if owner is not None and attr in owner.__dict__.get(k, ())), None)
        if kind is None:
            rest[name] = value
        else:
            per_dict.setdefault((owner, kind), {})[attr] = (name, value)
    return per_dict, rest


def _rnn_lock(module: nn.Module):
    if not rnn_modules(module):
        return contextlib.nullcontext()
    with _lock:
        lock = _serializing.get(module)
        if lock is None:
            lock = _serializing[module] = threading.RLock()
    return lock


@contextlib.contextmanager
def substituted(module: nn.Module, values: dict[str, Tensor]) -> Iterator[dict[str, Tensor]]:
    """`values` (full names -> tensors) in place of `module`'s tensors for the calling thread,
    for the body. Yields a dict that, after the body, holds each given name's value at the
    end (a re-assignment in the forward replaced it)."""
    if torch.compiler.is_compiling():
        with _swapped_for_all_threads(module, values) as after:
            yield after
        return
    per_dict, rest = _split(module, values)
    after: dict[str, Tensor] = {}
    with _rnn_lock(module):
        entered = []
        try:
            for (owner, kind), named in per_dict.items():
                stand_in = _enter(owner, kind)
                given = {attr: value for attr, (_, value) in named.items()}
                stand_in.stack().append(given)
                entered.append((owner, kind, stand_in, given, named))
            with _swapped_for_all_threads(module, rest) as swapped_after:
                yield after
            after.update(swapped_after)
        finally:
            for owner, kind, stand_in, given, named in reversed(entered):
                stand_in.stack().pop()
                _leave(owner, kind, stand_in)
                after.update({name: given[attr] for attr, (name, _) in named.items()})


@contextlib.contextmanager
def _swapped_for_all_threads(module: nn.Module, values: dict[str, Tensor]) -> Iterator[dict[str, Tensor]]:
    """Put `values` into `module` for the body (every thread sees them); put the originals
    back afterwards, also on error. Yields the values the module had at the given names
    just before they were swapped back (re-assignments included)."""
    after: dict[str, Tensor] = {}
    if not values:
        yield after
        return
    accessor = NamedMemberAccessor(module)
    originals, _ = accessor.swap_tensors_dict(values, allow_missing=True)
    try:
        yield after
    finally:
        # Restore in reverse order so that a name given twice (tied names) ends as it was.
        restored, _ = accessor.swap_tensors_dict(dict(reversed(originals.items())), allow_missing=True)
        after.update(restored)
