"""vmap over nested tensors (functx/vmap/nested.py), jagged and strided layouts.

PyTorch's own cases for nested tensors under vmap (`TestVmapNestedTensor` in torch's
test/functorch/test_vmap.py) re-expressed against the reference that cannot share functx's
bug: the function looped over `unbind()` (dense inputs sliced at their in_dims). Where
torch.func refuses (jagged inputs, `x.shape` inside, a dense input mapped at another dim,
`vmap(vmap(f))`) functx runs, checked against the same loop. Per-sample gradients over a
jagged batch against a per-sequence `torch.autograd` loop in float64.
"""

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import functx

D = torch.float64
LAYOUTS = [torch.jagged, torch.strided]

pytestmark = [
    pytest.mark.filterwarnings("ignore::functx.PerformanceWarning"),
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage"),
]


def make_nt(dims, layout, seed=0):
    """torch's `_create_nt`: `dims[0]` components, a None in `dims` a length that varies."""
    g = torch.Generator().manual_seed(seed)
    sizes = [[d if d is not None else int(torch.randint(2, 10, (1,), generator=g)) for d in dims[1:]] for _ in range(dims[0])]
    if dims.count(None) == 1 and layout is torch.jagged:  # lengths must differ, or jagged has nothing to hold
        i = dims[1:].index(None)
        for k, size in enumerate(sizes):
            size[i] = 2 + k
    return torch.nested.nested_tensor([torch.randn(*s, dtype=D, generator=g) for s in sizes], layout=layout)


def similar_nt(other, dims, layout, seed=1):
    """torch's `_nt_from_similar`: components of `other`'s shape where `dims` says -1."""
    g = torch.Generator().manual_seed(seed)
    comps = [torch.randn(*[s if d == -1 else d for s, d in zip(t.shape, dims[1:])], dtype=D, generator=g) for t in other.unbind()]
    return torch.nested.nested_tensor(comps, layout=layout)


def per_sample(x, d, b):
    if d is None:
        return x
    return x.unbind()[b] if x.is_nested else x.select(d, b)


def loop(f, args, in_dims):
    """The reference: `f` once per sample, per-sample outputs in a list (per output)."""
    in_dims = in_dims if isinstance(in_dims, tuple) else (in_dims,) * len(args)
    n = next(a.size(0) if a.is_nested else a.size(d) for a, d in zip(args, in_dims) if d is not None)
    return [f(*(per_sample(a, d, b) for a, d in zip(args, in_dims))) for b in range(n)]


def assert_matches_loop(out, expected):
    """`out` (vmap's output) holds the loop's per-sample outputs: a nested tensor's components,
    or a dense tensor's slices."""
    samples = out.unbind() if out.is_nested else list(out.unbind(0))
    assert len(samples) == len(expected)
    for got, want in zip(samples, expected):
        torch.testing.assert_close(got, want)


def check(f, args, in_dims=0):
    out = functx.vmap(f, in_dims=in_dims)(*args)
    assert_matches_loop(out, loop(f, args, in_dims))
    return out


# --- torch's TestVmapNestedTensor cases --------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_unary(layout):
    out = check(lambda x: x.sin() * 5.0 + 4.0, (make_nt([4, None, 3], layout),))
    assert out.is_nested and out.layout == layout


@pytest.mark.parametrize("layout", LAYOUTS)
def test_binary_two_nested(layout):
    x, y = make_nt([5, None, 3], layout, seed=0), make_nt([5, 3, None], layout, seed=1)
    out = check(torch.matmul, (x, y))
    assert out.is_nested  # ragged in two dims: a strided nested tensor holds it


