"""functionalize composed with vmap, grad, vjp, jvp, jacrev, jacfwd, hessian (both ways), against
plain torch references: loops over the batch, torch.autograd.grad, torch.autograd's jvp."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import functx
from functx import functionalize, grad, jacfwd, jacrev, jvp, vjp, vmap

from .opdb_support import mutations_in


def mutating(x):
    """A scalar function of a (3, 3) tensor that writes into intermediates through views."""
    y = x.clone()
    y.view(-1).mul_(2)
    y[0].sin_()
    y.t()[1:].add_(x[0])
    buf = torch.zeros_like(x[0])  # batched under vmap (a zeros(3) buffer could not take batched values)
    buf[1:] = y[2, :2]
    return (y * y).sum() + buf.exp().sum()


def mutating_vector(x):
    y = x.clone()
    y[1:].mul_(x[:-1])
    y.unsqueeze(0).cos_()
    return y


def writes_input(x):
    x[0].add_(1)
    x.mul_(2)
    return x.sum()


def grad_ref(f, x):
    x = x.detach().clone().requires_grad_()
    (g,) = torch.autograd.grad(f(x), x)
    return g


def jvp_ref(f, x, t):
    return torch.autograd.functional.jvp(f, (x,), (t,))[1]


def loop(f, xs):
    return torch.stack([f(x) for x in xs])


X = torch.randn(3, 3)
XS = torch.randn(4, 3, 3)
T = torch.randn(3, 3)


@pytest.mark.parametrize("remove", ["mutations", "mutations_and_views"])
def test_grad_of_functionalize(remove):
    torch.testing.assert_close(grad(functionalize(mutating, remove=remove))(X), grad_ref(mutating, X))


@pytest.mark.parametrize("remove", ["mutations", "mutations_and_views"])
def test_functionalize_of_grad(remove):
    torch.testing.assert_close(functionalize(grad(mutating), remove=remove)(X), grad_ref(mutating, X))


def test_vmap_of_functionalize():
    torch.testing.assert_close(vmap(functionalize(mutating))(XS), loop(mutating, XS))
    torch.testing.assert_close(vmap(functionalize(mutating_vector))(XS[:, 0]), loop(mutating_vector, XS[:, 0]))
    torch.testing.assert_close(vmap(functionalize(mutating_vector), in_dims=1)(XS[:, 0]), loop(mutating_vector, XS[:, 0].t()))


def test_functionalize_of_vmap():
    torch.testing.assert_close(functionalize(vmap(mutating))(XS), loop(mutating, XS))
    torch.testing.assert_close(functionalize(vmap(vmap(mutating_vector)))(XS), torch.stack([loop(mutating_vector, x) for x in XS]))


def test_per_sample_gradients_both_ways():
    expected = torch.stack([grad_ref(mutating, x) for x in XS])
    torch.testing.assert_close(vmap(grad(functionalize(mutating)))(XS), expected)
    torch.testing.assert_close(vmap(functionalize(grad(mutating)))(XS), expected)
    torch.testing.assert_close(functionalize(vmap(grad(mutating)))(XS), expected)
    torch.testing.assert_close(grad(lambda xs: vmap(functionalize(mutating))(xs).sum())(XS), expected)


def test_jvp_both_ways():
    expected = jvp_ref(mutating_vector, X[0], T[0])
    torch.testing.assert_close(jvp(functionalize(mutating_vector), (X[0],), (T[0],))[1], expected)
    torch.testing.assert_close(functionalize(lambda x, t: jvp(mutating_vector, (x,), (t,))[1])(X[0], T[0]), expected)
    # under vmap (a direct jvp level on vmap's tensors), and of vmap
    expected_batched = torch.stack([jvp_ref(mutating_vector, x, t) for x, t in zip(XS[:, 0], XS[:, 1])])
    torch.testing.assert_close(vmap(lambda x, t: jvp(functionalize(mutating_vector), (x,), (t,))[1])(XS[:, 0], XS[:, 1]), expected_batched)
    torch.testing.assert_close(jvp(functionalize(vmap(mutating_vector)), (XS[:, 0],), (XS[:, 1],))[1], expected_batched)


def test_vjp_both_ways():
    cot = torch.randn(3)
    x = X[0].clone().requires_grad_()
    (expected,) = torch.autograd.grad(mutating_vector(x), x, cot)
    out, vjp_fn = vjp(functionalize(mutating_vector), X[0])
    torch.testing.assert_close(vjp_fn(cot)[0], expected)
    torch.testing.assert_close(functionalize(lambda x, c: vjp(mutating_vector, x)[1](c)[0])(X[0], cot), expected)


def test_jacobians_and_hessian():
    expected = torch.autograd.functional.jacobian(mutating_vector, X[0])
    torch.testing.assert_close(jacrev(functionalize(mutating_vector))(X[0]), expected)
    torch.testing.assert_close(jacfwd(functionalize(mutating_vector))(X[0]), expected)
    torch.testing.assert_close(functionalize(jacrev(mutating_vector))(X[0]), expected)
    torch.testing.assert_close(functionalize(jacfwd(mutating_vector))(X[0]), expected)
    hess = torch.autograd.functional.hessian(mutating, X)
    torch.testing.assert_close(functx.hessian(functionalize(mutating))(X), hess)
    torch.testing.assert_close(functionalize(functx.hessian(mutating))(X), hess)


def test_second_order_through_functionalize():
    f = lambda s: functionalize(mutating)(s.sin() * torch.ones(3, 3)).cos()
    s = torch.tensor(0.3, requires_grad=True)
    (g,) = torch.autograd.grad(f(s), s, create_graph=True)
    (gg,) = torch.autograd.grad(g, s)
    torch.testing.assert_close(grad(grad(f))(torch.tensor(0.3)), gg)
    torch.testing.assert_close(functionalize(grad(grad(f)))(torch.tensor(0.3)), gg)


def test_perturbation_confusion():
    """d/dx [x * d/dy (x + y)] = 1, with functionalize between the levels."""

    def f(x):
        def g(y):
            z = x.clone()
            z.add_(y)  # x + y, written in place
            return z

        return x * functionalize(grad(g))(torch.tensor(1.0))

    assert grad(functionalize(f))(torch.tensor(2.0)).item() == 1.0
    assert functionalize(grad(f))(torch.tensor(2.0)).item() == 1.0


def test_input_written_inside_vmap():
    """vmap(functionalize(f)) with f writing into its input: written back into each sample,
    as plain vmap(f) writes."""
    xs_plain, xs_ours = XS.clone(), XS.clone()
    expected = vmap(writes_input)(xs_plain)
    got = vmap(functionalize(writes_input))(xs_ours)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(xs_ours, xs_plain)
    ys = XS.clone()
    functionalize(vmap(writes_input))(ys)
    torch.testing.assert_close(ys, xs_plain)


def test_grad_of_function_writing_its_input():
    """Inside grad, the input a function writes is grad's own tensor: the copy back happens at
    that level, and the gradient is that of the written value."""
    f = lambda x: writes_input(x.clone())
    torch.testing.assert_close(grad(functionalize(f))(X), grad_ref(f, X))

    def g(x):
        y = x * 1
        functionalize(writes_input)(y)  # writes y, a tensor of grad's level
        return (y * y).sum()

    torch.testing.assert_close(grad(g)(X), grad_ref(g, X))


# -- traced graphs --------------------------------------------------------------------------------
@pytest.mark.parametrize("remove", ["mutations", "mutations_and_views"])
@pytest.mark.parametrize(
    "transform",
    [
        lambda f: grad(f),
        lambda f: vmap(f),
        lambda f: vmap(grad(f)),
        lambda f: jacrev(f),
        lambda f: jacfwd(f),
        lambda f: (lambda x: jvp(f, (x,), (torch.ones_like(x),))[1]),
    ],
    ids=["grad", "vmap", "vmap_grad", "jacrev", "jacfwd", "jvp"],
)
def test_functionalize_of_transform_traces_without_mutations(transform, remove):
    """No mutation; with remove="mutations_and_views" no view of anything an input reaches
    (jacrev and jacfwd build their basis of plain constants in functx's own code, where the
    level does not see it: views of it stay; torch.func's basis is functional, C++ factories
    being lifted by its thread-local dispatch key)."""
    f = transform(mutating)
    x = XS if "vmap" in repr(transform.__code__.co_names) else X
    graph = make_fx(functionalize(f, remove=remove))(x.clone()).graph
    assert mutations_in(graph, remove, constant_views_ok=True) == []
    torch.testing.assert_close(make_fx(functionalize(f, remove=remove))(x.clone())(x.clone()), f(x.clone()))


def test_traced_graph_replays():
    """The graph of functionalize(grad(f)) computes the gradient for new inputs, and writes
    the input as f does."""
    g = make_fx(functionalize(grad(mutating)))(X.clone())
    x2 = torch.randn(3, 3)
    torch.testing.assert_close(g(x2), grad_ref(mutating, x2))
    h = make_fx(functionalize(writes_input))(X.clone())
    a, b = x2.clone(), x2.clone()
    torch.testing.assert_close(h(a), writes_input(b))
    torch.testing.assert_close(a, b)
