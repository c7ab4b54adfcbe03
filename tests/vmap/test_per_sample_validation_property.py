"""Property: under vmap, an op accepts exactly the samples plain PyTorch accepts.

Hypothesis draws a per-sample shape (rank 0-4), a shape-sensitive op, a batch size and the
batch dim's position; a loop of the op over the samples is the reference. If one sample
raises in plain PyTorch, vmap must raise (the batch dim is never a data dim); otherwise
vmap must return the loop's stacked values."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import functx
from functx.core import current_stack

D = torch.float64

OPS = {
    "det": torch.linalg.det,
    "inv": torch.linalg.inv,
    "slogdet": lambda x: torch.linalg.slogdet(x)[1],
    "t": torch.t,
    "tril": torch.tril,
    "triu": lambda x: torch.triu(x, 1),
    "trace": torch.trace,
    "diag": torch.diag,
    "diagonal": lambda x: torch.diagonal(x, 0, 0, 1),
    "unbind0": lambda x: torch.stack(x.unbind(0)) if x.dim() else x.unbind(0),
    "squeeze1": lambda x: x.squeeze(1),
    "transpose01": lambda x: x.transpose(0, 1),
    "movedim": lambda x: x.movedim(0, -1),
    "select1": lambda x: x.select(1, 0),
    "narrow0": lambda x: x.narrow(0, 0, 1),
    "softmax1": lambda x: x.softmax(1),
    "sum2": lambda x: x.sum(2),
    "cumsum1": lambda x: x.cumsum(1),
    "topk2": lambda x: x.topk(2, dim=-1).values,
    "view_half": lambda x: x.view(torch.float16).double() if x.dim() else x.view(torch.float16),
    "view_int32": lambda x: x.view(torch.int32),
    "dot": lambda x: torch.dot(x, x),
    "outer": lambda x: torch.outer(x, x),
    "mv": lambda x: torch.mv(x, torch.ones(3, dtype=D)),
    "mm": lambda x: torch.mm(x, torch.ones(3, 2, dtype=D)),
    "cross": lambda x: torch.linalg.cross(x, torch.ones_like(x)),
    "linear": lambda x: F.linear(x, torch.ones(2, 3, dtype=D)),
    "layer_norm": lambda x: F.layer_norm(x, (3,)),
    "conv1d": lambda x: F.conv1d(x, torch.ones(2, 3, 2, dtype=D)),
    "max_pool1d": lambda x: F.max_pool1d(x, 2),
    "matrix_norm": lambda x: torch.linalg.matrix_norm(x),
    "flatten12": lambda x: x.flatten(1, 2),
    "unflatten": lambda x: x.unflatten(0, (1, -1)),
    "expand": lambda x: x.expand(2, 3, *x.shape[2:]) if x.dim() >= 2 else x.expand(2, 3),
    "repeat": lambda x: x.repeat(1, 2),
    "gather": lambda x: torch.gather(x, 1, torch.zeros(1, 1, dtype=torch.long)),
}

_shapes = st.lists(st.sampled_from([1, 2, 3]), min_size=0, max_size=4).map(tuple)


def _raises(fn):
    try:
        fn()
    except Exception:  # noqa: BLE001 - any error a sample raises in plain torch
        return True
    return False


EXAMPLES = int(os.environ.get("FUNCTX_FUZZ_EXAMPLES", "400"))  # longer runs: FUNCTX_FUZZ_EXAMPLES=5000


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(sorted(OPS)),
    shape=_shapes,
    batch=st.integers(1, 3),
    position=st.integers(0, 4),
    seed=st.integers(0, 2**16),
)
def test_vmap_accepts_exactly_what_one_sample_accepts(name, shape, batch, position, seed):
    op = OPS[name]
    torch.manual_seed(seed)
    samples = [torch.randn(shape, dtype=D) for _ in range(batch)]
    in_dim = min(position, len(shape))
    batched = torch.stack(samples, dim=in_dim)
    # one sample as plain PyTorch sees it: the slice of the batched tensor (its strides too)
    samples = [batched.select(in_dim, i) for i in range(batch)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if any(_raises(lambda s=s: op(s)) for s in samples):
            with pytest.raises(Exception):  # noqa: B017,PT011 - whatever the op raises
                functx.vmap(op, in_dims=in_dim)(batched)
            assert current_stack() == ()
            return
        expected = torch.stack([op(s) for s in samples])
        actual = functx.vmap(op, in_dims=in_dim)(batched)
    if expected.dtype.is_floating_point:
        torch.testing.assert_close(actual, expected, equal_nan=True)
    else:
        assert torch.equal(actual, expected)
