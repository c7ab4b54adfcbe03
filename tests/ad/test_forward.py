"""jvp / linearize / jacfwd / hessian against torch.func, torch.autograd and finite differences."""

import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.func as tf

import functx
from functx import PerformanceWarning, grad, hessian, jacfwd, jacrev, jvp, linearize, vmap

D = torch.float64


def finite_difference_jvp(f, x, t, eps=1e-6):
    return (f(x + eps * t) - f(x - eps * t)) / (2 * eps)


def test_jvp_matches_finite_differences():
    w = torch.randn(3, 4, dtype=D)
    f = lambda x: torch.tanh(w @ x).exp()
    x, t = torch.randn(4, dtype=D), torch.randn(4, dtype=D)
    out, tangent = jvp(f, (x,), (t,))
    torch.testing.assert_close(out, f(x))
    torch.testing.assert_close(tangent, finite_difference_jvp(f, x, t), rtol=1e-6, atol=1e-6)


def test_jvp_pytree_primals_and_has_aux():
    x, y = torch.randn(3, dtype=D), torch.randn(3, dtype=D)
    f = lambda p: ((p["a"] * p["b"]).sum(), p["a"].max())
    tx, ty = torch.randn(3, dtype=D), torch.randn(3, dtype=D)
    out, tangent, aux = jvp(f, ({"a": x, "b": y},), ({"a": tx, "b": ty},), has_aux=True)
    torch.testing.assert_close(tangent, (tx * y + x * ty).sum())
    torch.testing.assert_close(aux, x.max())


def test_nested_jvp():
    x, t = torch.randn(4, dtype=D), torch.randn(4, dtype=D)
    inner = lambda y: jvp(torch.sin, (y,), (t,))[1]
    torch.testing.assert_close(jvp(inner, (x,), (t,))[1], -torch.sin(x) * t * t)


def test_hvp_three_ways():
    x, v = torch.randn(5, dtype=D), torch.randn(5, dtype=D)
    f = lambda a: (a.sin() ** 2).sum() * a.prod()
    expected = tf.hessian(f)(x) @ v
    torch.testing.assert_close(jvp(grad(f), (x,), (v,))[1], expected)  # forward-over-reverse
    torch.testing.assert_close(grad(lambda a: (grad(f)(a) * v).sum())(x), expected)  # reverse-over-reverse
    torch.testing.assert_close(linearize(grad(f), x)[1](v), expected)


def test_jvp_strict_and_independent_output():
    x = torch.randn(3, dtype=D)
    out, tangent = jvp(lambda a: torch.ones(2, dtype=D), (x,), (x,))
    torch.testing.assert_close(tangent, torch.zeros(2, dtype=D))
    with pytest.raises(RuntimeError, match="independent of the inputs"):
        jvp(lambda a: torch.ones(2, dtype=D), (x,), (x,), strict=True)


@pytest.mark.parametrize("chunk_size", [None, 1, 4])
def test_jacfwd_matches_torch_func(chunk_size):
    w = torch.randn(4, 5, dtype=D)
    f = lambda x, y: (torch.tanh(w @ x) * y.sum(), x.sum())
    x, y = torch.randn(5, dtype=D), torch.randn(2, 3, dtype=D)
    got = jacfwd(f, argnums=(0, 1), chunk_size=chunk_size)(x, y)
    want = tf.jacfwd(f, argnums=(0, 1))(x, y)
    for i in range(2):
        for j in range(2):
            torch.testing.assert_close(got[i][j], want[i][j])


def test_jacfwd_equals_jacrev_on_matrix_input():
    f = lambda m: (m @ m.T).sin()
    m = torch.randn(3, 2, dtype=D)
    torch.testing.assert_close(jacfwd(f)(m), jacrev(f)(m))


def test_hessian_equals_autograd_functional_hessian():
    f = lambda a: (a.sin() * a.cos().sum()).sum() + (a**4).sum()
    x = torch.randn(6, dtype=D)
    torch.testing.assert_close(hessian(f)(x), torch.autograd.functional.hessian(f, x))
    torch.testing.assert_close(hessian(f, chunk_size=2)(x), torch.autograd.functional.hessian(f, x))


def test_batched_jacobians_with_vmap():
    f = lambda a: a.sin() * a.sum()
    xs = torch.randn(4, 3, dtype=D)
    torch.testing.assert_close(vmap(jacfwd(f))(xs), tf.vmap(tf.jacfwd(f))(xs))
    torch.testing.assert_close(vmap(jacrev(f))(xs), tf.vmap(tf.jacrev(f))(xs))


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda x: jvp(torch.sin, [x], [x]), "Expected primals to be a tuple"),
        (lambda x: jvp(torch.sin, (x,), (x, x)), "same python structure"),
        (lambda x: jvp(torch.sin, (x,), (torch.ones(4, dtype=D),)), "same shape"),
        (lambda x: jvp(torch.sin, (1.0,), (1.0,)), "only contain Tensors"),
        (lambda x: jvp(lambda a: a, (x,), (x,), has_aux=True), "should be a tuple"),
    ],
)
def test_jvp_errors(call, match):
    with pytest.raises(RuntimeError, match=match):
        call(torch.randn(3, dtype=D))


