"""functx.laplacian, weighted_laplacian, bilaplacian (exact and stochastic) against
torch.autograd's Hessians in float64, against the same sum over per-direction jets (not
collapsed), and composed with vmap and grad."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import functx
from functx.core import current_stack

from .test_jet_fuzz import _run, programs

D = torch.float64


def _mlp_params(n_in, width=6, n_out=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(n_in, width, generator=g, dtype=D) / n_in**0.5,
        torch.randn(width, generator=g, dtype=D),
        torch.randn(width, width, generator=g, dtype=D) / width**0.5,
        torch.randn(width, n_out, generator=g, dtype=D) / width**0.5,
    ]


def mlp(params, x):
    w1, b1, w2, w3 = params
    h = torch.tanh(x.reshape(-1) @ w1 + b1)
    h = torch.nn.functional.gelu(h @ w2) * torch.sigmoid(h)
    return (h @ w3).squeeze(-1)


def _hessian_trace(f, x):
    return torch.diagonal(torch.autograd.functional.hessian(f, x).reshape(x.numel(), x.numel())).sum()


@pytest.mark.parametrize("shape", [(1,), (5,), (2, 3)])
def test_laplacian_equals_the_hessian_trace(shape):
    params, x = _mlp_params(int(torch.tensor(shape).prod())), torch.randn(*shape, dtype=D)
    f = lambda x: mlp(params, x)  # noqa: E731
    torch.testing.assert_close(functx.laplacian(f)(x), _hessian_trace(f, x))


def test_laplacian_of_each_output_element():
    params, x = _mlp_params(4, n_out=3), torch.randn(4, dtype=D)
    got = functx.laplacian(lambda x: mlp(params, x))(x)
    expected = torch.stack([_hessian_trace(lambda x: mlp(params, x)[i], x) for i in range(3)])
    torch.testing.assert_close(got, expected)


def test_value_and_gradient_from_the_same_pass():
    params, x = _mlp_params(4, n_out=2), torch.randn(4, dtype=D)
    f = lambda x: mlp(params, x)  # noqa: E731
    lap, value, gradient = functx.laplacian(f, value_and_grad=True)(x)
    torch.testing.assert_close(value, f(x))
    torch.testing.assert_close(gradient, torch.autograd.functional.jacobian(f, x))
    torch.testing.assert_close(lap, functx.laplacian(f)(x))


def _per_direction_sum(f, x, directions, weights, order):
    """The same weighted sum from one (non-collapsed) jet per direction, looped."""
    total = 0
    for v, w in zip(directions, weights):
        series = [v] + [torch.zeros_like(x)] * (order - 1)
        total = total + w * functx.jet(f, (x,), (series,))[1][-1]
    return total


def test_collapsed_equals_per_direction_jets():
    params, x = _mlp_params(5), torch.randn(5, dtype=D)
    f = lambda x: mlp(params, x)  # noqa: E731
    basis = torch.eye(5, dtype=D)
    torch.testing.assert_close(functx.laplacian(f)(x), _per_direction_sum(f, x, basis, [1] * 5, 2))


def test_weighted_laplacian_equals_trace_of_sigma_sigma_t_hessian():
    params, x = _mlp_params(4), torch.randn(4, dtype=D)
    f = lambda x: mlp(params, x)  # noqa: E731
    sigma = torch.randn(4, 3, dtype=D)
    hessian = torch.autograd.functional.hessian(f, x)
    torch.testing.assert_close(functx.weighted_laplacian(f, sigma)(x), torch.trace(sigma @ sigma.T @ hessian))
    state_dependent = lambda x: torch.diag(1 + x**2)  # noqa: E731
    s = state_dependent(x)
    torch.testing.assert_close(functx.weighted_laplacian(f, state_dependent)(x), torch.trace(s @ s.T @ hessian))


def _bilaplacian_reference(f, x):
    def laplacian_graph(x):
        hessian = torch.autograd.functional.hessian(f, x, create_graph=True)
        return torch.diagonal(hessian.reshape(x.numel(), x.numel())).sum()

    return torch.diagonal(torch.autograd.functional.hessian(laplacian_graph, x).reshape(x.numel(), x.numel())).sum()


@pytest.mark.parametrize("n", [1, 2, 4])
def test_bilaplacian_equals_the_laplacian_of_the_laplacian(n):
    params, x = _mlp_params(n), torch.randn(n, dtype=D)
    f = lambda x: mlp(params, x)  # noqa: E731
    torch.testing.assert_close(functx.bilaplacian(f)(x), _bilaplacian_reference(f, x))
    lap, value, gradient = functx.bilaplacian(f, value_and_grad=True)(x)
    torch.testing.assert_close(gradient, torch.autograd.functional.jacobian(f, x))


@pytest.mark.parametrize("distribution", ["rademacher", "gaussian", "sparse"])
def test_stochastic_laplacian_is_unbiased(distribution):
    """The mean over 400 seeds lies within 4 standard errors of the exact Laplacian."""
    params, x = _mlp_params(6), torch.randn(6, dtype=D)
    f = lambda x: mlp(params, x)  # noqa: E731
    exact = functx.laplacian(f)(x)
    estimates = torch.stack(
        [functx.laplacian(f, samples=2, distribution=distribution, generator=torch.Generator().manual_seed(s))(x) for s in range(400)]
    )
    error = (estimates.mean() - exact).abs()
    assert error < 4 * estimates.std() / 400**0.5 + 1e-12, (error, estimates.std())
    assert estimates.std() > 0  # random: not the exact value each time


def test_stochastic_estimators_are_exact_when_the_directions_span_the_space():
    params, x = _mlp_params(4), torch.randn(4, dtype=D)
    f = lambda x: mlp(params, x)  # noqa: E731
    sparse_all = functx.laplacian(f, samples=4, distribution="sparse", generator=torch.Generator().manual_seed(1))(x)
    torch.testing.assert_close(sparse_all, functx.laplacian(f)(x))
    diagonal = lambda x: (torch.sin(x) * x).sum()  # noqa: E731  (a diagonal Hessian: Rademacher exact)
    torch.testing.assert_close(functx.laplacian(diagonal, samples=1)(x), functx.laplacian(diagonal)(x))


def test_stochastic_bilaplacian_is_unbiased():
    params, x = _mlp_params(3), torch.randn(3, dtype=D)
    f = lambda x: mlp(params, x)  # noqa: E731
    exact = functx.bilaplacian(f)(x)
    estimates = torch.stack([functx.bilaplacian(f, samples=4, generator=torch.Generator().manual_seed(s))(x) for s in range(300)])
    assert (estimates.mean() - exact).abs() < 4 * estimates.std() / 300**0.5, (estimates.mean(), exact)


def test_vmap_over_points_equals_the_loop():
    params, points = _mlp_params(3), torch.randn(5, 3, dtype=D)
    f = lambda x: mlp(params, x)  # noqa: E731
    batched = functx.vmap(functx.laplacian(f))(points)
    torch.testing.assert_close(batched, torch.stack([_hessian_trace(f, p) for p in points]))
    batched_bi = functx.vmap(functx.bilaplacian(f))(points[:2])
    torch.testing.assert_close(batched_bi, torch.stack([_bilaplacian_reference(f, p) for p in points[:2]]))


def test_pinn_loss_gradient_in_the_parameters():
    """torch.autograd and functx.grad through the Laplacian to the network's parameters."""
    params, points = _mlp_params(3), torch.randn(4, 3, dtype=D)

    def loss(params, points):
        residual = functx.vmap(functx.laplacian(lambda x: mlp(params, x)))(points) - 1.0
        return (residual**2).mean()

    def reference(params, points):
        laps = []
        for p in points:
            p = p.detach().requires_grad_()
            (g,) = torch.autograd.grad(mlp(params, p), p, create_graph=True)
            laps.append(sum(torch.autograd.grad(g[i], p, create_graph=True)[0][i] for i in range(3)))
        return ((torch.stack(laps) - 1.0) ** 2).mean()

    leaves = [p.clone().requires_grad_() for p in params]
    expected = torch.autograd.grad(reference(leaves, points), leaves)
    got_torch = torch.autograd.grad(loss(leaves, points), leaves)
    got_functx = functx.grad(loss)(params, points)
    for e, a, b in zip(expected, got_torch, got_functx):
        torch.testing.assert_close(a, e)
        torch.testing.assert_close(b, e)


