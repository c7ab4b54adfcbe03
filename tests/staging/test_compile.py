"""torch.compile over functx transforms (functx/staging).

Every case is checked three ways: the compiled function's values against eager functx and
against an independent plain-torch reference (per-sample loops, torch.autograd.grad with
create_graph), `torch._dynamo.explain` finds one graph and no graph break, and gradients
through the compiled function equal eager's and the reference's. float64 throughout.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.utils._pytree as torch_pytree

import functx

DT = torch.float64
torch.manual_seed(0)
MODEL = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).to(DT)
PARAMS = {k: v.detach() for k, v in MODEL.named_parameters()}


def _randn(*shape, seed=0):
    return torch.randn(*shape, dtype=DT, generator=torch.Generator().manual_seed(seed))


def loss(p, x, y):
    return ((functx.functional_call(MODEL, p, (x,)) - y) ** 2).mean()


def loss_ref(p, x, y):
    return ((_mlp(p, x) - y) ** 2).mean()


def _mlp(p, x):
    h = torch.tanh(x @ p["0.weight"].T + p["0.bias"])
    return h @ p["2.weight"].T + p["2.bias"]


def _grad_ref(f, args, argnums=0):
    """torch.autograd.grad with create_graph: stays differentiable where the args are."""
    as_leaf = lambda t: t if t.requires_grad else t.detach().requires_grad_()
    args = [a if i != argnums else torch_pytree.tree_map(as_leaf, a) for i, a in enumerate(args)]
    leaves = torch_pytree.tree_leaves(args[argnums])
    grads = torch.autograd.grad(f(*args), leaves, create_graph=True)
    return torch_pytree.tree_unflatten(list(grads), torch_pytree.tree_structure(args[argnums]))


# --- the workloads: (function, args, independent reference) ---------------------------------


def per_sample_grads(p, x, y):
    return functx.vmap(functx.grad(loss), in_dims=(None, 0, 0))(p, x, y)


def per_sample_grads_ref(p, x, y):
    per = [_grad_ref(loss_ref, (p, x[i], y[i])) for i in range(x.shape[0])]
    return {k: torch.stack([g[k] for g in per]) for k in p}


def jacobian_rev(v):
    return functx.jacrev(lambda u: torch.sin(u) * u.sum())(v)


def jacobian_fwd(v):
    return functx.jacfwd(lambda u: torch.sin(u) * u.sum())(v)


def jacobian_ref(v):
    return torch.autograd.functional.jacobian(lambda u: torch.sin(u) * u.sum(), v, create_graph=True)


def hess(v):
    return functx.hessian(lambda u: (u.sin() ** 3).sum())(v)


def hess_ref(v):
    return torch.autograd.functional.hessian(lambda u: (u.sin() ** 3).sum(), v, create_graph=True)


def maml(p, xs, ys, xq, yq):
    def task(xs, ys, xq, yq):
        g = functx.grad(loss)(p, xs, ys)
        adapted = {k: p[k] - 0.1 * g[k] for k in p}
        return loss(adapted, xq, yq)

    return functx.vmap(task)(xs, ys, xq, yq).mean()


def maml_ref(p, xs, ys, xq, yq):
    total = 0
    for t in range(xs.shape[0]):
        g = _grad_ref(loss_ref, (p, xs[t], ys[t]))
        total = total + loss_ref({k: p[k] - 0.1 * g[k] for k in p}, xq[t], yq[t])
    return total / xs.shape[0]


def hvp_forward_over_reverse(v, t):
    return functx.jvp(functx.grad(lambda u: (u.sin() ** 2).sum()), (v,), (t,))[1]


def hvp_reverse_over_reverse(v, t):
    return functx.vjp(functx.grad(lambda u: (u.sin() ** 2).sum()), v)[1](t)[0]


def hvp_ref(v, t):
    return torch.autograd.functional.hvp(lambda u: (u.sin() ** 2).sum(), v, t, create_graph=True)[1]


def jvp_and_vjp(v, t):
    out, tangent = functx.jvp(lambda u: u.sin() * u, (v,), (t,))
    out2, vjp_fn = functx.vjp(lambda u: u.sin() * u, v)
    out3, jvp_fn = functx.linearize(lambda u: u.sin() * u, v)
    return out, tangent, out2, vjp_fn(t)[0], out3, jvp_fn(t)


def jvp_and_vjp_ref(v, t):
    f = lambda u: u.sin() * u
    out, tangent = torch.autograd.functional.jvp(f, v, t)
    _, cot = torch.autograd.functional.vjp(f, v, t)
    return out, tangent, out, cot, out, tangent


def grad_value_aux_pytree(p, x):
    def f(p, x):
        out = (p["a"] * x).sin().sum() + p["b"].pow(2).sum()
        return out, {"double": 2 * out}

    return functx.vmap(functx.grad_and_value(f, has_aux=True), in_dims=({"a": 0, "b": None}, 1))(p, x)


def grad_value_aux_pytree_ref(p, x):
    rows = []
    for i in range(p["a"].shape[0]):
        pi = {"a": p["a"][i], "b": p["b"]}
        f = lambda q: (q["a"] * x[:, i]).sin().sum() + q["b"].pow(2).sum()
        value = f(pi)
        rows.append((_grad_ref(lambda q: f(q), (pi,)), value))
    grads = {k: torch.stack([g[k] for g, _ in rows]) for k in p}
    values = torch.stack([v for _, v in rows])
    return grads, (values, {"double": 2 * values})


def vmap_jacrev_chunked(v):
    return functx.vmap(functx.jacrev(lambda u: u.sin() * u.prod(), chunk_size=2), in_dims=1, out_dims=2)(v)


def vmap_jacrev_chunked_ref(v):
    f = lambda u: u.sin() * u.prod()
    return torch.stack([torch.autograd.functional.jacobian(f, v[:, i], create_graph=True) for i in range(v.shape[1])], dim=2)


XS = (_randn(3, 4, 3, seed=1), _randn(3, 4, 2, seed=2), _randn(3, 4, 3, seed=3), _randn(3, 4, 2, seed=4))
CASES = {
    "per_sample_grads": (per_sample_grads, lambda: (PARAMS, _randn(5, 3, seed=5), _randn(5, 2, seed=6)), per_sample_grads_ref),
    "jacrev": (jacobian_rev, lambda: (_randn(4, seed=7),), jacobian_ref),
    "jacfwd": (jacobian_fwd, lambda: (_randn(4, seed=7),), jacobian_ref),
    "hessian": (hess, lambda: (_randn(4, seed=8),), hess_ref),
    "maml": (maml, lambda: (PARAMS, *XS), maml_ref),
    "hvp_forward_over_reverse": (hvp_forward_over_reverse, lambda: (_randn(4, seed=9), _randn(4, seed=10)), hvp_ref),
    "hvp_reverse_over_reverse": (hvp_reverse_over_reverse, lambda: (_randn(4, seed=9), _randn(4, seed=10)), hvp_ref),
    "jvp_vjp_linearize": (jvp_and_vjp, lambda: (_randn(4, seed=11), _randn(4, seed=12)), jvp_and_vjp_ref),
    "grad_and_value_aux_pytree_in_dims": (
        grad_value_aux_pytree,
        lambda: ({"a": _randn(3, 4, seed=13), "b": _randn(2, seed=14)}, _randn(4, 3, seed=15)),
        grad_value_aux_pytree_ref,
    ),
    "vmap_jacrev_chunked_out_dims": (vmap_jacrev_chunked, lambda: (_randn(3, 4, seed=16),), vmap_jacrev_chunked_ref),
}
INDUCTOR_CASES = ("per_sample_grads", "jacrev", "hessian", "maml")


def _assert_trees_close(got, expected):
    got_leaves, got_spec = torch_pytree.tree_flatten(got)
    exp_leaves, exp_spec = torch_pytree.tree_flatten(expected)
    assert got_spec == exp_spec
    for g, e in zip(got_leaves, exp_leaves):
        torch.testing.assert_close(g, e)


def _params():
    return [(name, backend) for name in CASES for backend in ("eager", "aot_eager", "inductor") if backend != "inductor" or name in INDUCTOR_CASES]


@pytest.mark.parametrize("name, backend", _params())
def test_compiled_values_match_eager_and_reference(name, backend):
    fn, make_args, reference = CASES[name]
    args = make_args()
    eager = fn(*args)
    _assert_trees_close(eager, reference(*args))
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    _assert_trees_close(compiled(*args), eager)
    _assert_trees_close(compiled(*make_args()), eager)  # a second call: the cached graph


@pytest.mark.parametrize("name", list(CASES))
def test_one_graph_no_graph_break(name):
    fn, make_args, _ = CASES[name]
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(*make_args())
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def _scalar_of(name, out):
    return sum((leaf * (i + 1)).sum() for i, leaf in enumerate(torch_pytree.tree_leaves(out)))


@pytest.mark.parametrize(
    "name, backend",
    [(n, b) for n in ("per_sample_grads", "maml", "hessian", "jacfwd", "hvp_forward_over_reverse") for b in ("eager", "aot_eager")]
    + [("maml", "inductor")],
)
def test_gradients_through_the_compiled_function(name, backend):
    fn, make_args, reference = CASES[name]

    def differentiable_args():
        return torch_pytree.tree_map(lambda t: t.detach().clone().requires_grad_(), make_args())

    def grads_of(f):
        args = differentiable_args()
        leaves = torch_pytree.tree_leaves(args[0])
        return torch.autograd.grad(_scalar_of(name, f(*args)), leaves)

    expected = grads_of(reference)
    eager = grads_of(fn)
    torch._dynamo.reset()
    compiled = grads_of(torch.compile(fn, backend=backend, fullgraph=True))
    for c, e, r in zip(compiled, eager, expected):
        torch.testing.assert_close(e, r)
        torch.testing.assert_close(c, e)


def test_a_transform_made_outside_the_compiled_region():
    transformed = functx.vmap(functx.grad(loss), in_dims=(None, 0, 0))
    x, y = _randn(5, 3, seed=20), _randn(5, 2, seed=21)
    torch._dynamo.reset()
    step = torch.compile(lambda p, x, y: transformed(p, x, y), backend="aot_eager", fullgraph=True)
    _assert_trees_close(step(PARAMS, x, y), per_sample_grads_ref(PARAMS, x, y))


def test_a_body_dynamo_cannot_trace_runs_eagerly_with_right_values():
    def f(v):
        def scaled(u):  # .item() and Python control flow on it: dynamo cannot stage the body
            return (u.sin() * (2.0 if u.sum().item() > 0 else 3.0)).sum()

        return functx.grad(scaled)(v)

    for v in (_randn(3, seed=22).abs(), -_randn(3, seed=22).abs()):
        expected = v.cos() * (2.0 if v.sum() > 0 else 3.0)
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(f, backend="aot_eager")(v), expected)
        torch._dynamo.reset()
        with pytest.raises(torch._dynamo.exc.Unsupported):
            torch.compile(f, backend="aot_eager", fullgraph=True)(v)


@pytest.mark.parametrize("given", ["all", "parameters_only"])
def test_functional_call_return_state_is_staged(given):
    """`return_state=True` compiles in one graph: the forward on clones of the buffers (the
    given ones, or the module's own), the new buffers returned, nothing mutated."""
    bn = torch.nn.BatchNorm1d(3).to(DT)
    module_buffers = {k: v.clone() for k, v in bn.named_buffers()}
    state = {k: v.clone() for k, v in (bn.state_dict() if given == "all" else dict(bn.named_parameters())).items()}

    def f(state, x):
        return functx.functional_call(bn, state, (x,), return_state=True)

    x = _randn(4, 3, seed=23)
    expected_out, expected_state = f({k: v.clone() for k, v in state.items()}, x)
    assert not torch.equal(expected_state["running_mean"], module_buffers["running_mean"])  # the stats moved
    torch._dynamo.reset()
    passed = {k: v.clone() for k, v in state.items()}
    out, new_state = torch.compile(f, backend="aot_eager", fullgraph=True)(passed, x)
    torch.testing.assert_close(out, expected_out)
    _assert_trees_close(new_state, expected_state)
    _assert_trees_close(passed, state)  # the passed tensors untouched
    _assert_trees_close(dict(bn.named_buffers()), module_buffers)  # the module's too


def test_errors_are_the_eager_ones():
    """A call functx rejects is a graph break, so the error raised is eager functx's."""
    x = _randn(3, 2, seed=24)
    bad_in_dims = lambda v: functx.vmap(torch.sin, in_dims=(0, 0))(v)
    with pytest.raises(ValueError) as eager:
        bad_in_dims(x)
    torch._dynamo.reset()
    with pytest.raises(ValueError) as compiled:
        torch.compile(bad_in_dims, backend="aot_eager")(x)
    assert str(compiled.value) == str(eager.value)
    # functional_call traced as torch's reparametrization keeps functx's checks
    doubled = lambda v: functx.functional_call(MODEL, (PARAMS, {"0.bias": PARAMS["0.bias"]}), (v,))
    torch._dynamo.reset()
    with pytest.raises(ValueError, match="appeared in multiple dictionaries"):
        torch.compile(doubled, backend="aot_eager")(_randn(3, seed=25))
    not_scalar = lambda v: functx.grad(torch.sin)(v)
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="Expected f\\(\\*args\\) to return a scalar Tensor"):
        torch.compile(not_scalar, backend="aot_eager")(x)


