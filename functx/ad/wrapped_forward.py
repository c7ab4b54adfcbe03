"""Forward mode, wrapped strategy: `DualTensor`s that hold a primal and a tangent.

A `DualTensor` of a jvp level holds its primal (`_value`) and its tangent (`_tangent`, None
for zero), both one level down. For each op, "one level down" means: make torch dual
tensors of the primals and tangents *for this op only* (`torch._make_dual` at torch's
single forward-AD level), run the op on them, and take the primal and tangent of each
result apart again (`_unpack_dual`). torch's own forward formulas (and an
`autograd.Function`'s `jvp`) compute the tangents, on values one level down, so their ops
dispatch through the lower levels like any other.

Where the op's values one level down (its primals and other arguments, not the tangents)
are not all plain tensors (a batched value under `vmap(jvp)`, another jvp level's value),
the duals are made of fresh DualTensors of this level ("carriers") instead, so that
torch's formulas run on this level's objects and only this level's process unwraps them:
otherwise the op would reach that lower level's rule with a dual among its arguments, and
the rule, running the op on its own values with autograd on, would propagate this level's
tangent there too. Tangents may be anything (`jacfwd`: plain primals, batched tangents):
torch's formulas see them only beside primal views, which carry no tangent. Carriers are
used too when another AD level lies below (`nested`): torch's formulas take faster
in-place paths on plain tensors (`logsumexp_jvp`: `exp_p *= self_t`) that write into
tensors a reverse level below saved, and out-of-place paths on tensor subclasses.

Why transient duals: torch has one dual level, and a tangent that stays attached to a
tensor is seen by every op that tensor meets, at every functx level. If an inner jvp's
op met an outer jvp's value carrying its tangent, torch would mix the outer tangent into
the inner one (perturbation confusion), and the outer level could no longer see how the
inner tangent depends on its own input (the mixed partial, dropped). Here a tangent is
attached only while one op of its own level runs, to objects made for that op; the outer
level's tangents live inside its own DualTensors, which the inner op's formulas meet as
ordinary values, so the outer level differentiates the inner tangent too. Forward mode
therefore nests by construction: `jvp(jvp(f))`, `jacfwd(jacfwd(f))`, `jvp` of a `vmap`.

Which way an op takes is its rule's, in `JVP_RULES` (ad/jvp_rules.py: own rules by ops that
re-dispatch, templates for views and value-free ops, and by default torch's formula on
transient duals, `on_duals`). An op with no forward formula in torch falls back, for that op
only, to the double-VJP identity (`op_jvp_without_formula`, installed by forward.py).

    >>> import torch
    >>> from functx.core.interpreter import interpreting
    >>> from functx.ad.level import dual_level
    >>> with dual_level(), interpreting(WrappedJvpLevel()) as level:
    ...     x = level.dual(torch.tensor(0.0), torch.tensor(2.0))
    ...     primal, tangent = level.unpack(torch.exp(x))
    >>> primal.item(), tangent.item()
    (1.0, 2.0)
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch._decomp
from torch.autograd.forward_ad import _set_fwd_grad_enabled

from ..core.dual_values import one_level_down_over_dual_values
from ..core.forward_ad_state import user_forward_ad
from ..core.interpreter import EnteredTogether, current_stack
from ..core.level_tensor import (
    LevelTensor,
    promote_for_write,
    refresh_views,
    replay_inplace_view,
)
from ..core.op_facts import is_inplace_view, mutated_argument, writes_out
from ..core.rules import answered_first, refreshing_views
from .custom_function import apply_at_jvp_level
from .dual_tensor import (
    LIST_MARK,
    DualList,
    DualTensor,
    as_outside,
    levels_of,
    lifted_tangent,
    load_forward_decompositions,
    make_duals,
    overlaps,
    tangent_like,
    tangent_of,
    view_like,
    views_tracked,
)
from .jvp_rules import GENERAL, JVP_RULES, TORCH_FUNCTION_RULES, VIEWS_TAKING_LISTS
from .level import AT_THIS_LEVEL, ADLevel, WrappedLevel
from .lifting import raise_captured_write

_restore_autograd = torch._C._RestorePythonTLSSnapshot
_make_dual = torch._make_dual
_unpack_dual = torch._VF._unpack_dual
_DUAL_LEVEL = 0  # torch has exactly one forward-AD level

_ADInplaceOrView = torch._C.DispatchKey.ADInplaceOrView
_tls_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded
NO_FORWARD_FORMULA = "Trying to use forward AD with"  # torch's error for an op without one
_SPARSE_PRIMAL = "Cannot access storage of SparseTensorImpl"  # `_make_dual` needs a strided primal
_no_context = contextlib.nullcontext()
_view_as_real = torch.ops.aten.view_as_real.default


def op_jvp_without_formula(op, primals, tangents, kwargs, error):
    """`(output, output tangents)` of one op torch has no forward formula for. The transforms
    above the levels install it (forward.jvp_by_double_vjp: the double-VJP identity, which
    needs `vjp` and `grad`)."""
    raise error


def _forward_ad_on():
    """torch's forward AD switched on (the jvp transform switches it on for the function;
    torch switches it off inside an autograd.Function's forward and jvp)."""
    return _no_context if torch._C._is_fwd_grad_enabled() else _set_fwd_grad_enabled(True)