def test_argnums_and_other_arguments():
    params, x = _mlp_params(3), torch.randn(3, dtype=D)
    got = functx.laplacian(lambda params, x: mlp(params, x), argnums=1)(params, x)
    torch.testing.assert_close(got, _hessian_trace(lambda x: mlp(params, x), x))


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda f: functx.laplacian(f, argnums=(0,)), TypeError, "argnums must be an int"),
        (lambda f: functx.laplacian(f, argnums=3), ValueError, "argnums=3"),
        (lambda f: functx.laplacian(f, samples=0), ValueError, "samples must be a positive int"),
        (lambda f: functx.laplacian(f, samples=2, distribution="uniform"), ValueError, "distribution must be one of"),
        (lambda f: functx.laplacian(f, samples=9, distribution="sparse"), ValueError, "without replacement"),
        (lambda f: functx.laplacian(f, samples=2, value_and_grad=True), ValueError, "value_and_grad needs the exact"),
        (lambda f: functx.weighted_laplacian(f, torch.ones(2, 2)), ValueError, "sigma must be a"),
    ],
)
def test_bad_arguments_are_named(make, error, match):
    with pytest.raises(error, match=match):
        make(lambda x: x.sum())(torch.randn(3))
    assert current_stack() == ()


def test_integer_argument_is_refused():
    with pytest.raises(TypeError, match="floating-point tensor"):
        functx.laplacian(lambda x: x.sum())(torch.arange(3))


