"""`.detach()` inside a transform is a stop-gradient at EVERY level (torch.func's and JAX's
`stop_gradient` semantics): a detached value is a constant to the transform that saw it
detached and to every transform around it, at depth 1, 2 and 3.

The references are closed forms under those semantics and torch.func. Finite differences
cannot check a detach (they see the function without it), so they appear only in the last
part: the second derivatives that torch's autograd builds from detached saved values
(exp, tanh, softmax, ... save their outputs) must stay the true ones.
"""

import itertools

import pytest
import torch
import torch.func as tf
import torch.nn.functional as F

import functx
from tests.ad import finite_differences as fd
from tests.ad.scalar_derivatives import DERIVATIVES, derivative

D = torch.float64
X0 = torch.tensor(0.7, dtype=D)
GEN = torch.Generator().manual_seed(0)
X = torch.randn(4, dtype=D, generator=GEN)
XB = torch.randn(3, 4, dtype=D, generator=GEN)


def check(build, closed_form):
    """build(lib) evaluates the expression with the transforms of lib."""
    ours = build(functx)
    torch.testing.assert_close(ours, closed_form)
    torch.testing.assert_close(ours, build(tf))


# ---------------------------------------------------------------------------------------------
# the examples of the brief


def test_jvp_of_grad_of_self_times_detached():
    """grad of sum(x * sg(x)) is sg(x): a constant to the jvp around it."""
    f = lambda x: (x * x.detach()).sum()
    check(lambda lib: lib.grad(f)(X), X)
    check(lambda lib: lib.jvp(lib.grad(f), (X,), (torch.ones_like(X),))[1], torch.zeros_like(X))


def test_grad_of_grad_of_detached_times_self():
    check(lambda lib: lib.grad(lambda x: lib.grad(lambda y: y.detach() * y)(x))(X0), torch.zeros_like(X0))


HESSIANS = {
    "hessian": lambda lib, f, x: lib.hessian(f)(x),
    "jacfwd-jacfwd": lambda lib, f, x: lib.jacfwd(lib.jacfwd(f))(x),
    "jacfwd-jacrev": lambda lib, f, x: lib.jacfwd(lib.jacrev(f))(x),
    "jacrev-jacfwd": lambda lib, f, x: lib.jacrev(lib.jacfwd(f))(x),
    "jacrev-jacrev": lambda lib, f, x: lib.jacrev(lib.jacrev(f))(x),
}


@pytest.mark.parametrize("way", sorted(HESSIANS))
def test_hessian_of_self_times_detached(way):
    # without the detach: 2 I; with it the gradient sg(x) is constant: 0
    check(lambda lib: HESSIANS[way](lib, lambda x: (x * x.detach()).sum(), X), torch.zeros(4, 4, dtype=D))
    # sum(x^2 sg(x)): gradient 2 x sg(x), Hessian 2 diag(sg(x)) (without the detach: 6 diag(x))
    check(lambda lib: HESSIANS[way](lib, lambda x: (x**2 * x.detach()).sum(), X), 2 * torch.diag(X))


@pytest.mark.parametrize("jac", ["jacfwd", "jacrev"])
def test_jacobian_of_self_times_detached(jac):
    check(lambda lib: getattr(lib, jac)(lambda x: x * x.detach())(X), torch.diag(X))
    check(lambda lib: getattr(lib, jac)(lambda x: x.detach().sin())(X), torch.zeros(4, 4, dtype=D))


# ---------------------------------------------------------------------------------------------
# every chain of derivative transforms, depth 1 to 3, on f(x) = x^3 sg(x) (0-d x)
#
# with the stop-gradient at every level the k-th derivative is (d^k/dx^k x^3) * sg(x):
# 3 x^3, 6 x^2, 6 x (without the detach: 4 x^3, 12 x^2, 24 x; a detach that cuts only the
# innermost level gives 3 x^3, 9 x^2, ...)

CHAINS = [c for depth in (1, 2, 3) for c in itertools.product(DERIVATIVES, repeat=depth)]
KTH_DERIVATIVE = {1: 3 * X0**3, 2: 6 * X0**2, 3: 6 * X0}


def apply_chain(lib, chain, f, x):
    """chain[0] is the outermost derivative."""
    g = f
    for name in reversed(chain[1:]):
        g = (lambda inner, d: lambda y: d(inner, y))(g, derivative(lib, name))
    return derivative(lib, chain[0])(g, x)


@pytest.mark.parametrize("chain", CHAINS, ids=["-".join(c) for c in CHAINS])
def test_detach_stops_every_level(chain):
    check(lambda lib: apply_chain(lib, chain, lambda x: x**3 * x.detach(), X0), KTH_DERIVATIVE[len(chain)])


