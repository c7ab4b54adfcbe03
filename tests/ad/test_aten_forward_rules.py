"""Forward-over-reverse through ATen operators whose torch forward formula fails
(functx/ad/aten_forward_rules.py): mse_loss_backward with reduction="mean" raised
"ZeroTensors are immutable" under jvp(grad), jvp(jacrev), vmap(jvp(jacrev)) (curvlinops'
Hessian and GGN products) and jacfwd(grad). References: torch.autograd double backward
with create_graph in float64, and central differences of the gradient."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import functx

DOUBLE = torch.float64


def _data(seed, n=5, d=3, k=2):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=DOUBLE) for shape in ((n, d), (n, k), (d, k), (d, k), (n, k))]


def _hvp_reference(f, args, tangents):
    """d/de grad f(args + e tangents) by autograd with create_graph (f differentiated in every argument)."""
    leaves = [a.clone().requires_grad_() for a in args]
    grads = torch.autograd.grad(f(*leaves), leaves, create_graph=True)
    dot = sum((g * t).sum() for g, t in zip(grads, tangents))
    second = torch.autograd.grad(dot, leaves, allow_unused=True, materialize_grads=True)
    return second


def _central_difference(f, args, tangents, eps=1e-6):
    def gradient(values):
        leaves = [v.clone().requires_grad_() for v in values]
        return torch.autograd.grad(f(*leaves), leaves)

    plus = gradient([a + eps * t for a, t in zip(args, tangents)])
    minus = gradient([a - eps * t for a, t in zip(args, tangents)])
    return [(p - m) / (2 * eps) for p, m in zip(plus, minus)]


TRANSFORMS = {
    "jvp(grad)": lambda f, w, v: functx.jvp(functx.grad(f), (w,), (v,))[1],
    "jvp(jacrev)": lambda f, w, v: functx.jvp(functx.jacrev(f), (w,), (v,))[1],
    "jacfwd(grad)@v": lambda f, w, v: (functx.jacfwd(functx.grad(f))(w) * v).sum((-2, -1)),
    "hessian@v": lambda f, w, v: (functx.hessian(f)(w) * v).sum((-2, -1)),
    "vmap(jvp(jacrev))": lambda f, w, v: functx.vmap(lambda t: functx.jvp(functx.jacrev(f), (w,), (t,))[1])(
        torch.stack([v, 2 * v])
    )[0],
    "vmap(jvp(grad)) in_dims=0": lambda f, w, v: functx.vmap(lambda ww, t: functx.jvp(functx.grad(f), (ww,), (t,))[1])(
        torch.stack([w, w]), torch.stack([v, v])
    )[1],
}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
def test_mse_loss_hessian_vector_products(transform, reduction):
    X, y, W, V, _ = _data(0)

    def loss(w):
        out = F.mse_loss(X @ w, y, reduction=reduction)
        return out if reduction != "none" else out.sum()

    got = TRANSFORMS[transform](loss, W, V)
    (expected,) = _hvp_reference(loss, [W], [V])
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got, _central_difference(loss, [W], [V])[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_mse_loss_tangent_on_target_and_on_input(reduction):
    """The rule's other terms: a tangent on the target alone and on both."""
    X, y, W, V, U = _data(1)

    def loss(w, target):
        return F.mse_loss(X @ w, target, reduction=reduction)

    for tangents in [(torch.zeros_like(V), U), (V, U)]:
        got = functx.jvp(functx.grad(loss, argnums=(0, 1)), (W, y), tangents)[1]
        expected = _hvp_reference(loss, [W, y], tangents)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e)