@pytest.mark.parametrize("layout", LAYOUTS)
def test_nested_and_unbatched_dense(layout):
    check(torch.matmul, (make_nt([5, None, 3], layout), torch.randn(3, 4, dtype=D)), in_dims=(0, None))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_nested_and_batched_dense(layout):
    check(torch.matmul, (make_nt([5, None, 3], layout), torch.randn(5, 3, 4, dtype=D)))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_acts_as_dense_inside(layout):
    seen = []

    def f(x):
        seen.append(x.is_nested)
        return x

    x = make_nt([5, None, 3], layout)
    out = check(f, (x,))
    assert seen and not any(seen)
    assert out.layout == layout


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "dims_x, dims_y, dim",
    [
        ([3, None, 2], [3, None, 2], 0),  # different ragged structure, same other dims
        ([3, 2, None], [3, 2, None], 1),
        ([3, 2, None], [-1, 4, -1], 0),  # same ragged structure, different other dims
        ([3, None, 2], [-1, -1, 4], 1),
    ],
)
def test_cat(layout, dims_x, dims_y, dim):
    x = make_nt(dims_x, layout, seed=0)
    y = make_nt(dims_y, layout, seed=1) if None in dims_y else similar_nt(x, dims_y, layout)
    check(lambda a, b: torch.cat([a, b], dim=dim), (x, y))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_shape_inside(layout):
    """torch.func fails here (an expected failure in its tests): each call sees its sample's shape."""
    check(lambda x: x * x.shape[0] + x.size(-1), (make_nt([3, None, 2], layout),))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_nonzero_in_dim_raises(layout):
    x = make_nt([3, None, 2], layout)
    with pytest.raises(RuntimeError, match=r"args\[0\] is a nested tensor with in_dim=2\. Nested tensors can only be vmapped over dim=0.*in_dim 0"):
        functx.vmap(lambda x: x, in_dims=2)(x)
    with pytest.raises(RuntimeError, match="Nested tensors can only be vmapped over dim=0"):
        functx.vmap(lambda x: x, in_dims=(None, 1))(torch.ones(3), x)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_nonzero_out_dim_raises_for_a_nested_output(layout):
    x = make_nt([3, None, 2], layout)
    with pytest.raises(RuntimeError, match=r"out_dims=2.*output 0 has different shapes per sample.*Nested tensors can only be vmapped over dim=0: give it out_dim 0"):
        functx.vmap(lambda x: x, out_dims=2)(x)
    # an output whose samples agree in shape is dense, and any out_dim places it
    out = functx.vmap(lambda x: x.sum(0), out_dims=1)(x)
    torch.testing.assert_close(out, torch.stack([t.sum(0) for t in x.unbind()], 1))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_nested_with_dense_mapped_at_another_dim(layout):
    """torch.func raises ("Fallback not supported for mixed nested / non-nested arguments
    without bdim=0"); functx slices the dense input at its own in_dim."""
    check(torch.matmul, (make_nt([5, None, 3], layout), torch.randn(3, 5, 4, dtype=D)), in_dims=(0, 1))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_vmap_of_vmap(layout):
    """torch.func raises ("Only one level of vmap is supported"); functx's inner vmap maps
    over each sample, a dense tensor."""
    x = make_nt([2, 2, 2, None], layout)

    def f(x):
        return x.sin() * 4.0 + 3.0

    for vmapped in (functx.vmap(functx.vmap(f)), functx.vmap(functx.vmap(functx.vmap(f)))):
        assert_matches_loop(vmapped(x), [f(t) for t in x.unbind()])


# --- what a nested output is -------------------------------------------------------------------


def test_outputs_of_one_shape_are_stacked():
    x = make_nt([4, None, 3], torch.jagged)
    out = functx.vmap(lambda t: (t.sum(0), t.mean(), t))(x)
    assert not out[0].is_nested and out[0].shape == (4, 3)
    assert out[1].shape == (4,)
    assert out[2].is_nested and out[2].layout == torch.jagged
    torch.testing.assert_close(out[1], torch.stack([t.mean() for t in x.unbind()]))


def test_jagged_in_the_last_dim():
    x = make_nt([4, 3, None], torch.jagged)
    out = check(lambda t: t.exp(), (x,))
    assert out.layout == torch.jagged


def test_out_dims_none_and_non_tensor_outputs():
    x = make_nt([3, None, 2], torch.jagged)
    w = torch.randn(2, dtype=D)
    out, same = functx.vmap(lambda t, w: (t @ w, w * 2), in_dims=(0, None), out_dims=(0, None))(x, w)
    torch.testing.assert_close(same, w * 2)
    assert_matches_loop(out, [t @ w for t in x.unbind()])
    with pytest.raises(ValueError, match="differs between samples with out_dim None"):
        functx.vmap(lambda t: t.sum(), out_dims=None)(x)
    with pytest.raises(ValueError, match="must only return Tensors, got type <class 'int'>"):
        functx.vmap(lambda t: t.shape[0])(x)
    assert functx.vmap(lambda t: (t.sum(0), 3), out_dims=(0, None))(x)[1] == 3
    with pytest.raises(IndexError, match="out_dim 3 is out of range"):
        functx.vmap(lambda t: t.sum(0), out_dims=3)(x)


def test_python_control_flow_on_a_sample():
    """Each call sees one sample's values, so `if` on them works (torch.func refuses)."""
    x = make_nt([4, None, 2], torch.jagged)

    def f(t):
        return t.exp() if t.sum() > 0 else -t

    check(f, (x,))


