"""torch's control-flow operators under functx's transforms (functx/core/control_flow.py):
`torch.cond`, `while_loop`, `scan`, `associative_scan`, `torch._higher_order_ops.map`.

Each program is written twice: with the operator, and with Python control flow on one
sample (the reference, which never meets functx). Values are compared with the reference
looped over the samples; derivatives with `torch.autograd` on the reference (plain torch,
float64: `torch.autograd.functional.jacobian`/`hessian`, which do not use torch.func), and
the Jacobian once with central finite differences. torch.func refuses every one of these
compositions (the operators need torch.compile, which cannot trace its wrappers).
"""

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._higher_order_ops import associative_scan, scan, while_loop
from torch._higher_order_ops import map as hop_map
from torch._higher_order_ops.associative_scan import associative_scan_op

import functx
from functx.core.interpreter import current_stack

from ..ad import finite_differences

D = torch.float64
N = 5  # features of one sample
W = torch.linspace(-0.8, 0.9, N * N, dtype=D).reshape(N, N) / 2  # a captured parameter
pytestmark = pytest.mark.filterwarnings("ignore::functx.PerformanceWarning")


# --- the programs: (operator form, Python form) of one sample x of shape (N,) -----------------


def cond_op(x):
    return torch.cond(x.sum() > 0, lambda v: torch.sin(v) @ W, lambda v: v * v.exp(), (x,))


def cond_py(x):
    return torch.sin(x) @ W if x.sum() > 0 else x * x.exp()


def while_op(x):
    # grows until its norm passes 4 (a trip count that differs between samples), counting
    def go(i, v):
        return v.norm() < 4

    def body(i, v):
        return i + 1, v * 1.3 + torch.tanh(v @ W)

    i, v = while_loop(go, body, (torch.tensor(0), x))
    return v * i


def while_py(x):
    i, v = 0, x
    while v.norm() < 4:
        i, v = i + 1, v * 1.3 + torch.tanh(v @ W)
    return v * i


def scan_op(x):
    # an RNN over the features: carry h, one step per element of x
    def step(h, xi):
        new = torch.tanh(h @ W[:3, :3] + xi)
        return new, new.sum() * xi

    h, ys = scan(step, x[:3] * 0.5, x)
    return torch.cat([h, ys])


def scan_py(x):
    h, ys = x[:3] * 0.5, []
    for xi in x:
        h = torch.tanh(h @ W[:3, :3] + xi)
        ys.append(h.sum() * xi)
    return torch.cat([h, torch.stack(ys)])


def scan_reverse_op(x):
    # a pytree carry, dim=1 of a matrix, reversed
    def step(carry, col):
        a, b = carry["a"], carry["b"]
        return {"a": a * col.cos(), "b": b + a.sum()}, (a * col).clone()

    carry, ys = scan(step, {"a": x[:2], "b": x[2:3]}, x.reshape(1, N).expand(2, N) * W[:2], dim=1, reverse=True)
    return torch.cat([carry["a"], carry["b"], ys.flatten()])


def scan_reverse_py(x):
    a, b, ys = x[:2], x[2:3], []
    m = x.reshape(1, N).expand(2, N) * W[:2]
    for j in reversed(range(N)):
        col = m[:, j]
        ys.append(a * col)
        a, b = a * col.cos(), b + a.sum()
    return torch.cat([a, b, torch.stack(ys[::-1], 1).flatten()])


def map_op(x):
    rows = x.reshape(N, 1) * W  # (N, N): f on each row, with an extra argument
    return hop_map(lambda r, s: torch.sin(r) * s + r.sum(), rows, x[0]).sum(0)


def map_py(x):
    rows = x.reshape(N, 1) * W
    return torch.stack([torch.sin(r) * x[0] + r.sum() for r in rows]).sum(0)


def _recurrence(left, right):  # (a1, b1) then (a2, b2): h -> a2 * (a1 * h + b1) + b2
    return left[0] * right[0], right[0] * left[1] + right[1]


def ascan_op(x):
    a, b = associative_scan(_recurrence, (torch.sigmoid(x), x @ W), 0, combine_mode="generic")
    return a + b


def ascan_py(x):
    a, b = torch.sigmoid(x), x @ W
    outs_a, outs_b = [a[0]], [b[0]]
    for t in range(1, N):
        outs_a.append(outs_a[-1] * a[t])
        outs_b.append(a[t] * outs_b[-1] + b[t])
    return torch.stack(outs_a) + torch.stack(outs_b)


