"""Reverse mode over forward mode through torch.linalg (functx/ad/jvp_rules.py's
explicit tangents: _det_jvp, _slogdet_jvp, _eigh_jvp, _solve_jvp).

torch's forward formulas for det, slogdet and solve solve with the LU factorization the op
returns, which has no derivative, and its eigh formula divides by the eigenvalue gaps with
the diagonal's zeros in it: reverse mode over them (vjp(jvp(det)), grad(jvp(slogdet)),
vjp(jvp(grad(eigvalsh)))) was wrong or NaN, in torch.func too. References: the jvp by the
double-vjp identity in plain torch.autograd (no forward formula involved) differentiated
again with create_graph, and central differences of the jvp (float64)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functx
from tests.ad import finite_differences as fd

DOUBLE = torch.float64


def _gram(x, n):
    """A well-conditioned symmetric positive-definite matrix with distinct eigenvalues."""
    m = x.reshape(-1, n)
    return m.mT @ m + torch.diag(torch.arange(1, n + 1, dtype=x.dtype))


FUNCTIONS = {
    "det": lambda a: torch.linalg.det(a),
    "slogdet": lambda a: torch.linalg.slogdet(a)[1],
    "slogdet_sign": lambda a: torch.linalg.slogdet(a)[0] * torch.linalg.slogdet(a)[1],
    "eigvalsh": lambda a: torch.linalg.eigvalsh(a),
    "eigh_vectors": lambda a: torch.linalg.eigh(a)[1].square(),
    "solve": lambda a: torch.linalg.solve(a, torch.arange(1.0, a.shape[-1] + 1, dtype=a.dtype)),
}


def _reference_jvp(f, x, t):
    """J(x) t by the double-vjp identity: d/du <J^T u, t>, reverse mode only, graph kept."""
    out = f(x)
    u = torch.zeros_like(out, requires_grad=True)
    (jt_u,) = torch.autograd.grad(out, x, u, create_graph=True)
    (jt,) = torch.autograd.grad((jt_u * t).sum(), u, create_graph=True)
    return jt


def _case(seed, n=3, rows=2):
    g = torch.Generator().manual_seed(seed)
    x, t = (torch.randn(rows * n, generator=g, dtype=DOUBLE) for _ in range(2))
    w = torch.randn(n, n, generator=g, dtype=DOUBLE)
    return x, t, w


def _weighted(name, n):
    """x -> <w, f(G(x))>, the weights the first elements of `w`, shaped like the output."""
    f = FUNCTIONS[name]

    def weighted(x, w):
        out = f(_gram(x, n))
        return (out * w.flatten()[: out.numel()].reshape(out.shape)).sum()

    return weighted


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
@pytest.mark.parametrize("seed", range(3))
def test_vjp_of_jvp_against_reverse_mode_and_finite_differences(name, seed):
    n = 3
    x, t, w = _case(seed, n)
    f = _weighted(name, n)

    def tangent(y):
        return functx.jvp(lambda z: f(z, w), (y,), (t,))[1]

    value, vjp_fn = functx.vjp(tangent, x)
    (got,) = vjp_fn(torch.ones((), dtype=DOUBLE))

    leaf = x.clone().requires_grad_()
    expected_value = _reference_jvp(lambda z: f(z, w), leaf, t)
    (expected,) = torch.autograd.grad(expected_value, leaf)
    torch.testing.assert_close(value, expected_value.detach())
    torch.testing.assert_close(got, expected)
    # the reference itself, against central differences of the jvp (float64)
    tangent_by_differences = lambda y: fd.directional(lambda z: f(z, w), y, t, fd.STEP[1])
    fd.assert_close(expected, fd.jacobian(tangent_by_differences, x, fd.STEP[2]), order=3)  # nested: 1e-4


@pytest.mark.parametrize("name", ["det", "slogdet", "eigh_vectors", "solve"])
def test_stacks_over_forward_mode(name):
    """grad(jvp), jacrev(jacfwd) and vmap(vjp(jvp)) over a batch, against the reverse-mode
    reference per sample."""
    n = 3
    x, t, w = _case(7, n)
    f = _weighted(name, n)

    def reference(y):
        leaf = y.clone().requires_grad_()
        return torch.autograd.grad(_reference_jvp(lambda z: f(z, w), leaf, t), leaf)[0]

    got = functx.grad(lambda y: functx.jvp(lambda z: f(z, w), (y,), (t,))[1])(x)
    torch.testing.assert_close(got, reference(x))

    hessian = functx.jacrev(functx.jacfwd(lambda z: f(z, w)))(x)
    leaf = x.clone().requires_grad_()
    (gradient,) = torch.autograd.grad(f(leaf, w), leaf, create_graph=True)
    rows = [torch.autograd.grad(gradient[i], leaf, retain_graph=True)[0] for i in range(x.numel())]
    torch.testing.assert_close(hessian, torch.stack(rows))

    xs = torch.stack([x, x.flip(0), x * 0.5])
    per_sample = functx.vmap(lambda y: functx.vjp(lambda z: functx.jvp(lambda v: f(v, w), (z,), (t,))[1], y)[1](torch.ones((), dtype=DOUBLE))[0])(xs)
    torch.testing.assert_close(per_sample, torch.stack([reference(y) for y in xs]))


def test_third_order_eigvalsh_is_finite_and_right():
    """vjp(jvp(grad(eigvalsh))): NaN before (0 / 0 in torch's eigh tangent under reverse)."""
    n = 3
    x, t, w = _case(3, n)
    f = _weighted("eigvalsh", n)
    grad_f = functx.grad(lambda z: f(z, w))
    value, vjp_fn = functx.vjp(lambda y: functx.jvp(grad_f, (y,), (t,))[1], x)
    cotangent = t.flip(0)
    got = vjp_fn(cotangent)[0]

    leaf = x.clone().requires_grad_()

    def gradient(z):
        return torch.autograd.grad(f(z, w), z, create_graph=True)[0]

    tangent = _reference_jvp(gradient, leaf, t)
    (expected,) = torch.autograd.grad((tangent * cotangent).sum(), leaf)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    name=st.sampled_from(sorted(FUNCTIONS)),
    n=st.integers(2, 4),
    rows=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_vjp_of_jvp_property(name, n, rows, seed):
    """Random sizes and values: vjp(jvp(f)) equals reverse mode over the double-vjp jvp."""
    x, t, w = _case(seed, n, rows)
    f = _weighted(name, n)
    value, vjp_fn = functx.vjp(lambda y: functx.jvp(lambda z: f(z, w), (y,), (t,))[1], x)
    (got,) = vjp_fn(torch.ones((), dtype=DOUBLE))
    leaf = x.clone().requires_grad_()
    (expected,) = torch.autograd.grad(_reference_jvp(lambda z: f(z, w), leaf, t), leaf)
    torch.testing.assert_close(got, expected)


def test_complex_slogdet_tangent_matches_differences():
    """A complex A: d sign = sign · i Im tr(A^-1 dA), d log|det| = Re tr(A^-1 dA), against
    central differences of slogdet along dA (first order, the wrapped level's formula)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 3, dtype=torch.complex128, generator=g)
    da = torch.randn(3, 3, dtype=torch.complex128, generator=g)

    def tangents(y):
        return functx.jvp(lambda z: tuple(torch.linalg.slogdet(z)), (y,), (da,))[1]

    # inside vjp the jvp level is a wrapped one: the explicit formula runs
    (sign_t, log_t), _ = functx.vjp(lambda y: tangents(y), a)
    step = 1e-6
    plus, minus = torch.linalg.slogdet(a + step * da), torch.linalg.slogdet(a - step * da)
    torch.testing.assert_close(sign_t, (plus[0] - minus[0]) / (2 * step), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(log_t, (plus[1] - minus[1]) / (2 * step), rtol=1e-6, atol=1e-6)
