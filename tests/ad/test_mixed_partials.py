"""Mixed partials across AD levels, where the inner transform's function closes over the outer
transform's input: d/db [d/da g(a, b)] needs the inner level's derivative to stay a function
of b at the outer level, and the two levels' perturbations must never be confused.

Every value is checked against independent references: torch.func (the same expression built
from torch.func's transforms), float64 central finite differences (`finite_differences.py`,
nested once per derivative order) and, wherever one is short, a closed form (the Hessian-vector
products through vmap take finite differences of plain torch.autograd gradients instead).
torch.func agrees with the finite differences on every case of this file (torch 2.13).
"""

import itertools

import pytest
import torch
import torch.func as tf

import functx
from tests.ad import finite_differences as fd
from tests.ad.scalar_derivatives import DERIVATIVES, derivative

D = torch.float64


def fd_derivative(order):
    return lambda f, x: fd.derivative(f, x, fd.STEP[order])


PAIRS = list(itertools.product(DERIVATIVES, repeat=2))
PAIR_IDS = [f"{outer}-of-{inner}" for outer, inner in PAIRS]
X0, Y0, Z0 = torch.tensor(0.7, dtype=D), torch.tensor(-1.3, dtype=D), torch.tensor(0.4, dtype=D)


def check_all(build, closed_form, order):
    """build(d) evaluates the expression with the derivative operator factory d(name)."""
    ours = build(lambda name: derivative(functx, name))
    torch.testing.assert_close(ours, closed_form)
    torch.testing.assert_close(ours, build(lambda name: derivative(tf, name)))
    fd.assert_close(ours, build(lambda name: fd_derivative(order)), order=order)


# ---------------------------------------------------------------------------------------------
# the two examples of the brief, spelled out


def test_jvp_of_jvp_of_closure_is_one():
    x, y, one = X0, Y0, torch.ones((), dtype=D)
    for lib in (functx, tf):
        got = lib.jvp(lambda b: lib.jvp(lambda a: a * b, (x,), (one,))[1], (y,), (one,))[1]
        torch.testing.assert_close(got, torch.tensor(1.0, dtype=D), msg=f"{lib.__name__}")
    reference = fd.derivative(lambda b: fd.derivative(lambda a: a * b, x, fd.STEP[2]), y, fd.STEP[2])
    fd.assert_close(reference, torch.tensor(1.0, dtype=D), order=2)


MIXED_SUMS = {  # g(a, b) summed over the elements, and its (diagonal) mixed partial d^2 g / da_i db_i
    "product": (lambda a, b: (a * b).sum(), lambda a, b: torch.ones_like(a)),
    "sin_product": (lambda a, b: torch.sin(a * b).sum(), lambda a, b: torch.cos(a * b) - a * b * torch.sin(a * b)),
}


@pytest.mark.parametrize("outer", ["jacfwd", "jacrev"])
@pytest.mark.parametrize("inner", ["jacfwd", "jacrev"])
@pytest.mark.parametrize("g", sorted(MIXED_SUMS))
def test_jacobian_of_jacobian_argnums(g, inner, outer):
    """outer(inner(g, argnums=0), argnums=1)(X, Y)[i, j] = d/dY_j d/dX_i g: a diagonal matrix."""
    f, mixed = MIXED_SUMS[g]
    X, Y = torch.randn(4, dtype=D), torch.randn(4, dtype=D)
    ours = getattr(functx, outer)(getattr(functx, inner)(f, argnums=0), argnums=1)(X, Y)
    torch.testing.assert_close(ours, torch.diag(mixed(X, Y)))
    torch.testing.assert_close(ours, getattr(tf, outer)(getattr(tf, inner)(f, argnums=0), argnums=1)(X, Y))
    by_fd = fd.jacobian(lambda b: fd.jacobian(lambda a: f(a, b), X, fd.STEP[2]), Y, fd.STEP[2])
    fd.assert_close(ours, by_fd, order=2)