def test_a_tensordict_beside_a_nested_tensor():
    from tensordict import TensorDict

    x = make_nt([3, None, 2], torch.jagged)
    td = TensorDict({"a": torch.randn(2, 3, dtype=D), "b": {"c": torch.randn(2, 3, 4, dtype=D)}}, [2, 3])
    out = functx.vmap(lambda t, d: t * d["a"] + d["b", "c"].sum(-1), in_dims=(0, 1))(x, td)
    assert_matches_loop(out, [t * td[:, b]["a"] + td[:, b]["b", "c"].sum(-1) for b, t in enumerate(x.unbind())])


def test_outputs_of_different_ranks_raise():
    x = make_nt([3, None, 2], torch.jagged)
    with pytest.raises(ValueError, match="different number of dims per sample"):
        functx.vmap(lambda t: t if t.shape[0] % 2 else t[0])(x)


def test_outputs_of_different_structures_raise():
    x = make_nt([3, None, 2], torch.jagged)
    with pytest.raises(ValueError, match="outputs of different structures"):
        functx.vmap(lambda t: tuple(t.unbind(0)))(x)


def test_batch_sizes_must_agree():
    x = make_nt([3, None, 2], torch.jagged)
    with pytest.raises(ValueError, match=r"sizes \[3, 4\].*args\[1\] has size 4"):
        functx.vmap(lambda a, b: a * b.sum())(x, torch.ones(4, 2))


def test_chunk_size_changes_nothing():
    x = make_nt([5, None, 3], torch.jagged)
    w = torch.randn(3, dtype=D)
    a = functx.vmap(lambda t, w: t @ w, in_dims=(0, None), chunk_size=2)(x, w)
    assert_matches_loop(a, [t @ w for t in x.unbind()])


def test_one_performance_warning_at_the_callers_line():
    x = make_nt([3, None, 2], torch.jagged)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        functx.vmap(lambda t: t.cos().sin())(x)
    perf = [w for w in caught if issubclass(w.category, functx.PerformanceWarning)]
    assert len(perf) == 1
    assert perf[0].filename == __file__ and "once per sample (3 samples)" in str(perf[0].message)


def test_sparse_inputs_still_refused():
    with pytest.raises(NotImplementedError, match="sparse_coo tensor.*to_dense"):
        functx.vmap(torch.sin)(torch.eye(3).to_sparse())


# --- randomness ---------------------------------------------------------------------------------


def test_randomness_modes():
    x = make_nt([4, None, 3], torch.jagged)

    def f(t):
        return t + torch.rand_like(t)

    with pytest.raises(RuntimeError, match="randomness error mode"):
        functx.vmap(f)(x)
    torch.manual_seed(7)
    out = functx.vmap(f, randomness="different")(x)
    torch.manual_seed(7)
    assert_matches_loop(out, [f(t) for t in x.unbind()])  # each sample draws its own, in order
    torch.manual_seed(7)
    same = functx.vmap(lambda t: torch.rand(3, dtype=D) + 0 * t.sum(), randomness="same")(x)
    assert all(torch.equal(same[0], same[b]) for b in range(4))
    torch.manual_seed(7)
    torch.testing.assert_close(same[0], torch.rand(3, dtype=D))


# --- per-sample gradients over a jagged batch (beyond torch.func) -----------------------------


def _jagged_sequences(lengths, dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.nested.nested_tensor([torch.randn(n, dim, dtype=D, generator=g) for n in lengths], layout=torch.jagged)


@pytest.mark.parametrize("kind", ["transformer", "gru"])
def test_per_sample_gradients_of_a_sequence_model(kind):
    torch.manual_seed(0)
    if kind == "transformer":
        model = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).to(D)
    else:
        model = torch.nn.GRU(8, 6, batch_first=True).to(D)
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = _jagged_sequences([3, 7, 2, 5], 8)

    def loss(p, seq):
        out = functx.functional_call(model, p, (seq.unsqueeze(0),))
        out = out[0] if isinstance(out, tuple) else out
        return out.tanh().pow(2).mean()

    grads = functx.vmap(functx.grad(loss), in_dims=(None, 0))(params, x)
    for b, seq in enumerate(x.unbind()):
        leaves = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
        out = torch.func.functional_call(model, leaves, (seq.unsqueeze(0),))
        out = out[0] if isinstance(out, tuple) else out
        want = torch.autograd.grad(out.tanh().pow(2).mean(), list(leaves.values()))
        for (k, g), w in zip(grads.items(), want):
            assert g.shape == (4, *params[k].shape)
            torch.testing.assert_close(g[b], w, msg=lambda m: f"{k}, sample {b}: {m}")