@pytest.mark.parametrize("chunk_size", [None, 1])
def test_jacfwd_pytree_outputs(chunk_size):
    w = torch.randn(12, 2, dtype=D)
    f = lambda x: {"a": torch.sin(w @ x), "b": (w @ x).view(3, 4).exp()}
    x = torch.randn(2, dtype=D)
    got, want = jacfwd(f, chunk_size=chunk_size)(x), tf.jacfwd(f)(x)
    torch.testing.assert_close(got["a"], want["a"])
    torch.testing.assert_close(got["b"], want["b"])


# -- forward mode proper: torch's forward formulas on jvp-level wrappers ------------------


def forward_ad_reference(f, primals, tangents):
    with fwAD.dual_level():
        out = f(*[fwAD.make_dual(p, t) for p, t in zip(primals, tangents)])
        return fwAD.unpack_dual(out).tangent


def test_jvp_uses_forward_formulas_where_torch_has_no_double_backward():
    """hardsigmoid's backward is not differentiable in torch (a double-VJP jvp raises),
    but it has a forward formula: functx.jvp uses it, also nested in vmap and grad."""
    x = torch.linspace(-4, 4, 9, dtype=D)
    t = torch.randn(9, dtype=D)
    f = torch.nn.functional.hardsigmoid
    with warnings.catch_warnings():
        warnings.simplefilter("error", PerformanceWarning)  # no fallback
        torch.testing.assert_close(jvp(f, (x,), (t,))[1], forward_ad_reference(f, (x,), (t,)))
        torch.testing.assert_close(jacfwd(f)(x), tf.jacfwd(f)(x))
        ts = torch.randn(3, 9, dtype=D)
        torch.testing.assert_close(vmap(lambda u: jvp(f, (x,), (u,))[1])(ts), torch.stack([forward_ad_reference(f, (x,), (u,)) for u in ts]))


@pytest.mark.parametrize("case", ["index_reduce_mean", "grid_sample"])
def test_jvp_falls_back_to_double_vjp_without_a_forward_formula(case):
    """torch has no forward formula for these ops: functx.jvp warns once and computes the
    jvp by the double-VJP identity (torch.func.jvp raises)."""
    if case == "index_reduce_mean":
        base, index = torch.randn(4, 3, dtype=D), torch.tensor([0, 2, 0, 3, 2])
        x, t = torch.randn(5, 3, dtype=D), torch.randn(5, 3, dtype=D)
        f = lambda src: base.index_reduce(0, index, src, "mean").sin()
    else:
        inp = torch.randn(1, 2, 5, 5, dtype=D)
        x, t = torch.rand(1, 3, 3, 2, dtype=D) * 1.6 - 0.8, torch.randn(1, 3, 3, 2, dtype=D)
        f = lambda g: torch.nn.functional.grid_sample(inp, g, align_corners=False)
    with pytest.raises(NotImplementedError, match="forward AD"):
        tf.jvp(f, (x,), (t,))
    with pytest.warns(PerformanceWarning, match="double-VJP"):
        out, tangent = jvp(f, (x,), (t,))
    torch.testing.assert_close(out, f(x))
    torch.testing.assert_close(tangent, finite_difference_jvp(f, x, t), rtol=1e-5, atol=1e-6)
    with pytest.warns(PerformanceWarning):
        jac = jacfwd(f)(x)
    torch.testing.assert_close(jac, tf.jacrev(f)(x))


def test_tangents_follow_views_and_non_contiguous_primals():
    """torch attaches a tangent only if its layout matches the primal's, and views of a dual
    take the same view of its tangent: transposed, sliced and expanded primals, plain and
    under vmap (jacfwd), where the tangent is batched and the primal is not."""
    base = torch.randn(6, 5, dtype=D)
    x = base.t()[1:]  # non-contiguous, offset
    f = lambda a: (a[:, 1:3].t().reshape(-1) * a.diagonal().sum()).expand(2, -1).cumsum(1)
    t = torch.randn_like(x)
    torch.testing.assert_close(jvp(f, (x,), (t,))[1], tf.jvp(f, (x,), (t,))[1])
    torch.testing.assert_close(jacfwd(f)(x), tf.jacfwd(f)(x))
    torch.testing.assert_close(jacfwd(f, chunk_size=7)(x), tf.jacfwd(f)(x))
    inplace = lambda a: a.clone().t().mul_(a.t()[0]).sin()
    torch.testing.assert_close(jacfwd(inplace)(x), tf.jacfwd(inplace)(x))