def test_jvp_of_jvp_of_closure_vectors():
    """jvp over b of jvp over a of g(a, b) = ta^T (d^2 g / da db) tb, the inner function closing over b."""
    M = torch.randn(4, 4, dtype=D)
    g = lambda a, b: a @ M @ b + torch.sin(a * b).sum()
    x, y, ta, tb = (torch.randn(4, dtype=D) for _ in range(4))
    u = x * y
    closed = ta @ (M + torch.diag(torch.cos(u) - u * torch.sin(u))) @ tb

    def build(lib):
        return lib.jvp(lambda b: lib.jvp(lambda a: g(a, b), (x,), (ta,))[1], (y,), (tb,))[1]

    ours = build(functx)
    torch.testing.assert_close(ours, closed)
    torch.testing.assert_close(ours, build(tf))
    by_fd = fd.directional(lambda b: fd.directional(lambda a: g(a, b), x, ta, fd.STEP[2]), y, tb, fd.STEP[2])
    fd.assert_close(ours, by_fd, order=2)


# ---------------------------------------------------------------------------------------------
# every (outer, inner) pair of derivative transforms


MIXED = {  # g(a, b) on 0-d tensors, d^2 g / da db in closed form
    "product": (lambda a, b: a * b, lambda a, b: torch.ones_like(a)),
    "sin_product": (lambda a, b: torch.sin(a * b), lambda a, b: torch.cos(a * b) - a * b * torch.sin(a * b)),
    "polynomial": (lambda a, b: a**2 * b**3 + a, lambda a, b: 6 * a * b**2),
    "exp_tanh": (lambda a, b: torch.exp(a) * torch.tanh(b), lambda a, b: torch.exp(a) * (1 - torch.tanh(b) ** 2)),
}


@pytest.mark.parametrize("g", sorted(MIXED))
@pytest.mark.parametrize(("outer", "inner"), PAIRS, ids=PAIR_IDS)
def test_mixed_partial_every_pair(outer, inner, g):
    """outer over b of (inner over a of g(a, b)), the inner function closing over b."""
    f, mixed = MIXED[g]

    def build(d):
        return d(outer)(lambda b: d(inner)(lambda a: f(a, b), X0), Y0)

    check_all(build, mixed(X0, Y0), order=2)


CONFUSION = {
    # Siskind & Pearlmutter's perturbation confusion: d/dx [x * d/dy (x + y)] = d/dx [x * 1] = 1
    # (a confused implementation mistakes x's perturbation for y's and answers 2).
    "x*d(x+y)": (lambda D_out, D_in: D_out(lambda x: x * D_in(lambda y: x + y, Y0), X0), torch.tensor(1.0, dtype=D)),
    # the same with the inner derivative taken at the outer variable itself
    "x*d(x+y)|y=x": (lambda D_out, D_in: D_out(lambda x: x * D_in(lambda y: x + y, x), X0), torch.tensor(1.0, dtype=D)),
    # d/dx [x * d/dy (x * y)] = d/dx x^2 = 2 x
    "x*d(x*y)": (lambda D_out, D_in: D_out(lambda x: x * D_in(lambda y: x * y, Y0), X0), 2 * X0),
}


@pytest.mark.parametrize("case", sorted(CONFUSION))
@pytest.mark.parametrize(("outer", "inner"), PAIRS, ids=PAIR_IDS)
def test_no_perturbation_confusion(outer, inner, case):
    expression, closed = CONFUSION[case]
    check_all(lambda d: expression(d(outer), d(inner)), closed, order=2)


# ---------------------------------------------------------------------------------------------
# depth 3: d^3 / dx dy dz, each level's function closing over the outer levels' inputs

TRIPLE = {
    "product": (lambda x, y, z: x * y * z, lambda x, y, z: torch.ones_like(x)),
    # u = xyz: d/dx sin u = yz cos u; d/dy: z cos u - u z sin u; d/dz: cos u (1 - u^2) - 3 u sin u
    "sin_product": (
        lambda x, y, z: torch.sin(x * y * z),
        lambda x, y, z: torch.cos(x * y * z) * (1 - (x * y * z) ** 2) - 3 * x * y * z * torch.sin(x * y * z),
    ),
}
TRIPLES = list(itertools.product(DERIVATIVES, repeat=3))


@pytest.mark.parametrize("g", sorted(TRIPLE))
@pytest.mark.parametrize("chain", TRIPLES, ids=["-".join(c) for c in TRIPLES])
def test_third_mixed_partial(chain, g):
    f, closed = TRIPLE[g]
    outer, middle, inner = chain

    def build(d):
        return d(outer)(lambda z: d(middle)(lambda y: d(inner)(lambda x: f(x, y, z), X0), Y0), Z0)

    check_all(build, closed(X0, Y0, Z0), order=3)


