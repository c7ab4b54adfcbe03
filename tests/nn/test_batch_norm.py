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


_THIRD_ORDER_NORMS = {  # on (2, 3, 4) values: the normalization, and its formula in ops
    "batch_norm": (lambda u: F.batch_norm(u, None, None, training=True), lambda u: _norm_in_ops(u, (0, 2))),
    "instance_norm": (lambda u: F.instance_norm(u), lambda u: _norm_in_ops(u, (2,))),
    "layer_norm": (lambda u: F.layer_norm(u, (4,)), lambda u: _norm_in_ops(u, (2,))),
    "layer_norm_2d": (lambda u: F.layer_norm(u, (3, 4)), lambda u: _norm_in_ops(u, (1, 2))),
    "nn.LayerNorm": (torch.nn.LayerNorm(4, dtype=torch.float64), None),
}
_THIRD_ORDER = {
    "grad(grad(grad))": lambda f, v, w: lambda u: functx.grad(lambda z: (functx.grad(lambda y: (functx.grad(f)(y) * v).sum())(z) * w).sum())(u),
    "grad(jvp(grad))": lambda f, v, w: lambda u: functx.grad(lambda z: (functx.jvp(functx.grad(f), (z,), (v,))[1] * w).sum())(u),
    "jacrev(hessian)": lambda f, v, w: lambda u: torch.tensordot(torch.tensordot(functx.jacrev(functx.hessian(f))(u), w, dims=w.dim()), v, dims=v.dim()),
}


def _third_derivative_by_differences(f, x, v, w, eps=1e-4):
    """d/dx <H(x) v, w> by central differences of the Hessian-vector product of plain autograd."""

    def hvp_w(u):
        u = u.clone().requires_grad_()
        (grad,) = torch.autograd.grad(f(u), u, create_graph=True)
        return (torch.autograd.grad((grad * v).sum(), u)[0] * w).sum()

    basis = torch.eye(x.numel(), dtype=x.dtype).view(-1, *x.shape)
    return torch.stack([(hvp_w(x + eps * e) - hvp_w(x - eps * e)) / (2 * eps) for e in basis]).view(x.shape)


@pytest.mark.parametrize("stack", list(_THIRD_ORDER))
@pytest.mark.parametrize("norm", list(_THIRD_ORDER_NORMS))
def test_third_derivatives_through_norms(norm, stack):
    """torch's derivatives of these norms' double backward are wrong (grad(grad(grad)) of
    sum(sin(layer_norm(x))): off by 25; batch norm's by 1.5); functx runs them as their
    formula in ops where a backward may be differentiated (ad/norms_in_ops.py). Reference:
    central differences of plain autograd's Hessian-vector product of the formula in ops, and
    torch's first derivative (right) for nn.LayerNorm's affine form."""
    fused, in_ops = _THIRD_ORDER_NORMS[norm]
    g = torch.Generator().manual_seed(2)
    x, v, w = (torch.randn(2, 3, 4, dtype=torch.float64, generator=g) for _ in range(3))
    if isinstance(fused, torch.nn.Module):
        with torch.no_grad():
            fused.weight.copy_(torch.randn(4, dtype=torch.float64, generator=g))
            fused.bias.copy_(torch.randn(4, dtype=torch.float64, generator=g))
        weight, bias = fused.weight.detach(), fused.bias.detach()
        in_ops = lambda u: _norm_in_ops(u, (2,)) * weight + bias  # noqa: E731
    f_ops = lambda u: in_ops(u).sin().sum()  # noqa: E731
    expected = _third_derivative_by_differences(f_ops, x, v, w)
    actual = _THIRD_ORDER[stack](lambda u: fused(u).sin().sum(), v, w)(x)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    # per sample, under vmap: the same
    per_sample = functx.vmap(_THIRD_ORDER[stack](lambda u: fused(u.unsqueeze(0)).squeeze(0).sin().sum(), v[0], w[0]))(x)
    for i in range(2):
        expected = _third_derivative_by_differences(lambda u: in_ops(u.unsqueeze(0)).squeeze(0).sin().sum(), x[i], v[0], w[0])
        torch.testing.assert_close(per_sample[i], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("norm", ["batch_norm", "instance_norm"])
def test_running_statistics_update_where_the_norm_runs_as_its_formula(norm):
    """Training mode with running statistics under a hessian (the formula in ops): the
    statistics move as torch's kernel moves them, once per forward."""
    x = torch.randn(4, 3, 5, dtype=torch.float64)
    start = (torch.randn(3, dtype=torch.float64), torch.rand(3, dtype=torch.float64) + 0.5)
    stats = {who: tuple(s.clone() for s in start) for who in ("functx", "torch")}
    call = {
        "batch_norm": lambda u, m, v: F.batch_norm(u, m, v, training=True, momentum=0.3),
        "instance_norm": lambda u, m, v: F.instance_norm(u, m, v, use_input_stats=True, momentum=0.3),
    }[norm]
    functx.hessian(lambda u: call(u, *stats["functx"]).sin().sum())(x)
    # jacrev(jacrev): the forward runs once (jacrev's rows are a vmap of the pullback)
    call(x, *stats["torch"])
    torch.testing.assert_close(stats["functx"], stats["torch"])
    assert not torch.equal(stats["torch"][0], start[0]) and not torch.equal(stats["torch"][1], start[1])


def test_one_value_per_channel_raises_as_torch_does():
    x = torch.randn(1, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        functx.hessian(lambda u: F.batch_norm(u, None, None, training=True).sum())(x)


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


def test_hessian_through_layer_norm_under_two_vmaps():
    """Once a known gap: layer norm's double backward wrote a batched value in place into an
    unbatched temporary (vmap(vmap(hessian)) raised); under two AD levels layer norm runs as
    its formula (ad/norms_in_ops.py)."""
    f = lambda u: F.layer_norm(u, (4,)).sin().sum()  # noqa: E731
    x = torch.randn(2, 3, 5, 4, dtype=torch.float64)
    actual = functx.vmap(functx.vmap(functx.hessian(f)))(x)
    expected = torch.stack(
        [torch.stack([torch.autograd.functional.hessian(lambda u: _norm_in_ops(u, (1,)).sin().sum(), x[i, j]) for j in range(3)]) for i in range(2)]
    )
    torch.testing.assert_close(actual, expected)
