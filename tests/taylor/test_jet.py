"""functx.jet: every rule against derivatives along the path by nested torch.autograd and
by central finite differences (float64, orders 1-4), the fallback, errors, in-place writes.

torch's own nested derivatives are wrong for the norms at order >= 2 along a path (its
double backward of layer/group norm takes the statistics as constants; issue 30): their
autograd reference runs the norm's formula written in ops, and finite differences check
both.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import functx
from functx.core import current_stack

from .reference import path_derivatives, path_finite_differences

D = torch.float64


def rnd(*shape):
    return torch.randn(*shape, dtype=D)


def pos(*shape):
    return torch.rand(*shape, dtype=D) + 0.5


def unit(*shape):
    return torch.rand(*shape, dtype=D) * 1.6 - 0.8


def _layer_norm_formula(x, shape):
    dims = list(range(x.dim() - len(shape), x.dim()))
    mean = x.mean(dims, keepdim=True)
    centered = x - mean
    return centered / torch.sqrt((centered * centered).mean(dims, keepdim=True) + 1e-5)


def _group_norm_formula(x, groups):
    n, c = x.shape[:2]
    g = x.reshape(n, groups, -1)
    return _layer_norm_formula(g, g.shape[-1:]).reshape(x.shape)


# name: (function, inputs, reference function or None (the same))
CASES = {
    "exp": (torch.exp, lambda: [rnd(3)]),
    "log": (torch.log, lambda: [pos(3)]),
    "sin": (torch.sin, lambda: [rnd(3)]),
    "cos": (torch.cos, lambda: [rnd(3)]),
    "tan": (torch.tan, lambda: [unit(3)]),
    "tanh": (torch.tanh, lambda: [rnd(3)]),
    "sigmoid": (torch.sigmoid, lambda: [rnd(3)]),
    "sqrt": (torch.sqrt, lambda: [pos(3)]),
    "rsqrt": (torch.rsqrt, lambda: [pos(3)]),
    "reciprocal": (torch.reciprocal, lambda: [pos(3)]),
    "erf": (torch.erf, lambda: [rnd(3)]),
    "erfc": (torch.erfc, lambda: [rnd(3)]),
    "atan": (torch.atan, lambda: [rnd(3)]),
    "asin": (torch.asin, lambda: [unit(3)]),
    "acos": (torch.acos, lambda: [unit(3)]),
    "asinh": (torch.asinh, lambda: [rnd(3)]),
    "acosh": (torch.acosh, lambda: [pos(3) + 1]),
    "atanh": (torch.atanh, lambda: [unit(3)]),
    "sinh": (torch.sinh, lambda: [rnd(3)]),
    "cosh": (torch.cosh, lambda: [rnd(3)]),
    "expm1": (torch.expm1, lambda: [rnd(3)]),
    "log1p": (torch.log1p, lambda: [pos(3)]),
    "log2": (torch.log2, lambda: [pos(3)]),
    "log10": (torch.log10, lambda: [pos(3)]),
    "exp2": (torch.exp2, lambda: [rnd(3)]),
    "square": (torch.square, lambda: [rnd(3)]),
    "pow_2": (lambda x: x**2, lambda: [rnd(3)]),
    "pow_3": (lambda x: x**3, lambda: [rnd(3)]),
    "pow_half": (lambda x: x**0.5, lambda: [pos(3)]),
    "pow_minus_1.5": (lambda x: x**-1.5, lambda: [pos(3)]),
    "pow_tensors": (lambda x, y: x**y, lambda: [pos(3), rnd(3)]),
    "pow_scalar_base": (lambda y: 2.0**y, lambda: [rnd(3)]),
    "relu": (torch.relu, lambda: [rnd(6)]),
    "abs": (torch.abs, lambda: [rnd(6)]),
    "clamp": (lambda x: x.clamp(-0.5, 0.5), lambda: [rnd(6)]),
    "hardtanh": (F.hardtanh, lambda: [rnd(6) * 2]),
    "softplus": (F.softplus, lambda: [rnd(3)]),
    "gelu": (F.gelu, lambda: [rnd(3)]),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), lambda: [rnd(3)]),
    "silu": (F.silu, lambda: [rnd(3)]),
    "mish": (F.mish, lambda: [rnd(3)]),
    "elu": (F.elu, lambda: [rnd(6)]),
    "selu": (F.selu, lambda: [rnd(6)]),
    "leaky_relu": (F.leaky_relu, lambda: [rnd(6)]),
    "logsigmoid": (F.logsigmoid, lambda: [rnd(3)]),
    "logit": (torch.logit, lambda: [torch.rand(3, dtype=D) * 0.8 + 0.1]),
    "sinc": (torch.sinc, lambda: [rnd(3)]),
    "xlogy": (lambda x: torch.xlogy(x, x), lambda: [pos(3)]),
    "softmax": (lambda x: F.softmax(x, -1), lambda: [rnd(2, 4)]),
    "softmin": (lambda x: F.softmin(x, -1), lambda: [rnd(2, 4)]),
    "log_softmax": (lambda x: F.log_softmax(x, -1), lambda: [rnd(2, 4)]),
    "logsumexp": (lambda x: x.logsumexp(-1), lambda: [rnd(2, 4)]),
    "layer_norm": (lambda x: F.layer_norm(x, (4,)), lambda: [rnd(2, 4)], lambda x: _layer_norm_formula(x, (4,))),
    "group_norm": (lambda x: F.group_norm(x, 2), lambda: [rnd(2, 4, 3)], lambda x: _group_norm_formula(x, 2)),
    "rms_norm": (lambda x: F.rms_norm(x, (3,)), lambda: [rnd(2, 3)]),
    "normalize": (lambda x: F.normalize(x, dim=-1), lambda: [rnd(3, 4)]),
    "cosine_similarity": (lambda x, y: F.cosine_similarity(x, y, dim=-1), lambda: [rnd(2, 3), rnd(2, 3)]),
    "var": (lambda x: x.var(-1), lambda: [rnd(3, 4)]),
    "std": (lambda x: x.std(-1), lambda: [rnd(3, 4)]),
    "var_mean": (lambda x: torch.stack(torch.var_mean(x, -1, correction=0)), lambda: [rnd(3, 4)]),
    "vector_norm": (lambda x: x.norm(dim=-1), lambda: [rnd(3, 4)]),
    "mul": (torch.mul, lambda: [rnd(3), rnd(3)]),
    "mul_broadcast": (torch.mul, lambda: [rnd(2, 3), rnd(3)]),
    "div": (torch.div, lambda: [rnd(3), pos(3)]),
    "div_by_constant": (lambda x: x / torch.arange(1.0, 4.0, dtype=D), lambda: [rnd(3)]),
    "addcmul": (lambda a, b, c: torch.addcmul(a, b, c, value=0.5), lambda: [rnd(3), rnd(3), rnd(3)]),
    "lerp": (lambda a, b: torch.lerp(a, b, 0.3), lambda: [rnd(3), rnd(3)]),
    "maximum": (torch.maximum, lambda: [rnd(4), rnd(4)]),
    "minimum": (torch.minimum, lambda: [rnd(4), rnd(4)]),
    "add_scalar": (lambda x: x + 2, lambda: [rnd(3)]),
    "rsub_scalar": (lambda x: 2 - 3 * x, lambda: [rnd(3)]),
    "matmul": (torch.matmul, lambda: [rnd(2, 3), rnd(3, 4)]),
    "bmm": (torch.matmul, lambda: [rnd(2, 2, 3), rnd(2, 3, 4)]),
    "mv": (torch.mv, lambda: [rnd(2, 3), rnd(3)]),
    "dot": (torch.dot, lambda: [rnd(3), rnd(3)]),
    "outer": (torch.outer, lambda: [rnd(3), rnd(2)]),
    "einsum": (lambda x, y: torch.einsum("ij,jk->ik", x, y), lambda: [rnd(2, 3), rnd(3, 2)]),
    "linear": (F.linear, lambda: [rnd(2, 3), rnd(4, 3), rnd(4)]),
    "addmm_scaled": (lambda b, x, y: torch.addmm(b, x, y, beta=0.5, alpha=2.0), lambda: [rnd(2), rnd(3, 4), rnd(4, 2)]),
    "baddbmm": (lambda b, x, y: torch.baddbmm(b, x, y), lambda: [rnd(2, 3, 2), rnd(2, 3, 4), rnd(2, 4, 2)]),
    "conv1d": (lambda x, w, b: F.conv1d(x, w, b, padding=1), lambda: [rnd(1, 2, 5), rnd(3, 2, 3), rnd(3)]),
    "conv2d": (lambda x, w: F.conv2d(x, w, stride=2), lambda: [rnd(1, 2, 5, 5), rnd(3, 2, 2, 2)]),
    "conv_transpose1d": (lambda x, w: F.conv_transpose1d(x, w), lambda: [rnd(1, 2, 4), rnd(2, 3, 3)]),
    "avg_pool": (lambda x: F.avg_pool2d(x, 2), lambda: [rnd(1, 1, 4, 4)]),
    "max_pool": (lambda x: F.max_pool2d(x, 2), lambda: [rnd(1, 1, 4, 4)]),
    "sum": (lambda x: x.sum(0), lambda: [rnd(3, 2)]),
    "mean": (lambda x: x.mean(), lambda: [rnd(3, 2)]),
    "cumsum": (lambda x: x.cumsum(0), lambda: [rnd(4)]),
    "amax": (lambda x: x.amax(-1), lambda: [rnd(3, 4)]),
    "max_dim": (lambda x: x.max(-1).values, lambda: [rnd(3, 4)]),
    "min_keepdim": (lambda x: x.min(0, keepdim=True).values, lambda: [rnd(3, 4)]),
    "max_all": (lambda x: x.max(), lambda: [rnd(3, 4)]),
    "sort": (lambda x: x.sort(-1).values, lambda: [rnd(3, 4)]),
    "topk": (lambda x: x.topk(2).values, lambda: [rnd(3, 4)]),
    "cat": (lambda x, y: torch.cat([x, y * 2, torch.ones(1, dtype=D)]), lambda: [rnd(3), rnd(2)]),
    "stack": (lambda x, y: torch.stack([x, y]), lambda: [rnd(3), rnd(3)]),
    "where": (lambda x, y: torch.where(x > 0, x, y), lambda: [rnd(4), rnd(4)]),
    "index": (lambda x: x[[0, 2]], lambda: [rnd(4)]),
    "slice_and_view": (lambda x: x[1:, ::2].reshape(-1).unsqueeze(0).t(), lambda: [rnd(3, 4)]),
    "gather": (lambda x: x.gather(0, torch.tensor([1, 1, 0])), lambda: [rnd(4)]),
    "pad": (lambda x: F.pad(x, (1, 1), value=3.0), lambda: [rnd(3)]),
    "masked_fill": (lambda x: x.masked_fill(x > 0, 2.0), lambda: [rnd(4)]),
    "scatter_add": (lambda x, y: x.scatter_add(0, torch.tensor([0, 0, 2]), y), lambda: [rnd(4), rnd(3)]),
    "index_put": (lambda x, y: x.index_put((torch.tensor([1, 3]),), y), lambda: [rnd(4), rnd(2)]),
    "mse_loss": (F.mse_loss, lambda: [rnd(3), rnd(3)]),
    "cross_entropy": (lambda x: F.cross_entropy(x, torch.tensor([1, 0])), lambda: [rnd(2, 3)]),
    "sdpa": (F.scaled_dot_product_attention, lambda: [rnd(1, 3, 4), rnd(1, 3, 4), rnd(1, 3, 4)]),
    "sdpa_causal": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), lambda: [rnd(1, 3, 4), rnd(1, 3, 4), rnd(1, 3, 4)]),
    "prod": (lambda x: x.prod(-1), lambda: [rnd(3, 4)]),
    "cumprod": (lambda x: x.cumprod(0), lambda: [rnd(4)]),
    "lgamma": (torch.lgamma, lambda: [pos(3)]),
    "digamma": (torch.digamma, lambda: [pos(3)]),
    "atan2": (torch.atan2, lambda: [rnd(3), rnd(3)]),
    "hypot": (torch.hypot, lambda: [rnd(3), rnd(3)]),
}

# ops whose coefficients come from the nested forward-mode fallback (a PerformanceWarning)
FALLBACK = {"prod", "cumprod", "lgamma", "digamma", "atan2", "hypot"}
ORDER = 4


def _case(name):
    entry = CASES[name]
    function, make = entry[0], entry[1]
    reference = entry[2] if len(entry) > 2 else function
    primals = make()
    series = [[torch.randn_like(p) for _ in range(ORDER)] for p in primals]
    return function, reference, primals, series


def _jet(function, primals, series):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, out_series = functx.jet(function, tuple(primals), tuple(series))
    fell_back = [w for w in caught if issubclass(w.category, functx.PerformanceWarning)]
    return out, out_series, fell_back


@pytest.mark.parametrize("name", sorted(CASES))
def test_rule_matches_nested_autograd(name):
    function, reference, primals, series = _case(name)
    out, out_series, fell_back = _jet(function, primals, series)
    expected = path_derivatives(reference, primals, series, ORDER)
    torch.testing.assert_close(out, expected[0], rtol=1e-10, atol=1e-12)
    for k in range(ORDER):
        scale = 1 + expected[k + 1].abs().max().item()
        torch.testing.assert_close(out_series[k], expected[k + 1], rtol=1e-7, atol=1e-9 * scale, msg=f"{name}: order {k + 1}")
    assert bool(fell_back) == (name in FALLBACK), [str(w.message) for w in fell_back]


@pytest.mark.parametrize("name", sorted(CASES))
def test_rule_matches_finite_differences(name):
    """Central differences of the function itself along the path (no derivative of torch's
    enters), orders 1-3 (the fourth's stencil error is too large to bound tightly)."""
    if name in ("relu", "abs", "clamp", "hardtanh", "elu", "selu", "leaky_relu", "max_pool"):
        pytest.skip("piecewise: a kink may lie within the stencil")
    function, _, primals, series = _case(name)
    _, out_series, _ = _jet(function, primals, series)
    differences = path_finite_differences(function, primals, series, 3)
    for k in range(3):
        scale = 1 + differences[k].abs().max().item()
        torch.testing.assert_close(out_series[k], differences[k], rtol=0, atol=[1e-6, 1e-4, 2e-3][k] * scale, msg=f"{name}: order {k + 1}")


def test_piecewise_ops_take_the_primal_branch():
    """relu, abs, clamp, maximum away from their kinks: each coefficient is the branch's."""
    x = torch.tensor([-2.0, -0.5, 0.5, 2.0], dtype=D)
    c = [torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=D)] * 3
    for function, slope in [
        (torch.relu, [0, 0, 1, 1]),
        (torch.abs, [-1, -1, 1, 1]),
        (lambda x: x.clamp(-1, 1), [0, 1, 1, 0]),
        (lambda x: torch.maximum(x, torch.zeros_like(x)), [0, 0, 1, 1]),
    ]:
        _, out_series = functx.jet(function, (x,), (c,))
        for k in range(3):
            torch.testing.assert_close(out_series[k], c[k] * torch.tensor(slope, dtype=D))


