"""`grad`, `jacrev` and `jvp` right inside `vmap` run on torch's autograd over vmap's
physical tensors (functx/ad/direct_reverse.py, direct_forward.py). These tests pin what
those levels must keep by hand: values equal to a per-sample loop and to torch.func,
per-element gradients of unbatched inputs, what leaves the level attached or detached,
`detach()` stopping every level (torch.func's stop-gradient), outer `no_grad`, nesting,
errors, and the stack after exceptions."""

import pytest
import torch
import torch.func as tf
from torch.testing import assert_close

import functx
from functx.ad.wrapped_reverse import WrappedGradLevel
from functx.ad.direct_forward import DirectJvpLevel
from functx.ad.direct_reverse import DirectGradLevel
from functx.core.interpreter import current_stack

D = torch.float64


def test_vmap_of_grad_uses_the_physical_level_and_matches_a_loop():
    seen = []

    def loss(w, x):
        if current_stack():
            seen.append(type(current_stack()[-1]))
        return torch.tanh(x @ w).pow(2).sum()

    w, x = torch.randn(3, 2, dtype=D), torch.randn(5, 4, 3, dtype=D)
    got = functx.vmap(functx.grad(loss, argnums=(0, 1)), in_dims=(None, 0))(w, x)
    assert seen == [DirectGradLevel]
    for i in range(5):
        wi, xi = w.clone().requires_grad_(), x[i].clone().requires_grad_()
        want = torch.autograd.grad(loss(wi, xi), (wi, xi))
        assert_close(got[0][i], want[0])  # the unbatched input's gradient is per sample
        assert_close(got[1][i], want[1])


def test_pytree_inputs_and_grad_and_value_with_aux():
    params = {"a": torch.randn(3, dtype=D), "b": [torch.randn((), dtype=D)]}
    x = torch.randn(4, 3, dtype=D)

    def loss(p, x):
        y = (p["a"] * x).sin().sum() + p["b"][0] * x.sum()
        return y, {"y2": y * 2, "x": x}

    ours = functx.vmap(functx.grad_and_value(loss, has_aux=True), in_dims=(None, 0))(params, x)
    theirs = tf.vmap(tf.grad_and_value(loss, has_aux=True), in_dims=(None, 0))(params, x)
    assert_close(ours, theirs)
    for leaf in torch.utils._pytree.tree_leaves(ours):
        assert not leaf.requires_grad  # nothing outside is tracked: everything leaves detached


def test_output_independent_of_input_gives_zero_gradients():
    x, y = torch.randn(4, 3, dtype=D), torch.randn(4, 3, dtype=D)
    got = functx.vmap(functx.grad(lambda x, y: y.sum()))(x, y)
    assert_close(got, torch.zeros_like(x))
    got = functx.vmap(functx.grad(lambda x: torch.tensor(1.0, dtype=D)))(x)
    assert_close(got, torch.zeros_like(x))


def test_closed_over_parameter_keeps_the_graph_like_torch_func():
    """A gradient penalty: the per-sample input gradients depend on a parameter that
    requires grad outside, so they leave attached and an outer backward goes through."""
    w = torch.randn(3, 3, dtype=D, requires_grad=True)
    x = torch.randn(5, 3, dtype=D)
    f = lambda x: torch.tanh(x @ w).sum()
    ours = functx.vmap(functx.grad(f))(x)
    assert ours.requires_grad
    (g_ours,) = torch.autograd.grad(ours.pow(2).sum(), w)
    theirs = tf.vmap(tf.grad(f))(x)
    (g_theirs,) = torch.autograd.grad(theirs.pow(2).sum(), w)
    assert_close(ours, theirs)
    assert_close(g_ours, g_theirs)


def test_outer_no_grad_holds_for_the_outside():
    w = torch.randn(3, dtype=D, requires_grad=True)
    x = torch.randn(4, 3, dtype=D)
    with torch.no_grad():
        got = functx.vmap(functx.grad(lambda x: (x * w).sin().sum()))(x)
    assert not got.requires_grad
    assert_close(got, (x * w).cos() * w.detach())


