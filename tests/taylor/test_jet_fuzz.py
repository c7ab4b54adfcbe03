"""A hypothesis property over random programs: `functx.jet` of a drawn program (unary and
binary ops on a few registers, views, reductions, products), at a drawn order 1-4, maybe
under a vmap over points, equals the derivatives along the path by nested torch.autograd.

Examples: FUNCTX_FUZZ_EXAMPLES (default 60 here; the long run: FUNCTX_FUZZ_EXAMPLES=2000).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import functx

from .reference import path_derivatives

D = torch.float64
EXAMPLES = int(os.environ.get("FUNCTX_FUZZ_EXAMPLES", "60"))

# unary ops, safe on any real input (domains folded in: log(1 + x^2), ...)
UNARY = {
    "exp_half": lambda x: torch.exp(0.5 * x),
    "sin": torch.sin,
    "cos": torch.cos,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "log_1_plus_square": lambda x: torch.log(1 + x * x),
    "sqrt_1_plus_square": lambda x: torch.sqrt(1 + x * x),
    "reciprocal_shifted": lambda x: 1 / (2 + torch.sin(x)),
    "erf": torch.erf,
    "atan": torch.atan,
    "softplus": F.softplus,
    "gelu": F.gelu,
    "silu": F.silu,
    "cube": lambda x: x**3,
    "square": lambda x: x * x,
    "pow_1.5": lambda x: (1 + x * x) ** 1.5,
    "softmax": lambda x: torch.softmax(x, -1),
    "log_softmax": lambda x: torch.log_softmax(x, -1),
    "flip": lambda x: x.flip(-1),
    "cumsum": lambda x: x.cumsum(-1),
    "centered": lambda x: x - x.mean(-1, keepdim=True),
    "scaled": lambda x: 2.5 * x - 1,
    "asinh": torch.asinh,
}
BINARY = {
    "add": torch.add,
    "sub": torch.sub,
    "mul": torch.mul,
    "div": lambda a, b: a / (1 + b * b),
    "log_sum_exp": lambda a, b: torch.log(torch.exp(a) + torch.exp(b)),
    "outer_sum": lambda a, b: (a.unsqueeze(-1) * b.unsqueeze(-2)).sum(-1),
    "matmul": lambda a, b: a @ torch.linspace(-1, 1, a.shape[-1] ** 2, dtype=D).reshape(a.shape[-1], -1) + b,
    "where": lambda a, b: torch.where(a > b, a, b * 0.5),
    "pow": lambda a, b: (1 + a * a) ** torch.sin(b),
}


@st.composite
def programs(draw):
    steps = []
    registers = 2
    for _ in range(draw(st.integers(1, 6))):
        if draw(st.booleans()):
            steps.append(("unary", draw(st.sampled_from(sorted(UNARY))), draw(st.integers(0, registers - 1))))
        else:
            a, b = draw(st.integers(0, registers - 1)), draw(st.integers(0, registers - 1))
            steps.append(("binary", draw(st.sampled_from(sorted(BINARY))), (a, b)))
        registers += 1
    return steps


def _run(steps, x, y):
    values = [x, y]
    for kind, name, where in steps:
        if kind == "unary":
            values.append(UNARY[name](values[where]))
        else:
            values.append(BINARY[name](values[where[0]], values[where[1]]))
    return values[-1] + 0.1 * values[-2].sum()


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=programs(), order=st.integers(1, 4), batched=st.booleans(), seed=st.integers(0, 2**16))
def test_jet_of_random_programs_equals_nested_autograd(program, order, batched, seed):
    generator = torch.Generator().manual_seed(seed)
    batch = 3 if batched else 1
    x, y = (torch.randn(batch, 4, generator=generator, dtype=D) for _ in range(2))
    sx = [torch.randn(batch, 4, generator=generator, dtype=D) for _ in range(order)]
    sy = [torch.randn(batch, 4, generator=generator, dtype=D) for _ in range(order)]

    def f(x, y):
        return _run(program, x, y)

    def one(x, y, sx, sy):
        return functx.jet(f, (x, y), (sx, sy))

    if batched:
        out, series = functx.vmap(one)(x, y, sx, sy)
    else:
        out, series = one(x[0], y[0], [s[0] for s in sx], [s[0] for s in sy])
    for i in range(batch):
        expected = path_derivatives(f, [x[i], y[i]], [[s[i] for s in sx], [s[i] for s in sy]], order)
        got_out = out[i] if batched else out
        torch.testing.assert_close(got_out, expected[0])
        for k in range(order):
            got = series[k][i] if batched else series[k]
            scale = 1 + expected[k + 1].abs().max().item()
            torch.testing.assert_close(got, expected[k + 1], rtol=1e-7, atol=1e-9 * scale, msg=f"{program}: order {k + 1}")
