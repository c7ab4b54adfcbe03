"""Reverse mode, wrapped strategy: `GradTensor`s that torch's autograd records.

functx reuses torch's autograd engine once per grad level (design A in DESIGN.md): a
GradTensor is a wrapper that torch autograd records, and for each op "one level down"
means: run the op on the wrappers' values with autograd restored (so the levels below
record their own graphs) and the grad mode of outside the transform. Derivative formulas
then run on GradTensors and re-dispatch through the lower levels, so every torch
derivative, `autograd.Function.backward` and `torch.library` autograd registration works
at every level and composes.

Two traps, both handled in each op's handler (`_handler`, at the end):
- autograd is switched off inside `__torch_dispatch__`; the op one level down runs with it
  restored (`_RestorePythonTLSSnapshot`) so lower grad levels record their own graphs;
- autograd detaches saved outputs through `aten.detach`: that must cut only this level's
  graph (`cut`: a new wrapper of the same value), or `grad(grad(exp))` is 0. A user's
  `.detach()` goes down to every level instead (level.py tells the two apart).

Driven through the AD level protocol (ad/level.py: `leaf`, `gradient`) on its own:

    >>> import torch
    >>> from functx.core.interpreter import interpreting
    >>> with interpreting(WrappedGradLevel()) as level:
    ...     x = level.leaf(torch.tensor(2.0))
    ...     (dx,) = level.gradient(x * x * x, [x])
    ...     type(dx).__name__, level.export(dx)
    ('GradTensor', tensor(12.))
"""

from __future__ import annotations

import contextlib

import torch

from ..core.forward_ad_state import at_wrappers, down_state
from ..core.interpreter import EnteredTogether
from ..core.level_tensor import (
    LevelTensor,
    call_at_values,
    mutated_argument,
    promote_for_write,
    replay_inplace_view,
    view_as_real_resolved,
    wrapper_like,
)
from ..vmap.batched_tensor import wrapper_requires_grad
from ..vmap.interpreter import VmapInterpreter
from ..core.op_facts import is_inplace_view
from ..core.rules import answered_first, refreshing_views, resolved_once
from .custom_function import apply_at_grad_level
from .level import AT_THIS_LEVEL, WrappedLevel, autograd_grad
from .lifting import raise_captured_write

_restore_autograd = torch._C._RestorePythonTLSSnapshot
_view_as_real = torch.ops.aten.view_as_real.default
_no_context = contextlib.nullcontext()


def _lands_in_vmap(values) -> bool:
    """Whether an op on `values` goes to a vmap level's rule and to nothing that records
    autograd on its own wrappers: some value is a BatchedTensor, none requires grad at its
    wrapper level, its vmap level has no direct AD level on values above it (`ad_above`:
    its rules run below autograd, and torch's autograd and forward AD record that level on
    the BatchedTensors themselves; skipping the restore lost a jvp on values' tangent:
    `vmap(jvp(lambda b: grad(f)(x, b)))` with a batched `x`), and no other level's tensor
    is among them."""
    batched = False
    for v in values:
        if isinstance(v, LevelTensor):
            if type(v._interp) is not VmapInterpreter or v._interp.ad_above or wrapper_requires_grad(v):
                return False
            batched = True
        elif type(v) is list or type(v) is tuple:
            return False
    return batched


class GradTensor(LevelTensor):
    """A tensor inside a wrapped `grad`/`vjp` level: the value one level down, recorded by
    torch autograd at this level."""

    @staticmethod
    def __new__(cls, value: torch.Tensor, level: "WrappedGradLevel", requires_grad: bool = False):
        return wrapper_like(cls, value, level, requires_grad)

    def __repr__(self):
        return f"GradTensor(level={self._interp.level}, value={self._value!r}, grad_fn={self.grad_fn})"

    __str__ = __repr__


class _restore_without_grad(EnteredTogether):
    """Outside's dispatch state with grad mode off (a level opened under `torch.no_grad()`)."""

    __slots__ = ()

    def guards(self):
        return _restore_autograd(), torch.no_grad()


def _no_context_factory():
    return _no_context


