"""functx.jet composed with the other transforms and with torch's autograd, against loops
and nested torch.autograd (float64)."""

from __future__ import annotations

import torch

import functx

from .reference import path_derivatives

D = torch.float64


def mlp(params, x):
    w1, b1, w2, b2 = params
    return torch.tanh(x @ w1 + b1) @ w2 + b2


def _params():
    return [torch.randn(3, 5, dtype=D), torch.randn(5, dtype=D), torch.randn(5, 2, dtype=D), torch.randn(2, dtype=D)]


def _second_along(f, x, v):
    zero = torch.zeros_like(x)
    return functx.jet(f, (x,), ([v, zero],))[1][1]


def test_vmap_over_points_equals_the_loop():
    params, points, v = _params(), torch.randn(4, 3, dtype=D), torch.randn(3, dtype=D)
    f = lambda x: mlp(params, x)  # noqa: E731
    batched = functx.vmap(lambda x: _second_along(f, x, v))(points)
    for i in range(4):
        expected = path_derivatives(f, [points[i]], [[v, torch.zeros(3, dtype=D)]], 2)[2]
        torch.testing.assert_close(batched[i], expected)


def test_vmap_over_directions_gives_the_hessian_diagonal():
    params, x = _params(), torch.randn(3, dtype=D)
    f = lambda x: mlp(params, x).sum()  # noqa: E731
    diagonal = functx.vmap(lambda v: _second_along(f, x, v))(torch.eye(3, dtype=D))
    hessian = torch.autograd.functional.hessian(f, x)
    torch.testing.assert_close(diagonal, torch.diagonal(hessian))


def test_jet_of_a_vmapped_function():
    params, points = _params(), torch.randn(4, 3, dtype=D)
    directions = torch.randn(4, 3, dtype=D)
    f = functx.vmap(lambda x: mlp(params, x))
    _, (first, second) = functx.jet(f, (points,), ([directions, torch.zeros_like(points)],))
    for i in range(4):
        expected = path_derivatives(lambda x: mlp(params, x), [points[i]], [[directions[i], torch.zeros(3, dtype=D)]], 2)
        torch.testing.assert_close(first[i], expected[1])
        torch.testing.assert_close(second[i], expected[2])


def _reference_second(params, x, v):
    """v^T H v of sum(mlp) in x, by nested autograd, keeping the graph to the parameters."""
    x = x if x.requires_grad else x.detach().requires_grad_()
    (g,) = torch.autograd.grad(mlp(params, x).sum(), x, create_graph=True)
    (hv,) = torch.autograd.grad(g @ v, x, create_graph=True)
    return hv @ v


def test_torch_autograd_through_jet_to_the_parameters():
    """A PINN's training step: torch's autograd differentiates the jet's coefficients in the
    parameters the function closes over."""
    params = [p.requires_grad_() for p in _params()]
    x, v = torch.randn(3, dtype=D), torch.randn(3, dtype=D)
    loss = _second_along(lambda x: mlp(params, x).sum(), x, v) ** 2
    got = torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True)
    expected = torch.autograd.grad(_reference_second(params, x, v) ** 2, params, allow_unused=True, materialize_grads=True)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


def test_functx_grad_through_jet_to_the_parameters_per_sample():
    params, points, v = _params(), torch.randn(4, 3, dtype=D), torch.randn(3, dtype=D)

    def loss(params, x):
        return _second_along(lambda x: mlp(params, x).sum(), x, v) ** 2

    per_sample = functx.vmap(functx.grad(loss), in_dims=(None, 0))(params, points)
    for i in range(4):
        leaves = [p.detach().requires_grad_() for p in params]
        expected = torch.autograd.grad(
            _reference_second(leaves, points[i], v) ** 2, leaves, allow_unused=True, materialize_grads=True
        )
        for g, e in zip(per_sample, expected):
            torch.testing.assert_close(g[i], e)


def test_jet_of_a_gradient():
    """Taylor coefficients of x -> grad f(x) along a path: third derivatives of f."""
    params, x = _params(), torch.randn(3, dtype=D)
    series = [torch.randn(3, dtype=D), torch.randn(3, dtype=D)]
    f = lambda x: mlp(params, x).sum()  # noqa: E731
    _, got = functx.jet(functx.grad(f), (x,), (series,))

    def gradient(x):
        x = x if x.requires_grad else x.requires_grad_()
        return torch.autograd.grad(f(x), x, create_graph=True)[0]

    expected = path_derivatives(gradient, [x], [series], 2)
    torch.testing.assert_close(got[0], expected[1])
    torch.testing.assert_close(got[1], expected[2])


def test_jvp_of_jet_coefficients():
    params, x, v, w = _params(), torch.randn(3, dtype=D), torch.randn(3, dtype=D), torch.randn(3, dtype=D)
    f = lambda x: mlp(params, x).sum()  # noqa: E731
    _, tangent = functx.jvp(lambda x: _second_along(f, x, v), (x,), (w,))
    xr = x.detach().requires_grad_()
    expected = torch.autograd.grad(_reference_second(params, xr, v), xr)[0] @ w
    torch.testing.assert_close(tangent, expected)


def test_nested_jets():
    """A jet of a jet's coefficient: mixed directional derivatives."""
    x, v, w = torch.randn(3, dtype=D), torch.randn(3, dtype=D), torch.randn(3, dtype=D)
    f = lambda x: torch.exp(torch.sin(x).sum() * x[0])  # noqa: E731
    _, (mixed,) = functx.jet(lambda y: _second_along(f, y, v), (x,), ([w],))
    xr = x.detach().requires_grad_()
    expected = torch.autograd.grad(_reference_second_of(f, xr, v), xr)[0] @ w
    torch.testing.assert_close(mixed, expected)


def _reference_second_of(f, x, v):
    (g,) = torch.autograd.grad(f(x), x, create_graph=True)
    (hv,) = torch.autograd.grad(g @ v, x, create_graph=True)
    return hv @ v