def test_maml_second_order_matches_an_autograd_loop():
    torch.manual_seed(0)
    p = torch.randn(3, dtype=D)
    xs, ys = torch.randn(4, 6, 3, dtype=D), torch.randn(4, 6, dtype=D)

    def task(p, x, y):
        for _ in range(2):
            p = p - 0.1 * functx.grad(lambda p: ((x @ p).tanh() - y).pow(2).mean())(p)
        return ((x @ p).tanh() - y).pow(2).mean()

    got = functx.grad(lambda p: functx.vmap(task, in_dims=(None, 0, 0))(p, xs, ys).sum())(p)
    leaf = p.clone().requires_grad_()
    total = 0
    for t in range(4):
        q = leaf
        for _ in range(2):
            (g,) = torch.autograd.grad(((xs[t] @ q).tanh() - ys[t]).pow(2).mean(), q, create_graph=True)
            q = q - 0.1 * g
        total = total + ((xs[t] @ q).tanh() - ys[t]).pow(2).mean()
    (want,) = torch.autograd.grad(total, leaf)
    assert_close(got, want)


def test_detach_inside_stops_every_level():
    """d/dp of sum_i grad_p[(p x_i).detach() * p]: the inner gradient is (p x_i), a
    constant for every level (torch.func's and JAX's stop_gradient), so the outer gradient
    is 0, with or without vmap between the levels."""
    p = torch.randn(3, dtype=D)
    x = torch.randn(4, 3, dtype=D)
    inner = lambda p, x: ((p * x).detach() * p).sum()
    per_sample = functx.vmap(functx.grad(inner), in_dims=(None, 0))
    assert_close(per_sample(p, x), p * x)
    outer = functx.grad(lambda p: per_sample(p, x).pow(2).sum())(p)
    assert_close(outer, torch.zeros(3, dtype=D))
    theirs = tf.grad(lambda p: tf.vmap(tf.grad(inner), in_dims=(None, 0))(p, x).pow(2).sum())(p)
    assert_close(outer, theirs)
    unbatched = sum(functx.grad(lambda p: functx.grad(inner)(p, x[i]).pow(2).sum())(p) for i in range(4))
    assert_close(outer, unbatched)


def test_detach_of_this_levels_tensor_inside_a_nested_grad():
    """`c` belongs to the physical level; a grad nested inside (a wrapping level) detaches
    it: the physical level's gradient must not flow through the detached use, the outer
    one must."""
    p = torch.randn(3, dtype=D)
    x = torch.randn(4, 3, dtype=D)

    def per_sample(transforms):
        def f(p, x):
            c = (p * x).sin()
            g = transforms.grad(lambda q: (q.pow(2) * c.detach()).sum())(p)
            return (g * c).sum()

        return f

    for argnums in (0, 1):
        ours = functx.vmap(functx.grad(per_sample(functx), argnums=argnums), in_dims=(None, 0))(p, x)
        theirs = tf.vmap(tf.grad(per_sample(tf), argnums=argnums), in_dims=(None, 0))(p, x)
        assert_close(ours, theirs)
    outer = functx.grad(lambda p: functx.vmap(functx.grad(per_sample(functx)), in_dims=(None, 0))(p, x).sum())(p)
    # the physical level's gradient is 2 c_d c + 2 p c_d cos(p x) x, c = sin(p x) and c_d
    # its detached copy (constant for every level); the outer level differentiates that
    leaf = p.clone().requires_grad_()
    c = (leaf * x).sin()
    c_d = c.detach()
    (want,) = torch.autograd.grad((2 * c_d * c + 2 * leaf * c_d * (leaf * x).cos() * x).sum(), leaf)
    assert_close(outer, want)
    theirs = tf.grad(lambda p: tf.vmap(tf.grad(per_sample(tf)), in_dims=(None, 0))(p, x).sum())(p)
    assert_close(outer, theirs)


