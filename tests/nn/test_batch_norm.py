import pytest
import torch
import torch.nn.functional as F

import functx


def test_replace_all_batch_norm_modules_then_vmap_training_mode():
    net = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.BatchNorm2d(3), torch.nn.ReLU(), torch.nn.BatchNorm2d(3))
    assert functx.replace_all_batch_norm_modules_(net) is net
    for bn in (net[1], net[3]):
        assert bn.running_mean is None and bn.running_var is None and not bn.track_running_stats
    x = torch.randn(4, 5, 2, 6, 6)  # 4 independent batches of 5 images
    out = functx.vmap(net)(x)
    torch.testing.assert_close(out, torch.stack([net(xi) for xi in x]), atol=1e-5, rtol=1e-5)


def test_training_batch_norm_with_batched_buffers_backpropagates():
    """Running stats updated in place under vmap must not break a later backward."""
    models = [torch.nn.BatchNorm1d(3) for _ in range(2)]
    params, buffers = functx.stack_module_state(models)
    x = torch.randn(2, 5, 3)

    def run(p, b, xi):
        return functx.functional_call(models[0], (p, b), (xi,))

    out = functx.vmap(run)(params, buffers, x)
    out.pow(2).sum().backward()
    for i, model in enumerate(models):
        xi = x[i].clone().requires_grad_()
        model(xi).pow(2).sum().backward()
        torch.testing.assert_close(params["weight"].grad[i], model.weight.grad)
        torch.testing.assert_close(buffers["running_mean"][i], model.running_mean)


# -- higher derivatives through training-mode batch norm -----------------------------------
# Reference: batch norm written in ops (mean, variance) in float64, differentiated by plain
# autograd; for the third derivative, central differences of that reference's
# Hessian-vector product (torch's own third derivative of batch norm is wrong).


def _norm_in_ops(u, dims):
    mean = u.mean(dims, keepdim=True)
    return (u - mean) / torch.sqrt((u - mean).pow(2).mean(dims, keepdim=True) + 1e-5)


_NORMS = {
    "batch_norm": (lambda u: F.batch_norm(u.unsqueeze(0), None, None, training=True), lambda u: _norm_in_ops(u.unsqueeze(0), (0, 2))),
    "instance_norm": (lambda u: F.instance_norm(u.unsqueeze(0)), lambda u: _norm_in_ops(u.unsqueeze(0), (2,))),
}
_SECOND_ORDER = {
    "vmap(hessian)": lambda f, xs: functx.vmap(functx.hessian(f))(xs),
    "vmap(jacrev(jacrev))": lambda f, xs: functx.vmap(functx.jacrev(functx.jacrev(f)))(xs),
    "vmap(jacfwd(jacrev))": lambda f, xs: functx.vmap(functx.jacfwd(functx.jacrev(f)))(xs),
    "jacrev(jacrev) per sample": lambda f, xs: torch.stack([functx.jacrev(functx.jacrev(f))(x) for x in xs]),
}


@pytest.mark.parametrize("stack", list(_SECOND_ORDER))
@pytest.mark.parametrize("norm", list(_NORMS))
def test_second_derivatives_through_training_mode_norms(norm, stack):
    """vmap(hessian) through batch / instance norm once lost the saved statistics' dependence on
    the input (the backward's decomposition took them as constants): off by ~3."""
    fused, in_ops = _NORMS[norm]
    xs = torch.randn(2, 3, 4, dtype=torch.float64)
    actual = _SECOND_ORDER[stack](lambda u: fused(u).pow(3).sum(), xs)
    expected = torch.stack([torch.autograd.functional.hessian(lambda u: in_ops(u).pow(3).sum(), x) for x in xs])
    torch.testing.assert_close(actual, expected)
    # grad of a jacobian (a vmap inside a grad)
    grad_of_jacobian = functx.grad(lambda u: functx.jacrev(lambda z: fused(z).sin())(u).sum())(xs[0])
    z = xs[0].clone().requires_grad_()
    jac = torch.autograd.functional.jacobian(lambda z: in_ops(z).sin(), z, create_graph=True)
    torch.testing.assert_close(grad_of_jacobian, torch.autograd.grad(jac.sum(), z)[0])


def test_third_derivative_of_batch_norm():
    f = lambda u: F.batch_norm(u.unsqueeze(0), None, None, training=True).sin().sum()  # noqa: E731
    f_ops = lambda u: _norm_in_ops(u.unsqueeze(0), (0, 2)).sin().sum()  # noqa: E731
    g = torch.Generator().manual_seed(2)
    x, v, w = (torch.randn(3, 4, dtype=torch.float64, generator=g) for _ in range(3))

    def hvp_w(u):  # <H(u) v, w> of the reference
        u = u.clone().requires_grad_()
        (grad,) = torch.autograd.grad(f_ops(u), u, create_graph=True)
        return (torch.autograd.grad((grad * v).sum(), u)[0] * w).sum()

    eps = 1e-4
    basis = torch.eye(x.numel(), dtype=torch.float64).view(-1, *x.shape)
    expected = torch.stack([(hvp_w(x + eps * e) - hvp_w(x - eps * e)) / (2 * eps) for e in basis]).view(x.shape)
    actual = functx.grad(lambda u: (functx.jvp(functx.grad(f), (u,), (v,))[1] * w).sum())(x)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.xfail(strict=True, reason="torch's third derivative of batch norm is wrong; grad(grad(grad)) is torch's autograd (known gap)")