@pytest.mark.parametrize("stack", ["jvp(vjp(grad))", "jvp(grad(grad))", "grad(jvp(grad))"])
def test_mse_loss_forward_over_reverse_over_reverse(stack):
    """jvp over vjp over grad of sin(mse_loss(sin(x), t)): the reverse graph the forward
    level differentiates must carry the tangents (a rule that gave the tangent beside the
    operator's kernel on the primals recorded a graph that saved primals without them: a
    wrong value, found by a 10,000-example fuzz run). Reference: autograd's third derivative
    (create_graph)."""
    X, y, W, V, U = _data(6)
    x, t = W[:, 0].clone(), y[:3, 0].clone()
    v, u = V[:, 0].clone(), U[:3, 0].clone()

    def loss(a):
        return torch.sin(F.mse_loss(torch.sin(a), t))

    leaf = x.clone().requires_grad_()
    (g1,) = torch.autograd.grad(loss(leaf), leaf, create_graph=True)
    (g2,) = torch.autograd.grad((g1 * u).sum(), leaf, create_graph=True)
    (g3,) = torch.autograd.grad((g2 * v).sum(), leaf)
    if stack == "jvp(vjp(grad))":
        got = functx.jvp(lambda a: functx.vjp(functx.grad(loss), a)[1](u)[0], (x,), (v,))[1]
    elif stack == "jvp(grad(grad))":
        got = functx.jvp(functx.grad(lambda a: (functx.grad(loss)(a) * u).sum()), (x,), (v,))[1]
    else:
        got = functx.grad(lambda a: (functx.jvp(functx.grad(loss), (a,), (v,))[1] * u).sum())(x)
    torch.testing.assert_close(got, g3)


def test_mse_loss_third_order_and_plain_double_backward():
    """The rule's tangent stays differentiable (grad of jvp(grad)); plain torch double
    backward through the shadowed kernel is unchanged."""
    X, y, W, V, _ = _data(2)
    loss = lambda w: F.mse_loss(torch.tanh(X @ w), y)
    third = functx.grad(lambda w: functx.jvp(functx.grad(loss), (w,), (V,))[1].sum())(W)
    w = W.clone().requires_grad_()
    (g,) = torch.autograd.grad(loss(w), w, create_graph=True)
    (hv,) = torch.autograd.grad((g * V).sum(), w, create_graph=True)
    (expected,) = torch.autograd.grad(hv.sum(), w)
    torch.testing.assert_close(third, expected)


def test_mse_loss_backward_tangent_of_grad_output():
    """A tangent on grad_output itself (the rule's (x - t) g_t term): jvp over the upstream
    scale of the loss."""
    X, y, W, V, _ = _data(3)

    def g_of(w, scale):
        return functx.grad(lambda ww: scale * F.mse_loss(X @ ww, y))(w)

    scale = torch.tensor(1.5, dtype=DOUBLE)
    got = functx.jvp(g_of, (W, scale), (V, torch.tensor(0.5, dtype=DOUBLE)))[1]
    # directional derivative by central differences in both arguments
    eps = 1e-6
    plus = g_of(W + eps * V, scale + eps * 0.5)
    minus = g_of(W - eps * V, scale - eps * 0.5)
    torch.testing.assert_close(got, (plus - minus) / (2 * eps), atol=1e-6, rtol=1e-6)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    reduction=st.sampled_from(["mean", "sum", "none"]),
    transform=st.sampled_from(sorted(TRANSFORMS)),
    broadcast_target=st.booleans(),
    nonlinearity=st.sampled_from([None, torch.tanh, torch.sin]),
)
def test_mse_loss_forward_over_reverse_property(seed, reduction, transform, broadcast_target, nonlinearity):
    X, y, W, V, _ = _data(seed)
    target = y[:1] if broadcast_target else y

    def loss(w):
        out = X @ w
        out = out if nonlinearity is None else nonlinearity(out)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the broadcast target's UserWarning
            value = F.mse_loss(out, target.expand_as(out) if broadcast_target else target, reduction=reduction)
        return value if reduction != "none" else value.sum()

    got = TRANSFORMS[transform](loss, W, V)
    (expected,) = _hvp_reference(loss, [W], [V])
    torch.testing.assert_close(got, expected)


