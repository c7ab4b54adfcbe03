"""The forward-AD state functx's levels keep per thread, beside torch's own switch.

torch has one switch for forward AD (`_set_fwd_grad_enabled`). functx flips it off for ops
on the wrappers of levels opened inside a jvp level on values (`at_wrappers`; the outer
tangents belong one level down, core/dual_values.py) and must still know, one level down,
the state the op was called in (`down_state`); it marks where a level's own rule runs in
user-facing code (`level_rule`) and where a level applies an autograd.Function
(`applying_function`), whose forward and jvp torch runs with forward AD off. Plain
thread-local state: nothing here knows a level tensor.

    >>> import torch
    >>> from functx.core.forward_ad_state import at_wrappers, down_state
    >>> with at_wrappers():
    ...     (torch._C._is_fwd_grad_enabled(), down_state())
    (False, True)
"""

from __future__ import annotations

import threading

import torch

_set_fwd_grad_enabled = torch.autograd.forward_ad._set_fwd_grad_enabled
_is_fwd_grad_enabled = torch._C._is_fwd_grad_enabled
_outside = threading.local()  # `enabled`: the forward AD state of the call at wrappers being run


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


class values_own_state:
    """A block whose forward AD state is the values' own (one level down), not one
    `at_wrappers` set: an `at_wrappers` inside it saves this state, not an outer one's."""

    __slots__ = ("_ours",)

    def __enter__(self):
        self._ours = getattr(_outside, "ours", False)
        _outside.ours = False

    def __exit__(self, *exc):
        _outside.ours = self._ours


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
    there (torch.func lowers a Function with each level's own forward AD mode). Counted only
    where forward AD is on for the op (`user_forward_ad`): a Function applied where it is off
    (by the user, or by torch inside a Function's jvp at a jvp level on values, after
    `applying_at_torch_level`) has no tangents at those levels, and counting it made that
    level switch its forward AD on again for the Function inside its own jvp (a Function
    whose jvp applies one with a generated vmap rule, under `jvp(jacrev(f))`: the inner jvp
    called again for the same level, without end)."""

    __slots__ = ("_saved",)

    def __enter__(self):
        self._saved = getattr(_outside, "functions", 0)
        if self._saved > 0 or down_state():
            _outside.functions = self._saved + 1

    def __exit__(self, *exc):
        _outside.functions = self._saved


class applying_at_torch_level:
    """While a jvp level on values (torch's forward AD itself) applies a Function with torch's
    own apply: torch switches forward AD off inside that Function's jvp for this very level,
    so the levels above's `applying_function` no longer speaks for it, nor does the state an
    `at_wrappers` around kept (a wrapped jvp over the values: `jvp(jvp(jacrev(f)))` of a
    Function whose jvp applies one with a generated vmap rule called that jvp again for the
    same level, without end): inside, torch's own switch is the state."""

    __slots__ = ("_saved",)

    def __enter__(self):
        self._saved = (
            getattr(_outside, "functions", 0),
            getattr(_outside, "enabled", None),
            getattr(_outside, "ours", False),
        )
        _outside.functions, _outside.enabled, _outside.ours = 0, None, False

    def __exit__(self, *exc):
        _outside.functions, _outside.enabled, _outside.ours = self._saved


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
