"""The interpreter contract as it stands, executable: a toy level built on `core/` alone.

A level is an `Interpreter` on the stack (`interpreting`) whose tensors are `LevelTensor`s;
every ATen op touching one reaches its `process(op, args, kwargs)`, which is the level's
handler of the op (`handler_of(op)`, resolved once per op; `refresh` sets the lookup and
`lower`), which computes one level down (on the values under its own wrappers, inside
`lower()`, where lower levels see the op) and wraps what comes back. `Tracer` below is the whole of such a level: it records the ops it sees. The
tests drive it through what the contract promises: composition both ways with a real
transform, the stack left as it was after an exception, a finished level's tensors standing
for their values, and the one door for an autograd.Function (`apply_function`: the tracer
records it and applies it one level down; a level without the method refuses it clearly).
"""

import pytest
import torch

import functx
from functx.core.interpreter import Interpreter, current_stack, interpreting
from functx.core.level_tensor import LevelTensor, wrapper_like
from functx.core.rules import resolved_once
from tests.autograd_functions import Cube, NoVmapSupport


class TracedTensor(LevelTensor):
    pass


class Tracer(Interpreter):
    """Records each op of its tensors, computes it one level down, wraps the results."""

    def __init__(self):
        super().__init__()
        self.ops = []
        self.refresh()

    def refresh(self):
        super().refresh()  # `lower`: the dispatch state of outside
        self.handler_of = _TRACED

    def wrap(self, value):
        return wrapper_like(TracedTensor, value, self)

    def unwrap(self, x):
        if isinstance(x, (list, tuple)):
            return type(x)(self.unwrap(e) for e in x)
        return x._value if type(x) is TracedTensor and x._interp is self else x

    def apply_function(self, function, args, kwargs):
        # the highest level among the Function's arguments: record it, apply it one level
        # down (where the next level, or torch, applies it in turn), wrap what comes back
        self.ops.append(function.__name__)
        out = function.apply(*self.unwrap(args), **kwargs)
        return self.wrap(out) if isinstance(out, torch.Tensor) else out


def _traced(op):
    """The tracer's handler of `op`: record it, compute it one level down, wrap the results."""
    name = op.__name__

    def handle(level, args, kwargs):
        level.ops.append(name)
        with level.lower():
            out = op(*level.unwrap(args), **{k: level.unwrap(v) for k, v in kwargs.items()})
        if isinstance(out, torch.Tensor):
            return level.wrap(out)
        if isinstance(out, (list, tuple)):
            return type(out)(level.wrap(o) if isinstance(o, torch.Tensor) else o for o in out)
        return out

    return handle


_TRACED = resolved_once(_traced)


class WithoutFunctions(Tracer):
    apply_function = Interpreter.apply_function  # the base: NotImplemented


def traced(f, x, kind=Tracer):
    with interpreting(kind()) as level:
        out = f(level.wrap(x))
        return level.unwrap(out), level.ops


def test_a_level_sees_its_ops_and_computes_one_level_down():
    x = torch.randn(3)
    out, ops = traced(lambda t: (t.sin() * 2).sum(), x)
    torch.testing.assert_close(out, (x.sin() * 2).sum())
    assert ops == ["sin.default", "mul.Tensor", "sum.default"]


def test_it_composes_with_a_transform_both_ways():
    xs = torch.randn(4, 3)
    f = lambda t: (t.sin() * t).sum()
    expected = torch.stack([torch.cos(x) * x + torch.sin(x) for x in xs])
    # the tracer inside vmap(grad): it sees per-sample ops on the transforms' tensors
    inside = functx.vmap(functx.grad(lambda t: traced(f, t)[0]))(xs)
    torch.testing.assert_close(inside, expected)
    # vmap(grad) inside the tracer: the transforms see the tracer's tensors as values
    outside, ops = traced(lambda t: functx.vmap(functx.grad(f))(t), xs)
    torch.testing.assert_close(outside, expected)
    assert "mul.Tensor" in ops  # the batched computation ran through the tracer below
    assert current_stack() == ()