# ---------------------------------------------------------------------------------------------
# the Hessian of a small MLP four ways (and three more)

GEN = torch.Generator().manual_seed(0)
W1, B1, W2 = torch.randn(5, 4, dtype=D, generator=GEN), torch.randn(5, dtype=D, generator=GEN), torch.randn(5, dtype=D, generator=GEN)
XM = torch.randn(4, dtype=D, generator=GEN)


def mlp(x):
    return W2 @ torch.tanh(W1 @ x + B1)


def mlp_hessian_closed_form(x):
    t = torch.tanh(W1 @ x + B1)
    return W1.T @ torch.diag(W2 * (-2 * t * (1 - t**2))) @ W1


def hessian_ways(lib):
    eye = torch.eye(4, dtype=D)
    return {
        "jacfwd-jacfwd": lambda f, x: lib.jacfwd(lib.jacfwd(f))(x),
        "jvp-jacfwd": lambda f, x: torch.stack([lib.jvp(lib.jacfwd(f), (x,), (e,))[1] for e in eye], dim=-1),
        "jacfwd-jacrev": lambda f, x: lib.jacfwd(lib.jacrev(f))(x),
        "jacrev-jacfwd": lambda f, x: lib.jacrev(lib.jacfwd(f))(x),
        "jacrev-jacrev": lambda f, x: lib.jacrev(lib.jacrev(f))(x),
        "jvp-grad": lambda f, x: torch.stack([lib.jvp(lib.grad(f), (x,), (e,))[1] for e in eye], dim=-1),
        "hessian": lambda f, x: lib.hessian(f)(x),
    }


@pytest.mark.parametrize("way", list(hessian_ways(tf)))
def test_mlp_hessian(way):
    ours = hessian_ways(functx)[way](mlp, XM)
    torch.testing.assert_close(ours, mlp_hessian_closed_form(XM))
    torch.testing.assert_close(ours, hessian_ways(tf)[way](mlp, XM))
    fd.assert_close(ours, fd.jacobian(lambda a: fd.jacobian(mlp, a, fd.STEP[2]), XM, fd.STEP[2]), order=2)


def mlp_loss(W, x):
    return W2 @ torch.tanh(W @ x + B1)


@pytest.mark.parametrize("outer", ["jacfwd", "jacrev"])
@pytest.mark.parametrize("inner", ["jacfwd", "jacrev", "grad"])
def test_mlp_weight_input_block_with_closure(inner, outer):
    """d/dx of d/dW loss(W, x): the inner transform's function closes over the outer's x."""

    def build(lib):
        return getattr(lib, outer)(lambda x: getattr(lib, inner)(lambda W: mlp_loss(W, x))(W1))(XM)

    t = torch.tanh(W1 @ XM + B1)
    s = 1 - t**2
    # d^2 loss / dW_kl dx_m = W2_k (s_k delta_lm - 2 t_k s_k W1_km x_l)
    closed = W2[:, None, None] * (
        s[:, None, None] * torch.eye(4, dtype=D)[None] - 2 * (t * s)[:, None, None] * XM[None, :, None] * W1[:, None, :]
    )
    ours = build(functx)
    torch.testing.assert_close(ours, closed)
    torch.testing.assert_close(ours, build(tf))
    by_fd = fd.jacobian(lambda x: fd.jacobian(lambda W: mlp_loss(W, x), W1, fd.STEP[2]), XM, fd.STEP[2])
    fd.assert_close(ours, by_fd, order=2)


# ---------------------------------------------------------------------------------------------
# forward mode and vmap with closures

B = 3
XB = torch.randn(B, 4, dtype=D, generator=GEN)
WV, VV = torch.randn(4, dtype=D, generator=GEN), torch.randn(4, dtype=D, generator=GEN)
VW = torch.randn(5, 4, dtype=D, generator=GEN)


def test_jvp_of_vmap_with_unbatched_closure():
    """Fisher-vector-product pattern: the jvp's input enters the vmapped function unbatched."""

    def build(lib):
        return lib.jvp(lambda w: lib.vmap(lambda xi: xi * w)(XB), (WV,), (VV,))

    out, tangent = build(functx)
    torch.testing.assert_close(out, XB * WV)
    torch.testing.assert_close(tangent, XB * VV)
    torch.testing.assert_close((out, tangent), build(tf))
    fd.assert_close(tangent, fd.directional(lambda w: XB * w, WV, VV))