def test_grad_of_vmap_over_a_jagged_batch():
    w = torch.randn(3, 4, dtype=D)
    x = _jagged_sequences([2, 6, 4], 3)

    def total(w):
        return functx.vmap(lambda s, w: (s @ w).sin().sum(0).pow(2).sum(), in_dims=(0, None))(x, w).sum()

    wr = w.clone().requires_grad_()
    want = torch.autograd.grad(sum((s @ wr).sin().sum(0).pow(2).sum() for s in x.unbind()), wr)[0]
    torch.testing.assert_close(functx.grad(total)(w), want)
    torch.testing.assert_close(functx.jacrev(total)(w), want)
    # forward mode over the same: a directional derivative
    t = torch.randn_like(w)
    _, tangent = functx.jvp(total, (w,), (t,))
    torch.testing.assert_close(tangent, (want * t).sum())


def test_per_sample_hessians_and_jvps():
    x = _jagged_sequences([2, 5, 3], 3)
    w = torch.randn(3, dtype=D)

    def f(w, s):
        return (s @ w).tanh().sum()

    hs = functx.vmap(functx.hessian(f), in_dims=(None, 0))(w, x)
    for b, s in enumerate(x.unbind()):
        torch.testing.assert_close(hs[b], torch.autograd.functional.hessian(lambda w: f(w, s), w))
    v = torch.randn(3, dtype=D)
    _, jv = functx.vmap(lambda s: functx.jvp(lambda w: f(w, s), (w,), (v,)))(x)
    for b, s in enumerate(x.unbind()):
        torch.testing.assert_close(jv[b], torch.autograd.functional.jvp(lambda w: f(w, s), w, v)[1])


# --- a property: random programs over random jagged batches -----------------------------------

STEPS = {
    "sin": lambda t, w: t.sin(),
    "matmul": lambda t, w: t @ w,
    "softmax": lambda t, w: F.softmax(t, dim=-1),
    "softmax over the sequence": lambda t, w: F.softmax(t, dim=0),
    "cumsum over the sequence": lambda t, w: t.cumsum(0),
    "layer_norm": lambda t, w: F.layer_norm(t, t.shape[-1:]),
    "cat with itself": lambda t, w: torch.cat([t, t.flip(0)], 0),
    "first rows": lambda t, w: t[: max(1, t.shape[0] // 2)],
    "outer over the sequence": lambda t, w: (t @ t.T) @ t / t.shape[0],
}


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    steps=st.lists(st.sampled_from(sorted(STEPS)), min_size=1, max_size=4),
    transform=st.sampled_from(["vmap", "vmap(grad)", "grad(vmap)"]),
    layout=st.sampled_from(LAYOUTS),
)
def test_random_programs_match_the_loop(lengths, steps, transform, layout):
    if layout is torch.jagged and len(set(lengths)) == 1:
        lengths = lengths + [lengths[0] + 1]  # jagged needs a length that differs
    x = torch.nested.nested_tensor([torch.randn(n, 3, dtype=D) for n in lengths], layout=layout)
    w = torch.randn(3, 3, dtype=D)

    def program(t, w):
        for name in steps:
            t = STEPS[name](t, w)
        return t

    def loss(w, t):
        return (program(t, w) @ w).pow(2).sum()

    samples = x.unbind()
    if transform == "vmap":
        assert_matches_loop(functx.vmap(program, in_dims=(0, None))(x, w), [program(t, w) for t in samples])
        return
    wr = w.clone().requires_grad_()
    per_sample = [torch.autograd.grad(loss(wr, t), wr)[0] for t in samples]
    if transform == "vmap(grad)":
        assert_matches_loop(functx.vmap(functx.grad(loss), in_dims=(None, 0))(w, x), per_sample)
    else:
        total = functx.grad(lambda w: functx.vmap(functools.partial(loss, w))(x).sum())(w)
        torch.testing.assert_close(total, sum(per_sample))


def test_a_write_into_a_captured_tensor_happens_once_per_sample():
    """As in the loop (torch.func refuses writes into captured tensors under vmap)."""
    x = make_nt([3, None, 2], torch.jagged)
    total = torch.zeros(2, dtype=D)

    def f(t):
        total.add_(t.sum(0))
        return t

    functx.vmap(f)(x)
    torch.testing.assert_close(total, sum(t.sum(0) for t in x.unbind()))
