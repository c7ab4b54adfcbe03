"""The wrapped jvp level's own rules (functx/ad/jvp_rules.py): each op's tangent, alone and
nested, against references that share none of functx's code.

- one wrapped level (primals the caller's autograd tracks: `choose.py` wraps them): against
  torch's own forward AD on plain float64 tensors;
- forward over forward (`jvp(jvp)`, the inner level wrapped) and reverse over forward
  (`grad` of a `jvp`): against central finite differences in float64 of torch's forward AD.

Hypothesis draws the op, the shapes (broadcasting ones where the op broadcasts), which
arguments carry a tangent, and the values.
"""

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from hypothesis import given, settings
from hypothesis import strategies as st

import functx
from functx.ad.jvp_rules import JVP_RULES

aten = torch.ops.aten
D = torch.float64


def _positive(x):
    return x.abs() + 0.5


# name -> (op, number of tensor arguments, argument maker, whether the shapes may broadcast)
OPS = {
    "tanh": (aten.tanh.default, 1, lambda xs: xs, False),
    "sigmoid": (aten.sigmoid.default, 1, lambda xs: xs, False),
    "exp": (aten.exp.default, 1, lambda xs: xs, False),
    "log": (aten.log.default, 1, lambda xs: [_positive(xs[0])], False),
    "sin": (aten.sin.default, 1, lambda xs: xs, False),
    "cos": (aten.cos.default, 1, lambda xs: xs, False),
    "neg": (aten.neg.default, 1, lambda xs: xs, False),
    "relu": (aten.relu.default, 1, lambda xs: xs, False),
    "sqrt": (aten.sqrt.default, 1, lambda xs: [_positive(xs[0])], False),
    "rsqrt": (aten.rsqrt.default, 1, lambda xs: [_positive(xs[0])], False),
    "reciprocal": (aten.reciprocal.default, 1, lambda xs: [_positive(xs[0])], False),
    "tanh_backward": (aten.tanh_backward.default, 2, lambda xs: xs, False),
    "sigmoid_backward": (aten.sigmoid_backward.default, 2, lambda xs: xs, False),
    "threshold_backward": (aten.threshold_backward.default, 2, lambda xs: [*xs, 0.25], False),
    "mul": (aten.mul.Tensor, 2, lambda xs: xs, True),
    "div": (aten.div.Tensor, 2, lambda xs: [xs[0], _positive(xs[1])], True),
    "add": (aten.add.Tensor, 2, lambda xs: xs, True),
    "sub": (aten.sub.Tensor, 2, lambda xs: xs, True),
    "mul_scalar": (aten.mul.Scalar, 1, lambda xs: [xs[0], -1.5], False),
    "div_scalar": (aten.div.Scalar, 1, lambda xs: [xs[0], 2.5], False),
    "pow": (aten.pow.Tensor_Scalar, 1, lambda xs: [_positive(xs[0]), 2.5], False),
    "square": (aten.pow.Tensor_Scalar, 1, lambda xs: [xs[0], 2], False),
    "sum": (aten.sum.default, 1, lambda xs: xs, False),
    "sum_dim": (aten.sum.dim_IntList, 1, lambda xs: [xs[0], [-1], True], False),
    "mean": (aten.mean.default, 1, lambda xs: xs, False),
    "mean_dim": (aten.mean.dim, 1, lambda xs: [xs[0], [0]], False),
    "mm": (aten.mm.default, 2, None, False),
    "addmm": (aten.addmm.default, 3, None, False),
    "softmax": (aten._softmax.default, 1, lambda xs: [xs[0], -1, False], False),
    "logsumexp": (aten.logsumexp.default, 1, lambda xs: [xs[0], [-1], False], False),
}


@st.composite
def cases(draw):
    name = draw(st.sampled_from(sorted(OPS)))
    op, n, make, broadcasts = OPS[name]
    shape = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    if name == "mm":
        m, k, p = (draw(st.integers(1, 4)) for _ in range(3))
        shapes = [(m, k), (k, p)]
    elif name == "addmm":
        m, k, p = (draw(st.integers(1, 4)) for _ in range(3))
        shapes = [(m, p), (m, k), (k, p)]
    elif broadcasts and draw(st.booleans()):
        other = [1 if draw(st.booleans()) else d for d in shape]
        shapes = [shape, other] if draw(st.booleans()) else [other, shape]
    else:
        shapes = [shape] * n
    with_tangent = draw(st.lists(st.booleans(), min_size=n, max_size=n).filter(any))
    seed = draw(st.integers(0, 2**16))
    return name, op, make, shapes, with_tangent, seed


