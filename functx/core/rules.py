"""Rule tables: one per transform, keyed by ATen `OpOverload`.

Family files fill a table with `@table.register(aten.sin.default, ...)`. When the
dispatcher meets an op, the table resolves a handler once and caches it:

1. the registered rule;
1b. a template whose predicate accepts the op (e.g. every `Tag.pointwise` op);
1c. the op's own CompositeImplicitAutograd kernel (such ops normally decompose before
    reaching a level; they arrive only when called with autograd switched off);
2. a `torch._decomp` decomposition, re-dispatched (its ops come back through the levels);
3. the transform's fallback (vmap: a per-sample loop), if it has one;
4. a handler that raises `NotImplementedError` naming the op and the transform.

A table made with `otherwise` (forward mode: torch's own formula on duals) uses
`otherwise(op)` after the rules and templates, instead of 1c-4.

A level's `handler_of` (core/interpreter.py) is `table.lookup(compose, overrides)`: each
op's handler made once by `compose(op, rule)` (what the level does around the rule: write
bookkeeping, entering its `lower()`), and kept. A level of another kind riding on a level of
this table (a direct AD level on a vmap level's physical tensors) brings its own
`Overrides`, each overridden op trying the rider's rule first while it rides.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Iterable

import torch
import torch._decomp

from .errors import ISSUES, op_name
from .level_tensor import refresh_views, replay_inplace_view
from .op_facts import is_inplace_view

_decompositions = torch._decomp.decomposition_table

Op = torch._ops.OpOverload
Rule = Callable[..., Any]
"""`rule(interp, *args, **kwargs)`: one op at one level (args as the op takes them)."""


def decomposition_for(op):
    """The `torch._decomp` decomposition of `op`, or None."""
    return _decompositions.get(op)


def _has_composite_implicit_kernel(op) -> bool:
    return op.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd)


def overloads(*ops: Any) -> Iterable[Op]:
    """Expand OpOverloadPackets (`aten.add`) into their overloads; pass overloads through."""
    for op in ops:
        if isinstance(op, torch._ops.OpOverloadPacket):
            for name in op.overloads():
                yield getattr(op, name)
        else:
            yield op


class RuleTable:
    """Rules of one transform. `handler(op)` is the dispatch-time lookup (cached)."""

    def __init__(
        self,
        transform: str,
        fallback: Callable[[Op], Rule] | None = None,
        guard: Callable[[Op, Rule], Rule] | None = None,
        otherwise: Callable[[Op], Rule] | None = None,
    ):
        self.transform = transform
        self.rules: dict[Op, Rule] = {}
        self.fallback = fallback
        self.otherwise = otherwise
        # `guard(op, handler)` wraps every handler but the fallback (vmap: per-sample checks)
        self.guard = guard
        self.templates: list[tuple[Callable[[Op], bool], Callable[[Op], Rule]]] = []
        self._handlers: dict[Op, Rule] = {}
        self._lookups: dict[tuple, Callable[[Op], Any]] = {}
        self._caches: list[dict] = [self._handlers]  # every resolved-handler cache made here

    def _changed(self, op=None):
        """Forget resolved handlers (of `op`, or all) after a rule, template or override
        changed, in every lookup made from this table."""
        for cache in self._caches:
            if op is None:
                cache.clear()
            else:
                cache.pop(op, None)

    def add_template(self, predicate: Callable[[Op], bool], factory: Callable[[Op], Rule]) -> None:
        """Ops without a registered rule for which `predicate(op)` holds get `factory(op)`."""
        self.templates.append((predicate, factory))
        self._changed()

    def register(self, *ops: Any) -> Callable[[Rule], Rule]:
        """Decorator registering one rule for several ops (packets expand to all overloads)."""

        def decorate(rule):
            for op in overloads(*ops):
                self.rules[op] = rule
                self._changed(op)
            return rule

        return decorate

    def set(self, op: Op, rule: Rule) -> None:
        """Register `rule` for one op (the functional form of `register`)."""
        self.rules[op] = rule
        self._changed(op)

    def handler(self, op: Op) -> Rule:
        handler = self._handlers.get(op)
        if handler is None:
            handler = self._handlers[op] = self._resolve(op)
        return handler

    def lookup(self, compose: Callable[[Op, Rule], Any] | None = None, overrides: Overrides | None = None):
        """A handler lookup `op -> compose(op, handler)` for a level of this table: `handler` is
        the table's (`handler(op)`), or, while a rider with `overrides` rides on the level, the
        rider's rule first for an op it overrides (inside the table's guard) and the table's
        own handler where that declines; `compose` makes the level's whole handling of one op
        from it (vmap/interpreter.py: its write bookkeeping, its `lower()`). Resolved once per
        op and kept; one lookup per (compose, overrides); forgotten when a rule changes.

            >>> from functx.vmap.batched_tensor import VMAP_RULES
            >>> import torch
            >>> compose = lambda op, rule: (op.__name__, rule)
            >>> lookup = VMAP_RULES.lookup(compose)
            >>> lookup(torch.ops.aten.sin.default)[0], lookup is VMAP_RULES.lookup(compose)
            ('sin.default', True)
            >>> lookup(torch.ops.aten.sin.default) is lookup(torch.ops.aten.sin.default)  # resolved once
            True
        """
        key = (compose, overrides)
        lookup = self._lookups.get(key)
        if lookup is None:
            resolved = {}
            self._caches.append(resolved)
            if overrides is not None:
                overrides.tables.add(self)

            def lookup(op):
                handler = resolved.get(op)
                if handler is None:
                    handler = self._resolve(op, overrides)
                    handler = resolved[op] = handler if compose is None else compose(op, handler)
                return handler

            self._lookups[key] = lookup
        return lookup

    def handler_under(self, overrides: Overrides) -> Callable[[Op], Rule]:
        """`lookup(overrides=overrides)`: the table's handlers under a rider's overrides."""
        return self.lookup(overrides=overrides)

    def how(self, op: Op) -> str:
        """How `op` is handled: "rule", "template", "default" (`otherwise`), "decomposition",
        "fallback" or "missing"."""
        if op in self.rules:
            return "rule"
        if any(predicate(op) for predicate, _ in self.templates):
            return "template"
        if self.otherwise is not None:
            return "default"
        if _has_composite_implicit_kernel(op) or decomposition_for(op) is not None:
            return "decomposition"
        return "fallback" if self.fallback is not None else "missing"

    def _resolve(self, op, overrides=None):
        handler = self._resolve_rule(op)
        if overrides is not None and op in overrides.rules:
            handler = overrides.over(op, handler)
        if self.guard is not None and self.how(op) != "fallback":
            handler = self.guard(op, handler)
        if is_inplace_view(op):
            return _fixing_wrapper_metadata(op, handler)
        return handler

    def _resolve_rule(self, op):
        rule = self.rules.get(op)
        if rule is not None:
            return rule
        for predicate, factory in self.templates:
            if predicate(op):
                return factory(op)
        if self.otherwise is not None:
            return self.otherwise(op)
        if _has_composite_implicit_kernel(op):
            return lambda interp, *args, **kwargs: op.decompose(*args, **kwargs)
        last_resort = self.fallback(op) if self.fallback is not None else self._missing(op)
        decomposition = decomposition_for(op)
        if decomposition is not None:

            def decomposed(interp, *args, **kwargs):
                out = decomposition(*args, **kwargs)
                if out is NotImplemented:  # the decomposition declined these arguments
                    return last_resort(interp, *args, **kwargs)
                return out

            return decomposed
        return last_resort

    def _missing(self, op):
        message = (
            f"functx.{self.transform}: there is no rule for {op_name(op)} and no "
            f"decomposition of it in torch._decomp. Please file an issue naming this op: {ISSUES}"
        )

        def missing(interp, *args, **kwargs):
            raise NotImplementedError(message)

        return missing


class Overrides:
    """The rules a level of one kind adds over another kind's `RuleTable` while it rides on
    a level of that table: `rule(rider, interp, *args, **kwargs)`, where `rider` is the
    riding level (the attribute `rider` of the level below names it), returning
    NotImplemented to leave the op to the table's own handler. (A direct grad level over
    vmap: a product whose per-element gradients torch's autograd should lay out like the
    operands, vmap/batched_tensor.py `UNDER_DIRECT_GRAD`.)

        >>> from functx.vmap.batched_tensor import UNDER_DIRECT_GRAD, VMAP_RULES
        >>> import torch
        >>> UNDER_DIRECT_GRAD.rider, torch.ops.aten.mm.default in UNDER_DIRECT_GRAD.rules
        ('direct_ad', True)
        >>> VMAP_RULES.handler_under(UNDER_DIRECT_GRAD) is VMAP_RULES.handler_under(UNDER_DIRECT_GRAD)
        True
    """

    def __init__(self, name: str, rider: str):
        self.name = name
        self.rider = rider
        self.rules: dict[Op, Rule] = {}
        self.tables: set[RuleTable] = set()  # the tables that resolved handlers under these

    def register(self, *ops: Any) -> Callable[[Rule], Rule]:
        """Decorator registering one override for several ops (packets expand)."""

        def decorate(rule):
            for op in overloads(*ops):
                self.set(op, rule)
            return rule

        return decorate

    def set(self, op: Op, rule: Rule) -> None:
        self.rules[op] = rule
        for table in self.tables:
            table._changed(op)

    def over(self, op: Op, handler: Rule) -> Rule:
        """`op`'s override, falling back to `handler` where it declines."""
        override, rider_of = self.rules[op], operator.attrgetter(self.rider)

        def overridden(interp, *args, **kwargs):
            out = override(rider_of(interp), interp, *args, **kwargs)
            return handler(interp, *args, **kwargs) if out is NotImplemented else out

        overridden.__name__ = getattr(override, "__name__", "override")
        overridden.__wrapped__ = handler
        return overridden


