"""Third and fourth derivatives of every op torch differentiates twice, against central
differences.

torch's derivative formulas are checked by torch's own gradcheck to second order (its
`gradgradcheck`); nothing checks the derivative of a double backward, and some are wrong
(layer norm's and batch norm's took their saved statistics as constants: off by 25).
functx's direct levels are torch's autograd, so `grad(grad(grad(f)))` inherits whatever
torch computes there. This sweep finds such ops: for each op_db OpInfo with
`supports_gradgrad`, on its first 2 float64 samples, with s(x) = <f(x), u> and random
directions v_1 .. v_{k-1}, d, the derivative of order k (3 or 4):

    functx      T = grad < ... grad < grad s(x), v_1 > ..., v_{k-1} >     (k functx.grad levels)
    reference   central differences of h(x) = < d/dx < grad s(x), v_1 >, v_2 > (plain torch's
                double backward) along the remaining k - 2 directions (mixed second
                differences for k = 4)

one reference per op that shares nothing with functx: differences of torch's second order,
which torch's gradgradcheck covers (its third order is what is in question).

Commands:
  default (CI) run: order 3 on a stable-hash eighth of the ops, and every normalization at
  both orders
      .venv/bin/python -m pytest tests/ad/test_op_db_higher_order.py -n 2 -q
  the full sweep (every op, both orders; ~2 min):
      .venv/bin/python -m pytest tests/ad/test_op_db_higher_order.py -m "slow or not slow" -n 2 -q
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

import functx
from tests.ad import opdb_ad_support as support

EPS = {1: 1e-5, 2: (5e-4, 2e-4)}  # the difference steps, by the number of directions differenced
SPREAD = 1e-3  # a fourth-order reference whose step sizes disagree by more (relative) is no reference
SAMPLES = 2
TOLERANCE = dict(rtol=1e-4, atol=1e-6)
ORDERS = (3, 4)

_TORCH_THIRD_NAN = "torch's derivative of logcumsumexp's double backward is NaN (functx's direct levels are torch's autograd)"
_OWN_SECOND_DERIVATIVE = (
    "the Function's backward reads a derivative its forward saved (3 x^2, not recomputed from x): "
    "its own second derivative is its author's, and plain torch computes the same higher derivatives"
)
_LABEL_TARGET = (
    "reference invalid: the sample differentiates the +-1 target, which selects the formula's branch; "
    "a difference step off +-1 changes branch (functx equals plain torch)"
)
_KINK = "reference invalid: the sample sits on the norm's kink at zero (NaN, as plain torch)"

_CHUNKED_REFERENCE = (
    "no reference: torch's double backward of F.linear_cross_entropy's chunked ops is 0 "
    "(first-order-only backwards; torch documents gradgrad as unsupported), so its differences "
    "are too; functx computes cross_entropy(linear(x)) there, tested against that formula's "
    "torch.autograd derivatives in tests/ad/test_torch_nn_rules.py"
)

# Known failures by cause, per (op, order) (strict xfails: a fix makes the test fail until
# its entry goes).
KNOWN_FAILURES: dict[tuple[str, int], str] = {
    ("logcumsumexp", 3): _TORCH_THIRD_NAN,
    ("logcumsumexp", 4): _TORCH_THIRD_NAN,
    ("CubeGenVmapAutogradFunction", 3): _OWN_SECOND_DERIVATIVE,
    ("CubeGenVmapAutogradFunction", 4): _OWN_SECOND_DERIVATIVE,
    ("nn.functional.cosine_embedding_loss", 3): _LABEL_TARGET,
    ("nn.functional.cosine_embedding_loss", 4): _LABEL_TARGET,
    ("linalg.norm.subgradients_at_zero", 3): _KINK,
    **{
        (identifier, order): _CHUNKED_REFERENCE
        for identifier in ("nn.functional.linear_cross_entropy.chunked", "nn.functional.linear_cross_entropy.chunked_none")
        for order in ORDERS
    },
}


def _in_default_subset(identifier: str, order: int) -> bool:
    """Order 3 on a stable-hash eighth of the ops; every normalization (functx's own
    formulas) at every order."""
    return "norm" in identifier or (order == 3 and zlib.crc32(identifier.encode()) % 8 == 0)


def _params():
    for op in support.autograd_ops():
        if not getattr(op, "supports_gradgrad", False):
            continue
        identifier = support.op_id(op)
        for order in ORDERS:
            marks = [] if _in_default_subset(identifier, order) else [pytest.mark.slow]
            if (identifier, order) in KNOWN_FAILURES:
                marks.append(pytest.mark.xfail(reason=KNOWN_FAILURES[identifier, order], strict=True))
            yield pytest.param(op, order, id=f"{identifier}-order{order}", marks=marks)


def test_known_failures_name_real_ops():
    identifiers = {support.op_id(op) for op in support.autograd_ops()}
    for identifier, order in KNOWN_FAILURES:
        assert identifier in identifiers and order in ORDERS, (identifier, order)


def _real(x):
    return torch.view_as_real(x.resolve_conj()) if x.is_complex() else x


def _dot(xs, ys):
    """The real inner product (complex tensors as pairs of reals)."""
    return sum((_real(x) * _real(y)).sum() for x, y in zip(xs, ys))


def _directional(case, grad, primals, u, directions):
    """<d/dx < ... < d/dx <f(x), u>, directions[0] > ..., directions[-1] >: the derivative of
    order len(directions) + 1 of s(x) = <f(x), u> along the directions, as a function of x
    (before the last contraction), computed by `grad(fn, primals) -> gradients`."""
    def s(*xs):
        return _dot(list(case.f(*xs)), u)

    fn = s
    for direction in directions:
        fn = (lambda inner, direction: lambda *xs: _dot(grad(inner, xs), direction))(fn, direction)
    return grad(fn, primals)


def _by_functx(fn, xs):
    return functx.grad(fn, argnums=tuple(range(len(xs))))(*xs)


def _by_torch(fn, xs):
    """The gradient by plain torch.autograd, recorded (create_graph) so it can be differentiated."""
    xs = [x if x.requires_grad else x.detach().requires_grad_() for x in xs]
    return support._torch_grad([fn(*xs)], xs, [torch.ones((), dtype=xs[0].real.dtype)], create_graph=True)


def _second_order_by_torch(case, primals, u, v, w):
    """< d/dx < grad s(x), v >, w > by plain torch's double backward (which gradgradcheck covers)."""
    with support.reference("double backward"):
        grads = _directional(case, _by_torch, support._leaves(primals), u, [v])
    return _dot(grads, w).item()