@settings(max_examples=int(os.environ.get("FUNCTX_FUZZ_EXAMPLES", "40")), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=programs(), seed=st.integers(0, 2**16), operator=st.sampled_from(["laplacian", "bilaplacian"]))
def test_random_programs_collapsed_equals_autograd(program, seed, operator):
    """Random programs (test_jet_fuzz's) of two 3-vectors, reduced to a scalar: the collapsed
    Laplacian equals the Hessian trace, the bi-Laplacian the Laplacian of the Laplacian."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(3, generator=g, dtype=D), torch.randn(3, generator=g, dtype=D)
    f = lambda x: _run(program, x, y).sum()  # noqa: E731
    if operator == "laplacian":
        expected = _hessian_trace(f, x)
        got = functx.laplacian(f)(x)
    else:
        expected = _bilaplacian_reference(f, x)
        got = functx.bilaplacian(f)(x)
    torch.testing.assert_close(got, expected, rtol=1e-7, atol=1e-9 * (1 + expected.abs().item()))


def test_under_functx_jit():
    """functx.jit traces the collapsed Laplacian (and replays it) with the eager values."""
    params, points = _mlp_params(3), torch.randn(4, 3, dtype=D)
    f = lambda x: mlp(params, x)  # noqa: E731
    eager = functx.vmap(functx.laplacian(f))(points)
    jitted = functx.jit(functx.vmap(functx.laplacian(f)))
    torch.testing.assert_close(jitted(points), eager)
    torch.testing.assert_close(jitted(points + 1), functx.vmap(functx.laplacian(f))(points + 1))  # replayed


def _laplacian_with_graph(f, x):
    x = x if x.requires_grad else x.detach().requires_grad_()
    return torch.diagonal(torch.autograd.functional.hessian(f, x, create_graph=True)).sum()


@pytest.mark.parametrize(
    "transform, order",
    [
        (functx.jacfwd, 1),
        (functx.jacrev, 1),
        (functx.grad, 1),
        (functx.hessian, 2),
        (lambda g: functx.jacfwd(functx.jacrev(g)), 2),
        (lambda g: functx.jacrev(functx.jacfwd(g)), 2),
    ],
)
def test_transforms_of_the_laplacian(transform, order):
    """Forward and reverse derivatives of the Laplacian in its point (third and fourth
    derivatives of f), against torch.autograd of the Hessian trace built with create_graph."""
    params, x = _mlp_params(3), torch.randn(3, dtype=D)
    f = lambda x: mlp(params, x)  # noqa: E731
    got = transform(functx.laplacian(f))(x)
    if order == 1:
        xr = x.clone().requires_grad_()
        expected = torch.autograd.grad(_laplacian_with_graph(f, xr), xr)[0]
    else:
        expected = torch.autograd.functional.hessian(lambda x: _laplacian_with_graph(f, x), x)
    torch.testing.assert_close(got, expected)
