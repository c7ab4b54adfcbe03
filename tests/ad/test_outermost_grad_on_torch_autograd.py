"""The outermost grad level runs on plain torch autograd (functx/ad/direct_reverse.py,
`DirectGradLevel` outside every vmap).

What wrappers would give for free must still hold: results leave detached unless the
function reached tensors tracked outside the transform, an outer differentiation through
a gradient (a gradient penalty) works, an outer `no_grad` holds for the outside, nothing
chains across training steps.
"""

import pytest
import torch
import torch.func as tf

import functx
from functx.core.interpreter import current_stack

D = torch.float64


def loss(w, x):
    return torch.tanh(x @ w).pow(2).sum()


def test_results_leave_detached():
    w, x = torch.randn(3, 2, dtype=D), torch.randn(4, 3, dtype=D)
    g, (value, aux) = functx.grad_and_value(lambda w: (loss(w, x), w * 2), has_aux=True)(w)
    out, vjp_fn = functx.vjp(lambda w: torch.sin(w), w)
    (cot,) = vjp_fn(torch.ones_like(out))
    for t in (g, value, aux, out, cot, functx.jacrev(torch.sin)(w), functx.hessian(lambda w: loss(w, x))(w)):
        assert not t.requires_grad and t.grad_fn is None
    torch.testing.assert_close(g, tf.grad(loss)(w, x))
    assert current_stack() == ()


def test_training_steps_do_not_chain():
    """A gradient step on plain parameters gives plain parameters: no graph grows across steps."""
    w, x = torch.randn(3, 2, dtype=D), torch.randn(4, 3, dtype=D)
    reference = w.clone()
    for _ in range(3):
        w = w - 0.1 * functx.grad(loss)(w, x)
        reference = reference - 0.1 * tf.grad(loss)(reference, x)
        assert w.grad_fn is None and not w.requires_grad
    torch.testing.assert_close(w, reference)


def test_gradient_penalty_differentiates_through_the_gradient():
    """WGAN-GP: the penalty on the input gradient of a critic whose parameters require grad."""
    torch.manual_seed(0)
    critic = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    x = torch.randn(5, 3, dtype=D)

    def penalty(grad_fn):
        g = grad_fn(lambda x: critic(x).sum())(x)
        return ((g.norm(dim=1) - 1) ** 2).mean()

    params = list(critic.parameters())[:3]  # the last bias does not reach the input gradient
    ours = torch.autograd.grad(penalty(functx.grad), params)
    xr = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(critic(xr).sum(), xr, create_graph=True)
    expected = torch.autograd.grad(((g.norm(dim=1) - 1) ** 2).mean(), params)
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a, b)


def test_input_that_requires_grad_stays_differentiable():
    x = torch.randn(4, dtype=D, requires_grad=True)
    f = lambda v: (v.sin() * v).sum()
    g = functx.grad(f)(x)
    assert g.requires_grad
    (hvp,) = torch.autograd.grad(g.sum(), x)
    torch.testing.assert_close(hvp, tf.hessian(f)(x.detach()).sum(0))


def test_outer_no_grad_holds_for_the_outside():
    critic = torch.nn.Linear(3, 1).double()
    x = torch.randn(5, 3, dtype=D)
    with torch.no_grad():
        g = functx.grad(lambda x: critic(x).sum())(x)
    assert not g.requires_grad
    torch.testing.assert_close(g, critic.weight.detach().expand(5, 3))


def test_vjp_fn_inside_a_later_grad():
    w = torch.randn(3, 3, dtype=D)
    x = torch.randn(3, dtype=D)
    out, vjp_fn = functx.vjp(lambda x: torch.tanh(w @ x), x)
    u0 = torch.randn(3, dtype=D)
    got = functx.grad(lambda u: (vjp_fn(u)[0] ** 2).sum())(u0)
    _, tf_vjp_fn = tf.vjp(lambda x: torch.tanh(w @ x), x)
    expected = tf.grad(lambda u: (tf_vjp_fn(u)[0] ** 2).sum())(u0)
    torch.testing.assert_close(got, expected)
    assert not got.requires_grad


def test_maml_on_plain_parameters_equals_autograd():
    torch.manual_seed(0)
    w = torch.randn(1, 8, dtype=D) * 0.5
    xs, ys = torch.randn(4, 6, 1, dtype=D), torch.randn(4, 6, 1, dtype=D)

    def task_loss(w, x, y):
        for _ in range(2):
            w = w - 0.1 * functx.grad(lambda w: ((torch.tanh(x @ w).sum(1, keepdim=True) - y) ** 2).mean())(w)
        return ((torch.tanh(x @ w).sum(1, keepdim=True) - y) ** 2).mean()

    meta = functx.grad(lambda w: functx.vmap(task_loss, in_dims=(None, 0, 0))(w, xs, ys).sum())(w)
    leaf = w.clone().requires_grad_()
    total = 0
    for x, y in zip(xs, ys):
        v = leaf
        for _ in range(2):
            (g,) = torch.autograd.grad(((torch.tanh(x @ v).sum(1, keepdim=True) - y) ** 2).mean(), v, create_graph=True)
            v = v - 0.1 * g
        total = total + ((torch.tanh(x @ v).sum(1, keepdim=True) - y) ** 2).mean()
    (expected,) = torch.autograd.grad(total, leaf)
    torch.testing.assert_close(meta, expected)
    assert not meta.requires_grad


def test_stack_restored_after_an_error_in_the_plain_level():
    def boom(w):
        raise ValueError("boom")

    with pytest.raises(ValueError):
        functx.grad(boom)(torch.randn(2))
    assert current_stack() == ()


def test_complex_inputs_keep_a_wrapped_level():
    """vjp of vjp of torch.polar w.r.t. a complex cotangent: a plain complex leaf would reach
    the inner level with a lazy conj bit that torch materializes below autograd."""
    a, u = torch.tensor(1.3, dtype=D), torch.tensor(0.7 + 0.2j, dtype=torch.complex128)
    h = lambda a: torch.polar(a, a * 0.3)
    ours = functx.vjp(lambda u: functx.vjp(h, a)[1](u)[0], u)[1](torch.tensor(1.0, dtype=D))
    theirs = tf.vjp(lambda u: tf.vjp(h, a)[1](u)[0], u)[1](torch.tensor(1.0, dtype=D))
    torch.testing.assert_close(ours, theirs)


def test_vmap_over_cotangents_of_layer_norm():
    """vmap(vjp_fn) with an unbatched input and batched cotangents (the layer-norm backward
    rule must not read expanded mean/rstd as dense rows)."""
    x, w, b = torch.randn(2, 2, 3, dtype=D), torch.randn(3, dtype=D), torch.randn(3, dtype=D)
    f = lambda x, w, b: torch.nn.functional.layer_norm(x, [3], w, b)
    cotangents = torch.randn(4, 2, 2, 3, dtype=D)
    _, vjp_fn = functx.vjp(f, x, w, b)
    _, tf_vjp_fn = tf.vjp(f, x, w, b)
    for ours, theirs in zip(functx.vmap(vjp_fn)(cotangents), tf.vmap(tf_vjp_fn)(cotangents)):
        torch.testing.assert_close(ours, theirs)