def _by_differences(h, primals, steps):
    """(estimate, its spread): d/dt_1 ... d/dt_m h(x + t_1 e_1 + ... + t_m e_m) at 0 for the
    directions e in `steps` (one or two): central differences; for two, a mixed second
    difference with Richardson's extrapolation (error O(eps^4): steep functions, tan or
    polygamma, need it) at two step sizes, whose disagreement is the spread."""
    if len(steps) == 1:
        return _central(h, primals, steps, EPS[1]), 0.0
    estimates = []
    for eps in EPS[2]:
        coarse, fine = _central(h, primals, steps, eps), _central(h, primals, steps, eps / 2)
        estimates.append((4 * fine - coarse) / 3)
    # (the two estimates disagree by about the error of either: rounding at the small step,
    # truncation at the large one)
    spread = abs(estimates[0] - estimates[-1])
    return estimates[-1], 0.0 if math.isnan(spread) else spread  # (NaN: compared as NaN)


def _central(h, primals, steps, eps):
    total = 0.0
    for signs in ([1], [-1]) if len(steps) == 1 else ([1, 1], [1, -1], [-1, 1], [-1, -1]):
        point = [p + sum(sign * eps * step[i] for sign, step in zip(signs, steps)) for i, p in enumerate(primals)]
        sign = 1
        for s_ in signs:
            sign *= s_
        total += sign * h(point)
    return total / (2 * eps) ** len(steps)


@pytest.mark.parametrize("op, order", list(_params()))
def test_higher_derivative_matches_finite_differences(op, order):
    checked = 0
    for case in support.float64_cases(op, SAMPLES):
        primals = case.primals
        outputs = case.f(*primals)
        if any(o.dtype not in (torch.float64, torch.complex128) for o in outputs):
            pytest.skip("an output in less than double precision: differences too coarse")
        u = support._random_like(outputs, support.COTANGENT_SEED)
        v, w, *steps = (support._random_like(primals, seed) for seed in range(11, 11 + order))
        try:
            expected, spread = _by_differences(lambda x: _second_order_by_torch(case, x, u, v, w), primals, steps)
        except support.ReferenceFailed:
            continue  # torch cannot differentiate this sample twice: no reference
        if spread > SPREAD * abs(expected) + TOLERANCE["atol"]:
            continue  # a kink within the steps (grid_sample's cells) or rounding: no reference
        checked += 1
        expected = torch.tensor(expected, dtype=torch.float64)
        *inner, last = steps
        actual = _dot(_directional(case, _by_functx, primals, u, [v, w, *inner]), last).detach()
        # (widened by the reference's own spread: its error, measured)
        tolerance = dict(rtol=TOLERANCE["rtol"], atol=TOLERANCE["atol"] + 2 * spread)
        torch.testing.assert_close(actual, expected, **tolerance, equal_nan=True, msg=lambda m: f"{case}: order {order}: {m}")
    if not checked:
        pytest.skip("no sample has a reference (torch's double backward fails, or the differences do not settle)")
