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

import torch

from .forward_ad_state import down_state, values_own_state
from .interpreter import EnteredTogether
from .level_tensor import call_at_values
from .torch_function import CallHandler, call_outer

_set_fwd_grad_enabled = torch.autograd.forward_ad._set_fwd_grad_enabled
_restore_autograd = torch._C._RestorePythonTLSSnapshot


class ForwardADAtValues(CallHandler):
    """While a level opened inside a jvp level on values computes with its values (one
    level down): forward AD in state `plain` for the plain values, off at the wrappers of
    the levels below."""

    def __init__(self, plain: bool):
        self.plain = plain

    def torch_function(self, func, types, args, kwargs):
        return call_at_values(lambda *a, **k: call_outer(func, types, a, k), args, kwargs, self.plain)


class one_level_down_over_dual_values(EnteredTogether):
    """The dispatch state a level over a jvp on values computes with its values in: the
    outside's (autograd on), forward AD as `down_state` says (or in the `state` a jvp level
    decides for what it runs one level down, wrapped_forward.py), and `ForwardADAtValues`."""

    __slots__ = ("_state",)

    def __init__(self, state=None):
        self._state = state

    def guards(self):
        plain = down_state() if self._state is None else self._state
        return values_own_state(), _restore_autograd(), _set_fwd_grad_enabled(plain), ForwardADAtValues(plain)
