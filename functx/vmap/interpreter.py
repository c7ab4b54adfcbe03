"""`VmapInterpreter`: one vmap level, its state, and what "one level down" is for it.

A level runs each op through the batching-rule table (`VMAP_RULES`, vmap/batched_tensor.py
and the family files in vmap/rules/) on its BatchedTensors' physical values, in the dispatch
state `lower` gives (decided in `refresh` when the level is made and when an AD level starts
or stops riding on it, `ride`), and applies autograd.Functions through vmap/custom_function.py.

    >>> import torch
    >>> from functx.core.interpreter import interpreting
    >>> with interpreting(VmapInterpreter(batch_size=3, randomness="error")) as level:
    ...     y = torch.sin(level.wrap(torch.zeros(3, 2)))
    ...     level.unwrap(y).shape
    torch.Size([3, 2])
"""

from __future__ import annotations

import optree
import torch

from ..core.dual_values import one_level_down_over_dual_values
from ..core.errors import DeadLevelError
from ..core.forward_ad_state import user_forward_ad
from ..core.interpreter import EnteredTogether, Interpreter
from ..core.level_tensor import LevelTensor, promote_for_write
from ..core.rules import answered_first, refreshing_views
from ..core.op_facts import mutated_argument
from .batched_tensor import RULES_USING_AUTOGRAD, SPECIAL_RULES, VMAP_RULES, WHOLE_CALL_RULES, BatchedTensor
from .chain import peel
from .custom_function import apply_at_vmap_level

_restore_autograd = torch._C._RestorePythonTLSSnapshot
_below_autograd_mode = torch._C._AutoDispatchBelowAutograd
_forward_ad_enabled = torch.autograd.forward_ad._set_fwd_grad_enabled


def _same_for_every_element(value) -> bool:
    """Whether every element along dim 0 of `value` (a plain tensor) equals the first."""
    if value.stride(0) == 0 or value.shape[0] == 1:
        return True
    with torch.no_grad():
        first = value[:1]
        same = value == first
        if value.is_floating_point() or value.is_complex():
            same |= value.isnan() & first.isnan()
        return bool(same.all())


class _forward_ad_lower(EnteredTogether):
    """`lower` under a direct jvp level (VmapInterpreter.refresh): outside's state, forward
    AD as the user has it."""

    __slots__ = ()

    def guards(self):
        return _restore_autograd(), _forward_ad_enabled(user_forward_ad())


_EXPANDED_LEAF_OF = "functx_expanded_leaf_of"  # ad/direct_reverse.EXPANDED_LEAF_OF (vmap sits below ad/)


def _reaches_only_finished_leaves(node, limit: int = 1000) -> bool:
    """Whether the autograd graph from `node` (None: no graph) reaches no leaf but those
    finished direct grad levels made (`_functx_leaf_of`, or a node marked as the expansion
    of an unbatched input, ad/direct_reverse.py); False past `limit` nodes."""
    seen, stack = set(), [node]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if len(seen) > limit:
            return False
        expanded_by = node.metadata.get(_EXPANDED_LEAF_OF)
        if expanded_by is not None and not expanded_by.alive:
            continue
        variable = getattr(node, "variable", None)
        if variable is not None:  # AccumulateGrad: a leaf
            level = getattr(variable, "_functx_leaf_of", None)
            if level is None or level.alive:
                return False
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    return True


_UNCHANGED = object()
_NO_WHOLE_CALLS: dict = {}


