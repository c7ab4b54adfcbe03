"""TensorDict, tensorclass and TensorDictParams under functx's transforms (issue 29):
vmap maps over a dim of a TensorDict's batch size (core/container_kinds.py), gradients
come back as TensorDicts, functional_call takes TensorDict parameters.

References: the function looped over `td.unbind(in_dim)` and stacked at out_dims (float64);
`torch.autograd.grad` per leaf; torch.func where its semantics are the ones promised.
"""

import pytest
import torch
import torch.func
from hypothesis import given, settings
from hypothesis import strategies as st

import functx

tensordict = pytest.importorskip("tensordict")
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictParams, tensorclass  # noqa: E402

D = torch.float64


def _random_td(shape, features, nested):
    data = {"x": torch.randn(*shape, features, dtype=D), "y": torch.randn(*shape, dtype=D)}
    if nested:
        data["inner"] = TensorDict({"z": torch.randn(*shape, 2, features, dtype=D)}, shape)
    return TensorDict(data, shape)


def _f(td):
    """Per element: leaves of different ranks mixed, a nested key written, a new TensorDict."""
    out = TensorDict({"s": td["x"].sin() * td["y"].unsqueeze(-1)}, td.batch_size)
    if "inner" in td.keys():
        out["inner", "w"] = td["inner", "z"].exp().sum(-2) + td["x"]
    return out


def _assert_same_td(actual, expected):
    assert isinstance(actual, TensorDict), type(actual)
    assert actual.batch_size == expected.batch_size
    assert set(actual.keys(True, True)) == set(expected.keys(True, True))
    for key in expected.keys(True, True):
        torch.testing.assert_close(actual[key], expected[key])


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 3), min_size=1, max_size=3),
    features=st.integers(1, 3),
    nested=st.booleans(),
    chunk=st.sampled_from([None, 1, 2]),
    data=st.data(),
)
def test_vmap_over_a_tensordict_matches_the_loop(shape, features, nested, chunk, data):
    rank = len(shape)
    in_dim = data.draw(st.integers(-rank, rank - 1), label="in_dim")
    out_dim = data.draw(st.integers(-rank, rank - 1), label="out_dim")
    td = _random_td(shape, features, nested)
    out = functx.vmap(_f, in_dims=in_dim, out_dims=out_dim, chunk_size=chunk)(td)
    expected = torch.stack([_f(t) for t in td.unbind(in_dim)], out_dim)
    _assert_same_td(out, expected)


def test_tensordicts_tensors_and_unmapped_containers_together():
    td = _random_td((4, 3), 2, nested=True)
    weights = torch.randn(4, dtype=D)
    scale = TensorDict({"a": torch.tensor(2.0, dtype=D)}, [])

    def f(td, w, scale):
        return td["x"].sum(-1) * w * scale["a"], TensorDict({"y": td["y"] + 1}, td.batch_size)

    out, out_td = functx.vmap(f, in_dims=(1, None, None), out_dims=(0, 1))(td, weights, scale)
    expected = torch.stack([f(t, weights, scale)[0] for t in td.unbind(1)])
    torch.testing.assert_close(out, expected)
    _assert_same_td(out_td, torch.stack([f(t, weights, scale)[1] for t in td.unbind(1)], 1))


def test_names_and_locks_follow_tensordicts_own_rules():
    a = TensorDict({"a": torch.randn(3, 4)}, [3], names=["0"])
    b = TensorDict({"b": torch.randn(3, 5, 4)}, [3, 5], names=["A", "B"])

    def fun(a, b):
        b["c"] = a["a"] + b["b"]
        return b

    c = functx.vmap(fun, (None, 1))(a, b)
    assert c.names == [None, "A"]
    locked = TensorDict({"x": torch.ones(2, 3)}, [2]).lock_()
    with pytest.raises(RuntimeError, match="Cannot modify"):
        functx.vmap(lambda td: td.set("y", td["x"]))(locked)