def test_polynomial_coefficients_are_exact():
    """x(t) = x0 + t through p(x) = x^4 - 2x: the coefficients are p's derivatives, and the
    fifth and higher are zero (a check that does not go through any reference)."""
    x = torch.tensor([0.0, 1.5, -2.0], dtype=D)
    one, zero = torch.ones_like(x), torch.zeros_like(x)
    _, out = functx.jet(lambda x: x**4 - 2 * x, (x,), ([one] + [zero] * 5,))
    expected = [4 * x**3 - 2, 12 * x**2, 24 * x, 24 * one, zero, zero]
    for got, want in zip(out, expected):
        torch.testing.assert_close(got, want)


def test_order_zero_and_outputs_off_the_path():
    x = torch.tensor([1.0, 2.0])
    out, series = functx.jet(torch.sin, (x,), ([],))
    assert torch.equal(out, torch.sin(x)) and series == []
    (a, b), (sa, sb) = functx.jet(lambda x: (x * 2, torch.ones(3)), (x,), ([x, x],))
    assert torch.equal(sa[0], 2 * x) and torch.equal(sa[1], 2 * x)
    assert torch.equal(sb[0], torch.zeros(3)) and torch.equal(sb[1], torch.zeros(3))


def test_pytree_arguments_and_outputs():
    x, y = rnd(3), rnd(3)
    sx, sy = [rnd(3), rnd(3)], [rnd(3), rnd(3)]

    def f(d):
        return {"product": d["x"] * d["y"], "pair": (d["x"].sin(),)}

    out, series = functx.jet(f, ({"x": x, "y": y},), ([{"x": sx[0], "y": sy[0]}, {"x": sx[1], "y": sy[1]}],))
    expected = path_derivatives(lambda x, y: x * y, [x, y], [sx, sy], 2)
    torch.testing.assert_close(series["product"][0], expected[1])
    torch.testing.assert_close(series["product"][1], expected[2])
    expected_sin = path_derivatives(torch.sin, [x], [sx], 2)
    torch.testing.assert_close(series["pair"][0][1], expected_sin[2])