def test_jvp_inside_a_users_dual_level():
    """functx reuses a dual level the user entered and leaves it (and the user's duals) alone."""
    x, t = torch.randn(3, dtype=D), torch.randn(3, dtype=D)
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, t)
        out, tangent = jvp(torch.sin, (x,), (torch.ones(3, dtype=D),))
        torch.testing.assert_close(tangent, torch.cos(x))
        # the user's own forward AD still works after functx's jvp returned
        torch.testing.assert_close(fwAD.unpack_dual(torch.exp(dual)).tangent, torch.exp(x) * t)
    assert fwAD._current_level == -1


def test_dual_level_and_stack_restored_after_an_error():
    from functx.core.interpreter import current_stack

    def boom(a):
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        jvp(boom, (torch.randn(2),), (torch.randn(2),))
    assert current_stack() == ()
    assert fwAD._current_level == -1
    with pytest.raises(ValueError, match="boom"):
        vmap(lambda u: jvp(boom, (torch.ones(2),), (u,)))(torch.randn(3, 2))
    assert current_stack() == ()
    assert fwAD._current_level == -1


def test_jvp_of_integer_primal_is_a_clear_error():
    with pytest.raises(RuntimeError, match="floating-point"):
        jvp(lambda a: a * 2, (torch.arange(3),), (torch.arange(3),))


@pytest.mark.parametrize("transform", ["jvp", "jacfwd", "linearize"])
def test_an_integer_primal_raises_torch_funcs_error_type(transform):
    """torch.func raises ValueError for an integer primal of a forward transform; functx's
    error is that ValueError (and still a RuntimeError, as before), with torch.func's words."""
    import torch.func

    i = torch.arange(3)
    calls = {
        "jvp": lambda lib: lib.jvp(lambda a: a * 2, (i,), (i,)),
        "jacfwd": lambda lib: lib.jacfwd(lambda a: a * 2)(i),
        "linearize": lambda lib: lib.linearize(lambda a: a * 2, i),
    }
    with pytest.raises(ValueError) as expected:
        calls[transform](torch.func)
    with pytest.raises(ValueError, match="Expected primal to be floating point or complex, but got: torch.int64") as got:
        calls[transform](functx)
    assert isinstance(got.value, RuntimeError) and type(expected.value) is ValueError
    assert "leave it out of argnums" not in str(got.value)  # (linearize said so; it has no argnums)


# -- matrix products: only the factors with a tangent contribute (jvp_rules._MATMUL_JVPS)
def _fd_jvp(f, primals, tangents, eps=1e-6):
    """Central finite difference of f along the tangents (float64)."""
    plus = f(*[p + eps * t for p, t in zip(primals, tangents)])
    minus = f(*[p - eps * t for p, t in zip(primals, tangents)])
    return (plus - minus) / (2 * eps)


_PRODUCTS = {
    "mm": (lambda a, b: torch.mm(a, b), [(3, 4), (4, 5)]),
    "bmm": (lambda a, b: torch.bmm(a, b), [(2, 3, 4), (2, 4, 5)]),
    "mv": (lambda a, b: torch.mv(a, b), [(3, 4), (4,)]),
    "addmv": (lambda c, a, b: torch.addmv(c, a, b, beta=2.0, alpha=0.5), [(3,), (3, 4), (4,)]),
    "addmm": (lambda c, a, b: torch.addmm(c, a, b), [(3, 5), (3, 4), (4, 5)]),
    "addmm broadcast c": (lambda c, a, b: torch.addmm(c, a, b), [(5,), (3, 4), (4, 5)]),
    "addmm beta alpha": (lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=-2.0), [(3, 5), (3, 4), (4, 5)]),
    "matmul 1-d @ 1-d": (lambda a, b: torch.matmul(a, b), [(4,), (4,)]),
    "matmul 1-d @ 2-d": (lambda a, b: a @ b, [(4,), (4, 5)]),
    "matmul 2-d @ 1-d": (lambda a, b: a.matmul(b), [(3, 4), (4,)]),
    "matmul 3-d @ 2-d": (lambda a, b: a @ b, [(2, 3, 4), (4, 5)]),
    "matmul broadcast batch": (lambda a, b: a @ b, [(2, 1, 3, 4), (5, 4, 2)]),
    "linear no bias": (lambda x, w: torch.nn.functional.linear(x, w), [(3, 4), (5, 4)]),
    "linear keywords": (lambda x, w, b: torch.nn.functional.linear(x, weight=w, bias=b), [(3, 4), (5, 4), (5,)]),
    "linear 1-d": (lambda x, w, b: torch.nn.functional.linear(x, w, b), [(4,), (5, 4), (5,)]),
    "linear 2-d": (lambda x, w, b: torch.nn.functional.linear(x, w, b), [(3, 4), (5, 4), (5,)]),
}