def test_lazy_stacks_stay_lazy():
    td0 = TensorDict({"a": torch.ones(1)}, [1])
    x = LazyStackedTensorDict.lazy_stack([td0, td0.clone() * 2], 0)
    out = functx.vmap(lambda t: t.set("b", t["a"] * 3), in_dims=0, out_dims=1)(x)
    assert isinstance(out, LazyStackedTensorDict)
    torch.testing.assert_close(out["b"], torch.stack([td0["a"] * 3, td0["a"] * 6], 1))


def test_tensorclass_instances_are_mapped_as_their_batch_size():
    @tensorclass
    class Points:
        xy: torch.Tensor
        weight: torch.Tensor

    pts = Points(xy=torch.randn(4, 5, 2, dtype=D), weight=torch.rand(4, 5, dtype=D), batch_size=[4, 5])
    out = functx.vmap(lambda p: (p.xy.norm(dim=-1) * p.weight).sum(), in_dims=1)(pts)
    expected = torch.stack([(p.xy.norm(dim=-1) * p.weight).sum() for p in pts.unbind(1)])
    torch.testing.assert_close(out, expected)
    same = functx.vmap(lambda p: p, in_dims=-1, out_dims=0)(pts)
    assert type(same) is Points and same.batch_size == torch.Size([5, 4])
    torch.testing.assert_close(same.xy, pts.xy.transpose(0, 1))


# -- gradients: TensorDicts of the same batch size and keys ----------------------------------
def _loss(td):
    return (td["x"].sin() * td["y"].unsqueeze(-1)).sum() + td["inner", "z"].pow(2).sum()


def _autograd_grads(f, td):
    leaves = {k: td[k].detach().clone().requires_grad_() for k in td.keys(True, True)}
    copy = TensorDict({}, td.batch_size)
    for k, v in leaves.items():
        copy[k] = v
    grads = torch.autograd.grad(f(copy), list(leaves.values()))
    return dict(zip(leaves, grads))


@pytest.mark.parametrize("transform", ["grad", "vjp", "jacrev", "jacfwd"])
def test_gradients_with_respect_to_a_tensordict(transform):
    td = _random_td((3,), 2, nested=True)
    if transform == "grad":
        g = functx.grad(_loss)(td)
    elif transform == "vjp":
        g = functx.vjp(_loss, td)[1](torch.tensor(1.0, dtype=D))[0]
    else:
        g = getattr(functx, transform)(_loss)(td)
    assert isinstance(g, TensorDict) and g.batch_size == td.batch_size
    expected = _autograd_grads(_loss, td)
    assert set(g.keys(True, True)) == set(expected)
    for k, v in expected.items():
        torch.testing.assert_close(g[k], v)


def test_hessian_with_respect_to_a_tensordict_matches_double_backward():
    td = TensorDict({"x": torch.randn(3, dtype=D)}, [3])
    f = lambda td: (td["x"].sin() * td["x"].sum()).sum()  # noqa: E731
    h = functx.hessian(f)(td)
    x = td["x"].clone().requires_grad_()
    expected = torch.autograd.functional.hessian(lambda x: (x.sin() * x.sum()).sum(), x)
    assert isinstance(h, TensorDict) and isinstance(h["x"], TensorDict)  # d/dtd of d/dtd: nested
    torch.testing.assert_close(h["x", "x"], expected)


def test_per_sample_gradients_over_a_tensordict_batch():
    batch = TensorDict({"x": torch.randn(6, 3, dtype=D), "y": torch.randn(6, dtype=D)}, [6])
    w = torch.randn(3, dtype=D)
    loss = lambda w, d: ((d["x"] @ w - d["y"]) ** 2).sum()  # noqa: E731
    out = functx.vmap(functx.grad(loss), in_dims=(None, 0))(w, batch)
    expected = []
    for d in batch.unbind(0):
        wi = w.clone().requires_grad_()
        expected.append(torch.autograd.grad(loss(wi, d), wi)[0])
    torch.testing.assert_close(out, torch.stack(expected))


# -- module state in TensorDicts -------------------------------------------------------------
def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1)).double()