@pytest.mark.parametrize("depth", ["grad_grad", "grad_vmap_grad", "hessian"])
def test_nested_inside_the_physical_level(depth):
    x = torch.randn(4, 3, dtype=D)
    f = lambda v: (v.sin() * v.cos().sum()).sum()
    if depth == "grad_grad":
        make = lambda T: T.vmap(T.grad(lambda v: T.grad(f)(v).pow(2).sum()))
    elif depth == "grad_vmap_grad":
        make = lambda T: T.vmap(T.grad(lambda v: T.vmap(T.grad(f))(v.expand(2, 3) * 1.5).sum()))
    else:
        make = lambda T: T.vmap(T.hessian(f))
    assert_close(make(functx)(x), make(tf)(x))


def test_grad_nested_inside_it_wraps():
    levels = []

    def f(v):
        levels.append(type(current_stack()[-1]))
        return v.pow(3).sum()

    functx.vmap(functx.grad(lambda v: functx.grad(f)(v).sum()))(torch.randn(2, 3))
    assert levels == [WrappedGradLevel]


def test_in_place_ops_on_non_leaves():
    x = torch.randn(4, 3, dtype=D)

    def f(v):
        y = v * 2
        y.mul_(v)
        y.add_(1)
        y[0] = y[1] * 3
        return y.relu_().sum()

    assert_close(functx.vmap(functx.grad(f))(x), tf.vmap(tf.grad(f))(x))


def test_dropout_with_different_randomness_matches_its_mask():
    x = torch.randn(6, 50, dtype=D)

    def f(v):
        return torch.nn.functional.dropout(v, 0.5).mul(v).sum()

    g = functx.vmap(functx.grad(f), randomness="different")(x)
    kept = g != 0  # d/dv (mask * v / 0.5 * v) = 4 v on kept entries, 0 elsewhere
    assert_close(g[kept], 4 * x[kept])
    assert 0 < kept.sum() < x.numel()
    assert not all(torch.equal(kept[0], kept[i]) for i in range(1, 6))


def test_errors_are_those_of_grad_and_the_stack_is_restored():
    x = torch.randn(4, 3)
    with pytest.raises(RuntimeError, match="Expected f\\(\\*args\\) to return a scalar Tensor"):
        functx.vmap(functx.grad(lambda v: v * 2))(x)
    with pytest.raises(RuntimeError, match="only floating-point or complex tensors"):
        functx.vmap(functx.grad(lambda v: v.sum()))(torch.ones(4, 3, dtype=torch.long))

    def boom(v):
        v.sum()
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        functx.vmap(functx.grad(boom))(x)
    assert current_stack() == ()
    assert_close(functx.vmap(functx.grad(lambda v: v.pow(2).sum()))(x), 2 * x)


def test_in_dims_other_than_zero_and_chunks():
    x = torch.randn(3, 6, dtype=D)
    f = lambda v: v.exp().sum()
    assert_close(functx.vmap(functx.grad(f), in_dims=1, out_dims=1)(x), x.exp())
    assert_close(functx.vmap(functx.grad(f), in_dims=1, chunk_size=4)(x), x.exp().T)


# -- the autograd API inside vmap(grad(f)) -------------------------------------------------
def test_inputs_report_requires_grad_like_torch_func():
    seen = {}

    def f(x, w):
        seen["x"], seen["w"], seen["y"] = x.requires_grad, w.requires_grad, (x * 2).requires_grad
        seen["const"] = torch.ones(()).requires_grad
        return (x * w).sum()

    functx.vmap(functx.grad(f, argnums=(0, 1)), in_dims=(0, None))(torch.randn(3, 2), torch.randn(2))
    assert seen == {"x": True, "w": True, "y": True, "const": False}
    # plain vmap of an input that requires grad: what one sample's tensor would report, and
    # torch.autograd.grad works there (issue 27; torch.func reports False, pytorch#158610)
    functx.vmap(lambda x: seen.update(plain=x.requires_grad, y=(x * 2).requires_grad) or x)(
        torch.randn(3, 2, requires_grad=True)
    )
    assert seen["plain"] is True and seen["y"] is True
    functx.vmap(lambda x: seen.update(plain=x.requires_grad) or x)(torch.randn(3, 2))
    assert seen["plain"] is False
    # under a jvp right inside vmap the physical tensors carry tangents, not a graph
    functx.vmap(lambda x: functx.jvp(lambda y: seen.update(fwd=y.requires_grad) or y, (x,), (x,)))(torch.randn(3, 2))
    assert seen["fwd"] is False


