"""Forward mode through torch.library operators (functx/ad/library_ops.py).

torch gives a `custom_op` with `register_autograd` reverse mode only; under forward AD its
output had no tangent, so functx.jvp / jacfwd / hessian through it were silently zero (as
torch.func's are). The references: float64 central finite differences (no AD at all) and the
closed forms of the numpy functions the operators wrap.
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functx
from tests.ad import finite_differences as fd


def _numpy_op(name, numpy_fn, derivative):
    """A custom op computing `numpy_fn` outside torch (no autograd of its own), with a
    reverse-mode formula only."""

    @torch.library.custom_op(f"functx_tests_library_ops::{name}", mutates_args=())
    def op(x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.asarray(numpy_fn(x.detach().cpu().numpy()))).to(x)

    op.register_fake(lambda x: torch.empty_like(x))
    op.register_autograd(
        lambda ctx, g: g * derivative(ctx.saved_tensors[0]),
        setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0]),
    )
    return op


numpy_sin = _numpy_op("sin", np.sin, torch.cos)
numpy_exp = _numpy_op("exp", np.exp, torch.exp)


@torch.library.custom_op("functx_tests_library_ops::scaled_product", mutates_args=())
def scaled_product(x: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.from_numpy(x.detach().numpy() * y.detach().numpy() * scale)


scaled_product.register_fake(lambda x, y, scale: torch.empty_like(x))


def _product_setup(ctx, inputs, output):
    x, y, ctx.scale = inputs
    ctx.save_for_backward(x, y)


def _product_backward(ctx, g):
    x, y = ctx.saved_tensors
    return g * y * ctx.scale, g * x * ctx.scale, None


scaled_product.register_autograd(_product_backward, setup_context=_product_setup)


@torch.library.custom_op("functx_tests_library_ops::no_autograd", mutates_args=())
def no_autograd(x: torch.Tensor) -> torch.Tensor:
    return x.detach() * 2


no_autograd.register_fake(lambda x: torch.empty_like(x))


@torch.library.custom_op("functx_tests_library_ops::cube_if_asked", mutates_args=())
def cube_if_asked(x: torch.Tensor, compute_grad: bool) -> torch.Tensor:
    return torch.from_numpy(x.detach().numpy() ** 3)


cube_if_asked.register_fake(lambda x, compute_grad: torch.empty_like(x))


def _cube_setup(ctx, inputs, output):
    x, ctx.compute_grad = inputs
    ctx.save_for_backward(x)


def _cube_backward(ctx, g):
    # the gradient only where the caller asked for it, as F.linear_cross_entropy's chunked op
    (x,) = ctx.saved_tensors
    return (g * 3 * x**2 if ctx.compute_grad else None), None


cube_if_asked.register_autograd(_cube_backward, setup_context=_cube_setup)


def cube(x):
    """The caller decides from `requires_grad`, which is False at a forward-mode level."""
    return cube_if_asked(x, x.requires_grad and torch.is_grad_enabled())


def f(v):
    return numpy_sin(v * 2) * numpy_exp(v)


def f_asking(v):
    return cube(numpy_sin(v * 2))


def f_asking_plain(v):
    return torch.sin(v * 2) ** 3


def f_plain(v):
    return torch.sin(v * 2) * torch.exp(v)


X = torch.tensor([0.3, -1.2, 0.7], dtype=torch.float64)
T = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
TRANSFORMS = {
    "jvp": lambda g, x: functx.jvp(g, (x,), (T,))[1],
    "jvp, primal tracked by the caller": lambda g, x: functx.jvp(g, (x.clone().requires_grad_(),), (T,))[1].detach(),
    "jacfwd": lambda g, x: functx.jacfwd(g)(x),
    "vmap(jvp), shared primal": lambda g, x: functx.vmap(lambda t: functx.jvp(g, (x,), (t,))[1])(torch.eye(3, dtype=x.dtype)),
    "vmap(jvp)": lambda g, x: functx.vmap(lambda p: functx.jvp(g, (p,), (T,))[1])(torch.stack([x, x * 0.5])),
    "linearize": lambda g, x: functx.linearize(g, x)[1](T),
    "hessian": lambda g, x: functx.hessian(lambda v: g(v).sum())(x),
    "jacfwd(jacrev)": lambda g, x: functx.jacfwd(functx.jacrev(lambda v: g(v).sum()))(x),
    "jvp(grad)": lambda g, x: functx.jvp(functx.grad(lambda v: g(v).sum()), (x,), (T,))[1],
    "grad(jvp)": lambda g, x: functx.grad(lambda v: functx.jvp(g, (v,), (T,))[1].sum())(x),
    "jvp(jvp)": lambda g, x: functx.jvp(lambda v: functx.jvp(g, (v,), (T,))[1], (x,), (T * 0.5,))[1],
}


@pytest.fixture(autouse=True)
def _quiet_double_vjp():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", functx.PerformanceWarning)
        yield


@pytest.mark.parametrize("name", TRANSFORMS)
@pytest.mark.parametrize("functions", [(f, f_plain), (f_asking, f_asking_plain)], ids=["reverse_only", "gradient_if_asked"])
def test_forward_transforms_through_a_custom_op_with_reverse_mode_only(name, functions):
    """`gradient_if_asked`: an op whose backward gives a gradient only where its caller saw
    `requires_grad`; at a jvp level on wrappers (a tracked primal, an outer level), the
    identity on the op alone had no gradient to differentiate and gave 0."""
    function, plain = functions
    got = TRANSFORMS[name](function, X)
    expected = TRANSFORMS[name](plain, X)  # the same math in torch ops, which torch differentiates
    torch.testing.assert_close(got, expected)
    assert got.abs().max() > 0.1  # was 0 before


def test_jet_refuses_an_op_that_gives_no_gradient_where_its_caller_saw_no_requires_grad():
    """functx.jet sees the op alone (its fallback cannot run the caller again under reverse
    mode, as jvp does): a clear error, never the zero the identity would give."""
    with pytest.raises(NotImplementedError, match="gives no gradient for differentiated argument 0"):
        functx.jet(f_asking, (X,), ((T, T),))
    # an argument whose tangent is zero needs no gradient
    primal, series = functx.jet(lambda v, w: cube(w) + v, (X, X), ((T,), (torch.zeros_like(T),)))
    torch.testing.assert_close(series[0], T)


def test_jvp_against_finite_differences_and_torch_funcs_refusal():
    got = functx.jvp(f, (X,), (T,))[1]
    torch.testing.assert_close(got, fd.directional(f, X, T), atol=fd.TOLERANCE[1], rtol=fd.TOLERANCE[1])
    # torch's forward AD through the op now says it has no forward formula instead of giving zeros
    with pytest.raises(NotImplementedError, match="Trying to use forward AD with .*functx_tests_library_ops.sin"):
        torch.func.jvp(f, (X,), (T,))


def test_several_inputs_and_a_non_tensor_argument():
    y = torch.tensor([2.0, 0.5, -1.0], dtype=torch.float64)
    ty = torch.tensor([0.3, 0.2, 0.1], dtype=torch.float64)
    _, tangent = functx.jvp(lambda a, b: scaled_product(a, b, 1.5), (X, y), (T, ty))
    torch.testing.assert_close(tangent, 1.5 * (T * y + X * ty))
    jac = functx.jacfwd(lambda a: scaled_product(a, y, 1.5))(X)
    torch.testing.assert_close(jac, torch.diag(1.5 * y))


def test_an_op_without_any_autograd_formula_is_an_error_not_zeros():
    with pytest.raises(RuntimeError, match="no autograd formula"):
        functx.jvp(no_autograd, (X,), (T,))


def test_reverse_mode_and_plain_calls_are_unchanged():
    torch.testing.assert_close(numpy_sin(X), torch.sin(X))
    leaf = X.clone().requires_grad_()
    (g,) = torch.autograd.grad(f(leaf).sum(), leaf)
    torch.testing.assert_close(g, functx.grad(lambda v: f_plain(v).sum())(X))
    torch.testing.assert_close(functx.vmap(functx.grad(lambda v: f(v).sum()))(X[:, None]), g[:, None])


def test_a_custom_op_defined_before_functx_is_imported():
    """Its autograd kernel was made before functx could wrap torch's maker: the first forward
    transform wraps it."""
    code = (
        "import torch, numpy as np\n"
        "@torch.library.custom_op('early::sin', mutates_args=())\n"
        "def s(x: torch.Tensor) -> torch.Tensor:\n"
        "    return torch.from_numpy(np.sin(x.numpy()))\n"
        "s.register_fake(lambda x: torch.empty_like(x))\n"
        "s.register_autograd(lambda ctx, g: g * ctx.x.cos(), setup_context=lambda ctx, inputs, output: setattr(ctx, 'x', inputs[0]))\n"
        "import warnings, functx\n"
        "warnings.simplefilter('ignore')\n"
        "x = torch.tensor([0.5, 1.0], dtype=torch.float64)\n"
        "t = functx.jvp(s, (x,), (torch.ones(2, dtype=torch.float64),))[1]\n"
        "assert torch.allclose(t, x.cos()), t\n"
        "# reverse mode and the plain call reach torch's kernel beneath the wrapper\n"
        "assert torch.allclose(functx.grad(lambda v: s(v).sum())(x), x.cos())\n"
        "leaf = x.clone().requires_grad_()\n"
        "assert torch.allclose(torch.autograd.grad(s(leaf).sum(), leaf)[0], x.cos())\n"
        "assert torch.allclose(functx.hessian(lambda v: s(v).sum())(x), torch.diag(-x.sin()))\n"
        "assert torch.allclose(functx.jacfwd(s)(x), torch.diag(x.cos()))\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "ok", result.stderr[-2000:]


OPS = {"sin": (numpy_sin, torch.sin), "exp": (numpy_exp, torch.exp), "cube if asked": (cube, lambda v: v**3)}


@settings(max_examples=25, deadline=None)
@given(
    chain=st.lists(st.sampled_from(sorted(OPS)), min_size=1, max_size=3),
    transform=st.sampled_from(sorted(TRANSFORMS)),
    scale=st.floats(0.1, 1.0),
)
def test_property_chains_of_custom_ops_under_forward_transforms(chain, transform, scale):
    """Chains of the numpy ops, interleaved with torch ops, under every transform: equal to the
    same chain of torch's own functions."""

    def build(which):
        def g(v):
            for name in chain:
                v = OPS[name][which](v * scale) + 0.1 * v
            return v

        return g

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", functx.PerformanceWarning)
        torch.testing.assert_close(TRANSFORMS[transform](build(0), X), TRANSFORMS[transform](build(1), X))
