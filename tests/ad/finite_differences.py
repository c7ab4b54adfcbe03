"""float64 central finite differences, nestable: the reference that does not use any AD.

Nesting k central differences of step h has a truncation error O(h^2) and a rounding error
O(eps_machine / h^k), so the step and the tolerance grow with the order of the derivative
(`STEP[k]`, `TOLERANCE[k]`, checked against closed forms in the tests that use them).
"""

import torch

STEP = {1: 1e-6, 2: 1e-4, 3: 1e-3}
TOLERANCE = {1: 1e-6, 2: 1e-6, 3: 1e-4}


def derivative(f, x, step=STEP[1]):
    """d/dt f(x + t) at t = 0 (a derivative for 0-d x, a directional one along ones otherwise)."""
    return directional(f, x, torch.ones_like(x), step)


def directional(f, x, t, step=STEP[1]):
    """d/ds f(x + s t) at s = 0."""
    assert x.dtype == torch.float64
    return (f(x + step * t) - f(x - step * t)) / (2 * step)


def jacobian(f, x, step=STEP[1]):
    """The Jacobian of f at x, shaped f(x).shape + x.shape (torch.func's layout)."""
    assert x.dtype == torch.float64
    columns = []
    for i in range(x.numel()):
        e = torch.zeros(x.numel(), dtype=x.dtype)
        e[i] = 1.0
        columns.append(directional(f, x, e.reshape(x.shape), step))
    stacked = torch.stack(columns, dim=-1)
    return stacked.reshape(*stacked.shape[:-1], *x.shape)


def assert_close(actual, expected, order=1, **kwargs):
    """assert_close with the finite-difference tolerance of a derivative of this order."""
    tol = TOLERANCE[order]
    torch.testing.assert_close(actual, expected, rtol=kwargs.pop("rtol", tol), atol=kwargs.pop("atol", tol), **kwargs)