class VmapInterpreter(Interpreter):
    """One `vmap` level: its batch size, its randomness policy, and the batching rules."""

    __slots__ = ("batch_size", "randomness", "direct_ad", "ad_above", "values_record_graphs", "whole_calls", "mapped_dim")

    def __init__(self, batch_size: int, randomness: str):
        super().__init__()
        self.batch_size = batch_size
        self.randomness = randomness
        # what the kinds of containers with a batch size get from this call
        # (vmap/containers.py; made on first use, for the whole call)
        self.mapped_dim = None
        # The direct AD level running on the physical tensors under this level (and maybe
        # the vmap levels below: ad/direct_reverse.py, direct_forward.py), while one is
        # open: `requires_grad` and torch.autograd.grad calls inside ask a grad level; a jvp
        # level keeps forward AD on for the rules.
        self.direct_ad = None
        # Set while a direct AD level on values (ad/direct_forward.py, direct_reverse.py with
        # no vmap levels of their own) is open above this one: torch's autograd and forward
        # AD then record on this level's BatchedTensors, and the rules run below autograd
        # (no AD level lies below), as torch.func's batching rules do.
        self.ad_above = False
        self.refresh()

    def ride(self, *, direct_ad=_UNCHANGED, ad_above=_UNCHANGED):
        """An AD level starts (or, given the values from before, stops) riding on this one:
        set `direct_ad` / `ad_above` and rebuild `lower`. The only way they change."""
        if direct_ad is not _UNCHANGED:
            self.direct_ad = direct_ad
        if ad_above is not _UNCHANGED:
            self.ad_above = ad_above
        self.refresh()

    def refresh(self):
        """`lower`: the dispatch state the rules compute in, one level down, for what rides
        on this level now. Inside __torch_dispatch__ torch switches off autograd, view
        tracking and the conj/neg keys; by default a rule runs with the state of outside
        restored, so the values one level down behave as they do outside any transform: they
        record autograd graphs (a grad level below, a physical grad level), views of them are
        tracked, and CompositeImplicitAutograd ops decompose before reaching the level below.
        (Always restoring measured faster than checking the values first: transformer
        per-sample grads 6% faster.)

        `handler_of`: each op's handler (`_handler`: special answers, write bookkeeping,
        then its batching rule under `lower`), with the rules under the overrides of a direct
        AD level riding on this one (its `vmap_overrides`, vmap/batched_tensor.py
        `UNDER_DIRECT_GRAD`): the rules never ask which AD level is above them."""
        overrides = None if self.direct_ad is None else self.direct_ad.vmap_overrides
        # whether the graphs torch records on the physical values are what `requires_grad`
        # inside reports (not under a direct jvp level, whose values carry tangents)
        self.values_record_graphs = self.direct_ad is None or not self.direct_ad.forward_mode
        # torch's autograd and forward AD record on this level's wrappers, above: the rules
        # run below autograd, but for those that run torch's autograd themselves
        compose = _handler_below_autograd if self.ad_above else _handler
        self.handler_of = VMAP_RULES.lookup(compose, overrides)
        if self.lifted_bases is not None:
            self.handler_of = refreshing_views(self.handler_of)
        # torch calls taken whole (vmap/rules/whole_calls.py): only with nothing riding here
        plain = self.direct_ad is None and not self.ad_above and not self.over_dual_values
        self.whole_calls = WHOLE_CALL_RULES if plain else _NO_WHOLE_CALLS
        if self.ad_above:
            self.lower = _restore_autograd
        elif self.over_dual_values:
            # opened inside a jvp level on values: its tangents flow through the physical
            # values, never through this level's wrappers (core/dual_values.py)
            self.lower = one_level_down_over_dual_values
        elif self.direct_ad is not None and self.direct_ad.forward_mode:
            # torch calls an autograd.Function's jvp with forward AD off; the physical
            # tangents here are a direct jvp level's (an outer level's), which must flow on;
            # the user's `_set_fwd_grad_enabled(False)` holds (core/dual_values.py)
            self.lower = _forward_ad_lower
        else:
            self.lower = _restore_autograd

    def apply_function(self, function, args, kwargs):
        """An autograd.Function whose arguments hold this level's tensors: its `vmap`
        staticmethod, the rule generated from its forward (`generate_vmap_rule`), or, under
        AD above, a batched Function (vmap/custom_function.py)."""
        return apply_at_vmap_level(self, function, args, kwargs)

    def unwrap_dead(self, x):
        """A BatchedTensor used after its vmap returned (it escaped: stored in a list, an
        attribute, a closure). Its value still carries the batch dim while its shape says
        one sample: any result would disagree with its own metadata (`.shape` (3,) but
        `.sum()` over the batch) or lose derivatives. Refuse, as torch.func does, unless
        every element is the same: then it stands for that one value. That is what escapes
        from an unbatched input a direct grad level batched for its per-element gradients
        (`vmap(grad(f), in_dims=(None, 0))`, f storing `p[0:2]` or `p * 3`: dattri's
        pattern), which torch.func never batched and lets escape as the plain value. By
        construction where the batch dim is an expand (stride 0): its derivative is the
        expand's, the same per element. By value otherwise (every element equal to the
        first, NaNs in the same places: a value computed from such an input), and only where
        its graph, if any, reaches nothing but the leaves finished functx levels made for
        such inputs (their own, or the expansion of the caller's tensor, through which the
        first element's derivative is the caller's, as in torch.func): equal values with
        another graph may still have a derivative per element (an inner vmap's `x * 2` of
        equal rows of an outer grad's input), so those raise. A value that depends on a
        batched input differs between elements and still raises, as in torch.func."""
        value = x._value
        if value.dim() and value.shape[0] and not isinstance(value, LevelTensor):
            if value.stride(0) == 0:
                return value[0]
            if _same_for_every_element(value) and _reaches_only_finished_leaves(value.grad_fn):
                return value[0]
        raise DeadLevelError(
            f"vmap: a tensor of shape {tuple(x.shape)} created inside a functx.vmap was used after "
            f"that vmap returned (it escaped the vmapped function, e.g. stored in a list, an "
            f"attribute or a closure). Its value holds the whole batch, so it cannot stand for "
            f"one sample any more. Return it from the vmapped function instead (it comes back "
            f"with the batch dim at out_dims)."
        )

    # -- helpers used by every rule ------------------------------------------------
    def is_batched(self, x) -> bool:
        return type(x) is BatchedTensor and x._interp is self

    def unwrap(self, x):
        """Physical value (batch dim 0) of this level's tensors; anything else as is."""
        return x._value if type(x) is BatchedTensor and x._interp is self else x

    def wrap(self, value):
        return BatchedTensor(value, self)

    def wrap_all(self, out):
        """Wrap every tensor in an op result (tensor, tuple/list of tensors, or other)."""
        if isinstance(out, torch.Tensor):
            return BatchedTensor(out, self)
        if type(out) is tuple or type(out) is list:
            return type(out)(BatchedTensor(o, self) if isinstance(o, torch.Tensor) else o for o in out)
        return out


