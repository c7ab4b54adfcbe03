"""Per-sample validation under vmap, driven by the op database's error inputs.

Every OpInfo in torch's `op_db` lists inputs that the op must reject (`error_inputs`:
bad ranks, shapes, dtypes, dims). For each one that plain PyTorch rejects on the CPU,
vmap over a batch of copies of it must reject it too — the batch dim is never a data
dim, so a rule may not accept what one sample would not (functx/vmap/per_sample_check.py
guards the rules). The error must be of the type plain PyTorch raises, except where
listed below with the reason.

Command (from the repository root; ~1 min on the shared 2-core machine, run in CI):
    .venv/bin/python -m pytest tests/vmap/test_op_db_errors.py -n 2
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db

import functx

from .opdb_support import op_id

B = 3

# (op id, error input index) -> why vmap raises another exception type than plain torch.
OTHER_ERROR_TYPE = {
    ("aminmax", 0): "the batched CPU kernel raises IndexError for the empty reduction dim (one sample: RuntimeError)",
    ("amax", 0): "as aminmax",
    ("amin", 0): "as aminmax",
    ("narrow_copy", 1): "functx's dim check raises IndexError, as torch's other dim checks do",
    ("nn.functional.multilabel_margin_loss", 4): "functx's dim check raises IndexError, as torch's other dim checks do",
    ("nn.functional.embedding", 0): "the rule reads the weight's shape before torch's check of its rank",
    ("nn.functional.gaussian_nll_loss", 0): "validates `var` with Python control flow on values: vmap's clear .item() error",
    ("nn.functional.gaussian_nll_loss", 1): "as above",
}


def _batched(x):
    """A batch of B copies of a CPU strided tensor (batch dim 0), or None if not batchable."""
    if isinstance(x, torch.Tensor) and x.layout is torch.strided and x.device.type == "cpu":
        return x.unsqueeze(0).expand(B, *x.shape).clone()
    return None


def _batch_argument(x):
    """(value, in_dim) for one argument: tensors and lists of tensors are batched."""
    batched = _batched(x)
    if batched is not None:
        return batched, 0
    if type(x) in (list, tuple) and x and all(_batched(t) is not None for t in x):
        return type(x)(_batched(t) for t in x), type(x)(0 for _ in x)
    return x, None


def _error_cases():
    cases = []
    for op in op_db:
        try:
            error_inputs = list(op.error_inputs(torch.device("cpu")))
        except Exception:  # noqa: BLE001 - OpInfos without CPU error inputs
            continue
        for index, error_input in enumerate(error_inputs):
            cases.append(pytest.param(op, index, error_input, id=f"{op_id(op)}-{index}"))
    return cases


@pytest.mark.parametrize("op, index, error_input", _error_cases())
def test_vmap_rejects_what_one_sample_rejects(op, index, error_input):
    sample = error_input.sample_input
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            op(sample.input, *sample.args, **sample.kwargs)
    except Exception as error:  # noqa: BLE001 - whatever plain torch raises
        plain = error
    else:
        pytest.skip("plain torch accepts this error input on the CPU")
    arguments = [_batch_argument(a) for a in (sample.input, *sample.args)]
    if all(d is None for _, d in arguments):
        pytest.skip("no CPU strided tensor to batch")
    kwargs = sample.kwargs

    def f(*xs):
        return op(*xs, **kwargs)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(Exception) as raised:  # noqa: PT011 - the type is asserted below
            functx.vmap(f, in_dims=tuple(d for _, d in arguments), randomness="different")(*(v for v, _ in arguments))
    if (op_id(op), index) in OTHER_ERROR_TYPE:
        return
    assert isinstance(raised.value, type(plain)), (
        f"plain torch raises {type(plain).__name__}: {plain}; vmap raised {type(raised.value).__name__}: {raised.value}"
    )


def test_other_error_type_entries_name_real_cases():
    """An entry for an op or index that no longer exists would be dead text."""
    ids = {(op_id(p.values[0]), p.values[1]) for p in _error_cases()}
    assert set(OTHER_ERROR_TYPE) <= ids


@pytest.mark.parametrize(
    "f, x, error, match",
    [
        (torch.linalg.det, torch.randn(B, 3), RuntimeError, "at least 2 dimensions"),
        (torch.t, torch.randn(B, 2, 3, 4), RuntimeError, "<= 2 dimensions"),
        (torch.linalg.cholesky, torch.randn(B, 3), RuntimeError, "at least 2 dimensions"),
        (torch.linalg.inv, torch.randn(B, 3), RuntimeError, "at least 2 dimensions"),
        (torch.linalg.lu_factor, torch.randn(B, 3), RuntimeError, "2 or more dimensions"),
        (torch.linalg.ldl_factor, torch.randn(B, 3), RuntimeError, "at least 2 dimensions"),
        (lambda x: x.view(torch.float16), torch.randn(B), RuntimeError, "cannot be 0"),
        (torch.tril, torch.randn(B, 3), RuntimeError, "at least 2 dimensions"),
        (lambda x: x.unbind(0), torch.randn(B), IndexError, "no dimensions"),
        (lambda p: torch.multinomial(p, 1), torch.rand(B, 2, 3, 4), RuntimeError, "must be 1 or 2|1 or 2 dim"),
    ],
)
def test_issue_examples_raise_as_one_sample_does(f, x, error, match):
    """The cases the issue names: each raised for one sample in plain torch, and returned
    a wrong-shaped value (or hit an ATen internal assert) under vmap before."""
    with pytest.raises(error, match=match):
        f(x[0])
    with pytest.raises(error, match=match):
        functx.vmap(f, randomness="different")(x)
    functx.vmap(torch.sin)(x)  # the stack is intact after the error


def test_valid_samples_of_the_same_ops_still_work():
    x = torch.randn(B, 3, 3, dtype=torch.float64)
    spd = x @ x.mT + 3 * torch.eye(3, dtype=torch.float64)
    for f in (torch.linalg.det, torch.linalg.inv, torch.linalg.cholesky, torch.t, torch.tril):
        expected = torch.stack([f(s) for s in spd])
        torch.testing.assert_close(functx.vmap(f)(spd), expected)
    y = torch.randn(B, 4)
    torch.testing.assert_close(functx.vmap(lambda s: s.view(torch.int32))(y), y.view(torch.int32))