PAIRS = list(itertools.product(DERIVATIVES, repeat=2))
PAIR_IDS = [f"{outer}-of-{inner}" for outer, inner in PAIRS]


@pytest.mark.parametrize(("outer", "inner"), PAIRS, ids=PAIR_IDS)
def test_detach_of_inner_input_is_constant_to_the_outer_level(outer, inner):
    """d/dx [d/dy (y^2 sg(y)) at y = x]: the inner derivative is 2 y sg(y) = 2 x sg(x), whose
    outer derivative is 2 sg(x) = 2 x (4 x if the detach cut only the inner level)."""

    def build(lib):
        return derivative(lib, outer)(lambda x: derivative(lib, inner)(lambda y: y**2 * y.detach(), x), X0)

    check(build, 2 * X0)


@pytest.mark.parametrize(("outer", "inner"), PAIRS, ids=PAIR_IDS)
def test_detach_of_outer_input_inside_inner_function(outer, inner):
    """d/dx [d/dy (y^2 sg(x)) at y = x] = d/dx [2 x sg(x)] = 2 x (4 x without the detach); and
    the mixed partial d/dx [d/dy (y sg(x))] is 0."""

    def build(lib):
        return derivative(lib, outer)(lambda x: derivative(lib, inner)(lambda y: y**2 * x.detach(), x), X0)

    check(build, 2 * X0)

    def mixed(lib):
        return derivative(lib, outer)(lambda x: derivative(lib, inner)(lambda y: y * x.detach(), X0 + 1), X0)

    check(mixed, torch.zeros_like(X0))


# ---------------------------------------------------------------------------------------------
# with vmap


def test_vmap_of_grad_with_detach():
    f = lambda x: (x**2 * x.detach()).sum()
    check(lambda lib: lib.vmap(lib.grad(f))(XB), 2 * XB**2)


def test_grad_of_vmap_with_detach():
    f = lambda x: (x**2 * x.detach()).sum()
    check(lambda lib: lib.grad(lambda xs: lib.vmap(f)(xs).sum())(XB), 2 * XB**2)


def test_grad_of_vmap_of_grad_with_detach():
    """The per-row gradient sg(x_i) is constant to the outer grad: 0 (2 without the detach)."""
    f = lambda x: (x * x.detach()).sum()
    check(lambda lib: lib.grad(lambda xs: lib.vmap(lib.grad(f))(xs).sum())(XB), torch.zeros_like(XB))


def test_vmap_of_grad_of_grad_with_detach():
    def build(lib):
        return lib.vmap(lambda xi: lib.grad(lambda x: lib.grad(lambda y: (y**3 * y.detach()).sum())(x).sum())(xi))(XB)

    check(build, 6 * XB**2)


def test_detach_under_vmap_of_jvp():
    ones = torch.ones(4, dtype=D)
    # tangent of a * sg(a) along ones: sg(a)
    check(lambda lib: lib.vmap(lambda xi: lib.jvp(lambda a: a * a.detach(), (xi,), (ones,))[1])(XB), XB)
    # the closure over the vmapped row, detached inside the jvp: tangent sg(xi)
    check(lambda lib: lib.vmap(lambda xi: lib.jvp(lambda a: a * xi.detach(), (X,), (ones,))[1])(XB), XB)


def test_detach_under_vmap_of_jvp_of_grad():
    """Per-sample forward-over-reverse: the gradient sg(x) has a zero tangent."""
    ones = torch.ones(4, dtype=D)
    f = lambda a: (a * a.detach()).sum()
    check(lambda lib: lib.vmap(lambda xi: lib.jvp(lib.grad(f), (xi,), (ones,))[1])(XB), torch.zeros_like(XB))
    f2 = lambda a: (a**2 * a.detach()).sum()
    check(lambda lib: lib.vmap(lambda xi: lib.jvp(lib.grad(f2), (xi,), (ones,))[1])(XB), 2 * XB)


def test_jvp_of_vmap_with_detach():
    v = torch.randn(4, dtype=D)
    # d/dw of xi * w * sg(w) along v: xi * v * sg(w)
    check(lambda lib: lib.jvp(lambda w: lib.vmap(lambda xi: xi * w * w.detach())(XB), (X,), (v,))[1], XB * v * X)


# ---------------------------------------------------------------------------------------------
# second derivatives that torch's own backward formulas build from saved values stay right
# (references: closed forms, torch.func, nested float64 finite differences)