class _RestoredForwardOff(EnteredTogether):
    """The outside dispatch state with torch's forward AD off (`_restored_forward_off`)."""

    __slots__ = ()

    def guards(self):
        return _restore_autograd(), _set_fwd_grad_enabled(False)


def _restored_forward_off():
    """The outside dispatch state with torch's forward AD off (a guard only where it is on)."""
    return _restore_autograd() if not torch._C._is_fwd_grad_enabled() else _RestoredForwardOff()


_op_kinds: dict = {}


def _op_kind(op):
    """(index of the argument an in-place op writes or None, in-place view op?, out= op?)."""
    kind = _op_kinds.get(op)
    if kind is None:
        kind = _op_kinds[op] = (mutated_argument(op), is_inplace_view(op), writes_out(op))
    return kind


class WrappedJvpLevel(WrappedLevel):
    """One `jvp` level over wrapper tensors (see the module docstring)."""

    __slots__ = ("nested", "over_plain_grads", "prev_fwd_grad_mode", "_lower_without_tangents")
    torch_function_rules = TORCH_FUNCTION_RULES
    forward_mode = True

    def __init__(self):
        # forward AD as the user's code had it where the jvp was called: off, everything this
        # level computes is invisible to the forward levels below (as `prev_grad_mode` for
        # an outer `no_grad()`, torch.func's rule for both); read by `refresh`
        self.prev_fwd_grad_mode = user_forward_ad()
        super().__init__()
        load_forward_decompositions()
        stack = current_stack()
        # another AD level below differentiates what this one computes: carriers for every op
        # (see the module docstring), and the normalizations decomposed (jvp_rules.py)
        self.nested = any(isinstance(level, ADLevel) for level in stack)
        # `over_dual_values` (a jvp level on values below, direct_forward.py, k = 0): its
        # tangents sit on plain tensors at torch's one dual level, which torch would take
        # for this level's. Then every tensor argument of an op goes in as a carrier, so only
        # this level's tangents are attached where the op's formulas see them; the outer
        # tangents flow one level down (core/dual_values.py), when the carriers are unwrapped.
        # only grad levels on plain values below (reverse over forward: grad(jvp(f)), a
        # Hessian-vector product): torch's autograd differentiates the formulas of the ops in
        # `jvp_rules._PLAIN_UNDER_GRAD` right on plain duals, so those need no carriers
        self.over_plain_grads = bool(stack) and all(
            getattr(level, "vmap_levels", None) == () and not level.forward_mode for level in stack
        )

    def refresh(self):
        """`lower`, the dispatch state the rules compute in one level down: outside's (autograd
        on), and forward AD as the user's code has it (it is on whenever a rule runs: the
        user's `_set_fwd_grad_enabled(False)` sends ops to `_without_tangents`; torch's own
        switching inside an autograd.Function's `jvp`, which this level runs on its carriers,
        does not hold: the tangents of the levels below must flow through what that
        computes), off if this jvp was called with it off (`prev_fwd_grad_mode`).
        `_lower_without_tangents`: the same with forward AD off."""
        if self.over_dual_values:
            self.lower = functools.partial(one_level_down_over_dual_values, self.prev_fwd_grad_mode)
            self._lower_without_tangents = functools.partial(one_level_down_over_dual_values, False)
        else:
            self.lower = _restore_autograd if self.prev_fwd_grad_mode else _restored_forward_off
            self._lower_without_tangents = _restored_forward_off
        self.handler_of = _HANDLERS
        if self.lifted_bases is not None:
            self.handler_of = refreshing_views(_HANDLERS)

    def apply_function(self, function, args, kwargs):
        """An autograd.Function whose arguments hold this level's tensors: applied one level
        down to duals of their primals and tangents, so torch calls its `jvp` there
        (ad/custom_function.py)."""
        return apply_at_jvp_level(self, function, args, kwargs)

    # -- the AD level protocol (level.py) ------------------------------------------------------
    def dual(self, primal: torch.Tensor, tangent: torch.Tensor) -> DualTensor:
        """The function's input for `primal` with `tangent`. Tangents are kept laid out like
        their primals (torch's rule for forward gradients), so views of them line up."""
        if primal.is_inference() or overlaps(primal):  # cannot carry a (per-element) tangent
            primal = primal.clone()
        if tangent.is_inference():
            tangent = tangent.clone()
        if tangent.layout == torch.strided and (
            tangent.stride() != primal.stride() or not levels_of(primal) <= levels_of(tangent)
        ):
            # laid out like the primal, and a tensor of the levels the primal lives at: torch's
            # formulas write into tangents in place (`sin_`), with values of those levels
            lifted = lifted_tangent(tangent, primal)
            tangent = tangent_like(tangent, primal, tangent) if lifted is None else lifted
        return DualTensor(primal, tangent, self)

    def unpack(self, x):
        """`(primal, tangent or None)` of a result, both one level down."""
        if type(x) is DualTensor and x._interp is self:
            if self.lifted_bases is not None:
                refresh_views(self, (x,))
            return x._value, tangent_of(x)
        return x, None

    def depends(self, output) -> bool:
        return self.unpack(output)[1] is not None

    def lift(self, value: torch.Tensor) -> DualTensor:
        """A tensor made inside the function (a factory's result): a constant of this level."""
        return DualTensor(value, None, self)

    wrap = lift  # autograd.Function outputs on this level's carriers (custom_function.py)

    def cut(self, x: DualTensor) -> DualTensor:
        """A new DualTensor with the same primal and tangent (an alias torch's autograd uses)."""
        return DualTensor(x._value, tangent_of(x), self)

    # -- one op: `handler_of(op)`, `_handler` at the end --------------------------------------
    def on_duals(self, op, args, kwargs):
        """The general way, torch's own formula: torch duals of the primals and tangents, for
        this op only (of the values, or of carriers), the op on them with torch's forward AD
        on, and its results taken apart into this level's DualTensors."""
        mutated, _, writes_out = _op_kind(op)
        if mutated is not None and type(args[mutated]) is DualTensor and args[mutated]._interp is self:
            promote_for_write(args[mutated], args)
        primals, tangents = self.split(args)
        kw_primals, kw_tangents = self.split(kwargs.values()) if kwargs else ((), ())
        if mutated is not None and not (type(args[mutated]) is DualTensor and args[mutated]._interp is self):
            if any(t is not None for t in (*tangents, *kw_tangents)):
                raise_captured_write(op, "jvp")
            mutated = None
        if all(t is None for t in tangents) and all(t is None for t in kw_tangents):
            with self.lower():  # nothing to differentiate here: the op one level down
                out = op(*primals, **dict(zip(kwargs, kw_primals)))
            return args[mutated] if mutated is not None else self.wrap_outputs(out, False)
        if writes_out:
            raise NotImplementedError(
                f"functx.jvp: {op} writes into an `out=` tensor, which forward-mode AD does not "
                f"support; use the out-of-place form."
            )
        if mutated is not None:
            written = _written_tangents(primals, tangents, kw_primals, kw_tangents, mutated)
            tangents[mutated] = self._tangent_for_write(args[mutated], tangents[mutated], written)
        carrier = None if not self.nested and _all_plain(primals, kw_primals) else self
        try:
            with _restore_autograd(), views_tracked(), _forward_ad_on():
                every = self.over_dual_values
                duals = make_duals(primals, tangents, carrier, every)
                kw_duals = dict(zip(kwargs, make_duals(kw_primals, kw_tangents, carrier, every)))
                out = op(*duals, **kw_duals)
                if mutated is not None:
                    return self._write_back(args[mutated], tangents[mutated], duals[mutated])
                return self.wrap_outputs(out, True)
        except NotImplementedError as error:
            if _SPARSE_PRIMAL in str(error):
                raise NotImplementedError(
                    f"functx.jvp: {op} on a sparse tensor that carries a tangent: torch cannot attach "
                    f"a tangent to a sparse tensor (`_make_dual`). Keep the tangent-carrying values "
                    f"dense (`.to_dense()`), or use reverse mode (vjp, jacrev)."
                ) from error
            simple = mutated is None and not kwargs and all(t is not LIST_MARK for t in tangents)
            if NO_FORWARD_FORMULA not in str(error) or not simple:
                raise
            with self.lower():
                out, out_tangent = op_jvp_without_formula(op, primals, tangents, {}, error)
            return self._wrap_pairs(out, out_tangent)

    def _without_tangents(self, op, args, kwargs):
        """The op under the user's `_set_fwd_grad_enabled(False)`: its results get no tangent
        here, and one level down forward AD stays off, so no forward level below gives them
        one either (torch.func's rule: the mode holds while an op goes down through its
        levels). An in-place (or `out=`) op leaves its target's tangent as it was, as torch
        does."""
        mutated, inplace_view, writes_out = _op_kind(op)
        if inplace_view:
            self.inplace_view(op, args, kwargs, self._lower_without_tangents)
            replay_inplace_view(op, args, kwargs)
            return args[0]
        own_target = mutated is not None and type(args[mutated]) is DualTensor and args[mutated]._interp is self
        if own_target:
            promote_for_write(args[mutated], args)
        values = [self.primals_of(a) for a in args]
        kw_values = {k: self.primals_of(v) for k, v in kwargs.items()} if kwargs else kwargs
        with self._lower_without_tangents():
            out = op(*values, **kw_values)
        if own_target:
            return args[mutated]
        target = kwargs.get("out") if writes_out else None
        if type(target) is DualTensor and target._interp is self:
            return target
        return self.wrap_outputs(out, False)

    def primals_of(self, a):
        """This level's primals in an op argument (lists opened), anything else as it is."""
        if type(a) is DualTensor and a._interp is self:
            return a._value
        if type(a) is list or type(a) is tuple:
            return type(a)(self.primals_of(e) for e in a)
        return a

    def has_tangents(self, args, kwargs) -> bool:
        """Whether a tensor of this level among the arguments (lists opened) has a tangent."""
        for a in (*args, *kwargs.values()):
            if type(a) is DualTensor and a._interp is self:
                if tangent_of(a) is not None:
                    return True
            elif (type(a) is list or type(a) is tuple) and self.has_tangents(a, {}):
                return True
        return False

    def view(self, op, args, kwargs):
        """A view op on one tensor of this level (`unsqueeze`, `select`, `transpose`...): views
        are linear, so the result's tangent is the same view of the tangent (torch's formula
        for every view op), made directly, no duals; both stay views of what they view.
        `GENERAL` for any other arguments."""
        x = args[0]
        if type(x) is not DualTensor or x._interp is not self:
            return GENERAL
        for a in args[1:]:
            # A list argument (a view's shape) takes the general path but for the views of a
            # tangent laid out like its primal that cannot make elements share memory
            # (`VIEWS_TAKING_LISTS`): there a view's tangent is laid out for in-place writes
            # through it (an `expand`ed tangent shared by a clone that is then written into
            # cannot take the write: fuzzer regression).
            if isinstance(a, torch.Tensor) or (type(a) is list or type(a) is tuple) and op not in VIEWS_TAKING_LISTS:
                return GENERAL
        tangent = x._tangent
        if tangent is None:
            tangent = tangent_of(x)
        value = x._value
        if tangent is not None and op in VIEWS_TAKING_LISTS and tangent.stride() != value.stride():
            return GENERAL  # (`view` may not apply to a tangent laid out otherwise)
        with self.lower():
            if op is _view_as_real and value.is_conj():
                # The wrapper of a lazily conjugated value does not carry the conj bit itself,
                # so torch's `real`/`imag` took it for resolved (`x.conj().real`): resolve the
                # value, and the tangent laid out like it, here (as the grad level does)
                value = value.resolve_conj()
                tangent = None if tangent is None else tangent.resolve_conj()
            primal = op(value, *args[1:], **kwargs)
            out_tangent = None if tangent is None else op(tangent, *args[1:], **kwargs)
        if type(primal) is list or type(primal) is tuple:  # `split`, `unbind`: one per piece
            if out_tangent is None:
                return type(primal)(DualTensor(p, None, self) for p in primal)
            return type(primal)(DualTensor(p, t, self) for p, t in zip(primal, out_tangent))
        return DualTensor(primal, out_tangent, self)

    def on_plain_duals(self, op, values, tangents, kwargs):
        """torch's formula on plain duals of `values` (plain tensors) with `tangents`, in one
        pass; `GENERAL` where torch declines (the general path raises or falls back)."""
        try:
            with _restore_autograd(), _forward_ad_on():
                if _tls_excluded(_ADInplaceOrView):  # rare (see views_tracked); the guard costs
                    with views_tracked():
                        return self._on_plain_duals(op, values, tangents, kwargs)
                return self._on_plain_duals(op, values, tangents, kwargs)
        except NotImplementedError:
            return GENERAL

    def split(self, values):
        """Primals and tangents (None where zero or not this level's) of op arguments."""
        primals, tangents = [], []
        for a in values:
            if type(a) is DualTensor and a._interp is self:
                primals.append(a._value)
                tangents.append(tangent_of(a))
            elif (type(a) is list or type(a) is tuple) and any(type(e) is DualTensor and e._interp is self for e in a):
                # a list argument (cat, stack, index): a dual per element
                inner_p, inner_t = self.split(a)
                if all(t is None for t in inner_t):
                    primals.append(type(a)(inner_p))
                    tangents.append(None)
                else:
                    primals.append(DualList(type(a), inner_p, inner_t))
                    tangents.append(LIST_MARK)
            else:
                primals.append(a)
                tangents.append(None)
        return primals, tangents

    def wrap_outputs(self, out, with_tangents: bool):
        """This level's DualTensors for an op's results (taken apart from torch duals when
        `with_tangents`; tangent-less otherwise); non-tensors as they are."""
        if isinstance(out, torch.Tensor):
            if not with_tangents:
                return DualTensor(out, None, self)
            primal, tangent = _unpack_dual(out, _DUAL_LEVEL)
            return DualTensor(self._inner(primal), self._inner(tangent), self)
        if type(out) is tuple or type(out) is list:
            return type(out)(self.wrap_outputs(o, with_tangents) for o in out)
        return out

    def _inner(self, x):
        """What a carrier (or any tensor of this level without a tangent) holds."""
        return x._value if type(x) is DualTensor and x._interp is self else x

    def _wrap_pairs(self, out, out_tangent):
        if isinstance(out, torch.Tensor):
            return DualTensor(out, out_tangent, self)
        return type(out)(self._wrap_pairs(o, t) for o, t in zip(out, out_tangent))

    def _tangent_for_write(self, target: DualTensor, tangent, written):
        """The tangent an in-place op on `target` writes into: its own, if it lives at every
        level the primal lives at and every level of the tangents `written` into it (the op
        writes values of those levels into it: a tangent batched at fewer vmap levels than
        its primal or than the tangent copied in, or plain under a grad level, could not
        take them); otherwise zeros of those levels (plus the old tangent). The written
        tangents count on their own: under `jacfwd`, a clone's tangent can be plain below
        the vmap while the tangent written into it is batched there (the primals of both
        plain), so the primal's levels alone do not say it. For a view, that happens to its
        base (the write lands in the base's tangent, as the value lands in the base), and
        the view's tangent is its part of the base's."""
        needed = levels_of(target._value)
        for t in written:
            needed |= levels_of(t)
        if tangent is not None and needed <= levels_of(tangent):
            return tangent
        # tangents laid out like this one's primal, through the levels each of them lives at
        likes = [t for t in (tangent, *written) if t is not None]
        base = target._base if target._is_view() else None
        with as_outside():
            if type(base) is DualTensor and base._interp is self:
                base._tangent = tangent_like(likes, base._value, tangent_of(base))
                target._tangent = view_like(base._tangent, base, target)
            else:
                target._tangent = tangent_like(likes, target._value, tangent)
        return target._tangent

    def _write_back(self, target: DualTensor, tangent, dual):
        """After an in-place op on `dual` (a dual of `target`'s primal, whose memory it wrote):
        the new tangent goes into `target`'s tangent in place, so its views and base see it."""
        new_tangent = self._inner(_unpack_dual(dual, _DUAL_LEVEL)[1])
        if new_tangent is not None and new_tangent is not tangent:
            tangent.copy_(new_tangent)
        return target

    def inplace_view(self, op, args, kwargs, lower):
        """`squeeze_`, `transpose_`, `as_strided_`...: change the primal's and the tangent's
        metadata in place, under `lower` (the wrapper's own metadata follows: the caller
        replays the op on it)."""
        x = args[0]
        rest = [a._value if type(a) is DualTensor and a._interp is self else a for a in args[1:]]
        tangent = tangent_of(x)
        with lower():
            op(x._value, *rest, **kwargs)
            if tangent is not None:
                op(tangent, *rest, **kwargs)

    def _on_plain_duals(self, op, values, tangents, kwargs):
        for i, tangent in enumerate(tangents):
            if tangent is not None:
                value = values[i]
                if 0 in value.stride() and overlaps(value):
                    # an expanded primal: where torch finds its tangent laid out otherwise
                    # (other strides, or another storage size: a reduction's 0-dim result
                    # expanded) it copies the tangent into the primal's layout, where elements
                    # share memory, and raises. The op reads the primal only: a copy of it,
                    # as `dual` makes for the function's inputs
                    value = value.clone()
                values[i] = _make_dual(value, tangent, _DUAL_LEVEL)
        out = op(*values, **kwargs)
        if isinstance(out, torch.Tensor):
            primal, tangent = _unpack_dual(out, _DUAL_LEVEL)
            return DualTensor(primal, tangent, self)
        return self.wrap_outputs(out, True)