def _build(case):
    name, op, make, shapes, with_tangent, seed = case
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(s, dtype=D, generator=g) for s in shapes]
    make = make or (lambda v: v)
    fixed = make(xs)  # the values the op takes (positive where it needs it; extra arguments)
    tensors = [a for a in fixed if isinstance(a, torch.Tensor)]
    tangents = [torch.randn(t.shape, dtype=D, generator=g) if w else None for t, w in zip(tensors, with_tangent)]
    second = [torch.randn(t.shape, dtype=D, generator=g) for t in tensors]
    extra = fixed[len(tensors):]

    def f(*ts):
        return op(*ts, *extra)

    return f, tensors, tangents, second


def _torch_jvp(f, primals, tangents):
    """torch's forward AD on plain tensors: the reference."""
    with fwAD.dual_level():
        duals = [p if t is None else fwAD.make_dual(p, t) for p, t in zip(primals, tangents)]
        out = fwAD.unpack_dual(f(*duals))
    return out.primal, torch.zeros_like(out.primal) if out.tangent is None else out.tangent


def _functx_jvp(f, primals, tangents):
    """functx.jvp over the differentiated arguments, the others closed over."""
    moving = [i for i, t in enumerate(tangents) if t is not None]

    def g(*moved):
        args = list(primals)
        for i, m in zip(moving, moved):
            args[i] = m
        return f(*args)

    return functx.jvp(g, tuple(primals[i] for i in moving), tuple(tangents[i] for i in moving))


@settings(max_examples=150, deadline=None)
@given(cases())
def test_one_wrapped_level_matches_torch_forward_ad(case):
    f, primals, tangents, _ = _build(case)
    tracked = [p.clone().requires_grad_() for p in primals]  # the caller tracks them: a wrapped level
    out, tangent = _functx_jvp(f, tracked, tangents)
    expected_out, expected_tangent = _torch_jvp(f, primals, tangents)
    torch.testing.assert_close(out.detach(), expected_out)
    torch.testing.assert_close(tangent.detach(), expected_tangent, rtol=1e-10, atol=1e-12)


def _second_order_fd(f, primals, tangents, second, eps=1e-5):
    """d/ds of torch's jvp at primals + s * second, central differences in float64."""
    plus = _torch_jvp(f, [p + eps * u for p, u in zip(primals, second)], tangents)[1]
    minus = _torch_jvp(f, [p - eps * u for p, u in zip(primals, second)], tangents)[1]
    return (plus - minus) / (2 * eps)


@settings(max_examples=150, deadline=None)
@given(cases())
def test_forward_over_forward_and_reverse_over_forward_match_finite_differences(case):
    name = case[0]
    f, primals, tangents, second = _build(case)
    if name in ("relu", "threshold_backward"):  # kinks: keep the primals off them
        primals = [p + 0.3 * torch.sign(p) for p in primals]
    expected = _second_order_fd(f, primals, tangents, second)
    # jvp(jvp): the inner level is wrapped (its primals carry the outer tangent)
    inner = lambda *xs: _functx_jvp(f, list(xs), tangents)[1]
    _, nested = functx.jvp(inner, tuple(primals), tuple(second))
    torch.testing.assert_close(nested, expected, rtol=1e-6, atol=1e-7)
    # grad of the jvp's sum against a random cotangent: <grad, second> is the same derivative
    weights = torch.randn(expected.shape, dtype=D, generator=torch.Generator().manual_seed(1))
    grads = functx.grad(lambda *xs: (inner(*xs) * weights).sum(), argnums=tuple(range(len(primals))))(*primals)
    torch.testing.assert_close(
        sum((gr * u).sum() for gr, u in zip(grads, second)), (expected * weights).sum(), rtol=1e-6, atol=1e-7
    )


@pytest.mark.parametrize("name", sorted(OPS))
def test_each_op_has_its_own_rule(name):
    assert JVP_RULES.how(OPS[name][0]) == "rule"


def test_a_tangent_is_never_an_arguments_own_object():
    # add with one tangent: the result's tangent is a copy; a write into the result's
    # tangent through an in-place op must not reach the argument's
    x, t = torch.randn(3, dtype=D, requires_grad=True), torch.randn(3, dtype=D)
    y = torch.randn(3, dtype=D)

    def f(x):
        out = x + y
        out.mul_(2)
        return out, x

    (out, same), (out_t, x_t) = functx.jvp(f, (x,), (t,))
    torch.testing.assert_close(out_t, 2 * t)
    torch.testing.assert_close(x_t, t)
