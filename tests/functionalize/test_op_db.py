"""functionalize of every op in torch's op database that writes in place or makes a view.

Oracles: plain torch, torch.func.functionalize, and the graph `make_fx` traces (no mutation
but the copies back into the inputs; for remove="mutations_and_views" no view op either);
see opdb_support's docstring for the functions built from each OpInfo.

Commands (from the repository root; times on the shared 2-core machine):
    CI subset, the first sample of every op (run by default, ~25 s):
        .venv/bin/python -m pytest tests/functionalize/test_op_db.py -p no:xdist -q
    Full sweep, every float32 CPU sample (~3 min):
        .venv/bin/python -m pytest tests/functionalize/test_op_db.py -m slow -p no:xdist -q

Where functionalization knowingly differs from plain torch, torch.func is the oracle
instead; the cases are listed below with their reasons.
"""

from __future__ import annotations

import functools

import pytest
import torch

import functx

from .opdb_support import REMOVES, call_args, check, inplace_functions, inplace_ops, is_view_op, op_db, op_id, samples, view_functions

CI_SAMPLES = 1
FULL_SAMPLES = 1000

_OVERLAP = (
    "the view's elements overlap in memory; functionalization replays the write element by "
    "element through the view's inverse (or refuses: 'a tensor being mutated that has internal "
    "overlap'), where plain torch writes each memory location several times"
)
# op id -> (the functions of opdb_support it concerns, why): torch.func is the oracle there.
KNOWN_DEVIATIONS = {
    "unsafe_split": ({"view intermediate", "view input"}, "unsafe_* results share their input's memory but their schema declares no alias, so functionalization treats them as new tensors: writes into them do not reach the input"),
    "unsafe_chunk": ({"view intermediate", "view input"}, "as unsafe_split"),
    "as_strided": ({"view intermediate", "view input"}, _OVERLAP),
    "unfold": ({"view intermediate", "view input"}, _OVERLAP),
    "as_strided.partial_views": ({"view", "input view"}, "with remove='mutations_and_views', as_strided_ of a view at an offset is replayed as as_strided_copy of that view, whose storage is too small for the offset"),
    "addbmm": ({"intermediate", "input", "view", "input view"}, "plain torch's addbmm_ resizes a `self` that only broadcasts (shape [] or [1]) to the result's shape; functionalization refuses, as for every other in-place op"),
}  # fmt: skip


def _like_torch_func(op, function) -> bool:
    functions, _ = KNOWN_DEVIATIONS.get(op_id(op), (set(), ""))
    return function in functions


@functools.cache
def _view_ops():
    ops = []
    for op in op_db():
        if not op.supports_dtype(torch.float32, "cpu"):
            continue
        first = samples(op, 1)
        if first and is_view_op(op, first[0]):
            ops.append(op)
    return ops


def _check_all(op, functions, limit):
    failures = []
    for sample in samples(op, limit):
        for name, f in functions.items():
            x, args, kwargs = call_args(name, sample)
            if x is None:
                continue
            for remove in REMOVES:
                problem = check(f, x, args, kwargs, remove, like_torch_func=_like_torch_func(op, name))
                if problem:
                    failures.append(f"{name}, remove={remove!r}, input {tuple(x.shape)}: {problem}")
    assert not failures, "\n".join(failures[:5])


_INPLACE = inplace_ops()


@pytest.mark.parametrize("op", _INPLACE, ids=op_id)
def test_inplace_variant(op):
    _check_all(op, inplace_functions(op), CI_SAMPLES)


@pytest.mark.parametrize("op", _view_ops(), ids=op_id)
def test_view_op(op):
    _check_all(op, view_functions(op), CI_SAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("op", _INPLACE, ids=op_id)
def test_inplace_variant_all_samples(op):
    _check_all(op, inplace_functions(op), FULL_SAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("op", _view_ops(), ids=op_id)
def test_view_op_all_samples(op):
    _check_all(op, view_functions(op), FULL_SAMPLES)


def test_known_deviations_are_real():
    """Every listed deviation still exists: plain torch and functionalize disagree (or one
    raises) on some sample, and functionalize agrees with torch.func there."""
    for name, (functions, _) in KNOWN_DEVIATIONS.items():
        op = next(o for o in op_db() if op_id(o) == name)
        makers = {**(inplace_functions(op) if op.inplace_variant else {}), **view_functions(op)}
        differs = False
        for sample in samples(op, FULL_SAMPLES):
            for function in functions:
                x, args, kwargs = call_args(function, sample)
                if x is None:
                    continue
                for remove in REMOVES:
                    if check(makers[function], x, args, kwargs, remove) is not None:
                        differs = True
            if differs:
                break
        assert differs, f"{name}: functionalize now agrees with plain torch; take it off KNOWN_DEVIATIONS"


def _grad_failures(op, limit):
    """grad(functionalize(f)) of the in-place variant on an intermediate (differentiable float
    inputs) against torch.autograd.grad of f."""
    f = inplace_functions(op)["intermediate"]
    failures = []
    for sample in samples(op, limit):
        x, args, kwargs = call_args("intermediate", sample)

        def loss(x):
            return f(x, args, kwargs).sum()

        leaf = x.clone().requires_grad_()
        torch.manual_seed(1234)  # random in-place ops (rrelu_) draw the same numbers in both
        try:
            (expected,) = torch.autograd.grad(loss(leaf * 1), leaf, allow_unused=True)
        except Exception:  # noqa: BLE001 - not differentiable here (or plain torch refuses the sample)
            continue
        expected = torch.zeros_like(x) if expected is None else expected
        torch.manual_seed(1234)
        try:
            got = functx.grad(functx.functionalize(lambda x: loss(x * 1)))(x.clone())
        except Exception as e:  # noqa: BLE001
            if not _like_torch_func(op, "intermediate"):  # (addbmm_: refused, see KNOWN_DEVIATIONS)
                failures.append(f"input {tuple(x.shape)}: raises {type(e).__name__}: {e}")
            continue
        if not torch.allclose(got, expected, rtol=1e-4, atol=1e-5, equal_nan=True):
            failures.append(f"input {tuple(x.shape)}: gradient differs from torch.autograd.grad")
    return failures


_DIFFERENTIABLE = [op for op in _INPLACE if op.supports_autograd]


@pytest.mark.parametrize("op", _DIFFERENTIABLE, ids=op_id)
def test_inplace_variant_under_grad(op):
    failures = _grad_failures(op, CI_SAMPLES)
    assert not failures, "\n".join(failures[:5])


@pytest.mark.slow
@pytest.mark.parametrize("op", _DIFFERENTIABLE, ids=op_id)
def test_inplace_variant_under_grad_all_samples(op):
    failures = _grad_failures(op, FULL_SAMPLES)
    assert not failures, "\n".join(failures[:5])
