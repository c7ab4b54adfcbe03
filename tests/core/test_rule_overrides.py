"""`Overrides`: the rules a riding level adds over another kind's `RuleTable`
(core/rules.py), and the vmap side of it: a direct AD level's table consulted by vmap's
handler lookup while it rides (`VmapInterpreter.refresh`), so that no batching rule asks which
AD level is above it."""

import ast
import pathlib

import pytest
import torch

import functx
from functx.core.rules import Overrides, RuleTable
from functx.vmap.batched_tensor import UNDER_DIRECT_GRAD, UNDER_DIRECT_JVP, VMAP_RULES
from functx.vmap.interpreter import VmapInterpreter, _handler

aten = torch.ops.aten


class Level:
    """Stands for an interpreter: the overrides find their rider in its `rider` slot."""

    def __init__(self, rider):
        self.rider = rider


def _tables():
    checked = []

    def guard(op, rule):
        def guarded(interp, *args, **kwargs):
            checked.append(op)
            return rule(interp, *args, **kwargs)

        return guarded

    table = RuleTable("toy", guard=guard)
    table.set(aten.sin.default, lambda interp, x: ("base", x))
    overrides = Overrides("toy under a rider", rider="rider")
    return table, overrides, checked


def test_an_override_runs_first_inside_the_tables_guard_and_may_decline():
    table, overrides, checked = _tables()
    overrides.set(aten.sin.default, lambda rider, interp, x: ("override", rider, x) if x > 0 else NotImplemented)
    lookup = table.handler_under(overrides)
    assert lookup(aten.sin.default)(Level("r"), 1) == ("override", "r", 1)
    assert lookup(aten.sin.default)(Level("r"), -1) == ("base", -1)  # declined: the table's rule
    assert checked == [aten.sin.default, aten.sin.default]  # the guard saw both calls
    # without the rider, the table alone
    assert table.handler(aten.sin.default)(Level("r"), 1) == ("base", 1)
    assert table.handler_under(overrides) is lookup  # one lookup per (table, overrides)


def test_registering_later_reaches_lookups_already_resolved():
    table, overrides, _ = _tables()
    lookup = table.handler_under(overrides)
    assert lookup(aten.sin.default)(Level(None), 1) == ("base", 1)
    overrides.set(aten.sin.default, lambda rider, interp, x: "override" if x > 0 else NotImplemented)
    assert lookup(aten.sin.default)(Level(None), 1) == "override"
    assert lookup(aten.sin.default)(Level(None), -1) == ("base", -1)
    table.set(aten.sin.default, lambda interp, x: "new base")
    assert lookup(aten.sin.default)(Level(None), -1) == "new base"


def test_the_direct_levels_carry_their_tables_and_vmap_consults_them_while_they_ride():
    seen = []

    def record(t):
        level = next(i for i in functx.core.interpreter.current_stack() if type(i) is VmapInterpreter)
        seen.append(level.handler_of)
        return t.sin().sum()

    x = torch.randn(2, 3)
    functx.vmap(record)(x)
    functx.vmap(functx.grad(record))(x)
    functx.vmap(lambda x: functx.jvp(record, (x,), (torch.ones_like(x),)))(x)
    # each op's handler (vmap/interpreter.py `_handler`) made from the rules under the overrides
    handlers = [VMAP_RULES.lookup(_handler, o) for o in (None, UNDER_DIRECT_GRAD, UNDER_DIRECT_JVP)]
    assert seen == handlers


@pytest.mark.parametrize("path", sorted((pathlib.Path(functx.__file__).parent / "vmap" / "rules").glob("*.py")), ids=lambda p: p.name)
def test_no_batching_rule_asks_which_ad_level_is_above_it(path):
    """A rule that must behave differently under an AD level is that level's override,
    given the level (`UNDER_DIRECT_GRAD`), not a rule reading the vmap level's AD slots."""
    slots = {"direct_ad", "ad_above", "over_dual_values"}
    reads = [
        f"{path.name}:{node.lineno} .{node.attr}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr in slots
    ]
    assert reads == []


def test_a_composed_lookup_is_made_once_per_op_and_forgotten_when_a_rule_changes():
    table, overrides, _ = _tables()
    made = []

    def compose(op, rule):
        made.append(op)
        return lambda interp, x: ("composed", rule(interp, x))

    lookup = table.lookup(compose)
    assert lookup(aten.sin.default)(Level(None), 2) == ("composed", ("base", 2))
    assert lookup(aten.sin.default)(Level(None), 3) == ("composed", ("base", 3))
    assert made == [aten.sin.default] and table.lookup(compose) is lookup
    under = table.lookup(compose, overrides)
    overrides.set(aten.sin.default, lambda rider, interp, x: "override")
    assert under(aten.sin.default)(Level(None), 1) == ("composed", "override")
    assert lookup(aten.sin.default)(Level(None), 1) == ("composed", ("base", 1))  # no rider here
    table.set(aten.sin.default, lambda interp, x: "new base")
    assert lookup(aten.sin.default)(Level(None), 1) == ("composed", "new base")
