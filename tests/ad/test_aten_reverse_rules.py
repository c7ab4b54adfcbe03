"""ad/aten_reverse_rules.py: det's higher derivatives under transforms, against plain
torch.autograd with create_graph (whose graph of det's second derivative holds no SVD on
plain tensors, so it stays finite) and the adjugate."""

import pytest
import torch

import functx

D = torch.float64


def _gram(x):
    m = x.reshape(-1, 3)
    return m.mT @ m + torch.diag(torch.arange(1, 4, dtype=D))


def f(x):
    return torch.sin(torch.linalg.det(_gram(x)))


def _plain_third(x, weights):
    """d/dx of sum(weights * Hessian(f)(x)): reverse mode three times on plain tensors."""
    x = x.detach().clone().requires_grad_()
    (g,) = torch.autograd.grad(f(x), x, create_graph=True)
    hessian = torch.stack([torch.autograd.grad(g[i], x, create_graph=True)[0] for i in range(x.numel())])
    (third,) = torch.autograd.grad((hessian * weights).sum(), x)
    return third


STACKS = {
    "vjp(vmap(hessian))": lambda x, w: functx.vjp(functx.vmap(functx.hessian(f)), x.unsqueeze(0))[1](w.unsqueeze(0))[0][0],
    "grad of sum(w * jacrev(jacrev))": lambda x, w: functx.grad(lambda v: (functx.jacrev(functx.jacrev(f))(v) * w).sum())(x),
    "jacrev(hessian) contracted": lambda x, w: (functx.jacrev(functx.hessian(f))(x) * w.unsqueeze(-1)).sum((0, 1)),
    "vmap(grad(sum(w * hessian)))": lambda x, w: functx.vmap(functx.grad(lambda v: (functx.hessian(f)(v) * w).sum()))(x.unsqueeze(0))[0],
}


@pytest.mark.parametrize("stack", list(STACKS))
def test_third_derivatives_of_det_are_finite_and_right(stack):
    """NaN before (torch.func's too): torch's det backward on tensor subclasses is its SVD
    formula, whose derivative divides by the zero gaps of det's orthogonal factor."""
    torch.manual_seed(0)
    x, w = torch.randn(3, dtype=D), torch.randn(3, 3, dtype=D)
    got = STACKS[stack](x, w)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, _plain_third(x, w))


def test_the_callers_gradient_through_a_hessian_of_det():
    torch.manual_seed(1)
    x, w = torch.randn(3, dtype=D, requires_grad=True), torch.randn(3, 3, dtype=D)
    (got,) = torch.autograd.grad((functx.hessian(f)(x) * w).sum(), x)
    torch.testing.assert_close(got, _plain_third(x, w))


def test_det_values_are_torchs_to_rounding_under_transforms():
    """sign · exp(log|det|) is torch's det to rounding (a few ulps)."""
    a = _gram(torch.randn(3, dtype=D))
    grads, values = functx.vmap(functx.grad_and_value(torch.linalg.det))(torch.stack([a, a * 2]))
    torch.testing.assert_close(values, torch.linalg.det(torch.stack([a, a * 2])), rtol=1e-13, atol=0)
    torch.testing.assert_close(grads[0], torch.linalg.det(a) * torch.linalg.inv(a).mT)


def test_a_singular_matrix_keeps_torchs_formula():
    """At a singular matrix the slogdet route would be 0 * inf (log|det| = -inf): NaN. There
    torch's own formula runs, for the whole batch: the per-sample values of plain torch."""
    singular = torch.tensor([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [1.0, 0.0, 1.0]], dtype=D)
    batch = torch.stack([singular, torch.eye(3, dtype=D) * 2])
    got = functx.vmap(functx.grad(torch.linalg.det))(batch)
    expected = torch.stack([_plain_grad_det(m) for m in batch])
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected)


def _plain_grad_det(m):
    m = m.clone().requires_grad_()
    (g,) = torch.autograd.grad(torch.linalg.det(m), m)
    return g


def test_plain_torch_outside_transforms_is_untouched():
    a = _gram(torch.randn(3, dtype=D)).requires_grad_()
    functx.grad(torch.sin)(torch.tensor(1.0))  # a transform has run: the kernel is wrapped
    assert type(torch.linalg.det(a).grad_fn).__name__ == "LinalgDetBackward0"


def test_forward_ad_through_det_keeps_torchs_formula():
    """The wrapped autograd kernel keeps torch's forward formula: plain forward AD after a
    transform ran, and functx.jvp (no double-VJP fallback warning), give det·tr(A⁻¹ dA)."""
    import warnings

    import torch.autograd.forward_ad as fwAD

    functx.grad(torch.sin)(torch.tensor(1.0))  # the kernel is wrapped from the first transform
    a, t = _gram(torch.randn(3, dtype=D)), torch.randn(3, 3, dtype=D)
    expected = torch.linalg.det(a) * torch.trace(torch.linalg.solve(a, t))
    with fwAD.dual_level():
        plain = fwAD.unpack_dual(torch.linalg.det(fwAD.make_dual(a, t))).tangent
    torch.testing.assert_close(plain, expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error", functx.PerformanceWarning)
        torch.testing.assert_close(functx.jvp(torch.linalg.det, (a,), (t,))[1], expected)
        hvp = functx.jvp(functx.grad(torch.linalg.det), (a,), (t,))[1]

    def plain_grad(m):
        return torch.autograd.grad(torch.linalg.det(m), m, create_graph=True)[0]

    hessian = torch.autograd.functional.jacobian(plain_grad, a).reshape(9, 9)
    torch.testing.assert_close(hvp, (hessian @ t.reshape(9)).reshape(3, 3))


@pytest.mark.parametrize("stack", ["jvp(grad)", "jvp(vjp(grad))", "jvp(hessian)"])
def test_forward_over_reverse_through_det(stack):
    """jvp(grad(sin(det(G(x))))): a first version added torch's det value to a zero made with
    `detach()`, and forward AD kept the value's tangent: the tangent counted twice (found by
    the 10,000-example fuzz run). Against plain forward AD over create_graph backwards."""
    import torch.autograd.forward_ad as fwAD

    torch.manual_seed(2)
    x, t = torch.randn(3, dtype=D), torch.randn(3, dtype=D)
    u = torch.randn(3, dtype=D)
    if stack == "jvp(grad)":
        got = functx.jvp(functx.grad(f), (x,), (t,))[1]
    elif stack == "jvp(vjp(grad))":
        got = functx.jvp(lambda v: functx.vjp(functx.grad(f), v)[1](u)[0], (x,), (t,))[1]
    else:
        got = functx.jvp(functx.hessian(f), (x,), (t,))[1]
    with fwAD.dual_level():
        dual = fwAD.make_dual(x.clone().requires_grad_(), t)
        (g,) = torch.autograd.grad(f(dual), dual, create_graph=True)
        if stack == "jvp(grad)":
            out = g
        elif stack == "jvp(vjp(grad))":
            (out,) = torch.autograd.grad(g, dual, u, create_graph=True)
        else:
            out = torch.stack([torch.autograd.grad(g[i], dual, create_graph=True)[0] for i in range(3)])
        expected = fwAD.unpack_dual(out).tangent
    torch.testing.assert_close(got, expected)