def test_fallback_warns_once_per_op_and_points_at_the_caller():
    x = pos(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        functx.jet(torch.special.i1, (x,), ([x],))  # (no other test takes it)
        functx.jet(torch.special.i1, (x,), ([x],))
    fell_back = [w for w in caught if issubclass(w.category, functx.PerformanceWarning)]
    assert len(fell_back) == 1
    assert "aten::special_i1" in str(fell_back[0].message)
    assert fell_back[0].filename == __file__


def test_in_place_write_into_a_temporary_runs_out_of_place():
    x = rnd(3)
    series = [rnd(3), rnd(3)]

    def f(x):
        y = x * 2
        y.add_(1).mul_(x)  # a temporary with no views: the jet takes the result
        return y

    _, got = functx.jet(f, (x,), (series,))
    expected = path_derivatives(lambda x: (x * 2 + 1) * x, [x], [series], 2)
    torch.testing.assert_close(got[0], expected[1])
    torch.testing.assert_close(got[1], expected[2])


@pytest.mark.parametrize(
    "write",
    [
        lambda y: y.mul_(2),  # y has a view: the view's path would be left behind
        lambda y: y[0].add_(1),  # through a view
        lambda y: torch.zeros(3, dtype=D).copy_(y),  # a plain tensor cannot take coefficients
    ],
)
def test_writes_that_would_lose_coefficients_are_refused(write):
    x = rnd(3)
    with pytest.raises(RuntimeError, match="functx.jet: .* writes in place"):
        functx.jet(_with_a_view(write), (x,), ([x],))
    assert current_stack() == ()


def _with_a_view(write):
    def f(x):
        y = x * 1
        y.view(3)  # y now has a view: writing into y would leave the view's path behind
        return write(y)

    return f


@pytest.mark.parametrize(
    "primals, series, error, match",
    [
        (rnd(3), [[rnd(3)]], TypeError, "must be tuples"),
        ((rnd(3),), ([rnd(3)], [rnd(3)]), ValueError, "1 entries and series 2"),
        ((rnd(3), rnd(3)), ([rnd(3)], [rnd(3), rnd(3)]), ValueError, "different numbers of coefficients"),
        ((rnd(3),), ([rnd(2)],), ValueError, r"coefficient 1 has shape \(2,\)"),
        ((torch.arange(3),), ([torch.arange(3)],), TypeError, "floating-point"),
        ((rnd(3),), (rnd(3),), TypeError, "must be a list"),
        ((rnd(3),), ([1.0],), TypeError, "coefficient 1 is a float"),
    ],
)
def test_bad_arguments_are_named(primals, series, error, match):
    with pytest.raises(error, match=match):
        functx.jet(torch.sin, primals, series)
    assert current_stack() == ()


def test_non_tensor_output_is_refused_and_the_stack_restored():
    with pytest.raises(TypeError, match="must return tensors"):
        functx.jet(lambda x: 3, (rnd(2),), ([rnd(2)],))
    with pytest.raises(ZeroDivisionError):
        functx.jet(lambda x: 1 / 0, (rnd(2),), ([rnd(2)],))
    assert current_stack() == ()