# --- random programs under random transform stacks, compiled (tests/ad/test_fuzz_transforms) --

import os  # noqa: E402

from hypothesis import HealthCheck, event, given, settings  # noqa: E402

from tests.ad.test_fuzz_transforms import ALL, PURE_FAMILIES, Ref, cases  # noqa: E402

COMPILE_FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=int(os.environ.get("FUNCTX_COMPILE_FUZZ_EXAMPLES", "12")),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


def eager_checked(case):
    """(functx's transformed function, the float64 reference's value) for a drawn case whose
    eager functx value was checked against the reference; None for a case to pass over (an
    untame reference, or one functx raises on: the eager fuzzer checks which errors)."""
    expected = case.run(Ref).detach()
    if not (torch.isfinite(expected).all() and expected.abs().max() < 1e4):
        return None
    transformed = case.build(functx)
    try:
        eager = transformed(*case.inputs())
    except Exception:
        event("eager functx raises")
        return None
    torch.testing.assert_close(eager, expected, rtol=1e-6, atol=1e-6)
    return transformed, expected


@COMPILE_FUZZ
@given(cases(PURE_FAMILIES, ALL))
def test_fuzz_compiled_transform_stacks(case):
    """torch.compile (aot_eager) of a random program under a random stack of 1-3 transforms
    equals eager functx and the plain-torch float64 reference. Long run:
    FUNCTX_COMPILE_FUZZ_EXAMPLES=200 .venv/bin/python -m pytest tests/staging -q -p no:xdist -k fuzz"""
    checked = eager_checked(case)
    if checked is None:
        return
    transformed, expected = checked
    torch._dynamo.reset()
    explained = torch._dynamo.explain(transformed)(*case.inputs())
    event(f"graph breaks: {explained.graph_break_count}")
    torch._dynamo.reset()
    compiled = torch.compile(transformed, backend="aot_eager")(*case.inputs())
    torch.testing.assert_close(compiled, expected, rtol=1e-6, atol=1e-6)


