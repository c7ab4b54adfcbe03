"""grad / grad_and_value / vjp / jacrev against torch.autograd and torch.func (oracle)."""

import pytest
import torch
import torch.func as tf

import functx
from functx import grad, grad_and_value, jacrev, vjp, vmap

D = torch.float64


def test_grad_matches_autograd():
    x = torch.randn(5, dtype=D)
    f = lambda v: (v.sin() * v.exp()).sum()
    xr = x.clone().requires_grad_()
    (expected,) = torch.autograd.grad(f(xr), xr)
    torch.testing.assert_close(grad(f)(x), expected)


def test_third_derivative_of_sin():
    x = torch.tensor(0.3, dtype=D)
    torch.testing.assert_close(grad(grad(grad(torch.sin)))(x), -torch.cos(x))


def test_perturbation_confusion():
    """d/dx [x · d/dy (x + y)] = 1: the inner derivative must not see the outer x."""
    one = torch.tensor(1.0, dtype=D)
    f = lambda x: x * grad(lambda y: x + y)(one)
    torch.testing.assert_close(grad(f)(torch.tensor(2.0, dtype=D)), one)


def test_nested_grad_closing_over_outer_variable():
    f = lambda x: grad(lambda y: (x * y) ** 2)(torch.tensor(3.0, dtype=D))  # (2 x^2 y = 6 x^2)
    torch.testing.assert_close(grad(f)(torch.tensor(2.0, dtype=D)), torch.tensor(24.0, dtype=D))  # 12 x


def test_argnums_tuple_and_pytree_arguments():
    w, b, x = torch.randn(3, 4, dtype=D), torch.randn(3, dtype=D), torch.randn(4, dtype=D)

    def loss(params, x):
        return torch.tanh(params["w"] @ x + params["b"]).sum()

    g_params, g_x = grad(loss, argnums=(0, 1))({"w": w, "b": b}, x)
    e_params, e_x = tf.grad(loss, argnums=(0, 1))({"w": w, "b": b}, x)
    torch.testing.assert_close(g_params["w"], e_params["w"])
    torch.testing.assert_close(g_params["b"], e_params["b"])
    torch.testing.assert_close(g_x, e_x)


def test_has_aux_and_grad_and_value():
    x = torch.randn(3, dtype=D)
    g, aux = grad(lambda v: ((v**2).sum(), v.mean()), has_aux=True)(x)
    torch.testing.assert_close(g, 2 * x)
    torch.testing.assert_close(aux, x.mean())
    g, (value, aux) = grad_and_value(lambda v: ((v**2).sum(), {"m": v.max()}), has_aux=True)(x)
    torch.testing.assert_close(value, (x**2).sum())
    torch.testing.assert_close(aux["m"], x.max())


def test_unused_input_gets_zero_gradient():
    x, y = torch.randn(3, dtype=D), torch.randn(2, dtype=D)
    gx, gy = grad(lambda a, b: a.sum(), argnums=(0, 1))(x, y)
    torch.testing.assert_close(gy, torch.zeros_like(y))


def test_output_independent_of_input_gives_zero_gradient():
    x = torch.randn(3, dtype=D)
    torch.testing.assert_close(grad(lambda a: torch.tensor(1.0, dtype=D))(x), torch.zeros_like(x))


def test_inner_no_grad_is_obeyed_outer_is_not():
    x = torch.randn(3, dtype=D)

    def f(a):
        with torch.no_grad():
            c = a * 2  # constant at this level
        return (c * a).sum()

    torch.testing.assert_close(grad(f)(x), 2 * x)
    with torch.no_grad():
        torch.testing.assert_close(grad(lambda a: (a**2).sum())(x), 2 * x)


def test_detach_stops_every_level():
    x = torch.tensor(1.5, dtype=D)
    # inner: d/dy [y.detach() * y] = y.detach(); a constant for the outer level too, as
    # torch.func's and JAX's stop_gradient: d/dx = 0
    f = lambda x: grad(lambda y: y.detach() * y)(x)
    torch.testing.assert_close(f(x), x)
    torch.testing.assert_close(grad(f)(x), torch.tensor(0.0, dtype=D))
    torch.testing.assert_close(grad(f)(x), tf.grad(lambda x: tf.grad(lambda y: y.detach() * y)(x))(x))


def test_integer_output_is_non_differentiable():
    x = torch.randn(4, dtype=D)
    out, vjp_fn = vjp(lambda a: (a.sin(), a.argmax()), x)
    (g,) = vjp_fn((torch.ones(4, dtype=D), torch.zeros((), dtype=torch.long)))
    torch.testing.assert_close(g, x.cos())


def test_inplace_ops_under_grad():
    x = torch.randn(5, dtype=D)

    def f(a):
        b = a * 1.0
        b.mul_(2)
        b.relu_()
        c = b.clone()
        c[1:3] = a[1:3] ** 2
        return (c * torch.nn.ReLU(inplace=True)(c.clone())).sum()

    torch.testing.assert_close(grad(f)(x), tf.grad(f)(x))