def test_torch_autograd_grad_inside_matches_torch_func():
    """A hand-written input-gradient penalty per sample, differentiated w.r.t. the
    (unbatched) parameters and the input."""
    w = torch.randn(4, 3, dtype=D)
    x = torch.randn(5, 4, dtype=D)

    def penalized(w, x):
        x_in = x * 1.0
        score = torch.tanh(x_in @ w).sum()
        (gx,) = torch.autograd.grad(score, x, create_graph=True)
        return score + (gx.norm() - 1) ** 2

    for argnums in (1, (0, 1)):
        ours = functx.vmap(functx.grad(penalized, argnums=argnums), in_dims=(None, 0))(w, x)
        theirs = tf.vmap(tf.grad(penalized, argnums=argnums), in_dims=(None, 0))(w, x)
        assert_close(ours, theirs)
    for transforms in (functx, tf):  # x is not differentiated: both refuse the same way
        with pytest.raises(RuntimeError, match="does not require grad"):
            transforms.vmap(transforms.grad(penalized), in_dims=(None, 0))(w, x)


def test_torch_autograd_grad_inside_with_grad_outputs_and_unused():
    x = torch.randn(4, 3, dtype=D)

    def f(x):
        y = x.sin()
        (g,) = torch.autograd.grad(y, x, grad_outputs=torch.ones(3, dtype=D), create_graph=True)
        (h, unused) = torch.autograd.grad(y.sum(), (x, x * 0 + 1), create_graph=True, allow_unused=True)
        assert unused is None
        return (g * h).sum()

    assert_close(functx.vmap(functx.grad(f))(x), tf.vmap(tf.grad(f))(x))


def test_torch_autograd_grad_inside_respects_detach():
    x = torch.randn(4, 3, dtype=D)

    def f(x):
        y = x.detach() * x
        (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)  # = x.detach(): constant
        return (g * x).sum()

    assert_close(functx.vmap(functx.grad(f))(x), x)


def test_torch_autograd_grad_inside_errors():
    x = torch.randn(4, 3)
    with pytest.raises(NotImplementedError, match="is_grads_batched"):
        functx.vmap(functx.grad(lambda x: torch.autograd.grad(x.sum(), x, is_grads_batched=True)[0].sum()))(x)
    with pytest.raises(RuntimeError, match=r"functx.grad: the transformed function called \.backward\(\)"):
        functx.vmap(functx.grad(lambda x: (x * 2).sum().backward() or x.sum()))(x)
    with pytest.raises(RuntimeError, match="implicitly created only for scalar outputs"):
        functx.vmap(functx.grad(lambda x: torch.autograd.grad(x * 2, x)[0].sum()))(x)
    assert current_stack() == ()


def test_an_exception_caught_inside_vmap_leaves_the_vmap_level_as_it_was():
    def per_sample(v):
        vmap_level = current_stack()[-1]
        with pytest.raises(ValueError):
            functx.grad(lambda u: (_ for _ in ()).throw(ValueError("inner")))(v)
        assert vmap_level.direct_ad is None and current_stack() == (vmap_level,)
        return v.detach() * 2  # a plain detach again

    x = torch.randn(3, 2)
    assert_close(functx.vmap(per_sample)(x), 2 * x)