class WrappedGradLevel(WrappedLevel):
    """One `grad`/`vjp` level over wrapper tensors (see the module docstring)."""

    __slots__ = ("_lower_into_vmap",)

    def refresh(self):
        """`lower`: outside's dispatch state (the levels below record the op) with the grad
        mode of outside the transform; `_lower_into_vmap`, for ops whose values all go to a
        vmap level's rule (which restores the state itself), that grad mode alone."""
        if self.prev_grad_mode:
            self.lower, self._lower_into_vmap = _restore_autograd, _no_context_factory
        else:
            self.lower, self._lower_into_vmap = _restore_without_grad, torch.no_grad
        # `handler_of`: each op's handler, `_handler`
        self.handler_of = _HANDLERS_OVER_DUAL_VALUES if self.over_dual_values else _HANDLERS
        if self.lifted_bases is not None:
            self.handler_of = refreshing_views(self.handler_of)

    def apply_function(self, function, args, kwargs):
        """An autograd.Function whose arguments hold this level's tensors: its single-level
        version, applied to them (ad/custom_function.py)."""
        return apply_at_grad_level(self, function, args, kwargs)

    # -- the AD level protocol (level.py) ------------------------------------------------------
    def leaf(self, x):
        return GradTensor(x, self, requires_grad=True)

    def gradient(self, output, leaves):
        # Results leave as values one level down, where any graph they have belongs to the
        # levels below: gradients are always built with create_graph=True at this level.
        return self.vjp([output], leaves, [None], create_graph=True, retain_graph=None)

    def vjp(self, outputs, leaves, cotangents, *, create_graph, retain_graph):
        # Only this level's wrappers can depend on its leaves: an output of a lower level
        # (one that does not involve the differentiated input, e.g. the gradient of a linear
        # function under hessian) contributes zero here, whatever the levels below record
        # (its tape may be a direct grad level's, on vmap's physical values).
        own = [(o, c) for o, c in zip(outputs, cotangents) if type(o) is GradTensor and o._interp is self]
        with self._backward_context():
            return autograd_grad(
                [o for o, _ in own], leaves, [c for _, c in own], create_graph=create_graph, retain_graph=retain_graph
            )

    def _backward_context(self):
        """Over a jvp level on values, the backward's formulas on this level's wrappers run
        with forward AD off; their ops one level down switch it on (core/dual_values.py).
        (A `vjp_fn` called after the level finished runs its ops on the values directly.)"""
        return at_wrappers() if self.over_dual_values and self.alive else _no_context

    def depends(self, output) -> bool:
        """Whether `output` depends on this level's differentiated inputs."""
        return output.requires_grad

    def lift(self, value):
        """A tensor made inside the function (a factory's result): a constant of this level."""
        return GradTensor(value, self)

    def cut(self, x):
        """The same value, cut from this level's graph (autograd's detach of a saved output)."""
        return GradTensor(x._value, self)

    wrap = lift  # autograd.Function outputs at this level (custom_function.py)

    def _check_write_into_foreign(self, op, args):
        """An in-place write into a tensor that is not this level's, of a value this level
        differentiates, would record this level's history on a lower level's object."""
        for a in args:
            if type(a) is GradTensor and a._interp is self and a.requires_grad:
                raise_captured_write(op, "grad")
            if type(a) is list or type(a) is tuple:
                self._check_write_into_foreign(op, a)

    def _unwrap(self, x):
        if type(x) is GradTensor and x._interp is self:
            return x._value
        if type(x) is list or type(x) is tuple:
            return type(x)(self._unwrap(e) for e in x)
        return x

    def _wrap_result(self, op, args, mutated, out):
        if mutated is not None:  # in-place: the value changed under the same wrapper
            if is_inplace_view(op):
                replay_inplace_view(op, args, {})
            return args[mutated]
        if isinstance(out, torch.Tensor):
            return GradTensor(out, self)
        if type(out) is tuple or type(out) is list:
            return type(out)(
                GradTensor(o, self) if isinstance(o, torch.Tensor)
                else [GradTensor(e, self) for e in o] if type(o) is list
                else o
                for o in out
            )
        return out

    # -- after the transform returned ----------------------------------------------------------
    def rebox_dead(self, value):
        return GradTensor(value, self)

    def detach_dead(self, x):
        return GradTensor(x._value, self)  # cut the dead level's graph only, as in process


# -- one op: `WrappedGradLevel.handler_of(op)`, made once per op by `_handler` ---------------------
def _handler(op, over_dual_values):
    """The whole of `op` at a grad level: the op on the wrappers' values one level down,
    with autograd restored (the levels below record it) and the grad mode of outside the
    transform, its results wrapped (torch's autograd records the op on the wrappers
    themselves, above); for an in-place op the write's bookkeeping first; for the ops
    torch's autograd asks about this level's wrappers their answer here (`AT_THIS_LEVEL`).
    Over a jvp level on values, the op is called so that its tangents flow one level
    down (core/dual_values.py)."""
    mutated = mutated_argument(op)
    call = _view_as_real_at_level if op is _view_as_real else op

    def handle(level, args, kwargs):
        unwrap = level._unwrap
        values = [
            a._value if type(a) is GradTensor and a._interp is level
            else unwrap(a) if type(a) is list or type(a) is tuple
            else a
            for a in args
        ]
        kw_values = {k: unwrap(v) for k, v in kwargs.items()} if kwargs else kwargs
        # A vmap rule restores autograd for the physical values itself; restoring it here
        # too would also record the op on the BatchedTensor wrappers: a second graph nobody
        # differentiates (and its saved-tensor detaches).
        with (level._lower_into_vmap if _lands_in_vmap(values) else level.lower)():
            if over_dual_values:
                out = call_at_values(call, values, kw_values, down_state())
            else:
                out = call(*values, **kw_values)
        if mutated is None and isinstance(out, torch.Tensor):  # the common case
            return GradTensor(out, level)
        return level._wrap_result(op, args, mutated, out)

    if mutated is not None:
        handle = _writing(mutated, handle, op)
    return answered_first(AT_THIS_LEVEL, op, handle)


def _writing(mutated, handle, op):
    """An in-place op: a target of this level gets a value of every level the written values
    belong to (`promote_for_write`); a write of this level's differentiated values into a
    tensor not its own is refused (`_check_write_into_foreign`)."""

    def write(level, args, kwargs):
        target = args[mutated]
        if type(target) is GradTensor and target._interp is level:
            promote_for_write(target, args)
        else:
            level._check_write_into_foreign(op, args)
        return handle(level, args, kwargs)

    return write


def _view_as_real_at_level(x):
    """`view_as_real` one level down. The wrapper of a lazily conjugated value does not
    carry the conj bit itself (copying it breaks second-order gradients of complex ops), so
    user-level `resolve_conj()` never reached the value: resolve it here, with the op, where
    the levels below record it (resolved outside, its graph was lost: a third derivative
    through `x.conj().real` was wrong)."""
    return view_as_real_resolved(x) if x.is_conj() else _view_as_real(x)


_HANDLERS = resolved_once(lambda op: _handler(op, over_dual_values=False))
_HANDLERS_OVER_DUAL_VALUES = resolved_once(lambda op: _handler(op, over_dual_values=True))
