"""`functx.explain` (functx/explain.py): how each op of a call ran, against what the code
is known to do (a rule, a template, an op without a batching rule looping over samples, a
whole-function fallback), with the caller's lines; the call's output equals the plain call."""

import pytest
import torch

import functx
from functx.core import config
from functx.core.interpreter import Interpreter, current_stack

D = torch.float64


def branchy(x):
    if x.sum() > 0:  # reads a sample's value
        return x.sin()
    return x * 2


def test_a_vectorized_call():
    x = torch.randn(4, 3, dtype=D)
    report = functx.explain(functx.vmap(lambda v: torch.sin(v) @ v))(x)
    torch.testing.assert_close(report.output, torch.stack([torch.sin(v) @ v for v in x]))
    assert report.vectorized and not report.fallbacks
    assert {(row.level, row.op, row.how) for row in report.rows} == {("vmap", "aten::sin", "template"), ("vmap", "aten::dot", "rule")}
    assert all(row.where.startswith(f"{__file__}:") and "torch.sin(v) @ v" in row.where for row in report.rows)
    assert "vectorized" in str(report) and "NOT" not in str(report)


def test_a_whole_function_fallback_is_reported_with_its_line():
    x = torch.randn(5, 3, dtype=D)
    report = functx.explain(functx.vmap(branchy))(x)
    torch.testing.assert_close(report.output, torch.stack([branchy(v) for v in x]))
    assert not report.vectorized and len(report.fallbacks) == 1
    assert "if x.sum() > 0:" in report.fallbacks[0]
    (needs,) = [row for row in report.rows if row.how == "needs each sample"]
    assert needs.op == "aten::is_nonzero" or needs.op == "aten::_local_scalar_dense"
    assert "NOT vectorized" in str(report)


@pytest.mark.parametrize("mode", ["warn", "silent"])
def test_an_op_without_a_batching_rule_loops_every_time(mode):
    x = torch.randn(3, 4, dtype=D)
    with functx.vmap_fallback(mode):
        for _ in range(2):  # the loop's warning is once per process; the report, every call
            report = functx.explain(functx.vmap(lambda v: torch.select_copy(v, 0, 1)))(x)
            assert [(row.op, row.how, row.count) for row in report.rows] == [("aten::select_copy.int", "per-sample loop", 1)]
            assert not report.vectorized
        assert config.fallback == mode
    torch.testing.assert_close(report.output, x[:, 1])


def test_forward_mode_rules_at_a_wrapped_jvp_level():
    x = torch.randn(3, dtype=D)
    report = functx.explain(functx.jacfwd(functx.jacfwd(lambda v: (v.sin() * v).sum())))(x)
    torch.testing.assert_close(report.output, torch.autograd.functional.hessian(lambda v: (v.sin() * v).sum(), x))
    assert any(row.level == "jvp" for row in report.rows)
    assert report.vectorized


def test_state_is_restored_after_an_exception():
    process = Interpreter.process

    def bad(v):
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        functx.explain(functx.vmap(bad))(torch.ones(2, 2))
    assert Interpreter.process is process and current_stack() == ()
    from functx.vmap import fallback

    assert type(fallback._warned) is set


def test_a_template_that_loops_is_reported_every_time():
    """nonzero's rule loops over the samples (their shapes agree here) and warns once per
    process: the report still says so on the second call."""
    x = torch.randn(3, 4, dtype=D).abs()
    for _ in range(2):
        report = functx.explain(functx.vmap(lambda v: torch.nonzero(v > 0)))(x)
        assert ("aten::nonzero", "per-sample loop") in {(row.op, row.how) for row in report.rows}
    torch.testing.assert_close(report.output, torch.stack([torch.nonzero(v > 0) for v in x]))
