"""`F.linear_cross_entropy`'s chunked operators under every transform (functx/ad/torch_nn_rules.py).

torch's chunked operators give one derivative, and only where their caller saw
`requires_grad`: `functx.jvp` with a tracked primal, `functx.jet`, and every second derivative
(`hessian`, `jacrev(jacrev)`) were 0, and `reduction="none"` had no tangent at all. The
reference is the same loss written as `cross_entropy(linear(x))`, differentiated by
torch.autograd alone (`torch.autograd.functional`, nested `torch.autograd.grad` along a path)
in float64: no functx, no chunked operator.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import LinearCrossEntropyOptions

import functx
from functx.ad import library_ops, torch_nn_rules

OPTIONS = LinearCrossEntropyOptions(batch_chunk_size=2)
N, IN, C = 5, 3, 4
TARGET = torch.tensor([0, 3, 1, 3, 2])
CONFIGS = {
    "mean": dict(reduction="mean"),
    "sum, bias, class weights": dict(reduction="sum", bias=True, weight=True),
    "mean, ignore_index": dict(reduction="mean", ignore_index=3),
    "none": dict(reduction="none"),
    "none, bias, ignore_index": dict(reduction="none", bias=True, ignore_index=1),
}


def _losses(config):
    """(chunked loss, its plain reference), functions of (x, linear weight)."""
    generator = torch.Generator().manual_seed(0)
    bias = torch.randn(C, generator=generator, dtype=torch.float64) if config.get("bias") else None
    weight = torch.rand(C, generator=generator, dtype=torch.float64) + 0.5 if config.get("weight") else None
    keywords = dict(weight=weight, reduction=config["reduction"], label_smoothing=config.get("label_smoothing", 0.0))
    ignore = config.get("ignore_index")

    def chunked(x, w, target=TARGET):
        return F.linear_cross_entropy(x, w, target, linear_bias=bias, ignore_index=ignore, options=OPTIONS, **keywords)

    def plain(x, w, target=TARGET):
        return F.cross_entropy(F.linear(x, w, bias), target, ignore_index=-100 if ignore is None else ignore, **keywords)

    return chunked, plain


def _point():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(N, IN, generator=generator, dtype=torch.float64)
    w = torch.randn(C, IN, generator=generator, dtype=torch.float64)
    return x, w, torch.randn(N, IN, generator=generator, dtype=torch.float64), torch.randn(C, IN, generator=generator, dtype=torch.float64)


def _scalar(loss):
    return lambda x, w: loss(x, w).sum()


@pytest.fixture
def decompositions_counted(monkeypatch):
    """How often each operator ran as its decomposition."""
    counts = {}
    for op in (torch_nn_rules._CHUNKED, torch_nn_rules._CHUNKED_PER_SAMPLE):
        applies, decomposition = library_ops._REVERSE_DECOMPOSITIONS[op]

        def counted(*args, _decomposition=decomposition, _op=op, **kwargs):
            counts[_op] = counts.get(_op, 0) + 1
            return _decomposition(*args, **kwargs)

        monkeypatch.setitem(library_ops._REVERSE_DECOMPOSITIONS, op, (applies, counted))
    return counts


@pytest.mark.parametrize("config", CONFIGS)
def test_first_derivatives_forward_mode(config):
    chunked, plain = _losses(CONFIGS[config])
    x, w, tx, tw = _point()
    expected = torch.autograd.functional.jvp(plain, (x, w), (tx, tw))[1]
    for tracked in (False, True):  # a tracked primal puts the jvp level on wrappers
        primals = (x.clone().requires_grad_(tracked), w.clone().requires_grad_(tracked))
        got = functx.jvp(chunked, primals, (tx, tw))[1]
        torch.testing.assert_close(got.detach(), expected)
    torch.testing.assert_close(functx.jacfwd(chunked)(x, w), torch.autograd.functional.jacobian(lambda x: plain(x, w), x))


@pytest.mark.parametrize("config", CONFIGS)
def test_second_derivatives(config):
    chunked, plain = _losses(CONFIGS[config])
    x, w, tx, tw = _point()
    expected = torch.autograd.functional.hessian(_scalar(plain), (x, w))
    for name, hessian in {"hessian": functx.hessian, "jacrev(jacrev)": lambda f, argnums: functx.jacrev(functx.jacrev(f, argnums), argnums)}.items():
        got = hessian(_scalar(chunked), argnums=(0, 1))(x, w)
        for i in range(2):
            for j in range(2):
                torch.testing.assert_close(got[i][j], expected[i][j], msg=f"{name}[{i}][{j}]")
    # the caller differentiating a functx gradient, and forward over reverse
    xr = x.clone().requires_grad_()
    (caller,) = torch.autograd.grad(functx.grad(_scalar(chunked))(xr, w).pow(2).sum(), xr)
    xp = x.clone().requires_grad_()
    (gp,) = torch.autograd.grad(_scalar(plain)(xp, w), xp, create_graph=True)
    (reference,) = torch.autograd.grad(gp.pow(2).sum(), xp)
    torch.testing.assert_close(caller, reference)
    hvp = functx.jvp(functx.grad(_scalar(chunked)), (x, w), (tx, tw))[1]
    torch.testing.assert_close(hvp, expected[0][0].reshape(N * IN, N * IN).mv(tx.flatten()).view(N, IN) + expected[0][1].reshape(N * IN, C * IN).mv(tw.flatten()).view(N, IN))


@pytest.mark.parametrize("config", CONFIGS)
def test_jet_against_nested_autograd_along_the_path(config):
    chunked, plain = _losses(CONFIGS[config])
    x, w, tx, tw = _point()
    x2 = 0.3 * tx.flip(0)
    t = torch.zeros((), dtype=torch.float64, requires_grad=True)
    value = plain(x + tx * t + x2 * t**2 / 2, w + tw * t).sum()
    derivatives = []
    for _ in range(3):
        (value,) = torch.autograd.grad(value, t, create_graph=True)
        derivatives.append(value.detach())
    _, series = functx.jet(lambda x, w: chunked(x, w).sum(), (x, w), ((tx, x2, torch.zeros_like(x)), (tw, torch.zeros_like(w), torch.zeros_like(w))))
    for k, (got, expected) in enumerate(zip(series, derivatives), start=1):
        torch.testing.assert_close(got, expected, msg=f"order {k}")


@pytest.mark.parametrize("config", ["mean", "sum, bias, class weights", "none"])
def test_one_reverse_level_keeps_the_chunked_operator(config, decompositions_counted):
    """Per-sample gradients (vmap(grad)) and a plain gradient: first order, where torch's op
    is right and saves memory; it runs as itself."""
    chunked, plain = _losses(CONFIGS[config])
    x, w, _, _ = _point()
    per_sample = functx.grad(lambda x, w, t: chunked(x[None], w, t[None]).sum(), argnums=1)
    got = functx.vmap(per_sample, in_dims=(0, None, 0))(x, w, TARGET)
    expected = []
    for i in range(N):
        wi = w.clone().requires_grad_()
        (g,) = torch.autograd.grad(plain(x[i : i + 1], wi, TARGET[i : i + 1]).sum(), wi)
        expected.append(g)
    torch.testing.assert_close(got, torch.stack(expected))
    torch.testing.assert_close(functx.grad(_scalar(chunked))(x, w), torch.autograd.functional.jacobian(lambda x: _scalar(plain)(x, w), x))
    assert not decompositions_counted
    functx.hessian(_scalar(chunked))(x, w)  # and a second derivative decomposes
    assert decompositions_counted


@settings(max_examples=25, deadline=None)
@given(
    config=st.sampled_from(sorted(CONFIGS)),
    transform=st.sampled_from(["jvp", "jvp_tracked", "hessian_vector", "jet2"]),
    seed=st.integers(0, 2**16),
    scale=st.floats(0.1, 3.0),
)
def test_property_random_points_and_transforms(config, transform, seed, scale):
    """Random points, scales and transforms against torch.autograd on the plain loss."""
    chunked, plain = _losses(CONFIGS[config])
    generator = torch.Generator().manual_seed(seed)
    x, tx = (scale * torch.randn(N, IN, generator=generator, dtype=torch.float64) for _ in range(2))
    w = torch.randn(C, IN, generator=generator, dtype=torch.float64)
    of_x = lambda x: chunked(x, w).sum()  # noqa: E731
    plain_of_x = lambda x: plain(x, w).sum()  # noqa: E731
    if transform in ("jvp", "jvp_tracked"):
        got = functx.jvp(of_x, (x.clone().requires_grad_(transform == "jvp_tracked"),), (tx,))[1].detach()
        expected = torch.autograd.functional.jvp(plain_of_x, x, tx)[1]
    elif transform == "hessian_vector":
        got = functx.jvp(functx.grad(of_x), (x,), (tx,))[1]
        expected = torch.autograd.functional.hvp(plain_of_x, x, tx)[1]
    else:
        got = functx.jet(of_x, (x,), ((tx, torch.zeros_like(tx)),))[1][1]
        expected = torch.autograd.functional.vhp(plain_of_x, x, tx)[1].mul(tx).sum()
    torch.testing.assert_close(got, expected)
    assert math.isfinite(float(got.sum()))


def test_checkpointed_under_grad_with_the_callers_gradient_and_hessian():
    """A checkpoint recomputes the op in the backward, with the decision of its first run
    (ad/aten_reverse_rules.py `_capture_decision`): the caller's gradient of a functx
    gradient, and the Hessian, through a checkpointed chunked loss."""
    from torch.utils.checkpoint import checkpoint

    chunked, plain = _losses(CONFIGS["mean"])
    x, w, _, _ = _point()
    loss = lambda w: checkpoint(lambda w: chunked(x, w), w, use_reentrant=False)  # noqa: E731
    tracked = w.clone().requires_grad_()
    gradient = functx.grad(loss)(tracked)
    (caller,) = torch.autograd.grad(gradient.pow(2).sum(), tracked)
    leaf = w.clone().requires_grad_()
    (expected_gradient,) = torch.autograd.grad(plain(x, leaf), leaf, create_graph=True)
    (expected_caller,) = torch.autograd.grad(expected_gradient.pow(2).sum(), leaf)
    torch.testing.assert_close(gradient.detach(), expected_gradient.detach())
    torch.testing.assert_close(caller, expected_caller)
    torch.testing.assert_close(functx.hessian(loss)(w), torch.autograd.functional.hessian(lambda w: plain(x, w), w))