# -- one op: `VmapInterpreter.handler_of(op)`, made once per op by `_handler` ------------------
def _handler(op, rule):
    """The whole of `op` at a vmap level, from its batching rule `rule`: the rule on the
    physical values (batch dim first), in the level's `lower()` state; for an in-place op
    the write's bookkeeping first (`_writing`); for the ops in `SPECIAL_RULES` their answer
    in __torch_dispatch__'s own state first."""
    mutated = mutated_argument(op)
    if mutated is not None:
        handle = _writing(op, mutated, rule)
    else:

        def handle(interp, args, kwargs):
            with interp.lower():
                return rule(interp, *args, **kwargs)

    return answered_first(SPECIAL_RULES, op, handle)


def _handler_below_autograd(op, rule):
    """`_handler` under AD on values above (`VmapInterpreter.ad_above`): torch's autograd
    records on this level's wrappers, so the rule runs below autograd, unless it runs
    torch's autograd itself (`RULES_USING_AUTOGRAD`)."""
    if op in RULES_USING_AUTOGRAD:
        return _handler(op, rule)

    def below_autograd(interp, *args, **kwargs):
        with _below_autograd_mode():
            return rule(interp, *args, **kwargs)

    return _handler(op, below_autograd)


def _writing(op, mutated, rule):
    """An in-place op writing into argument `mutated`: a tensor of this level gets a value
    of every level the written values belong to (`promote_for_write`); under a direct AD
    level, a write into a tensor not batched here of values that include fresh constants
    it batched writes the constants' unbatched value (`_unlifted_fresh_constants`)."""

    def write(interp, args, kwargs):
        target = args[mutated]
        if type(target) is BatchedTensor and target._interp is interp:
            promote_for_write(target, args)
        elif interp.direct_ad is not None:
            unlifted = _unlifted_fresh_constants(args, mutated)
            if unlifted is not args and not any(interp.is_batched(a) for a in unlifted):
                with _restore_autograd():  # nothing batched is written: not this level's op
                    return op(*unlifted, **kwargs)
            args = unlifted
        with interp.lower():
            return rule(interp, *args, **kwargs)

    return write


def _unlifted_fresh_constants(args, mutated):
    """A write into a tensor not batched here, of values that include a buffer the function
    made and a direct AD level batched (vmap/randomness.py `_lift_buffer`): while nothing has
    written into that buffer, every element holds the same value, the factory's, which is
    written instead (`captured.copy_(torch.zeros(3))` inside `vmap(grad(f))` stays legal)."""
    new = None
    for i, a in enumerate(args):
        origin = getattr(a, "_fresh_origin", None) if i != mutated and type(a) is BatchedTensor else None
        if origin is not None:
            value, physical, version = origin
            if physical._version == version:
                if new is None:
                    new = list(args)
                new[i] = value
    return args if new is None else tuple(new)


def vmap_levels_on_top(stack, below_ok, tensors):
    """The vmap levels on top of `stack` (innermost last) when everything under them is
    plain: the levels below them satisfy `below_ok`, and every tensor in `tensors` is real
    and plain under those levels' wrappers. None otherwise."""
    vmap_levels = []
    for level in reversed(stack):
        if type(level) is not VmapInterpreter:
            break
        vmap_levels.append(level)
    if not vmap_levels or not all(below_ok(level) for level in stack[: len(stack) - len(vmap_levels)]):
        return None
    vmap_levels.reverse()
    for x in optree.tree_leaves(tensors):
        if isinstance(x, torch.Tensor):
            x = peel(vmap_levels, x)
            if isinstance(x, LevelTensor) or x.is_complex():
                return None
    return vmap_levels
