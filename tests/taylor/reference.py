"""References for Taylor mode that cannot share its bugs: derivatives along the path by
nested `torch.autograd.grad` (create_graph), and central finite differences in t."""

from __future__ import annotations

import math

import torch


def on_path(primals, series, t):
    """x(t) = x0 + sum_k x_k t^k / k! for each argument."""
    return tuple(
        p + sum(c * t**k / math.factorial(k) for k, c in enumerate(terms, start=1)) if terms else p
        for p, terms in zip(primals, series)
    )


def path_derivatives(f, primals, series, order):
    """[f(x0), d/dt f(x(t)), ..., d^K/dt^K f(x(t))] at t = 0 by nested reverse mode: each
    derivative of the (vector) output in the scalar t is taken whole by the double-backward
    trick (the gradient of u . dy/dt in u, u a dummy)."""
    t = torch.zeros((), dtype=primals[0].dtype, requires_grad=True)
    current = f(*on_path(primals, series, t))
    out = [current.detach()]
    for _ in range(order):
        u = torch.ones_like(current, requires_grad=True)
        (g,) = torch.autograd.grad(current, t, u, create_graph=True, allow_unused=True)
        if g is None:
            current = torch.zeros_like(current).requires_grad_()
        else:
            (current,) = torch.autograd.grad(g, u, create_graph=True, allow_unused=True)
            if current is None:
                current = torch.zeros_like(out[0]).requires_grad_()
        out.append(current.detach())
    return out


_STENCILS = {
    1: ([-1, 1], [-0.5, 0.5]),
    2: ([-1, 0, 1], [1, -2, 1]),
    3: ([-2, -1, 1, 2], [-0.5, 1, -1, 0.5]),
    4: ([-2, -1, 0, 1, 2], [1, -4, 6, -4, 1]),
}


def path_finite_differences(f, primals, series, order, step=None):
    """d^k/dt^k f(x(t)) at 0 by central differences in float64 (k = 1..order)."""
    out = []
    with torch.no_grad():
        for k in range(1, order + 1):
            h = step or {1: 1e-6, 2: 1e-4, 3: 1e-3, 4: 5e-3}[k]
            points, weights = _STENCILS[k]
            total = sum(w * f(*on_path(primals, series, torch.tensor(p * h, dtype=torch.float64))) for p, w in zip(points, weights))
            out.append(total / h**k)
    return out