def _written_tangents(primals, tangents, kw_primals, kw_tangents, mutated):
    """The tangents an in-place op writes into its target's tangent: those of every argument
    but the target (list elements included)."""
    written = []
    for values, marks in ((primals, tangents), (kw_primals, kw_tangents)):
        for i, (p, t) in enumerate(zip(values, marks)):
            if t is LIST_MARK:
                written.extend(e for e in p.tangents if e is not None)
            elif t is not None and not (values is primals and i == mutated):
                written.append(t)
    return written


def _plain(x) -> bool:
    if type(x) is DualList:
        return all(_plain(e) for e in x.primals)
    if type(x) is list or type(x) is tuple:
        return all(_plain(e) for e in x)
    return not isinstance(x, LevelTensor)


def _all_plain(*groups) -> bool:
    """Whether every value of an op one level down is plain (or not a tensor)."""
    return all(_plain(x) for group in groups for x in group)


def _handler(op, rule):
    """The whole of `op` at a jvp level, from its forward rule `rule` (ad/jvp_rules.py: its
    own, a template, or torch's formula on duals made for this op only), which enters the
    level's `lower()` to compute one level down; under the user's
    `_set_fwd_grad_enabled(False)` the op without tangents (`_without_tangents`); the ops
    torch's autograd asks about this level's wrappers answered here first (`AT_THIS_LEVEL`)."""

    def handle(level, args, kwargs):
        if not user_forward_ad():
            return level._without_tangents(op, args, kwargs)
        return rule(level, *args, **kwargs)

    return answered_first(AT_THIS_LEVEL, op, handle)


_HANDLERS = JVP_RULES.lookup(_handler)
