"""jvp / linearize / jacfwd / hessian against torch.func, torch.autograd and finite differences."""

import pytest
import torch
import torch.func as tf

from functx import grad, hessian, jacfwd, jacrev, jvp, linearize, vmap

D = torch.float64


def finite_difference_jvp(f, x, t, eps=1e-6):
    return (f(x + eps * t) - f(x - eps * t)) / (2 * eps)


def test_jvp_matches_finite_differences():
    w = torch.randn(3, 4, dtype=D)
    f = lambda x: torch.tanh(w @ x).exp()  # noqa: E731
    x, t = torch.randn(4, dtype=D), torch.randn(4, dtype=D)
    out, tangent = jvp(f, (x,), (t,))
    torch.testing.assert_close(out, f(x))
    torch.testing.assert_close(tangent, finite_difference_jvp(f, x, t), rtol=1e-6, atol=1e-6)


def test_jvp_pytree_primals_and_has_aux():
    x, y = torch.randn(3, dtype=D), torch.randn(3, dtype=D)
    f = lambda p: ((p["a"] * p["b"]).sum(), p["a"].max())  # noqa: E731
    tx, ty = torch.randn(3, dtype=D), torch.randn(3, dtype=D)
    out, tangent, aux = jvp(f, ({"a": x, "b": y},), ({"a": tx, "b": ty},), has_aux=True)
    torch.testing.assert_close(tangent, (tx * y + x * ty).sum())
    torch.testing.assert_close(aux, x.max())


def test_nested_jvp():
    x, t = torch.randn(4, dtype=D), torch.randn(4, dtype=D)
    inner = lambda y: jvp(torch.sin, (y,), (t,))[1]  # noqa: E731
    torch.testing.assert_close(jvp(inner, (x,), (t,))[1], -torch.sin(x) * t * t)


def test_hvp_three_ways():
    x, v = torch.randn(5, dtype=D), torch.randn(5, dtype=D)
    f = lambda a: (a.sin() ** 2).sum() * a.prod()  # noqa: E731
    expected = tf.hessian(f)(x) @ v
    torch.testing.assert_close(jvp(grad(f), (x,), (v,))[1], expected)  # forward-over-reverse
    torch.testing.assert_close(grad(lambda a: (grad(f)(a) * v).sum())(x), expected)  # reverse-over-reverse
    torch.testing.assert_close(linearize(grad(f), x)[1](v), expected)


def test_jvp_strict_and_independent_output():
    x = torch.randn(3, dtype=D)
    out, tangent = jvp(lambda a: torch.ones(2, dtype=D), (x,), (x,))
    torch.testing.assert_close(tangent, torch.zeros(2, dtype=D))
    with pytest.raises(RuntimeError, match="independent of the inputs"):
        jvp(lambda a: torch.ones(2, dtype=D), (x,), (x,), strict=True)


@pytest.mark.parametrize("chunk_size", [None, 1, 4])
def test_jacfwd_matches_torch_func(chunk_size):
    w = torch.randn(4, 5, dtype=D)
    f = lambda x, y: (torch.tanh(w @ x) * y.sum(), x.sum())  # noqa: E731
    x, y = torch.randn(5, dtype=D), torch.randn(2, 3, dtype=D)
    got = jacfwd(f, argnums=(0, 1), chunk_size=chunk_size)(x, y)
    want = tf.jacfwd(f, argnums=(0, 1))(x, y)
    for i in range(2):
        for j in range(2):
            torch.testing.assert_close(got[i][j], want[i][j])


def test_jacfwd_equals_jacrev_on_matrix_input():
    f = lambda m: (m @ m.T).sin()  # noqa: E731
    m = torch.randn(3, 2, dtype=D)
    torch.testing.assert_close(jacfwd(f)(m), jacrev(f)(m))


def test_hessian_equals_autograd_functional_hessian():
    f = lambda a: (a.sin() * a.cos().sum()).sum() + (a**4).sum()  # noqa: E731
    x = torch.randn(6, dtype=D)
    torch.testing.assert_close(hessian(f)(x), torch.autograd.functional.hessian(f, x))
    torch.testing.assert_close(hessian(f, chunk_size=2)(x), torch.autograd.functional.hessian(f, x))


def test_batched_jacobians_with_vmap():
    f = lambda a: a.sin() * a.sum()  # noqa: E731
    xs = torch.randn(4, 3, dtype=D)
    torch.testing.assert_close(vmap(jacfwd(f))(xs), tf.vmap(tf.jacfwd(f))(xs))
    torch.testing.assert_close(vmap(jacrev(f))(xs), tf.vmap(tf.jacrev(f))(xs))


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda x: jvp(torch.sin, [x], [x]), "Expected primals to be a tuple"),
        (lambda x: jvp(torch.sin, (x,), (x, x)), "same python structure"),
        (lambda x: jvp(torch.sin, (x,), (torch.ones(4, dtype=D),)), "same shape"),
        (lambda x: jvp(torch.sin, (1.0,), (1.0,)), "only contain Tensors"),
        (lambda x: jvp(lambda a: a, (x,), (x,), has_aux=True), "should be a tuple"),
    ],
)
def test_jvp_errors(call, match):
    with pytest.raises(RuntimeError, match=match):
        call(torch.randn(3, dtype=D))


@pytest.mark.parametrize("chunk_size", [None, 1])
def test_jacfwd_by_columns_when_outputs_outnumber_inputs(chunk_size):
    """Many more outputs than inputs: jacfwd builds the Jacobian column by column."""
    w = torch.randn(12, 2, dtype=D)
    f = lambda x: {"a": torch.sin(w @ x), "b": (w @ x).view(3, 4).exp()}  # noqa: E731
    x = torch.randn(2, dtype=D)
    got, want = jacfwd(f, chunk_size=chunk_size)(x), tf.jacfwd(f)(x)
    torch.testing.assert_close(got["a"], want["a"])
    torch.testing.assert_close(got["b"], want["b"])
