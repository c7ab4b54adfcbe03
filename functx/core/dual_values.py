"""Keeping the tangents of a jvp level on values off the wrappers of levels opened inside it.

A jvp level on values (ad/direct_forward.py with no vmap levels of its own) runs torch's
forward AD on the plain tensors the function computes with: its tangents sit on them, at
torch's one dual level, where no level sees them. A level opened inside it (a vmap, a
wrapped grad or jvp level: `Interpreter.over_dual_values`) has wrapper tensors, and an op
that mixes one of its wrappers with such a plain tensor would have torch run its forward
formulas on the wrapper too. The wrapper would then carry the outer tangent at its own
level, where a jvp level inside takes it for its own (perturbation confusion: silently
wrong values), an in-place formula writes a batched tangent into an unbatched one, and a
rule that returns what its own ops made has its tangent re-set (torch asserts).

The outer tangent's place is one level down, in the values the wrapper's level computes
with. So ops on those wrappers run with forward AD off at the wrapper, and where a level
computes with its values (its rule, one level down) forward AD is on again for plain
values and off for wrappers of the levels below it: `ForwardADAtValues` decides per call.
The levels' own modes do it for the user's calls (vmap/randomness.py, ad/lifting.py).

    >>> import torch, functx
    >>> x, t = torch.tensor([1.0, 2.0]), torch.tensor([1.0, 0.0])
    >>> f = lambda x: functx.vmap(lambda r: torch.stack([r * x, r]))(x.unsqueeze(0))
    >>> functx.jvp(f, (x,), (t,))[1]
    tensor([[[2., 0.],
             [1., 0.]]])
"""

from __future__ import annotations

import threading

import torch
from torch.overrides import TorchFunctionMode

from .level_tensor import LevelTensor

_set_fwd_grad_enabled = torch.autograd.forward_ad._set_fwd_grad_enabled
_is_fwd_grad_enabled = torch._C._is_fwd_grad_enabled
_restore_autograd = torch._C._RestorePythonTLSSnapshot
_outside = threading.local()  # `enabled`: the forward AD state of the call at wrappers being run


def wraps_over_dual_values(values) -> bool:
    """Whether `values` (a call's arguments: tensors, or lists of them as `torch.cat` takes)
    include a wrapper of a live level opened inside a jvp level on values. (The ops on a
    finished level's wrappers run on their values directly, level_tensor.py: forward AD on.)"""
    for a in values:
        if isinstance(a, LevelTensor):
            if a._interp.over_dual_values and a._interp.alive:
                return True
        elif type(a) is list or type(a) is tuple:
            for e in a:
                if isinstance(e, LevelTensor) and e._interp.over_dual_values and e._interp.alive:
                    return True
    return False


def call_at_values(func, args, kwargs, plain=None):
    """`func(*args, **kwargs)` with torch's forward AD off if it mixes in such wrappers (the
    state it was called in is kept for their level's rule: `down_state`); otherwise in
    forward AD state `plain` (None: as it is)."""
    if wraps_over_dual_values(args) or bool(kwargs) and wraps_over_dual_values(kwargs.values()):
        with at_wrappers():
            return func(*args, **kwargs)
    if plain is None or plain == _is_fwd_grad_enabled():
        return func(*args, **kwargs)
    with _set_fwd_grad_enabled(plain):
        return func(*args, **kwargs)


class at_wrappers:
    """Forward AD off for ops on the wrappers of levels over a jvp on values, the state
    before kept for their rules (`down_state`). Nested right inside another (torch's
    autograd making a backward's default cotangent), the state before is the outer one's."""

    __slots__ = ("_saved", "_off")

    def __enter__(self):
        self._saved = (getattr(_outside, "enabled", None), getattr(_outside, "ours", False))
        if not self._saved[1]:
            _outside.enabled = _is_fwd_grad_enabled()
        _outside.ours = True
        self._off = _set_fwd_grad_enabled(False)

    def __exit__(self, *exc):
        self._off.__exit__(*exc)
        _outside.enabled, _outside.ours = self._saved


class level_rule:
    """While a level's own rule runs in user-facing code (the AD levels' autograd.Function
    rules, ad/custom_function.py, which make this level's carriers and set forward AD for
    what they run one level down themselves): the levels' modes leave its calls alone."""

    __slots__ = ("_saved",)

    def __enter__(self):
        self._saved = getattr(_outside, "in_rule", False)
        _outside.in_rule = True

    def __exit__(self, *exc):
        _outside.in_rule = self._saved


def in_level_rule() -> bool:
    return getattr(_outside, "in_rule", False)


class applying_function:
    """While a level applies a `torch.autograd.Function` (core/custom_function.py): torch runs
    the Function's forward and jvp with forward AD off, meant for the level applying it
    (whose rule handles its tangents); the forward levels below must still compute theirs
    there (torch.func lowers a Function with each level's own forward AD mode)."""

    __slots__ = ()

    def __enter__(self):
        _outside.functions = getattr(_outside, "functions", 0) + 1

    def __exit__(self, *exc):
        _outside.functions -= 1


def user_forward_ad() -> bool:
    """Whether forward AD is on for the op a forward level is given, as the user's code set
    it. `_set_fwd_grad_enabled(False)` around an op stops its tangents at every forward level,
    as in torch.func (its levels keep the mode while an op goes down through them; so does a
    jvp on values, which is torch's forward AD itself), and as `torch.no_grad()` stops every
    reverse level. What functx switches off itself (`at_wrappers`) is seen through
    (`down_state`), and so is torch's switching inside an autograd.Function (above)."""
    return getattr(_outside, "functions", 0) > 0 or down_state()


def down_state() -> bool:
    """The forward AD state a level over a jvp on values computes with its values in: the
    state the op on its wrappers was called in (torch switches forward AD off inside an
    autograd.Function's jvp at the values, and it must stay off there)."""
    enabled = getattr(_outside, "enabled", None)
    return _is_fwd_grad_enabled() if enabled is None else enabled


class ForwardADAtValues(TorchFunctionMode):
    """While a level opened inside a jvp level on values computes with its values (one
    level down): forward AD in state `plain` for the plain values, off at the wrappers of
    the levels below."""

    def __init__(self, plain: bool):
        super().__init__()
        self.plain = plain

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return call_at_values(func, args, kwargs or {}, self.plain)


class one_level_down_over_dual_values:
    """The dispatch state a level over a jvp on values computes with its values in: the
    outside's (autograd on), forward AD as `down_state` says (or in the `state` a jvp level
    decides for what it runs one level down, wrapped_forward.py), and `ForwardADAtValues`."""

    __slots__ = ("_state", "_guards", "_ours")

    def __init__(self, state=None):
        self._state = state

    def __enter__(self):
        plain = down_state() if self._state is None else self._state
        self._ours = getattr(_outside, "ours", False)
        _outside.ours = False  # the state set here is the values' own
        self._guards = (_restore_autograd(), _set_fwd_grad_enabled(plain), ForwardADAtValues(plain))
        for guard in self._guards:
            guard.__enter__()

    def __exit__(self, *exc):
        for guard in reversed(self._guards):
            guard.__exit__(*exc)
        _outside.ours = self._ours