def test_jvp_of_vmap_matmul_closure():
    def build(lib):
        return lib.jvp(lambda W: lib.vmap(lambda xi: torch.tanh(W @ xi))(XB), (W1,), (VW,))

    out, tangent = build(functx)
    torch.testing.assert_close(out, torch.tanh(XB @ W1.T))
    torch.testing.assert_close(tangent, (1 - torch.tanh(XB @ W1.T) ** 2) * (XB @ VW.T))
    torch.testing.assert_close((out, tangent), build(tf))
    fd.assert_close(tangent, fd.directional(lambda W: torch.tanh(XB @ W.T), W1, VW))


def test_vmap_of_jvp_closing_over_batched_input():
    def build(lib):
        return lib.vmap(lambda xi: lib.jvp(lambda w: torch.sin(w * xi), (WV,), (VV,))[1])(XB)

    ours = build(functx)
    torch.testing.assert_close(ours, torch.cos(WV * XB) * XB * VV)
    torch.testing.assert_close(ours, build(tf))
    fd.assert_close(ours, fd.directional(lambda w: torch.sin(w * XB), WV, VV))


def test_vmap_over_tangents_of_jvp_closure():
    V = torch.randn(B, 5, 4, dtype=D)

    def build(lib):
        return lib.vmap(lambda vi: lib.jvp(lambda W: torch.tanh(W @ XM), (W1,), (vi,))[1])(V)

    ours = build(functx)
    torch.testing.assert_close(ours, (1 - torch.tanh(W1 @ XM) ** 2) * (V @ XM))
    torch.testing.assert_close(ours, build(tf))
    fd.assert_close(ours, torch.stack([fd.directional(lambda W: torch.tanh(W @ XM), W1, vi) for vi in V]))


@pytest.mark.parametrize("jac", ["jacfwd", "jacrev"])
def test_jacobian_of_vmap_closure(jac):
    def build(lib):
        return getattr(lib, jac)(lambda w: lib.vmap(lambda xi: torch.tanh(w @ xi))(XB))(WV)

    ours = build(functx)
    torch.testing.assert_close(ours, (1 - torch.tanh(XB @ WV) ** 2)[:, None] * XB)
    torch.testing.assert_close(ours, build(tf))
    fd.assert_close(ours, fd.jacobian(lambda w: torch.tanh(XB @ w), WV))


@pytest.mark.parametrize("jac", ["jacfwd", "jacrev"])
def test_vmap_of_jacobian_closing_over_batched_input(jac):
    def build(lib):
        return lib.vmap(lambda xi: getattr(lib, jac)(lambda w: torch.sin(w * xi).sum())(WV))(XB)

    ours = build(functx)
    torch.testing.assert_close(ours, torch.cos(WV * XB) * XB)
    torch.testing.assert_close(ours, build(tf))
    fd.assert_close(ours, torch.stack([fd.jacobian(lambda w: torch.sin(w * xi).sum(), WV) for xi in XB]))


def loss_of_batch(W):
    return torch.tanh(XB @ W.T).pow(2).sum()


def test_hvp_through_vmap_closure():
    """Forward-over-reverse over vmap: the Hessian-vector product of a batched loss."""

    def build(lib):
        return lib.jvp(lib.grad(lambda W: lib.vmap(lambda xi: torch.tanh(W @ xi))(XB).pow(2).sum()), (W1,), (VW,))[1]

    def autograd_gradient(W):  # plain torch.autograd, no transform
        W = W.detach().requires_grad_()
        return torch.autograd.grad(loss_of_batch(W), W)[0]

    ours = build(functx)
    torch.testing.assert_close(ours, build(tf))
    fd.assert_close(ours, fd.directional(autograd_gradient, W1, VW))


def test_vmap_of_hvp_closing_over_batched_input():
    """Per-sample Hessian-vector products: the grad's function closes over the vmapped row."""

    def build(lib):
        return lib.vmap(lambda xi: lib.jvp(lib.grad(lambda W: torch.tanh(W @ xi).pow(2).sum()), (W1,), (VW,))[1])(XB)

    def autograd_gradient(W, xi):
        W = W.detach().requires_grad_()
        return torch.autograd.grad(torch.tanh(W @ xi).pow(2).sum(), W)[0]

    ours = build(functx)
    torch.testing.assert_close(ours, build(tf))
    fd.assert_close(ours, torch.stack([fd.directional(lambda W: autograd_gradient(W, xi), W1, VW) for xi in XB]))