def test_third_derivative_of_batch_norm_by_reverse_mode_only():
    f = lambda u: F.batch_norm(u.unsqueeze(0), None, None, training=True).sin().sum()  # noqa: E731
    g = torch.Generator().manual_seed(2)
    x, v, w = (torch.randn(3, 4, dtype=torch.float64, generator=g) for _ in range(3))
    actual = functx.grad(lambda u: (functx.grad(lambda z: (functx.grad(f)(z) * v).sum())(u) * w).sum())(x)
    by_forward = functx.grad(lambda u: (functx.jvp(functx.grad(f), (u,), (v,))[1] * w).sum())(x)
    torch.testing.assert_close(actual, by_forward, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("norm", list(_NORMS))
def test_caller_differentiates_per_sample_gradients_through_training_mode_norms(norm):
    """One functx level (vmap(grad)), the caller's autograd differentiating its result (a
    gradient penalty): the backward's decomposition runs recorded by the caller's graph."""
    fused, in_ops = _NORMS[norm]
    xs = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    penalty = functx.vmap(functx.grad(lambda u: fused(u).pow(3).sum()))(xs).pow(2).sum()
    (actual,) = torch.autograd.grad(penalty, xs)
    ref = xs.detach().clone().requires_grad_()
    grads = [torch.autograd.grad(in_ops(x).pow(3).sum(), x, create_graph=True)[0] for x in ref.unbind()]
    (expected,) = torch.autograd.grad(sum(g.pow(2).sum() for g in grads), ref)
    torch.testing.assert_close(actual, expected)


@pytest.mark.parametrize("norm", list(_NORMS))
def test_caller_differentiates_a_jacobian_through_training_mode_norms(norm):
    """jacrev's vmap runs the norm's backward on batched cotangents (the vmap rule's
    decomposition) while the caller's autograd records it."""
    fused, in_ops = _NORMS[norm]
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    (actual,) = torch.autograd.grad(functx.jacrev(lambda u: fused(u).sin())(x).pow(2).sum(), x)
    ref = x.detach().clone().requires_grad_()
    jac = torch.autograd.functional.jacobian(lambda u: in_ops(u).sin(), ref, create_graph=True)
    (expected,) = torch.autograd.grad(jac.pow(2).sum(), ref)
    torch.testing.assert_close(actual, expected)


_NORMS_AND_FORMULAS = {  # on (2, 3) values: the normalization, and its formula in ops
    "batch_norm": (lambda u: F.batch_norm(u.reshape(2, 3, 1), None, None, training=True), lambda u: _norm_in_ops(u.reshape(2, 3, 1), (0, 2))),
    "layer_norm": (lambda u: F.layer_norm(u, (3,)), lambda u: _norm_in_ops(u, (1,))),
    "group_norm": (lambda u: F.group_norm(u.reshape(2, 3, 1), 1), lambda u: _norm_in_ops(u.reshape(2, 3, 1), (1, 2))),
}


@pytest.mark.parametrize("norm", list(_NORMS_AND_FORMULAS))
def test_caller_differentiates_a_jvp_through_norms(norm):
    """The caller's autograd differentiates a jvp's tangent through a normalization: torch's
    forward formula takes the saved statistics as constants (once off by 500 under
    functx.jvp; the fuzzer's `test_fuzz_under_the_callers_autograd`). Reference: the jvp of
    the formula in ops by the double-backward identity, differentiated by plain autograd
    (torch's own third derivatives of the norms cannot be the reference)."""
    fused, in_ops = _NORMS_AND_FORMULAS[norm]
    g = torch.Generator().manual_seed(3)
    x, t = (torch.randn(2, 3, dtype=torch.float64, generator=g) for _ in range(2))
    xs = x.clone().requires_grad_()
    (actual,) = torch.autograd.grad(functx.jvp(lambda u: fused(torch.sin(u)).reshape(2, 3).pow(2), (xs,), (t,))[1].pow(2).sum(), xs)
    xs = x.clone().requires_grad_()
    tangent = torch.autograd.functional.jvp(lambda u: in_ops(torch.sin(u)).reshape(2, 3).pow(2), xs, t, create_graph=True)[1]
    (expected,) = torch.autograd.grad(tangent.pow(2).sum(), xs)
    torch.testing.assert_close(actual, expected)