def test_curvlinops_hessian_times_matrix_pattern():
    """curvlinops' Hessian @ M: vmap over M's columns of jvp(jacrev(loss of the parameters
    through functional_call)), MSELoss(reduction="mean"), against autograd's full Hessian."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()
    X, y = torch.randn(6, 3, dtype=DOUBLE), torch.randn(6, 2, dtype=DOUBLE)
    names = [n for n, _ in model.named_parameters()]
    params = tuple(p.detach() for p in model.parameters())
    loss_fn = torch.nn.MSELoss(reduction="mean")

    def loss(*ps):
        return loss_fn(functx.functional_call(model, dict(zip(names, ps)), (X,)), y)

    sizes = [p.numel() for p in params]
    M = torch.randn(sum(sizes), 3, dtype=DOUBLE)

    def hvp(column):
        tangents = tuple(t.reshape(p.shape) for t, p in zip(column.split(sizes), params))
        out = functx.jvp(functx.jacrev(loss, argnums=tuple(range(len(params)))), params, tangents)[1]
        return torch.cat([o.flatten() for o in out])

    got = functx.vmap(hvp, in_dims=1, out_dims=1)(M)
    flat = torch.cat([p.flatten() for p in params]).requires_grad_()

    def flat_loss(v):
        return loss(*(c.reshape(p.shape) for c, p in zip(v.split(sizes), params)))

    hessian = torch.autograd.functional.hessian(flat_loss, flat.detach())
    torch.testing.assert_close(got, hessian @ M)


def test_grad_of_jvp_of_jvp_of_a_norm():
    """grad(jvp(jvp(vector_norm))) (F.normalize's norm; issue 27's grad(jacfwd(jacfwd)) with
    index_fill_ and F.normalize): "one of the variables needed for gradient computation has
    been modified by an inplace operation ... output 0 of MaskedFill" (torch.func too):
    torch's norm_jvp divides and masks a temporary in place. The wrapped jvp level computes
    the 2-norm's tangent out of place (jvp_rules._vector_norm_jvp). Plain autograd's
    third derivative is the reference."""
    x, one = torch.randn(3, dtype=DOUBLE), torch.ones(3, dtype=DOUBLE)

    def f(x):
        return functx.jvp(lambda a: functx.jvp(lambda b: torch.linalg.vector_norm(b), (a,), (one,))[1], (x,), (one,))[1]

    leaf = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(torch.linalg.vector_norm(leaf), leaf, create_graph=True)
    (hv,) = torch.autograd.grad((g * one).sum(), leaf, create_graph=True)
    (expected,) = torch.autograd.grad((hv * one).sum(), leaf)
    torch.testing.assert_close(functx.grad(f)(x), expected)


def _third_order_reference(g, x, y):
    """d/dx sum_ij d/dx_j d/dy_i... : grad over x of the sum of the mixed Hessian d2 g / dy dx
    of each output, by plain autograd with create_graph (float64)."""
    xx, yy = x.clone().requires_grad_(), y.clone().requires_grad_()
    out = g(xx, yy).flatten()
    total = 0
    for o in out:
        (gy,) = torch.autograd.grad(o, yy, create_graph=True)
        for e in gy.flatten():
            (gx,) = torch.autograd.grad(e, xx, create_graph=True, allow_unused=True, materialize_grads=True)
            total = total + gx.sum()
    return torch.autograd.grad(total, xx)[0]


def test_the_issues_index_fill_and_normalize_under_grad_of_jacfwd_of_jacfwd():
    idx = torch.tensor([1])

    def g(x, y):
        a = x.clone()
        a.index_fill_(0, idx, 0.5)
        b = y.clone()
        b.index_fill_(0, idx, 2.0)
        return F.normalize(a * b + x * y, dim=0)

    x, y = _data(4)[0][0][:3].clone(), _data(5)[0][0][:3].clone()
    got = functx.grad(lambda x, y: functx.jacfwd(functx.jacfwd(g, argnums=1), argnums=0)(x, y).sum())(x, y)
    torch.testing.assert_close(got, _third_order_reference(g, x, y))


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    dim=st.sampled_from([None, 0, 1, (0, 1)]),
    keepdim=st.booleans(),
    stack=st.sampled_from(["grad(jvp(jvp))", "grad(jacfwd(jacfwd))", "jacfwd(jacfwd(jacfwd))"]),
)
def test_norms_under_third_order_stacks(seed, dim, keepdim, stack):
    """The 2-norm's tangent at a wrapped jvp level, against plain autograd's third
    derivatives: dims as int, list or None, keepdim, a normalize-like division."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 2, dtype=DOUBLE, generator=g)
    v = torch.randn(3, 2, dtype=DOUBLE, generator=g)

    def f(a):
        n = torch.linalg.vector_norm(a, dim=dim, keepdim=keepdim)
        return (n.sum() * a).sin().sum() if not keepdim else (a / n.clamp_min(1e-12)).sin().sum()

    leaf = x.clone().requires_grad_()
    (g1,) = torch.autograd.grad(f(leaf), leaf, create_graph=True)
    (g2,) = torch.autograd.grad((g1 * v).sum(), leaf, create_graph=True)
    (g3,) = torch.autograd.grad((g2 * v).sum(), leaf)
    if stack == "grad(jvp(jvp))":
        got = functx.grad(lambda a: functx.jvp(lambda b: functx.jvp(f, (b,), (v,))[1], (a,), (v,))[1])(x)
    elif stack == "grad(jacfwd(jacfwd))":
        got = functx.grad(lambda a: (functx.jacfwd(lambda b: (functx.jacfwd(f)(b) * v).sum())(a) * v).sum())(x)
    else:
        got = functx.jacfwd(lambda a: (functx.jacfwd(lambda b: (functx.jacfwd(f)(b) * v).sum())(a) * v).sum())(x)
    torch.testing.assert_close(got, g3)