def ascan_pointwise_op(x):
    # torch's pointwise associative_scan refuses CPU tensors before it starts, so its operator
    # is called directly: functx's log-depth form of it (run_associative_scan)
    def combine(a1, b1, a2, b2):
        return list(_recurrence((a1, b1), (a2, b2)))

    a, b = associative_scan_op(combine, [torch.sigmoid(x), x @ W], ())
    return a + b


PROGRAMS = {
    "cond": (cond_op, cond_py),
    "while_loop": (while_op, while_py),
    "scan": (scan_op, scan_py),
    "scan_pytree_dim_reverse": (scan_reverse_op, scan_reverse_py),
    "map": (map_op, map_py),
    "associative_scan": (ascan_op, ascan_py),
    "associative_scan_pointwise": (ascan_pointwise_op, ascan_py),
}


def samples(batch=4, seed=0):
    """Samples on both sides of cond's predicate and with different while_loop trip counts."""
    x = torch.randn(batch, N, dtype=D, generator=torch.Generator().manual_seed(seed))
    x[0] = x[0].abs() * 0.3
    x[1] = -x[1].abs()
    return x


# --- the references -----------------------------------------------------------------------


def loop(f, x):
    return torch.stack([f(v) for v in x])


def jacobian(f, v):
    return torch.autograd.functional.jacobian(f, v)


def hessian(f, v):
    return torch.autograd.functional.hessian(lambda u: f(u).sum(), v)


# --- values and derivatives under each transform --------------------------------------------


@pytest.mark.parametrize("name", PROGRAMS)
def test_vmap_equals_the_loop(name):
    op, py = PROGRAMS[name]
    x = samples()
    torch.testing.assert_close(functx.vmap(op)(x), loop(py, x))
    assert current_stack() == ()


def _transforms():
    """name -> (functx's computation, the reference's) of program f on a batch x."""
    v = torch.linspace(-1, 1, N, dtype=D)
    return {
        "vmap": (lambda f, x: functx.vmap(f)(x), lambda f, x: loop(f, x)),
        "grad": (
            lambda f, x: functx.grad(lambda u: f(u).sum())(x[2]),
            lambda f, x: jacobian(lambda u: f(u).sum(), x[2]),
        ),
        "vmap_grad": (
            lambda f, x: functx.vmap(functx.grad(lambda u: f(u).sum()))(x),
            lambda f, x: loop(lambda u: jacobian(lambda w: f(w).sum(), u), x),
        ),
        "grad_of_vmap": (
            lambda f, x: functx.grad(lambda b: functx.vmap(f)(b).pow(2).sum())(x),
            lambda f, x: loop(lambda u: jacobian(lambda w: f(w).pow(2).sum(), u), x),
        ),
        "jacrev": (lambda f, x: functx.jacrev(f)(x[1]), lambda f, x: jacobian(f, x[1])),
        "jacfwd": (lambda f, x: functx.jacfwd(f)(x[0]), lambda f, x: jacobian(f, x[0])),
        "vmap_jacrev": (lambda f, x: functx.vmap(functx.jacrev(f))(x), lambda f, x: loop(lambda u: jacobian(f, u), x)),
        "jvp": (
            lambda f, x: functx.jvp(f, (x[3],), (v,))[1],
            lambda f, x: jacobian(f, x[3]) @ v,
        ),
        "vmap_jvp": (
            lambda f, x: functx.vmap(lambda u: functx.jvp(f, (u,), (v,))[1])(x),
            lambda f, x: loop(lambda u: jacobian(f, u) @ v, x),
        ),
        "jvp_of_vmap": (
            lambda f, x: functx.jvp(functx.vmap(f), (x,), (x.flip(0),))[1],
            lambda f, x: torch.stack([jacobian(f, u) @ t for u, t in zip(x, x.flip(0))]),
        ),
        "vjp": (
            lambda f, x: _pulled_back(*functx.vjp(f, x[2])),
            lambda f, x: _cotangent(f(x[2])) @ jacobian(f, x[2]),
        ),
        "linearize": (
            lambda f, x: functx.linearize(f, x[3])[1](v),
            lambda f, x: jacobian(f, x[3]) @ v,
        ),
        "hessian": (lambda f, x: functx.hessian(lambda u: f(u).sum())(x[2]), lambda f, x: hessian(f, x[2])),
        "hvp_forward_over_reverse": (
            lambda f, x: functx.jvp(functx.grad(lambda u: f(u).sum()), (x[0],), (v,))[1],
            lambda f, x: hessian(f, x[0]) @ v,
        ),
        "vmap_hessian": (
            lambda f, x: functx.vmap(functx.hessian(lambda u: f(u).sum()))(x[:3]),
            lambda f, x: loop(lambda u: hessian(f, u), x[:3]),
        ),
        "vmap_vmap": (
            lambda f, x: functx.vmap(functx.vmap(f))(x.reshape(2, 2, N)),
            lambda f, x: loop(f, x).reshape(2, 2, -1),
        ),
        "grad_wrt_captured": (
            lambda f, x: functx.grad(lambda w: _with_weight(w, lambda: functx.vmap(f)(x).sum()))(W.clone()),
            lambda f, x: _reference_weight_grad(f, x),
        ),
    }