def test_jvp_of_vmap_of_jvp_mixed_partial():
    """jvp over b, vmap over rows xi, jvp over a of sum(a * b * xi): the innermost function
    closes over the outer jvp's b and vmap's xi; per row the result is sum(ta * tb * xi)."""
    a0, b0, ta, tb = (torch.randn(4, dtype=D) for _ in range(4))

    def build(lib):
        inner = lambda b, xi: lib.jvp(lambda a: (a * b * xi).sum(), (a0,), (ta,))[1]
        return lib.jvp(lambda b: lib.vmap(lambda xi: inner(b, xi))(XB), (b0,), (tb,))[1]

    ours = build(functx)
    torch.testing.assert_close(ours, (ta * tb * XB).sum(-1))
    torch.testing.assert_close(ours, build(tf))
    by_fd = fd.directional(lambda b: fd.directional(lambda a: (a * b * XB).sum(-1), a0, ta, fd.STEP[2]), b0, tb, fd.STEP[2])
    fd.assert_close(ours, by_fd, order=2)


# ---------------------------------------------------------------------------------------------
# Jacobians of 0-d -> 0-d functions (the helper above goes around them through 1-element vectors)


@pytest.mark.parametrize("transform", ["jacfwd", "jacrev", "hessian"])
def test_zero_dim_jacobians(transform):
    x = torch.tensor(0.9, dtype=D)
    ours = getattr(functx, transform)(torch.sin)(x)
    expected = torch.cos(x) if transform != "hessian" else -torch.sin(x)
    torch.testing.assert_close(ours, expected)
    torch.testing.assert_close(ours, getattr(tf, transform)(torch.sin)(x))
    if transform == "hessian":
        fd.assert_close(ours, fd.derivative(lambda a: fd.derivative(torch.sin, a, fd.STEP[2]), x, fd.STEP[2]), order=2)
    else:
        fd.assert_close(ours, fd.derivative(torch.sin, x))


# jvp of a Hessian whose function reads strided views: the layout of a view's tangent under
# vmap over grad levels (vmap/rules/autograd_meta.py) decides whether torch's forward AD
# accepts it; a column of a matrix is a view whose grad-level wrapper has a shorter storage
# than its value. Reference: central differences of torch.autograd's Hessian (float64).
STRIDED_PROGRAMS = {
    "column": lambda x: torch.sin(x.reshape(3, 3)[:, 1]).sum() * x.sum(),
    "transposed-slice": lambda x: (x.reshape(3, 3).t()[1:] ** 3).sum(),
    "indexed-write": lambda x: _written(x).sin().sum(),
    "diagonal": lambda x: torch.exp(x.reshape(3, 3).diagonal()).prod(),
}


def _written(x):
    w = x.clone()
    w[0] = w[0] * 2
    w[4:6] = w[1:3] + x[7] ** 2  # (a product with w[1:3] would save it, then the write changes it)
    return w


def _autograd_hessian(f, x):
    return torch.autograd.functional.hessian(f, x, create_graph=False)


@pytest.mark.parametrize("name", list(STRIDED_PROGRAMS))
@pytest.mark.parametrize("mix", [False, True], ids=["closed", "mixed"])
def test_jvp_of_hessian_through_strided_views(name, mix):
    torch.manual_seed(3)
    f = STRIDED_PROGRAMS[name]
    x, t = torch.randn(9, dtype=D), torch.randn(9, dtype=D)

    def closing(x0, hessian):
        # mixed: the differentiated function closes over the jvp's own input
        return hessian(lambda y: f(y * (1 + 0.5 * torch.sin(x0)) if mix else y))(x0)

    primal, tangent = functx.jvp(lambda x0: closing(x0, functx.hessian), (x,), (t,))
    reference = lambda x0: closing(x0, lambda g: lambda y: _autograd_hessian(g, y))
    fd.assert_close(primal, reference(x), order=1)
    # one difference of an exact (autograd) Hessian: a first-order step and tolerance
    fd.assert_close(tangent, fd.directional(reference, x, t), order=1)