@pytest.mark.parametrize("case", ["vector", "matrix", "right"])
def test_solve_reverse_over_forward(case):
    """vjp(jvp(linalg.solve(A(x), B))): torch's forward formula reuses the LU factorization
    the op returns, which has no derivative, so reverse mode over it was wrong (functx and
    torch.func alike); a wrapped jvp level computes the tangent by solve itself. Reference:
    plain autograd (the jvp by the double-backward trick, then its gradient), and central
    differences of the jvp."""
    g = torch.Generator().manual_seed(7)
    x, v = torch.randn(3, dtype=DOUBLE, generator=g), torch.randn(3, dtype=DOUBLE, generator=g)
    B = {"vector": torch.randn(3, dtype=DOUBLE, generator=g), "matrix": torch.randn(3, 2, dtype=DOUBLE, generator=g),
         "right": torch.randn(2, 3, dtype=DOUBLE, generator=g)}[case]

    def f(a):
        m = torch.outer(a, a) + torch.diag(torch.arange(1.0, 4.0, dtype=DOUBLE))
        return torch.linalg.solve(m, B, left=case != "right")

    cotangent = torch.randn(f(x).shape, dtype=DOUBLE, generator=g)
    got = functx.vjp(lambda a: functx.jvp(f, (a,), (v,))[1], x)[1](cotangent)[0]

    def jvp_by_autograd(a):
        out = f(a)
        dummy = torch.zeros_like(out, requires_grad=True)
        (vjp,) = torch.autograd.grad(out, a, dummy, create_graph=True)
        (jv,) = torch.autograd.grad(vjp, dummy, v, create_graph=True)
        return jv

    leaf = x.clone().requires_grad_()
    (expected,) = torch.autograd.grad((jvp_by_autograd(leaf) * cotangent).sum(), leaf)
    torch.testing.assert_close(got, expected)
    eps = 1e-6
    scalar = lambda a: (functx.jvp(f, (a,), (v,))[1] * cotangent).sum()
    differences = torch.stack([(scalar(x + eps * e) - scalar(x - eps * e)) / (2 * eps) for e in torch.eye(3, dtype=DOUBLE)])
    torch.testing.assert_close(got, differences, atol=1e-6, rtol=1e-6)


# --- forward mode through fused attention (F.scaled_dot_product_attention) ----------------------
# torch.func: "derivative for aten::_scaled_dot_product_flash_attention_for_cpu_backward is not
# implemented" (jvp, jacfwd, HVPs). Reference: the math form (softmax(q kᵀ s + mask) v) in
# float64, differentiated by torch.autograd (double backward: no forward AD involved).


