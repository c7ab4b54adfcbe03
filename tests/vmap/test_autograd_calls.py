"""torch.autograd.grad / .backward() called by user code inside functx.vmap on tensors that
autograd tracks from outside the vmap (functx/vmap/autograd_calls.py; beyond torch.func,
which refuses). References: per-sample loops with plain torch.autograd."""

import pytest
import torch

import functx

D = torch.float64


def test_autograd_grad_of_an_input_that_requires_grad_from_outside():
    X = torch.randn(4, 3, dtype=D, requires_grad=True)

    def f(x):
        return torch.autograd.grad((x**3).sum(), x)[0]

    got = functx.vmap(f)(X)
    want = torch.stack([torch.autograd.grad((X[i] ** 3).sum(), X, retain_graph=True)[0][i] for i in range(4)])
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got, 3 * X.detach() ** 2)


def test_create_graph_keeps_the_outside_graph():
    X = torch.randn(4, 3, dtype=D, requires_grad=True)

    def f(x):
        (g,) = torch.autograd.grad((x.sin() * x).sum(), x, create_graph=True)
        return g.pow(2).sum()

    out = functx.vmap(f)(X).sum()
    (got,) = torch.autograd.grad(out, X)
    leaf = X.detach().clone().requires_grad_()
    ref = sum(torch.autograd.grad((leaf[i].sin() * leaf[i]).sum(), leaf, create_graph=True)[0][i].pow(2).sum() for i in range(4))
    (want,) = torch.autograd.grad(ref, leaf)
    torch.testing.assert_close(got, want)


def test_grad_outputs_batched_and_unbatched_and_two_vmaps():
    X = torch.randn(2, 3, 4, dtype=D, requires_grad=True)
    v = torch.randn(4, dtype=D)

    def f(x, c):
        y = x.exp() * 2
        return torch.autograd.grad(y, x, grad_outputs=c)[0]

    got = functx.vmap(functx.vmap(f, in_dims=(0, None)), in_dims=(0, None))(X, v)
    torch.testing.assert_close(got, 2 * X.detach().exp() * v)
    C = torch.randn(2, 3, 4, dtype=D)
    got = functx.vmap(functx.vmap(f))(X, C)
    torch.testing.assert_close(got, 2 * X.detach().exp() * C)


def test_an_unbatched_input_that_requires_grad_gets_per_element_gradients():
    # the op meets W at vmap's wrapper level, where torch's autograd records it: no routing
    W = torch.randn(3, dtype=D, requires_grad=True)
    X = torch.randn(4, 3, dtype=D)
    got = functx.vmap(lambda x: torch.autograd.grad((x * W).sin().sum(), W)[0])(X)
    torch.testing.assert_close(got, X * (X * W.detach()).cos())


def test_an_input_not_batched_like_its_output_raises():
    X = torch.randn(4, 3, dtype=D, requires_grad=True)
    Y = torch.randn(5, 3, dtype=D, requires_grad=True)

    def f(x):  # the output is batched at both levels, x only at the outer one
        return functx.vmap(lambda y: torch.autograd.grad((x * y).sum(), x)[0])(Y)

    with pytest.raises(NotImplementedError, match="not batched at every vmap level"):
        functx.vmap(f)(X)


def test_backward_accumulates_the_batch_into_the_outside_grad():
    X = torch.randn(4, 3, dtype=D, requires_grad=True)
    w = torch.randn(3, dtype=D)

    def f(x):
        (x * w).pow(2).sum().backward()
        return x.detach() * 0

    functx.vmap(f)(X)
    Xr = X.detach().clone().requires_grad_()
    for i in range(4):
        (Xr[i] * w).pow(2).sum().backward()
    torch.testing.assert_close(X.grad, Xr.grad)