def test_batch_size_changes_dynamic_shapes():
    """After a second batch size dynamo makes the batch dim symbolic: the staged calls run
    functx on symbolic shapes."""
    torch._dynamo.reset()
    compiled = torch.compile(per_sample_grads, backend="aot_eager")
    for size in (5, 7, 9, 16):
        x, y = _randn(size, 3, seed=size), _randn(size, 2, seed=size + 1)
        _assert_trees_close(compiled(PARAMS, x, y), per_sample_grads_ref(PARAMS, x, y))


def _mutating(a):
    b = a + 1
    b.view(-1).add_(1)  # a write through a view
    a.mul_(2)  # a write into the input: reproduced by the compiled function
    return b * a


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: functx.functionalize(_mutating)(x),
        lambda x: functx.functionalize(_mutating, remove="mutations_and_views")(x),
        lambda x: functx.vmap(functx.functionalize(_mutating))(x),
        lambda x: functx.grad(lambda v: functx.functionalize(_mutating)(v * 1).sum())(x),
    ],
    ids=["functionalize", "mutations_and_views", "vmap_of", "grad_of"],
)
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_functionalize_compiles(fn, backend):
    x = _randn(3, 2, seed=30)
    a = x.clone()
    b = x.clone()
    b_out = (b + 1 + 1) * (b * 2)  # plain torch: what _mutating computes, and b as it leaves it
    b.mul_(2)
    expected = fn(a)
    torch._dynamo.reset()
    assert torch._dynamo.explain(fn)(x.clone()).graph_break_count == 0
    torch._dynamo.reset()
    c = x.clone()
    torch.testing.assert_close(torch.compile(fn, backend=backend, fullgraph=True)(c), expected)
    torch.testing.assert_close(c, a)  # the input written as eager writes it
    if expected.shape == b_out.shape and not torch.equal(a, x):
        torch.testing.assert_close(a, b)