# every non-empty subset of each op's factors, as a bit mask
_SUBSETS = [(name, mask) for name, (_, shapes) in _PRODUCTS.items() for mask in range(1, 1 << len(shapes))]


@pytest.mark.parametrize("name, mask", _SUBSETS, ids=[f"{n}-{m}" for n, m in _SUBSETS])
def test_matrix_product_tangents_with_any_subset_of_factors(name, mask):
    """Each subset of the factors carries a tangent (the others are closed over): the
    tangent is the product rule's sum over that subset, as finite differences give it; also
    one level up (jvp of jvp, jacfwd) and under vmap, where the factors are other levels'
    tensors."""
    f, shapes = _PRODUCTS[name]
    torch.manual_seed(mask)
    values = [torch.randn(s, dtype=torch.float64) for s in shapes]
    moving = [i for i in range(len(shapes)) if mask >> i & 1]

    def g(*moved):
        full = list(values)
        for i, m in zip(moving, moved):
            full[i] = m
        return f(*full)

    primals = tuple(values[i] for i in moving)
    tangents = tuple(torch.randn_like(p) for p in primals)
    out, tangent = functx.jvp(g, primals, tangents)
    torch.testing.assert_close(out, g(*primals))
    torch.testing.assert_close(tangent, _fd_jvp(g, primals, tangents), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(tangent, tf.jvp(g, primals, tangents)[1])
    # second order: the tangent's own derivative along the same directions (jvp of jvp)
    inner = lambda *p: functx.jvp(g, p, tangents)[1]
    second = functx.jvp(inner, primals, tangents)[1]
    torch.testing.assert_close(second, _fd_jvp(lambda *p: tf.jvp(g, p, tangents)[1], primals, tangents), rtol=1e-5, atol=1e-6)
    # a Jacobian (vmap over basis tangents, the factors batched or not below the jvp level)
    first = lambda p0: g(p0, *primals[1:])
    torch.testing.assert_close(functx.jacfwd(first)(primals[0]), tf.jacrev(first)(primals[0]))
    # per-sample tangents: vmap(jvp) with batched tangents
    batched = tuple(torch.randn(2, *p.shape, dtype=torch.float64) for p in primals)
    expected = torch.stack([tf.jvp(g, primals, tuple(t[i] for t in batched))[1] for i in range(2)])
    torch.testing.assert_close(functx.vmap(lambda *t: functx.jvp(g, primals, t)[1])(*batched), expected)


def test_addmm_with_beta_zero_ignores_c_and_its_tangent():
    c = torch.full((3, 5), float("nan"), dtype=torch.float64)
    a, b = torch.randn(3, 4, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    out, tangent = functx.jvp(lambda c, a: torch.addmm(c, a, b, beta=0), (c, a), (torch.ones_like(c), torch.ones_like(a)))
    torch.testing.assert_close(tangent, torch.ones_like(a) @ b)
    assert not tangent.isnan().any() and not out.isnan().any()


@pytest.mark.parametrize("stack", ["jvp", "grad(jvp)", "jacfwd", "vmap(jvp) tangents"])
def test_jvp_of_an_expanded_primal(stack):
    """Issue 27: a primal whose elements share memory (`x.expand(3, 4)`) raised "more than one
    element of the written-to tensor refers to a single memory location": its tangent was
    laid out like it. The level differentiates a copy now. Against closed forms."""
    base = torch.randn(4, dtype=torch.float64)
    p = base.expand(3, 4)
    t = torch.randn(3, 4, dtype=torch.float64)
    if stack == "jvp":
        out, tangent = functx.jvp(lambda a: a.sin() * a, (p,), (t,))
        torch.testing.assert_close(tangent, (p.cos() * p + p.sin()) * t)
    elif stack == "grad(jvp)":
        w = torch.tensor(1.5, dtype=torch.float64)
        g = functx.grad(lambda w: functx.jvp(lambda a: (a * w).sin().sum(), (p,), (t,))[1])(w)
        torch.testing.assert_close(g, (-(p * w).sin() * p * w * t + (p * w).cos() * t).sum())
    elif stack == "jacfwd":
        jac = functx.jacfwd(lambda a: (a * a).sum(0))(p)
        expected = torch.zeros(4, 3, 4, dtype=torch.float64)
        for i in range(3):
            expected[:, i, :] = torch.diag(2 * base)
        torch.testing.assert_close(jac, expected)
    else:
        ts = torch.randn(5, 3, 4, dtype=torch.float64)
        tangents = functx.vmap(lambda t: functx.jvp(torch.exp, (p,), (t,))[1])(ts)
        torch.testing.assert_close(tangents, p.exp() * ts)
    assert torch.equal(p, base.expand(3, 4))  # the caller's primal is left alone