def test_vjp_pytree_and_cotangent_structure():
    x, y = torch.randn(3, dtype=D), torch.randn(3, dtype=D)
    out, vjp_fn = vjp(lambda a, b: {"s": a * b, "t": a.sin()}, x, y)
    gx, gy = vjp_fn({"s": torch.ones(3, dtype=D), "t": torch.ones(3, dtype=D)})
    torch.testing.assert_close(gx, y + x.cos())
    torch.testing.assert_close(gy, x)
    with pytest.raises(RuntimeError, match="pytree structure of cotangents"):
        vjp_fn(torch.ones(3, dtype=D))


def test_vjp_fn_called_after_vjp_returned_composes_with_outer_grad():
    x = torch.randn(3, dtype=D)
    g = lambda y: vjp(lambda v: v.sin().sum(), y)[1](torch.tensor(1.0, dtype=D))[0].sum()
    torch.testing.assert_close(grad(g)(x), -x.sin())


@pytest.mark.parametrize("chunk_size", [None, 1, 3])
def test_jacrev_matches_torch_func(chunk_size):
    w = torch.randn(4, 5, dtype=D)
    f = lambda x, y: {"a": torch.tanh(w @ x) * y.sum(), "b": x.sum()}
    x, y = torch.randn(5, dtype=D), torch.randn(2, dtype=D)
    got = jacrev(f, argnums=(0, 1), chunk_size=chunk_size)(x, y)
    want = tf.jacrev(f, argnums=(0, 1))(x, y)
    for key in ("a", "b"):
        for i in range(2):
            torch.testing.assert_close(got[key][i], want[key][i])


def test_torch_autograd_grad_inside_vmap():
    """Beyond torch.func: user code calling torch.autograd.grad inside a functx vmap."""
    x = torch.randn(4, 3, dtype=D)

    def per_sample(a):
        a = a.clone().requires_grad_()
        (g,) = torch.autograd.grad((a.sin() * a).sum(), a)
        return g

    torch.testing.assert_close(vmap(per_sample)(x), x.cos() * x + x.sin())


def test_backward_inside_vmap():
    x = torch.randn(4, 3, dtype=D)

    def per_sample(a):
        a = a.detach().requires_grad_()
        (a**3).sum().backward()
        return a.grad

    torch.testing.assert_close(vmap(per_sample)(x), 3 * x**2)


# -- errors ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argnums, match",
    [(2, "Got argnum=2, but only 2 positional inputs"), ((0, 0), "must be unique"), ((), "must be non-empty"),
     ([0], "argnums must be int or Tuple"), ((0, 1.0), "argnum must be int")],
)
def test_bad_argnums(argnums, match):
    with pytest.raises(RuntimeError, match=match):
        grad(lambda a, b: (a * b).sum(), argnums=argnums)(torch.randn(2), torch.randn(2))


def test_grad_of_non_scalar_or_non_tensor_output():
    with pytest.raises(RuntimeError, match="Expected f\\(\\*args\\) to return a scalar Tensor"):
        grad(lambda a: a * 2)(torch.randn(3))
    with pytest.raises(RuntimeError, match="to return a Tensor, got <class 'float'>"):
        grad(lambda a: 1.0)(torch.randn(3))


def test_has_aux_requires_a_pair():
    with pytest.raises(RuntimeError, match="should be a tuple: \\(output, aux\\)"):
        grad(lambda a: a.sum(), has_aux=True)(torch.randn(3))
    with pytest.raises(RuntimeError, match="should be a tuple: \\(output, aux\\)"):
        vjp(lambda a: a, torch.randn(3), has_aux=True)


def test_non_tensor_primal():
    with pytest.raises(ValueError, match="must be Tensor, got <class 'float'>"):
        grad(lambda a: a)(1.0)
    with pytest.raises(RuntimeError, match="only floating-point or complex"):
        grad(lambda a: a.sum())(torch.arange(3))


def test_stack_restored_after_error_inside_grad():
    with pytest.raises(ZeroDivisionError):
        grad(lambda a: 1 / 0)(torch.randn(2))
    assert functx.core.current_stack() == ()


def test_a_none_leaf_of_a_differentiated_argument_passes_through_every_jacobian():
    """A None in a differentiated pytree has no derivative: grad, jacfwd, hessian and jacrev
    return None in its place (jacrev raised a vmap error about its rows, with chunks too);
    the tensor leaves' blocks are the closed forms."""
    d = {"a": torch.tensor([0.3, -1.2], dtype=torch.float64), "b": None}
    expected = torch.diag(d["a"].cos())
    for jacobian in (functx.jacrev(lambda d: d["a"].sin()), functx.jacrev(lambda d: d["a"].sin(), chunk_size=1),
                     functx.jacfwd(lambda d: d["a"].sin())):
        got = jacobian(d)
        assert got["b"] is None
        torch.testing.assert_close(got["a"], expected)
    assert functx.grad(lambda d: d["a"].sin().sum())(d)["b"] is None
    torch.testing.assert_close(functx.hessian(lambda d: d["a"].sin().sum())(d)["a"]["a"], torch.diag(-d["a"].sin()))