# -- jacrev right inside vmap (DirectGradLevel.vjp) ---------------------------------------
def _mlp(w1, w2):
    return lambda x: torch.tanh(torch.tanh(x @ w1.T) @ w2.T)


@pytest.mark.parametrize("chunk_size", [None, 1, 3])
def test_per_sample_jacobians_match_torch_func(chunk_size):
    w1, w2 = torch.randn(6, 4, dtype=D), torch.randn(5, 6, dtype=D)
    x = torch.randn(7, 4, dtype=D)
    f = _mlp(w1, w2)
    ours = functx.vmap(functx.jacrev(f, chunk_size=chunk_size))(x)
    assert_close(ours, tf.vmap(tf.jacrev(f))(x))
    assert not ours.requires_grad


def test_per_sample_jacobians_pytrees_argnums_aux_and_unbatched_inputs():
    w = torch.randn(3, 4, dtype=D)
    x = torch.randn(5, 4, dtype=D)

    def f(w, x):
        y = w @ x
        return {"a": y.sin(), "b": (y.sum(), torch.ones(2, dtype=D))}, y.detach()

    ours = functx.vmap(functx.jacrev(f, argnums=(0, 1), has_aux=True), in_dims=(None, 0))(w, x)
    theirs = tf.vmap(tf.jacrev(f, argnums=(0, 1), has_aux=True), in_dims=(None, 0))(w, x)
    assert_close(ours, theirs)


def test_per_sample_hessians_and_detach_inside():
    x = torch.randn(5, 4, dtype=D)
    f = lambda v: (v.sin() * v.cos()).sum() + (v**3).prod()
    assert_close(functx.vmap(functx.hessian(f))(x), tf.vmap(tf.hessian(f))(x))
    jac = functx.vmap(functx.jacrev(lambda v: v.detach() * v))(x)
    assert_close(jac, torch.diag_embed(x))  # the detached factor is a constant here


def test_per_sample_jacobians_keep_the_outside_graph():
    w = torch.randn(4, 4, dtype=D, requires_grad=True)
    x = torch.randn(3, 4, dtype=D)
    f = lambda v: torch.tanh(w @ v)
    ours = functx.vmap(functx.jacrev(f))(x)
    theirs = tf.vmap(tf.jacrev(f))(x)
    assert ours.requires_grad
    assert_close(ours, theirs)
    (g_ours,) = torch.autograd.grad(ours.pow(2).sum(), w)
    (g_theirs,) = torch.autograd.grad(theirs.pow(2).sum(), w)
    assert_close(g_ours, g_theirs)


def test_vjp_inside_vmap_still_wraps():
    """A user's vjp_fn can be called anywhere later, so vjp keeps the wrapping level."""
    levels = []

    def f(v):
        levels.append(type(current_stack()[-1]))
        return v.sin()

    x = torch.randn(3, 4, dtype=D)
    got = functx.vmap(lambda v: functx.vjp(f, v)[1](torch.ones(4, dtype=D))[0])(x)
    assert_close(got, x.cos())
    assert levels == [WrappedGradLevel]


# -- under nested vmaps ----------------------------------------------------------------------
def test_grad_under_two_vmaps_runs_on_the_innermost_physical_tensors():
    seen = []
    w = torch.randn(4, 3, dtype=D)
    x = torch.randn(2, 5, 3, dtype=D)

    def loss(w, x):
        if current_stack():
            seen.append(type(current_stack()[-1]))
        return torch.tanh(w @ x).pow(2).sum()

    for in_dims in ((None, 0), (0, 0)):
        ws = w if in_dims[0] is None else w.expand(2, 4, 3) * torch.arange(1, 3, dtype=D)[:, None, None]
        ours = functx.vmap(functx.vmap(functx.grad(loss, argnums=(0, 1)), in_dims=(None, 0)), in_dims=in_dims)(ws, x)
        theirs = tf.vmap(tf.vmap(tf.grad(loss, argnums=(0, 1)), in_dims=(None, 0)), in_dims=in_dims)(ws, x)
        assert_close(ours, theirs)
    assert seen[0] is DirectGradLevel