def _attention_math(q, k, v, is_causal=False, attn_mask=None, scale=None):
    scores = q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if is_causal:
        scores = scores.masked_fill(torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril().logical_not(), float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    return scores.softmax(-1) @ v


def _attention_inputs(seed, rows=7, keys=7):
    g = torch.Generator().manual_seed(seed)
    shapes = [(2, 3, rows, 4), (2, 3, keys, 4), (2, 3, keys, 4)]  # one head dim: the fused kernel
    primals = [torch.randn(*s, generator=g, dtype=DOUBLE) for s in shapes]
    tangents = [torch.randn(*s, generator=g, dtype=DOUBLE) for s in shapes]
    return primals, tangents


_MASKS = {
    "none": lambda rows, keys: {},
    "causal": lambda rows, keys: {"is_causal": True},
    "bool_mask": lambda rows, keys: {"attn_mask": torch.rand(rows, keys, generator=torch.Generator().manual_seed(3)) > 0.3},
    "float_mask_and_scale": lambda rows, keys: {
        "attn_mask": torch.randn(rows, keys, generator=torch.Generator().manual_seed(4), dtype=DOUBLE),
        "scale": 0.3,
    },
}


@pytest.mark.filterwarnings("ignore::functx.PerformanceWarning")
@pytest.mark.parametrize("block", [256, 3])  # one block, and several (with a partial last one)
@pytest.mark.parametrize("shape", [(7, 7), (5, 9)], ids=["self", "cross"])
@pytest.mark.parametrize("mask", list(_MASKS))
def test_attention_jvp_jacfwd_and_hvp(mask, shape, block, monkeypatch):
    from functx.ad import aten_forward_rules

    monkeypatch.setattr(aten_forward_rules, "_QUERY_BLOCK", block)
    rows, keys = shape
    kwargs = _MASKS[mask](rows, keys)
    if mask == "bool_mask":
        kwargs["attn_mask"][:, 0] = True  # no fully masked row
    (q, k, v), (tq, tk, tv) = _attention_inputs(rows + keys, rows, keys)
    fused = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kwargs)  # noqa: E731
    math = lambda q, k, v: _attention_math(q, k, v, **kwargs)  # noqa: E731
    expected = torch.autograd.functional.jvp(math, (q, k, v), (tq, tk, tv))[1]
    torch.testing.assert_close(functx.jvp(fused, (q, k, v), (tq, tk, tv))[1], expected)
    # one tangent (jacfwd over the queries of one head), batched by vmap
    jac = functx.jacfwd(lambda q0: fused(q0.expand(2, 3, rows, 4), k, v)[0, 0, -1])(q[0, 0])
    jac_ref = torch.autograd.functional.jacobian(lambda q0: math(q0.expand(2, 3, rows, 4), k, v)[0, 0, -1], q[0, 0])
    torch.testing.assert_close(jac, jac_ref)
    # forward over reverse: the Hessian-vector product of a loss through attention
    loss = lambda q, k, v: fused(q, k, v).pow(2).sum()  # noqa: E731
    hvp = functx.jvp(functx.grad(loss, argnums=(0, 1, 2)), (q, k, v), (tq, tk, tv))[1]
    hvp_ref = _hvp_reference(lambda q, k, v: math(q, k, v).pow(2).sum(), (q, k, v), (tq, tk, tv))
    for got, want in zip(hvp, hvp_ref):
        torch.testing.assert_close(got, want)
    # per-sample jvps
    per_sample = functx.vmap(lambda q, tq: functx.jvp(lambda u: fused(u, k[0], v[0]), (q,), (tq,))[1])(q, tq)
    torch.testing.assert_close(per_sample, torch.stack([torch.autograd.functional.jvp(lambda u: math(u, k[0], v[0]), a, t)[1] for a, t in zip(q, tq)]))