def _cotangent(out):
    return torch.linspace(-1, 1.5, out.numel(), dtype=D).reshape(out.shape)


def _pulled_back(out, vjp_fn):
    return vjp_fn(_cotangent(out))[0]


def _with_weight(w, run):
    """Run with the module-level parameter W replaced by w (a captured tensor the transform
    differentiates)."""
    global W
    saved = W
    W = w
    try:
        return run()
    finally:
        W = saved


def _reference_weight_grad(f, x):
    w = W.clone().requires_grad_()
    total = _with_weight(w, lambda: loop(f, x).sum())
    return torch.autograd.grad(total, w)[0]


TRANSFORMS = _transforms()


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("name", PROGRAMS)
def test_each_transform_equals_autograd_on_the_python_program(name, transform):
    op, py = PROGRAMS[name]
    ours, reference = TRANSFORMS[transform]
    x = samples()
    torch.testing.assert_close(ours(op, x), reference(py, x))
    assert current_stack() == ()


@pytest.mark.parametrize("name", ["cond", "while_loop", "scan"])
def test_jacobian_against_finite_differences(name):
    op, py = PROGRAMS[name]
    for u in samples()[:3]:
        torch.testing.assert_close(functx.jacrev(op)(u), finite_differences.jacobian(py, u), atol=1e-6, rtol=1e-6)


def test_outside_transforms_torch_runs_them_as_before():
    x = samples()[2]
    torch.testing.assert_close(cond_op(x), cond_py(x))
    torch.testing.assert_close(scan_op(x), scan_py(x))


# --- vmap's batched control values ---------------------------------------------------------


def test_batched_cond_runs_both_branches_and_selects():
    seen = []

    def true_fn(v):
        seen.append("true")
        return v * 2

    def false_fn(v):
        seen.append("false")
        return -v

    x = samples()
    out = functx.vmap(lambda v: torch.cond(v.sum() > 0, true_fn, false_fn, (v,)))(x)
    torch.testing.assert_close(out, torch.stack([v * 2 if v.sum() > 0 else -v for v in x]))
    assert seen == ["true", "false"]  # one call of each, on the whole batch


def test_unbatched_predicate_takes_one_branch():
    seen = []

    def true_fn(v):
        seen.append("true")
        return v * 2

    out = functx.vmap(lambda v, flag: torch.cond(flag, true_fn, lambda v: -v, (v,)), (0, None))(samples(), torch.tensor(True))
    torch.testing.assert_close(out, samples() * 2)
    assert seen == ["true"]


def test_batched_while_loop_keeps_finished_samples():
    # sample i stops after i iterations: each ends with its own count and value
    x = torch.arange(1.0, 5.0, dtype=D).reshape(4, 1)
    calls = []

    def body(i, v):
        calls.append(1)
        return i + 1, v * 2

    out = functx.vmap(lambda v: while_loop(lambda i, w: i < v[0], body, (torch.tensor(0.0, dtype=D), v)))(x)
    torch.testing.assert_close(out[0], torch.arange(1.0, 5.0, dtype=D))
    torch.testing.assert_close(out[1], x * 2 ** x)
    assert len(calls) == 4  # until the last sample is done, once per iteration for the batch