SCALAR_OPS = {  # f, f'', f''' in closed form
    "exp": (torch.exp, torch.exp, torch.exp),
    "tanh": (
        torch.tanh,
        lambda x: -2 * torch.tanh(x) * (1 - torch.tanh(x) ** 2),
        lambda x: (1 - torch.tanh(x) ** 2) * (6 * torch.tanh(x) ** 2 - 2),
    ),
    "sigmoid": (
        torch.sigmoid,
        lambda x: torch.sigmoid(x) * (1 - torch.sigmoid(x)) * (1 - 2 * torch.sigmoid(x)),
        lambda x: torch.sigmoid(x) * (1 - torch.sigmoid(x)) * (1 - 6 * torch.sigmoid(x) * (1 - torch.sigmoid(x))),
    ),
    "sqrt": (torch.sqrt, lambda x: -0.25 * x**-1.5, lambda x: 0.375 * x**-2.5),
}


@pytest.mark.parametrize("op", sorted(SCALAR_OPS))
@pytest.mark.parametrize("chain", [("grad", "grad"), ("jvp", "grad"), ("grad", "grad", "grad"), ("jvp", "grad", "grad")], ids="-".join)
def test_higher_derivatives_of_ops_saving_outputs(chain, op):
    f, second, third = SCALAR_OPS[op]
    x = torch.tensor(0.8, dtype=D)
    ours = apply_chain(functx, chain, f, x)
    torch.testing.assert_close(ours, (second if len(chain) == 2 else third)(x))
    torch.testing.assert_close(ours, apply_chain(tf, chain, f, x))
    order = len(chain)
    by_fd = f
    for _ in range(order):
        by_fd = (lambda h: lambda a: fd.derivative(h, a, fd.STEP[order]))(by_fd)
    fd.assert_close(ours, by_fd(x), order=order)


C = torch.randn(4, dtype=D, generator=GEN)
LN_WEIGHT, LN_BIAS = torch.randn(4, dtype=D, generator=GEN), torch.randn(4, dtype=D, generator=GEN)
VECTOR_OPS = {  # scalar functions of a vector whose backward uses saved outputs / statistics
    "softmax": lambda x: (F.softmax(x, dim=0) * C).sum(),
    "log_softmax": lambda x: (F.log_softmax(x, dim=0) * C).sum(),
    "logsumexp": lambda x: torch.logsumexp(x, dim=0),
    "layer_norm": lambda x: (F.layer_norm(x, (4,), LN_WEIGHT, LN_BIAS) * C).sum(),
    "exp_sum": lambda x: (torch.exp(x) * C).sum(),
}


def layer_norm_decomposed(x):
    normed = (x - x.mean()) / torch.sqrt(x.var(unbiased=False) + 1e-5)
    return ((normed * LN_WEIGHT + LN_BIAS) * C).sum()


# torch.func's (and plain torch.autograd.forward_ad's) second derivative of layer_norm through
# an inner forward-mode level is wrong: native_layer_norm's forward formula drops a
# second-order term (pytorch/pytorch#196700, umbrella #198017; torch 2.13 off by up to 0.48
# here). Finite differences win there: the references are finite differences and torch.func
# on the decomposed layer norm above, not torch.func on F.layer_norm.
TORCH_FUNC_WRONG = {("layer_norm", "jacfwd-jacfwd"), ("layer_norm", "jacrev-jacfwd")}


def logsumexp_hessian(x):
    p = torch.softmax(x, dim=0)
    return torch.diag(p) - torch.outer(p, p)


@pytest.mark.parametrize("way", sorted(HESSIANS))
@pytest.mark.parametrize("op", sorted(VECTOR_OPS))
def test_hessians_of_ops_with_saved_values(op, way):
    f = VECTOR_OPS[op]
    ours = HESSIANS[way](functx, f, X)
    if (op, way) in TORCH_FUNC_WRONG:
        torch.testing.assert_close(ours, HESSIANS[way](tf, layer_norm_decomposed, X))
    else:
        torch.testing.assert_close(ours, HESSIANS[way](tf, f, X))
    fd.assert_close(ours, fd.jacobian(lambda a: fd.jacobian(f, a, fd.STEP[2]), X, fd.STEP[2]), order=2)
    if op == "logsumexp":
        torch.testing.assert_close(ours, logsumexp_hessian(X))
    if op == "exp_sum":
        torch.testing.assert_close(ours, torch.diag(torch.exp(X) * C))


@pytest.mark.parametrize("op", sorted(VECTOR_OPS))
def test_hvp_of_ops_with_saved_values_under_vmap(op):
    """Per-sample Hessian-vector products (vmap of jvp of grad) of the same functions."""
    f = VECTOR_OPS[op]
    v = torch.randn(4, dtype=D)

    def build(lib):
        return lib.vmap(lambda xi: lib.jvp(lib.grad(f), (xi,), (v,))[1])(XB)

    ours = build(functx)
    torch.testing.assert_close(ours, build(tf))
    by_fd = torch.stack([fd.directional(lambda a: fd.jacobian(f, a, fd.STEP[2]), xi, v, fd.STEP[2]) for xi in XB])
    fd.assert_close(ours, by_fd, order=2)