@pytest.mark.parametrize("shape", [(7, 7), (5, 9)], ids=["self", "cross"])
@pytest.mark.parametrize("mask", list(_MASKS))
def test_attention_jvp_with_primals_the_caller_tracks(mask, shape):
    """A jvp level over values the caller's autograd tracks meets `_FusedAttention` (the fused
    kernel with a differentiable backward): it raised "You must implement the jvp function";
    its jvp is the math form's tangent, and the caller's gradient goes through it."""
    rows, keys = shape
    kwargs = _MASKS[mask](rows, keys)
    if mask == "bool_mask":
        kwargs["attn_mask"][:, 0] = True
    (q, k, v), (tq, tk, tv) = _attention_inputs(rows * keys, rows, keys)
    fused = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kwargs)  # noqa: E731
    math = lambda q, k, v: _attention_math(q, k, v, **kwargs)  # noqa: E731
    expected = torch.autograd.functional.jvp(math, (q, k, v), (tq, tk, tv))[1]
    tracked = [x.clone().requires_grad_() for x in (q, k, v)]
    out, tangent = functx.jvp(fused, tuple(tracked), (tq, tk, tv))
    torch.testing.assert_close(tangent.detach(), expected)
    for which in range(3):  # one input carrying a tangent at a time (the others None in the jvp)
        tangents = [t if i == which else torch.zeros_like(t) for i, t in enumerate((tq, tk, tv))]
        one = torch.autograd.functional.jvp(math, (q, k, v), tuple(tangents))[1]
        only = functx.jvp(lambda x: fused(*[x if i == which else y for i, y in enumerate(tracked)]), (tracked[which],), (tangents[which],))[1]
        torch.testing.assert_close(only.detach(), one)
    # the caller's autograd differentiates the tangent (a Hessian-vector product by hand)
    (caller,) = torch.autograd.grad(tangent.pow(2).sum(), tracked[0])
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    reference_tangent = torch.autograd.functional.jvp(math, tuple(leaves), (tq, tk, tv), create_graph=True)[1]
    (expected_caller,) = torch.autograd.grad(reference_tangent.pow(2).sum(), leaves[0])
    torch.testing.assert_close(caller, expected_caller)


@pytest.mark.filterwarnings("ignore::functx.PerformanceWarning")
@pytest.mark.parametrize("mask", list(_MASKS))
def test_attention_differentiated_twice(mask):
    """hessian, jacrev(jacrev), jacfwd(jacrev), vmap(jvp(grad)) and linearize through fused
    attention (torch: its backward has no derivative; functx runs the math form in blocks
    where two AD levels are live: ad/aten_reverse_rules.py), against the math form's
    reverse-over-reverse derivatives in float64."""
    rows = keys = 5
    kwargs = _MASKS[mask](rows, keys)
    if mask == "bool_mask":
        kwargs["attn_mask"][:, 0] = True
    (q, k, v), (tq, _, _) = _attention_inputs(11, rows, keys)
    # one head, 4-d (what the fused kernel takes): Hessians of 20 x 20
    q0, tq0, k0, v0 = q[:1, :1], tq[:1, :1], k[:1, :1], v[:1, :1]
    fused_loss = lambda q: F.scaled_dot_product_attention(q, k0, v0, **kwargs).pow(2).sum()  # noqa: E731
    math_loss = lambda q: _attention_math(q, k0, v0, **kwargs).pow(2).sum()  # noqa: E731
    hessian_ref = torch.autograd.functional.hessian(math_loss, q0)
    for second_order in (functx.hessian, lambda f: functx.jacrev(functx.jacrev(f)), lambda f: functx.jacfwd(functx.jacrev(f))):
        torch.testing.assert_close(second_order(fused_loss)(q0), hessian_ref)
    heads, head_tangents = q[0].unsqueeze(1).unsqueeze(1), tq[0].unsqueeze(1).unsqueeze(1)  # 3 samples of (1, 1, 5, 4)
    per_sample = functx.vmap(lambda q, t: functx.jvp(functx.grad(fused_loss), (q,), (t,))[1])(heads, head_tangents)
    expected = torch.stack([_hvp_reference(math_loss, (a,), (t,))[0] for a, t in zip(heads, head_tangents)])
    torch.testing.assert_close(per_sample, expected)
    fused = lambda q: F.scaled_dot_product_attention(q, k0, v0, **kwargs)  # noqa: E731
    out, jvp_fn = functx.linearize(fused, q0)
    torch.testing.assert_close(jvp_fn(tq0), torch.autograd.functional.jvp(lambda q: _attention_math(q, k0, v0, **kwargs), q0, tq0)[1])


