"""Direct AD levels on values (functx/ad/choose.py): an outermost `jvp` runs torch's forward
AD on its plain primals, a `grad` right over such levels (or over an outermost grad/vjp) is
torch's autograd on the same values, and a `vjp` of plain primals inside vmap records on
the vmap level's BatchedTensors. The workloads of benchmarks/ad_hvp.py: Hessian-vector
products three ways, the Hessian times a matrix, Gauss-Newton products, a CG solve.

References, float64: plain torch.autograd (a create_graph gradient, then a backward per
tangent), explicit Jacobians and Hessians from torch.autograd.functional, central finite
differences of plain gradients, per-tangent loops.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import functx
from functx.ad.choose import GRAD, JVP, choose_level
from functx.ad.direct_forward import DirectJvpLevel
from functx.ad.direct_reverse import DirectGradLevel
from functx.core.interpreter import current_stack
from functx.vmap.interpreter import VmapInterpreter
from tests.ad import finite_differences as fd
from tests.autograd_functions import Cube, Mul, NumpyTanh, OnceDifferentiableExp

D = torch.float64
SIZES = (5, 7, 6, 3)


def make_problem(seed=0, norm=False):
    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(SIZES) - 2:
            layers.extend([nn.LayerNorm(b)] if norm else [])
            layers.append(nn.Tanh())
    model = nn.Sequential(*layers).to(D)
    params = {k: v.detach() for k, v in model.named_parameters()}
    names = list(params)
    shapes = [params[k].shape for k in names]
    sizes = [params[k].numel() for k in names]
    flat = torch.cat([params[k].flatten() for k in names])
    x = torch.randn(9, SIZES[0], dtype=D)
    y = torch.randint(0, SIZES[-1], (9,))

    def unflatten(p):
        return {k: t.view(s) for k, t, s in zip(names, p.split(sizes), shapes)}

    def loss_dict(params):
        return F.cross_entropy(functx.functional_call(model, params, (x,)), y)

    def loss_flat(p):
        return loss_dict(unflatten(p))

    def net_flat(p):
        return functx.functional_call(model, unflatten(p), (x,))

    return dict(model=model, params=params, flat=flat, unflatten=unflatten, x=x, y=y,
                loss_dict=loss_dict, loss_flat=loss_flat, net_flat=net_flat)  # fmt: skip


def plain_hvp(loss, p, v):
    leaf = p.detach().requires_grad_()
    (g,) = torch.autograd.grad(loss(leaf), leaf, create_graph=True)
    return torch.autograd.grad(g, leaf, v)[0]


def plain_hessian(loss, p):
    return torch.autograd.functional.hessian(loss, p, vectorize=True)


HVPS = {
    "fwd-over-rev": lambda f, p, v: functx.jvp(functx.grad(f), (p,), (v,))[1],
    "rev-over-rev": lambda f, p, v: functx.vjp(functx.grad(f), p)[1](v)[0],
    "rev-over-fwd": lambda f, p, v: functx.grad(lambda q: functx.jvp(f, (q,), (v,))[1])(p),
}


@pytest.mark.parametrize("norm", [False, True], ids=["tanh", "layer_norm"])
@pytest.mark.parametrize("way", sorted(HVPS))
def test_hvp_flat_params(way, norm):
    P = make_problem(norm=norm)
    v = torch.randn_like(P["flat"])
    got = HVPS[way](P["loss_flat"], P["flat"], v)
    torch.testing.assert_close(got, plain_hvp(P["loss_flat"], P["flat"], v))
    torch.testing.assert_close(got, plain_hessian(P["loss_flat"], P["flat"]) @ v)
    # finite differences of plain gradients along v (no AD of second order)
    grad = lambda q: torch.autograd.grad(P["loss_flat"](q.requires_grad_()), q)[0]
    fd_hvp = fd.directional(lambda q: grad(q.detach()), P["flat"], v, 1e-5)  # of first derivatives
    torch.testing.assert_close(got, fd_hvp, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("way", sorted(HVPS))
def test_hvp_dict_params(way):
    P = make_problem()
    v = {k: torch.randn_like(t) for k, t in P["params"].items()}
    got = HVPS[way](P["loss_dict"], P["params"], v)
    flat_v = torch.cat([v[k].flatten() for k in P["params"]])
    want = P["unflatten"](plain_hvp(P["loss_flat"], P["flat"], flat_v))
    for k in want:
        torch.testing.assert_close(got[k], want[k])


@pytest.mark.parametrize("way", ["fwd-over-rev", "rev-over-rev"])
def test_hessian_times_matrix(way):
    P = make_problem(norm=True)
    V = torch.randn(4, P["flat"].numel(), dtype=D)
    f, p = P["loss_flat"], P["flat"]
    if way == "fwd-over-rev":
        got = functx.vmap(lambda t: functx.jvp(functx.grad(f), (p,), (t,))[1])(V)
    else:
        vjp_fn = functx.vjp(functx.grad(f), p)[1]
        got = functx.vmap(lambda t: vjp_fn(t)[0])(V)
    want = torch.stack([plain_hvp(f, p, t) for t in V])
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got, V @ plain_hessian(f, p))


def ggn_vp(P, p, v):
    out, jv = functx.jvp(P["net_flat"], (p,), (v,))
    hjv = functx.jvp(functx.grad(lambda o: F.cross_entropy(o, P["y"])), (out,), (jv,))[1]
    return functx.vjp(P["net_flat"], p)[1](hjv)[0]


def explicit_ggn(P, p):
    J = torch.autograd.functional.jacobian(P["net_flat"], p, vectorize=True).reshape(-1, p.numel())
    out = P["net_flat"](p)
    H = torch.autograd.functional.hessian(lambda o: F.cross_entropy(o.view(out.shape), P["y"]), out.reshape(-1))
    return J.T @ H @ J


def test_gauss_newton_products():
    P = make_problem()
    p = P["flat"]
    G = explicit_ggn(P, p)
    v = torch.randn_like(p)
    torch.testing.assert_close(ggn_vp(P, p, v), G @ v)
    V = torch.randn(3, p.numel(), dtype=D)
    torch.testing.assert_close(functx.vmap(lambda t: ggn_vp(P, p, t))(V), V @ G)


def test_conjugate_gradient_solve():
    """10 CG steps on (H + damping I) x = g with functx HVPs equal the same steps with plain
    HVPs, and (with the problem's size as steps) solve the system."""
    P = make_problem()
    f, p, damping = P["loss_flat"], P["flat"], 0.1

    def cg(hvp, g, steps):
        x, r = torch.zeros_like(g), g.clone()
        d, rs = r.clone(), r @ r
        for _ in range(steps):
            hd = hvp(d) + damping * d
            alpha = rs / (d @ hd)
            x, r = x + alpha * d, r - alpha * hd
            rs_new = r @ r
            d, rs = r + (rs_new / rs) * d, rs_new
        return x

    g = functx.grad(f)(p)
    ours = lambda t: functx.jvp(functx.grad(f), (p,), (t,))[1]
    plain = lambda t: plain_hvp(f, p, t)
    torch.testing.assert_close(cg(ours, g, 10), cg(plain, g, 10))
    x = cg(ours, g, 3 * p.numel())
    A = plain_hessian(f, p) + damping * torch.eye(p.numel(), dtype=D)
    torch.testing.assert_close(A @ x, g, atol=1e-6, rtol=1e-6)


def test_levels_chosen():
    """The strategies the workloads above rely on (choose.py)."""
    x = torch.randn(3, dtype=D)
    seen = {}

    def record(name):
        def inner(v):
            seen[name] = [type(level).__name__ for level in current_stack()] + [
                (type(level).__name__, getattr(level, "vmap_levels", None)) for level in current_stack()[-1:]
            ]
            return (v.sin() * v).sum()

        return inner

    functx.jvp(functx.grad(record("fwd-over-rev")), (x,), (x,))
    functx.vjp(functx.grad(record("rev-over-rev")), x)[1](x)
    functx.vmap(lambda t: functx.jvp(functx.grad(record("H @ M")), (x,), (t,))[1])(torch.randn(2, 3, dtype=D))
    # forward-over-reverse: torch's forward AD on the values, and torch's autograd on them
    # for the grad inside (levels opened inside a jvp on values: core/dual_values.py)
    assert seen["fwd-over-rev"][:2] == ["DirectJvpLevel", "DirectGradLevel"]
    assert seen["fwd-over-rev"][-1][1] == ()
    assert seen["rev-over-rev"][:2] == ["DirectGradLevel", "DirectGradLevel"]
    assert seen["rev-over-rev"][-1][1] == ()
    # Hessian @ matrix: the primal once, only the tangents batched
    assert seen["H @ M"][:3] == ["VmapInterpreter", "DirectJvpLevel", "DirectGradLevel"]
    assert seen["H @ M"][-1][1] == ()
    # a grad of batched inputs inside vmap stays on the physical tensors; jvp inside grad wraps
    with functx.core.interpreter.interpreting(VmapInterpreter(2, "error")) as vmap_level:
        from functx.vmap.batched_tensor import BatchedTensor

        level = choose_level(GRAD, [BatchedTensor(torch.randn(2, 3), vmap_level)])
        assert type(level) is DirectGradLevel and level.vmap_levels == (vmap_level,)
        assert type(choose_level(JVP, ([torch.randn(3)], [torch.randn(3)]))) is DirectJvpLevel
    assert type(choose_level(JVP, ([torch.randn(3, requires_grad=True)], [torch.randn(3)]))).__name__ == "WrappedJvpLevel"


def test_jvp_on_values_with_batched_tangents_and_batched_closures():
    """vmap over tangents of a jvp of shared primals whose function also closes over a
    batched value (the vmap level's rules run below autograd, `ad_above`): per-element
    loop of plain forward-mode derivatives."""
    torch.manual_seed(1)
    w = torch.randn(4, 3, dtype=D)
    xs = torch.randn(5, 3, dtype=D)
    ts = torch.randn(5, 4, 3, dtype=D)

    def f(w, x):
        return torch.tanh(w @ x).pow(2).sum() * x.sum()

    got = functx.vmap(lambda x, t: functx.jvp(lambda w: f(w, x), (w,), (t,))[1])(xs, ts)
    want = torch.stack([torch.func.jvp(lambda w: f(w, x), (w,), (t,))[1] for x, t in zip(xs, ts)])
    torch.testing.assert_close(got, want)
    fd_want = torch.stack([fd.directional(lambda w: f(w, x), w, t) for x, t in zip(xs, ts)])
    fd.assert_close(got, fd_want)
    # and a Hessian-vector product of it (forward over reverse, both on values)
    got = functx.vmap(lambda x, t: functx.jvp(functx.grad(lambda w: f(w, x)), (w,), (t,))[1])(xs, ts)
    want = torch.stack([plain_hvp(lambda w: f(w, x), w, t) for x, t in zip(xs, ts)])
    torch.testing.assert_close(got, want)


def _vjp_per_sample(f, w, xs, cs):
    """The reference for vmap over (x, c) of vjp(lambda w: f(w, x), w)[1](c): a plain
    torch.autograd loop over the samples."""
    want = []
    for x, c in zip(xs, cs):
        leaf = w.clone().requires_grad_()
        want.append(torch.autograd.grad(f(leaf, x), leaf, c)[0])
    return torch.stack(want)


def test_vjp_of_shared_primals_inside_vmap():
    """vjp of unbatched primals inside vmap, batched cotangents and a batched closure: a
    loop of plain torch.autograd vector-Jacobian products; the vjp_fn also used after the
    vmap returned (escaping only plain tensors)."""
    torch.manual_seed(2)
    w = torch.randn(4, 3, dtype=D)
    xs = torch.randn(5, 3, dtype=D)
    cs = torch.randn(5, 4, dtype=D)

    def f(w, x):
        return torch.sin(w @ x) * x.sum()

    got = functx.vmap(lambda x, c: functx.vjp(lambda w: f(w, x), w)[1](c)[0])(xs, cs)
    torch.testing.assert_close(got, _vjp_per_sample(f, w, xs, cs))
    _, vjp_fn = functx.vjp(lambda w: torch.sin(w).sum(0), w)
    torch.testing.assert_close(functx.vmap(vjp_fn)(cs[:, :3])[0], cs[:, None, :3] * torch.cos(w)[None])


def test_grad_of_grad_on_values_keeps_levels_apart():
    """d/dx [x * d/dy (x * y)] = 2x, with the inner grad on the outer level's values, and the
    inner grad at the outer input itself (y = x)."""
    x = torch.tensor(0.7, dtype=D)
    torch.testing.assert_close(functx.grad(lambda a: a * functx.grad(lambda b: a * b)(x * 0 + 1.3))(x), 2 * x)
    torch.testing.assert_close(functx.grad(lambda a: a * functx.grad(lambda b: a + b)(a))(x), torch.ones((), dtype=D))
    # forward over reverse of the same
    one = torch.ones((), dtype=D)
    torch.testing.assert_close(functx.jvp(lambda a: a * functx.grad(lambda b: a * b)(a), (x,), (one,))[1], 2 * x)


def test_function_without_jvp_is_refused_clearly_on_values():
    x = torch.randn(3, dtype=D)
    with pytest.raises(RuntimeError, match="OnceDifferentiableExp has no jvp staticmethod"):
        functx.jvp(OnceDifferentiableExp.apply, (x,), (x,))
    assert current_stack() == ()
    # a Function with a jvp runs it: HVP of a Function-built loss (forward over reverse)
    v = torch.randn(3, dtype=D)
    torch.testing.assert_close(functx.jvp(lambda a: Cube.apply(a, 1.0), (x,), (v,))[1], 3 * x**2 * v)
    torch.testing.assert_close(functx.jvp(functx.grad(lambda a: Cube.apply(a, 1.0).sum()), (x,), (v,))[1], 6 * x * v)


def test_jvp_on_values_leaves_inputs_alone_and_detach_stops_it():
    x, t = torch.randn(3, dtype=D), torch.randn(3, dtype=D)
    out, tangent = functx.jvp(lambda a: (a * a.detach()).sum(), (x,), (t,))
    torch.testing.assert_close(tangent, (x * t).sum())
    assert torch.autograd.forward_ad._current_level < 0  # the dual level functx entered is left
    for value in (x, t, out, tangent):
        assert torch._VF._unpack_dual(value, 0)[1] is None


@pytest.mark.parametrize("norm", ["layer", "group", "batch"])
@pytest.mark.parametrize("primals", ["shared", "batched"])
def test_hessian_times_matrix_through_normalizations(norm, primals):
    """vmap over tangents of forward-over-reverse HVPs through normalization layers, with the
    primal shared (a jvp on values, tangents batched) or batched too (the physical jvp level:
    the norms' backward rules recompute their statistics so that their tangents are right;
    layer and batch norm were wrong by O(1) before). Reference: plain double backward."""
    torch.manual_seed(6)
    layer = {"layer": nn.LayerNorm(6), "group": nn.GroupNorm(2, 6), "batch": nn.BatchNorm1d(6, track_running_stats=False)}[norm]
    model = nn.Sequential(nn.Linear(4, 6), layer, nn.Tanh(), nn.Linear(6, 3)).to(D)
    named = [(k, v.detach()) for k, v in model.named_parameters()]
    p = torch.cat([v.flatten() for _, v in named])
    x = torch.randn(5, 4, dtype=D)

    def loss(q):
        params, offset = {}, 0
        for k, v in named:
            params[k] = q[offset : offset + v.numel()].view(v.shape)
            offset += v.numel()
        return (functx.functional_call(model, params, (x,)) ** 2).sum()

    V = torch.randn(3, p.numel(), dtype=D)
    want = torch.stack([plain_hvp(loss, p, t) for t in V])
    if primals == "shared":
        got = functx.vmap(lambda t: functx.jvp(functx.grad(loss), (p,), (t,))[1])(V)
    else:
        got = functx.vmap(lambda q, t: functx.jvp(functx.grad(loss), (q,), (t,))[1])(p.expand(3, -1).clone(), V)
    torch.testing.assert_close(got, want)


ELEMENTWISE = {
    "tanh": torch.tanh, "sigmoid": torch.sigmoid, "exp": torch.exp, "log": lambda z: torch.log(z * z + 1),
    "sin": torch.sin, "cos": torch.cos, "relu": F.relu, "sqrt": lambda z: torch.sqrt(z * z + 1),
    "rsqrt": lambda z: torch.rsqrt(z * z + 1), "reciprocal": lambda z: torch.reciprocal(z * z + 1),
    "gelu": F.gelu, "silu": F.silu, "softplus": F.softplus, "elu": F.elu, "leaky_relu": F.leaky_relu,
    "pow": lambda z: (z * z + 1) ** 1.5, "square": torch.square, "div": lambda z: z / (z * z + 2),
    "softmax": lambda z: F.softmax(z, -1), "log_softmax": lambda z: F.log_softmax(z, -1),
    "cross_entropy": lambda z: F.cross_entropy(z, torch.tensor([1, 0, 2]), reduction="none"),
    "weighted_nll": lambda z: F.nll_loss(F.log_softmax(z, -1), torch.tensor([1, 0, 2]), weight=torch.tensor([0.5, 2.0, 1.0, 1.5], dtype=D)),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
def test_reverse_over_forward_on_plain_duals(name):
    """grad of a jvp over the ops a wrapped jvp level runs on plain duals (or with functx's own
    tangent formula) when only grad levels on values lie below: a Hessian-vector product,
    against plain double backward (and torch.func's jvp(grad))."""
    torch.manual_seed(7)
    a = torch.randn(4, 4, dtype=D)
    w = torch.randn(3, 4, dtype=D)
    op = ELEMENTWISE[name]

    def f(x):
        out = op(x.view(3, 4) @ a)
        return (out * w.flatten()[: out.numel()].reshape(out.shape)).sum()

    x, t = torch.randn(12, dtype=D), torch.randn(12, dtype=D)
    got = functx.grad(lambda y: functx.jvp(f, (y,), (t,))[1])(x)
    torch.testing.assert_close(got, plain_hvp(f, x, t))
    torch.testing.assert_close(functx.jvp(f, (x,), (t,))[1], torch.func.jvp(f, (x,), (t,))[1])


@pytest.mark.parametrize("fn", ["generate_vmap_rule", "vmap_staticmethod"])
def test_functions_under_levels_on_values_inside_vmap(fn):
    """autograd.Functions applied to the BatchedTensors that a level on values records on
    (vjp of shared primals inside vmap; the Hessian times a matrix): their backward and jvp
    are recorded at that level (vmap/custom_function.py), against plain loops."""
    torch.manual_seed(8)
    w = torch.randn(3, dtype=D)
    xs, cs = torch.randn(4, 3, dtype=D), torch.randn(4, 3, dtype=D)
    f = (lambda w, x: Mul.apply(w, x).exp()) if fn == "generate_vmap_rule" else (lambda w, x: NumpyTanh.apply(w * x))
    got = functx.vmap(lambda x, c: functx.vjp(lambda w: f(w, x), w)[1](c)[0])(xs, cs)
    torch.testing.assert_close(got, _vjp_per_sample(f, w, xs, cs))
    got = functx.vmap(lambda x, c: functx.jvp(functx.grad(lambda w: f(w, x).sum()), (w,), (c,))[1])(xs, cs)
    want = torch.stack([plain_hvp(lambda w: f(w, x).sum(), w, c) for x, c in zip(xs, cs)])
    torch.testing.assert_close(got, want)


def test_dropout_of_shared_primals_inside_vmap():
    """A random op on the level's plain values under vmap(randomness="different"): the batch
    enters through an op torch's autograd records (vmap/randomness.py)."""
    w = torch.ones(3, 4, dtype=D)

    def per_element(_):
        out, pullback = functx.vjp(lambda w: F.dropout(w, 0.5, training=True), w)
        return out, pullback(torch.full_like(out, 3.0))[0]

    out, grad = functx.vmap(per_element, randomness="different")(torch.ones(5))
    torch.testing.assert_close(grad, 3 * out)
    assert not all(torch.equal(out[0], out[b]) for b in range(1, 5))


def test_jacobians_inside_vmap_are_laid_out_as_torch_func():
    """vmap(jacrev(f)) comes out row-major per element, as torch.func's does: the rows of a
    jacrev under vmap came out with the row dim outermost in memory, and `jac.view(b, -1)`
    (which works on torch.func's) raised."""
    import torch.func as tf

    f = lambda v: torch.tanh(v * 2).sum() * v
    x = torch.randn(5, 7, dtype=D)
    ours, theirs = functx.vmap(functx.jacrev(f))(x), tf.vmap(tf.jacrev(f))(x)
    torch.testing.assert_close(ours, theirs)
    assert ours.stride() == theirs.stride() == (49, 7, 1)
    torch.testing.assert_close(ours.view(5, -1), theirs.view(5, -1))