def resolved_once(resolve: Callable[[Op], Any]) -> Callable[[Op], Any]:
    """A lookup `op -> resolve(op)` that resolves each op once and keeps the answer: the
    handler lookup of a level without a rule table (ad/wrapped_reverse.py), whose handling of
    an op depends on the op's schema alone."""
    resolved = {}

    def lookup(op):
        handler = resolved.get(op)
        if handler is None:
            handler = resolved[op] = resolve(op)
        return handler

    return lookup


def answered_first(answers: dict, op: Op, handle: Callable) -> Callable:
    """`handle(level, args, kwargs)`, the handler of `op`, preceded by `answers[op]` if there
    is one: an answer a level gives in __torch_dispatch__'s own state (the questions torch's
    autograd asks about the level's wrappers), NotImplemented from it going on to `handle`."""
    answer = answers.get(op)
    if answer is None:
        return handle

    def answered_here(level, args, kwargs):
        out = answer(level, args, kwargs)
        return handle(level, args, kwargs) if out is NotImplemented else out

    return answered_here


def refreshing_views(lookup: Callable[[Op], Any]) -> Callable[[Op], Any]:
    """`lookup`'s handlers (`handle(level, args, kwargs)`), each first giving the views among
    the arguments the lifted value of their base (core/level_tensor.py `refresh_views`): a
    level's lookup once `promote_for_write` lifted one of its bases (rare; the level's
    `refresh` switches to it)."""

    def resolve(op):
        handle = lookup(op)

        def refreshed(level, args, kwargs):
            refresh_views(level, (*args, *kwargs.values()))
            return handle(level, args, kwargs)

        return refreshed

    return resolved_once(resolve)


def _fixing_wrapper_metadata(op, handler):
    """In-place view ops change the shape of `self`: the rule changes the inner value,
    then the wrapper's own sizes and strides follow (`replay_inplace_view`)."""

    def handler_and_fix(interp, *args, **kwargs):
        handler(interp, *args, **kwargs)
        replay_inplace_view(op, args, kwargs)
        return args[0]

    return handler_and_fix