def test_lower_is_one_level_down_where_autograd_records():
    # the default `lower` restores the state of outside: torch's autograd records the
    # op on the values below the tracer's wrappers, so a gradient flows through the level
    x = torch.randn(3, requires_grad=True)
    out, _ = traced(lambda t: (t.sin() * t).sum(), x)
    (g,) = torch.autograd.grad(out, x)
    torch.testing.assert_close(g, x.cos() * x + x.sin())


def test_vmap_refreshes_lower_when_an_ad_level_rides_on_it():
    from functx.vmap.interpreter import VmapInterpreter

    seen = []

    def record(t):
        seen.append([(type(i).__name__, i.lower) for i in current_stack() if type(i) is VmapInterpreter])
        return t.sin().sum()

    plain_lower = torch._C._RestorePythonTLSSnapshot
    functx.vmap(record)(torch.randn(2, 3))
    assert seen[-1] == [("VmapInterpreter", plain_lower)]
    # a direct jvp level rides on the vmap level below it: forward AD kept on for the rules
    functx.vmap(lambda x: functx.jvp(record, (x,), (torch.ones_like(x),)))(torch.randn(2, 3))
    assert seen[-1][0][1] is not plain_lower
    assert current_stack() == ()


def test_the_stack_is_restored_after_an_exception():
    with pytest.raises(RuntimeError, match="boom"):
        with interpreting(Tracer()):
            raise RuntimeError("boom")
    assert current_stack() == ()


def test_a_finished_levels_tensor_stands_for_its_value():
    kept = []
    traced(lambda t: kept.append(t * 3) or t, torch.ones(2))
    assert not kept[0]._interp.alive
    torch.testing.assert_close(kept[0] + 1, torch.full((2,), 4.0))  # plain torch from now on


def test_an_autograd_function_reaches_the_highest_level_among_its_arguments():
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    out, ops = traced(lambda t: Cube.apply(t.sin(), 2.0) * 3, x)
    assert ops == ["sin.default", "Cube", "mul.Tensor"]
    torch.testing.assert_close(out, x.sin() ** 3 * 6)
    (g,) = torch.autograd.grad(out.sum(), x)  # the Function's backward, recorded one level down
    torch.testing.assert_close(g, 18 * x.sin() ** 2 * x.cos())
    # under grad: the tracer's tensors are the highest; the grad level below applies it next
    inner = []

    def f(t):
        out, ops = traced(lambda u: Cube.apply(u, 2.0).sum(), t)
        inner.append(ops)
        return out

    torch.testing.assert_close(functx.grad(f)(x.detach()), 6 * x.detach() ** 2)
    assert inner[0] == ["Cube", "sum.default"]


def test_an_autograd_function_at_a_level_without_a_rule_is_refused_clearly():
    with pytest.raises(NotImplementedError, match="WithoutFunctions levels do not support torch.autograd.Function"):
        traced(NoVmapSupport.apply, torch.ones(2), WithoutFunctions)
    assert current_stack() == ()


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_every_level_processes_an_op_by_its_handler():
    """`process` is the contract's lookup + call for every functx level: what a level does per
    op lives in the handlers its `refresh` looks up (the direct AD levels own no tensors and
    refuse to process any)."""
    import functx.ad.direct_forward
    import functx.ad.direct_reverse

    no_tensors = {functx.ad.direct_reverse.DirectGradLevel, functx.ad.direct_forward.DirectJvpLevel}
    own_process = [
        cls.__qualname__
        for cls in _subclasses(Interpreter)
        if cls.__module__.startswith("functx.") and "process" in cls.__dict__ and cls not in no_tensors
    ]
    assert own_process == []
    assert {cls.__qualname__ for cls in _subclasses(Interpreter) if cls.__module__.startswith("functx.")} >= {
        "VmapInterpreter", "WrappedGradLevel", "WrappedJvpLevel", "FunctionalizeInterpreter"
    }