def test_while_loop_under_nested_vmaps_runs_until_every_sample_of_every_level_is_done():
    x = samples(6, seed=3).reshape(2, 3, N)
    out = functx.vmap(functx.vmap(while_op))(x)
    torch.testing.assert_close(out, loop(while_py, x.reshape(6, N)).reshape(2, 3, N))


def test_under_chunked_vmap_and_the_fallback_error_mode():
    x = samples(7, seed=4)
    with functx.vmap_fallback("error"):  # no per-sample fallback: the operators vectorize
        torch.testing.assert_close(functx.vmap(while_op, chunk_size=3)(x), loop(while_py, x))
        torch.testing.assert_close(functx.vmap(cond_op, chunk_size=2)(x), loop(cond_py, x))


def test_branches_of_different_shapes_under_a_batched_predicate_raise():
    x = samples()
    with pytest.raises(RuntimeError, match="both run and each sample takes its own outputs"):
        functx.vmap(lambda v: torch.cond(v.sum() > 0, lambda v: v, lambda v: v[:2], (v,)))(x)
    assert current_stack() == ()
    # an unbatched predicate takes one branch: torch's own eager semantics
    out = functx.vmap(lambda v: torch.cond(torch.tensor(False), lambda v: v, lambda v: v[:2], (v,)))(x)
    torch.testing.assert_close(out, x[:, :2])


def test_bad_while_loop_bodies_raise_clear_errors():
    x = samples()
    with pytest.raises(RuntimeError, match="must return a tuple of 2 values"):
        functx.vmap(lambda v: while_loop(lambda i, v: i < 2, lambda i, v: v, (torch.tensor(0), v)))(x)
    with pytest.raises(RuntimeError, match="with its shape and dtype"):
        functx.vmap(lambda v: while_loop(lambda i, v: i < 2, lambda i, v: (i + 1, v[:2]), (torch.tensor(0), v)))(x)
    with pytest.raises(RuntimeError, match="boolean scalar tensor"):
        functx.vmap(lambda v: while_loop(lambda i, v: v, lambda i, v: (i + 1, v), (torch.tensor(0), v)))(x)
    assert current_stack() == ()


def test_randomness_inside_a_scan_body():
    # randomness="different": each sample and each step draws its own numbers, as a loop of
    # the body would; "error" refuses the draw as vmap does anywhere
    x = samples()

    def f(v):
        return scan(lambda h, xi: (h + xi * torch.rand(()), h.clone()), v[0], v)[1]

    torch.manual_seed(0)
    out = functx.vmap(f, randomness="different")(x)
    assert out.shape == x.shape and not torch.allclose(out[0, 1:] - out[0, :-1], out[1, 1:] - out[1, :-1])
    with pytest.raises(RuntimeError, match="randomness"):
        functx.vmap(f)(x)


# --- random programs under random transform stacks -------------------------------------------


@functools.cache
def _stacks():
    return ["vmap", "vmap_grad", "grad_of_vmap", "vmap_jacrev", "vmap_jvp", "jvp_of_vmap", "hvp_forward_over_reverse", "vmap_vmap"]


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    st.lists(st.sampled_from(sorted(PROGRAMS)), min_size=1, max_size=3),
    st.sampled_from(_stacks()),
    st.integers(0, 2**16),
)
def test_random_compositions_of_operators(names, transform, seed):
    """A random chain of the programs (each one's output fed, squashed to N features, to the
    next) under a random transform stack, against the Python chain."""

    def chain(kind):
        def f(x):
            for name in names:
                out = PROGRAMS[name][kind](x)
                x = torch.tanh(out[:N] if out.shape[0] >= N else torch.cat([out, x[out.shape[0] :]]))
            return x

        return f

    ours, reference = TRANSFORMS[transform]
    x = samples(seed=seed)
    torch.testing.assert_close(ours(chain(0), x), reference(chain(1), x))


@pytest.mark.parametrize("name", ["cond", "while_loop", "scan", "associative_scan_pointwise"])
def test_under_jit(name):
    op, py = PROGRAMS[name]
    x = samples()
    per_sample_grads = functx.jit(functx.vmap(functx.grad(lambda u: op(u).sum())))
    for _ in range(2):  # the trace, then its replay
        torch.testing.assert_close(per_sample_grads(x), loop(lambda u: jacobian(lambda w: py(w).sum(), u), x))
    torch.testing.assert_close(functx.jit(functx.vmap(op))(x), loop(py, x))
