"""Forward over reverse through backward formulas that take a shortcut without grad mode.

Some of torch's backward formulas branch on grad mode: with it off they reuse what the
forward saved (linalg.solve's LU factorization, det's), which carries no tangent; with it
on they recompute differentiably. A grad / vjp level on values under a jvp on values
(`jvp(grad(f))`, `jvp(lambda u: vjp(f, x)[1](u))`: Hessian-vector products) ran its
backward without create_graph when nothing outside needed the graph, so the jvp's tangents
flowing through the backward missed the primal's dependence: HVPs of `solve`, `det`,
`slogdet` were off by up to 77 (issue 26, found by the op-database sweep's jvp-of-vjp). The
backward of a level opened over a jvp on values now always records, also under an outer
`torch.no_grad()` (where torch.func is still wrong).

Reference: central differences (float64) of the VJP by plain `torch.autograd.grad`.
"""

import pytest
import torch

import functx
from functx.core import current_stack

D = torch.float64
EPS = 1e-6

OPS = {
    "solve": torch.linalg.solve,
    "solve_ex": lambda a, b: torch.linalg.solve_ex(a, b)[0],
    "solve of a transposed A": lambda a, b: torch.linalg.solve(a.mT, b),
    "det": lambda a, b: torch.linalg.det(a) * b,
    "slogdet": lambda a, b: torch.linalg.slogdet(a)[1] * b,
    "logdet": lambda a, b: torch.logdet(a @ a.mT) * b,
    "lu_factor + lu_solve": lambda a, b: torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b[:, None])[:, 0],
    "inv": lambda a, b: torch.linalg.inv(a) @ b,
    "cholesky_solve": lambda a, b: torch.cholesky_solve(b[:, None], torch.linalg.cholesky(a @ a.mT + torch.eye(4, dtype=D)))[:, 0],
}


def _inputs():
    g = torch.Generator().manual_seed(0)
    A = torch.randn(4, 4, dtype=D, generator=g) + 4 * torch.eye(4, dtype=D)
    B, U = torch.randn(4, dtype=D, generator=g), torch.randn(4, dtype=D, generator=g)
    return (A, B, U), tuple(torch.randn(t.shape, dtype=D, generator=g) for t in (A, B, U))


def _reference(f, primals, tangents):
    """d/de of the plain-autograd VJP at primals + e * tangents (central differences)."""

    def vjp(a, b, u):
        a, b = a.detach().requires_grad_(), b.detach().requires_grad_()
        return torch.autograd.grad(f(a, b), (a, b), u)

    plus = vjp(*(p + EPS * t for p, t in zip(primals, tangents)))
    minus = vjp(*(p - EPS * t for p, t in zip(primals, tangents)))
    return tuple((p - m) / (2 * EPS) for p, m in zip(plus, minus))


STACKS = {
    "jvp(vjp)": lambda f, P, T: functx.jvp(lambda a, b, u: functx.vjp(f, a, b)[1](u), P, T)[1],
    "jvp(grad)": lambda f, P, T: functx.jvp(
        lambda a, b, u: functx.grad(lambda a, b: (f(a, b) * u).sum(), argnums=(0, 1))(a, b), P, T
    )[1],
    "jvp(jacrev) row": lambda f, P, T: functx.jvp(
        lambda a, b, u: tuple(torch.tensordot(u, j, dims=1) for j in functx.jacrev(f, argnums=(0, 1))(a, b)), P, T
    )[1],
    # a vjp_fn called under vmap inside the jvp (its results under vmap's wrappers)
    "jvp(vmap(vjp_fn))": lambda f, P, T: functx.jvp(
        lambda a, b, u: tuple(r[1] for r in functx.vmap(functx.vjp(f, a, b)[1])(torch.stack([-u, u]))), P, T
    )[1],
    "vmap(jvp(vjp))": lambda f, P, T: tuple(
        r[0]
        for r in functx.vmap(lambda a, b, u: functx.jvp(lambda a, b, u: functx.vjp(f, a, b)[1](u), (a, b, u), T)[1])(
            *(p[None] for p in P)
        )
    ),
}


@pytest.mark.parametrize("stack", sorted(STACKS))
@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("grad_mode", [True, False], ids=["grad on", "under no_grad"])
def test_hessian_vector_products_through_grad_mode_shortcuts(op, stack, grad_mode):
    primals, tangents = _inputs()
    expected = _reference(OPS[op], primals, tangents)
    with torch.set_grad_enabled(grad_mode):
        actual = STACKS[stack](OPS[op], primals, tangents)
    assert current_stack() == ()
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("op", ["solve", "det", "slogdet"])
def test_under_a_wrapped_jvp_level(op):
    """A jvp level that wraps (inside an outer grad: the tangents live in DualTensors) under
    the vjp: the same shortcut, the same fix. d/dw of <w, J_jvp(vjp)> = the HVP itself."""
    primals, tangents = _inputs()
    expected = _reference(OPS[op], primals, tangents)
    f = OPS[op]

    def inner(a, b, u):
        return functx.jvp(lambda a, b, u: functx.vjp(f, a, b)[1](u), (a, b, u), tangents)[1]

    w = torch.ones(()).double()
    actual = functx.grad(lambda w: sum((w * t).sum() for t in inner(*primals)) * w)(w)  # 2 w <sum of the HVP>
    torch.testing.assert_close(actual, 2 * sum(e.sum() for e in expected), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("op", ["solve", "det", "slogdet"])
def test_vjp_under_jacfwd_under_no_grad(op):
    """jacfwd (a jvp level that wraps) over the VJP w.r.t. A, under an outer no_grad: the
    vjp level's backward records only because a forward level lies below (`under_forward`;
    `reaches_outside` alone would not under no_grad). Against central differences of the
    plain VJP, one column per element of A."""
    primals, _ = _inputs()
    f = OPS[op]
    A, B, U = primals
    zero_b, zero_u = torch.zeros_like(B), torch.zeros_like(U)
    columns = [_reference(f, primals, (e.reshape(4, 4), zero_b, zero_u))[1] for e in torch.eye(16, dtype=D)]
    expected = torch.stack(columns, -1).reshape(4, 4, 4)
    with torch.no_grad():
        actual = functx.jacfwd(lambda a: functx.vjp(f, a, B)[1](U)[1])(A)
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_the_recorded_backward_does_not_leave_the_transform(stack):
    """The graph recorded for the tangents is the level's own: with nothing outside
    requiring grad, no result of the transform requires grad (it used to leave jvp(grad)'s
    tangent with a grad_fn)."""
    primals, tangents = _inputs()
    for result in STACKS[stack](OPS["solve"], primals, tangents):
        assert not result.requires_grad and result.grad_fn is None