def test_under_two_vmaps_detach_autograd_grad_and_outer_grad():
    p = torch.randn(3, dtype=D)
    x = torch.randn(2, 4, 3, dtype=D)

    def inner(transforms):
        def f(p, x):
            y = (p * x).detach() * p + (p * x).sin()
            (gp,) = torch.autograd.grad(y.sum(), p, create_graph=True)
            assert p.requires_grad and y.requires_grad
            return (y.sum() + gp.pow(2).sum())

        return f

    def nested(T, p):
        return T.vmap(T.vmap(T.grad(inner(T)), in_dims=(None, 0)), in_dims=(None, 0))(p, x)

    def one_level(p, i):
        return functx.vmap(functx.grad(inner(functx)), in_dims=(None, 0))(p, x[i])

    assert_close(nested(functx, p), nested(tf, p))  # per element: one grad level, no disagreement
    assert_close(nested(functx, p), torch.stack([one_level(p, i) for i in range(2)]))
    # the detach stops the outer level too (torch.func's stop-gradient)
    outer = functx.grad(lambda p: nested(functx, p).pow(2).sum())(p)
    want = sum(functx.grad(lambda p: one_level(p, i).pow(2).sum())(p) for i in range(2))
    assert_close(outer, want)
    assert_close(outer, tf.grad(lambda p: nested(tf, p).pow(2).sum())(p))


def test_jacrev_under_two_vmaps_wraps_and_matches():
    x = torch.randn(2, 3, 4, dtype=D)
    f = lambda v: v.sin() * v.sum()
    assert_close(functx.vmap(functx.vmap(functx.jacrev(f)))(x), tf.vmap(tf.vmap(tf.jacrev(f)))(x))


@pytest.mark.parametrize("norm", ["layer_norm", "group_norm", "softmax"])
def test_per_sample_hessians_through_normalizations(norm):
    """vmap(hessian) through layer_norm used to fail on the wrapping level (the double
    backward writes a batched value in place into an unbatched temporary); the physical
    level runs that double backward on plain tensors."""
    w = torch.randn(6, dtype=D)
    ops = {
        "layer_norm": lambda v: torch.nn.functional.layer_norm(v, (6,), w),
        "group_norm": lambda v: torch.nn.functional.group_norm(v.view(1, 6, 1), 2, w).view(6),
        "softmax": lambda v: (v * w).softmax(0),
    }
    f = lambda v: (ops[norm](v) ** 2 * torch.arange(6, dtype=D)).sum()
    x = torch.randn(3, 6, dtype=D)
    assert_close(functx.vmap(functx.hessian(f))(x), tf.vmap(tf.hessian(f))(x))


# -- jvp right inside vmap (DirectJvpLevel) -------------------------------------------------
W_IN, W_OUT = torch.randn(6, 4, dtype=D), torch.randn(3, 6, dtype=D)


def _f(x):
    return torch.tanh(torch.tanh(x @ W_IN.T) @ W_OUT.T)