def test_functional_call_takes_tensordict_parameters():
    model, other = _mlp(), _mlp()
    x = torch.randn(5, 2, dtype=D)
    for params in (TensorDict.from_module(other), TensorDictParams(TensorDict.from_module(other))):
        torch.testing.assert_close(functx.functional_call(model, params, (x,)), other(x))
    grads = functx.grad(lambda p: functx.functional_call(model, p, (x,)).sum())(TensorDict.from_module(other))
    out = other(x).sum()
    expected = torch.autograd.grad(out, list(other.parameters()))
    for (name, _), e in zip(other.named_parameters(), expected):
        torch.testing.assert_close(grads[tuple(name.split("."))], e)


def test_ensembles_from_modules_under_vmap():
    model, members = _mlp(), [_mlp() for _ in range(4)]
    stacked = TensorDict.from_modules(*members)
    x = torch.randn(5, 2, dtype=D)
    expected = torch.stack([m(x) for m in members])
    out = functx.vmap(lambda p, x: functx.functional_call(model, p, (x,)), in_dims=(0, None))(stacked, x)
    torch.testing.assert_close(out, expected)

    def through_to_module(p, x):
        with p.to_module(model):
            return model(x)

    torch.testing.assert_close(functx.vmap(through_to_module, in_dims=(0, None))(stacked, x), expected)


def test_jit_over_a_tensordict_function():
    jitted = functx.jit(_loss)
    for _ in range(3):  # traced once, then replayed on new values of the same structure
        td = _random_td((3,), 2, nested=True)
        torch.testing.assert_close(jitted(td), _loss(td))


# -- bad input -------------------------------------------------------------------------------
def test_a_tensordict_without_the_batch_dim_is_refused_clearly():
    td = TensorDict({"x": torch.randn(3, 4)}, [3])
    with pytest.raises(ValueError, match=r"in_dim=1 for args\[0\], a TensorDict with batch size \[3\]"):
        functx.vmap(lambda td: td["x"], in_dims=1)(td)
    with pytest.raises(ValueError, match="no batch dims"):
        functx.vmap(lambda td: td["x"])(TensorDict({"x": torch.randn(3, 4)}, []))


def test_a_batched_tensordict_returned_with_out_dim_none_is_refused():
    td = TensorDict({"x": torch.randn(3)}, [3])
    with pytest.raises(ValueError, match="can not return a BatchedTensor when out_dim is None"):
        functx.vmap(lambda t: TensorDict({"y": t["x"] * 2}, []), out_dims=None)(td)
    same = TensorDict({"c": torch.ones(2)}, [])
    assert functx.vmap(lambda t: (t["x"], same), out_dims=(0, None))(td)[1] is same  # unbatched: as it is


def test_tensordicts_of_different_mapped_sizes_are_refused():
    a, b = TensorDict({"x": torch.randn(3)}, [3]), TensorDict({"x": torch.randn(4)}, [4])
    with pytest.raises(ValueError, match="same size in the mapped dimension"):
        functx.vmap(lambda a, b: a["x"] + b["x"])(a, b)


def test_torch_funcs_vmap_over_tensordicts_still_works_after_functx():
    td = _random_td((4,), 2, nested=False)
    functx.vmap(_f)(td)  # functx's routing in tensordict's modules is installed now
    _assert_same_td(torch.func.vmap(_f)(td), torch.stack([_f(t) for t in td.unbind(0)]))


def test_a_locked_tensordict_is_batched_afresh_by_every_call():
    """tensordict caches what a locked container's methods return, keyed by the level: each
    vmap call's key is new (a key reused after garbage collection handed a later call the
    batched container of a finished one: 'used after that vmap returned')."""
    import gc

    td = TensorDict({"x": torch.randn(3, 2, dtype=D)}, [3]).lock_()
    for scale in range(1, 8):
        out = functx.vmap(lambda t: t["x"] * scale)(td)
        torch.testing.assert_close(out, td["x"] * scale)
        gc.collect()