@pytest.mark.parametrize("mask", list(_MASKS))
def test_attention_first_order_keeps_the_fused_backward_and_the_caller_can_differentiate(mask, monkeypatch):
    """One reverse level runs torch's fused backward (its memory is O(L)); where the caller's
    autograd differentiates the gradient (create_graph), the same gradient is recorded in
    differentiable ops. Reference: the math form, reverse-over-reverse in float64."""
    from functx.ad import aten_reverse_rules

    fused_backward_calls = []
    original = aten_reverse_rules._FLASH_CPU_BACKWARD
    monkeypatch.setattr(aten_reverse_rules, "_FLASH_CPU_BACKWARD", lambda *a, **k: fused_backward_calls.append(1) or original(*a, **k))
    kwargs = _MASKS[mask](5, 5)
    if mask == "bool_mask":
        kwargs["attn_mask"][:, 0] = True
    (q, k, v), _ = _attention_inputs(12, 5, 5)
    fused_loss = lambda q, k: F.scaled_dot_product_attention(q, k, v, **kwargs).sin().sum()  # noqa: E731
    math_loss = lambda q, k: _attention_math(q, k, v, **kwargs).sin().sum()  # noqa: E731
    grads = functx.grad(fused_loss, argnums=(0, 1))(q, k)
    expected = torch.autograd.grad(math_loss(q.requires_grad_(), k), q)[0]
    q = q.detach()
    torch.testing.assert_close(grads[0], expected)
    assert fused_backward_calls, "first order must use torch's fused backward"
    per_sample = functx.vmap(functx.grad(fused_loss), in_dims=(0, None))(q.unsqueeze(1), k)
    per_sample_ref = [torch.autograd.functional.jacobian(lambda u: math_loss(u.unsqueeze(0), k), qi) for qi in q]
    torch.testing.assert_close(per_sample.squeeze(1), torch.stack(per_sample_ref))
    # the caller differentiates functx's gradients: a gradient penalty
    queries, keys = q.clone().requires_grad_(), k.clone().requires_grad_()
    penalty = sum(g.pow(2).sum() for g in functx.grad(fused_loss, argnums=(0, 1))(queries, keys))
    actual = torch.autograd.grad(penalty, (queries, keys))
    queries, keys = q.clone().requires_grad_(), k.clone().requires_grad_()
    grads = torch.autograd.grad(math_loss(queries, keys), (queries, keys), create_graph=True)
    wanted = torch.autograd.grad(sum(g.pow(2).sum() for g in grads), (queries, keys))
    torch.testing.assert_close(actual, wanted)


def test_attention_with_dropout_under_forward_mode():
    """On CPU, attention with dropout runs torch's math form (whose dropout has a forward
    formula): the tangent is that of the function with the same random draws. Reference:
    central differences, each evaluation from the same seed."""
    (q, k, v), (tq, tk, tv) = _attention_inputs(0)
    fused = lambda q: F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)  # noqa: E731

    def seeded(q):
        torch.manual_seed(7)
        return fused(q)

    torch.manual_seed(7)
    tangent = functx.jvp(fused, (q,), (tq,))[1]
    eps = 1e-6
    torch.testing.assert_close(tangent, (seeded(q + eps * tq) - seeded(q - eps * tq)) / (2 * eps), rtol=1e-6, atol=1e-6)
    # the fused CPU kernel called with dropout: its draws are not returned, so a clear error
    with pytest.raises(RuntimeError, match="dropout_p > 0 needs the dropout mask"):
        functx.jvp(lambda q: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.5)[0], (q,), (tq,))
    assert functx.core.current_stack() == ()
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v), _attention_math(q, k, v))


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_attention_recomputed_after_the_transform_returned(reentrant):
    """vjp's pullback, called after vjp returned, recomputes a checkpointed attention outside
    the transform: it must save what the first run saved (torch compares: CheckpointError
    once, the first run having taken functx's attention and the recomputation torch's)."""
    from torch.utils.checkpoint import checkpoint

    (q, k, v), (tq, _, _) = _attention_inputs(13, 5, 5)
    fused = lambda q: checkpoint(lambda u: F.scaled_dot_product_attention(u, k, v, is_causal=True).sin(), q, use_reentrant=reentrant)  # noqa: E731
    _, pullback = functx.vjp(fused, q)
    (actual,) = pullback(tq)
    _, expected = torch.autograd.functional.vjp(lambda u: _attention_math(u, k, v, is_causal=True).sin(), q, tq)
    torch.testing.assert_close(actual, expected)