JVP_CASES = {
    "both_batched": lambda T, x, t: T.vmap(lambda x, t: T.jvp(_f, (x,), (t,)))(x, t),
    "tangent_unbatched": lambda T, x, t: T.vmap(lambda x: T.jvp(_f, (x,), (t[0],)))(x),
    "primal_unbatched": lambda T, x, t: T.vmap(lambda t: T.jvp(_f, (x[0],), (t,)))(t),
    "pytree_aux": lambda T, x, t: T.vmap(
        lambda x, t: T.jvp(lambda d: ({"a": _f(d["p"]), "b": d["p"].sum()}, d["p"] * 2), ({"p": x},), ({"p": t},), has_aux=True)
    )(x, t),
    "independent_output": lambda T, x, t: T.vmap(lambda x, t: T.jvp(lambda v: W_IN.sum() * torch.ones(2, dtype=D), (x,), (t,)))(x, t),
    "hvp": lambda T, x, t: T.vmap(lambda x, t: T.jvp(T.grad(lambda v: _f(v).pow(2).sum()), (x,), (t,)))(x, t),
    "jvp_of_jvp": lambda T, x, t: T.vmap(lambda x, t: T.jvp(lambda y: T.jvp(_f, (y,), (t,))[1], (x,), (t,)))(x, t),
    "two_vmaps": lambda T, x, t: T.vmap(T.vmap(lambda x, t: T.jvp(_f, (x,), (t,))))(x.view(2, 2, 4), t.view(2, 2, 4)),
    "grad_over_it": lambda T, x, t: T.grad(lambda x: T.vmap(lambda x, t: T.jvp(_f, (x,), (t,))[1])(x, t).pow(2).sum())(x),
}


@pytest.mark.parametrize("case", list(JVP_CASES))
def test_vmap_of_jvp_matches_torch_func(case):
    x, t = torch.randn(4, 4, dtype=D), torch.randn(4, 4, dtype=D)
    assert_close(JVP_CASES[case](functx, x, t), JVP_CASES[case](tf, x, t))


def test_vmap_of_jvp_uses_the_physical_level_and_restores_it():
    seen = []

    def f(v):
        seen.append(type(current_stack()[-1]))
        return v.sin()

    x = torch.randn(3, 4, dtype=D)
    _, tangent = functx.vmap(lambda v: functx.jvp(f, (v,), (torch.ones(4, dtype=D),)))(x)
    assert seen == [DirectJvpLevel]
    assert_close(tangent, x.cos())

    def boom(v):
        vmap_level = current_stack()[-1]
        with pytest.raises(ValueError):
            functx.jvp(lambda u: (_ for _ in ()).throw(ValueError("inner")), (v,), (v,))
        assert vmap_level.direct_ad is None and current_stack() == (vmap_level,)
        return v.detach() * 2

    assert_close(functx.vmap(boom)(x), 2 * x)


def test_detach_inside_vmap_of_jvp_stops_every_level():
    x, t = torch.randn(3, 4, dtype=D), torch.randn(3, 4, dtype=D)
    f = lambda v: v.detach() * v.sin()
    _, tangent = functx.vmap(lambda x, t: functx.jvp(f, (x,), (t,)))(x, t)
    assert_close(tangent, x * x.cos() * t)  # d/dv [c sin v] t, c held constant
    # the outer grad level does not see through the detach either, as without vmap
    outer = functx.grad(lambda x: functx.vmap(lambda x, t: functx.jvp(f, (x,), (t,))[1])(x, t).sum())(x)
    per_row = torch.stack([functx.grad(lambda r: functx.jvp(f, (r,), (t[i],))[1].sum())(x[i]) for i in range(3)])
    assert_close(outer, per_row)
    assert_close(outer, -x.detach() * x.sin() * t)  # d/dx [c cos x t], c constant
    assert_close(outer, tf.grad(lambda x: tf.vmap(lambda x, t: tf.jvp(f, (x,), (t,))[1])(x, t).sum())(x))


def test_vmap_of_jvp_without_a_forward_formula_falls_back():
    index = torch.tensor([0, 1, 0])
    base = torch.randn(2, 3, dtype=D)
    f = lambda src: base.index_reduce(0, index, src, "mean").sin()
    src, t = torch.randn(5, 3, 3, dtype=D), torch.randn(5, 3, 3, dtype=D)
    with pytest.warns(functx.PerformanceWarning):
        _, ours = functx.vmap(lambda s, t: functx.jvp(f, (s,), (t,)))(src, t)
    for i in range(5):
        # compare with finite differences of f along t[i]
        eps = 1e-6
        fd = (f(src[i] + eps * t[i]) - f(src[i] - eps * t[i])) / (2 * eps)
        assert_close(ours[i], fd, atol=1e-6, rtol=1e-5)
