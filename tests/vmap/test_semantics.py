"""vmap semantics beyond single ops: randomness, in-place, views, data-dependent errors."""

import pytest
import torch
import torch.nn.functional as F

import functx
from functx import vmap


# -- randomness ------------------------------------------------------------------------
RANDOM_FUNCTIONS = {
    "randn": lambda a: a + torch.randn(3),
    "rand": lambda a: a + torch.rand(3),
    "randint": lambda a: a + torch.randint(0, 100, (3,)),
    "normal": lambda a: a + torch.normal(0.0, 1.0, (3,)),
    "rand_like": lambda a: a + torch.rand_like(a),
    "randn_like_unbatched": lambda a: a + torch.randn_like(torch.zeros(3)),
    "bernoulli_scalar": lambda a: a + torch.empty_like(a).bernoulli_(0.5) * 7,
    "dropout": lambda a: F.dropout(a + 1, 0.5),
    "uniform_": lambda a: a.clone().uniform_(),
    "randperm": lambda a: a + torch.randperm(3),
    "multinomial_unbatched": lambda a: a + torch.multinomial(torch.ones(5), 3).float(),
}


@pytest.mark.parametrize("name", sorted(RANDOM_FUNCTIONS))
def test_randomness_error_raises(name):
    with pytest.raises(RuntimeError, match="randomness"):
        vmap(RANDOM_FUNCTIONS[name])(torch.zeros(6, 3))


@pytest.mark.parametrize("name", sorted(RANDOM_FUNCTIONS))
def test_randomness_same_gives_equal_rows(name):
    out = vmap(RANDOM_FUNCTIONS[name], randomness="same")(torch.zeros(6, 3))
    torch.testing.assert_close(out, out[0].expand_as(out))


@pytest.mark.parametrize("name", sorted(RANDOM_FUNCTIONS))
def test_randomness_different_gives_different_rows(name):
    out = vmap(RANDOM_FUNCTIONS[name], randomness="different")(torch.zeros(6, 3))
    assert any(not torch.equal(out[0], out[i]) for i in range(1, 6))


def test_randomness_different_matches_one_batched_draw():
    """'different' draws the same numbers as one unbatched call of the batched shape."""
    torch.manual_seed(1)
    out = vmap(lambda a: a + torch.randn(3), randomness="different")(torch.zeros(4, 3))
    torch.manual_seed(1)
    torch.testing.assert_close(out, torch.randn(4, 3))


def test_dropout_eval_is_not_random():
    x = torch.randn(4, 3)
    torch.testing.assert_close(vmap(lambda a: F.dropout(a, 0.5, training=False))(x), x)


def test_inplace_random_on_unbatched_tensor_with_different_raises():
    with pytest.raises(RuntimeError, match="different inplace randomness on an unbatched tensor"):
        vmap(lambda a: a + torch.zeros(3).uniform_(), randomness="different")(torch.zeros(2, 3))


def test_nested_vmap_different_randomness():
    out = vmap(vmap(lambda a: a + torch.randn(()), randomness="different"), randomness="different")(torch.zeros(3, 4))
    assert out.unique().numel() == 12


# -- in-place ops and views ------------------------------------------------------------
def test_inplace_methods_on_batched_tensors():
    x = torch.randn(4, 3)

    def f(a):
        b = a.clone()
        b.add_(1).mul_(torch.tensor([1.0, 2.0, 3.0]))
        b.relu_()
        b[0] = 5.0
        return b

    expected = torch.relu((x + 1) * torch.tensor([1.0, 2.0, 3.0]))
    expected[:, 0] = 5.0
    torch.testing.assert_close(vmap(f)(x), expected)


def test_inplace_returns_the_same_object():
    def f(a):
        b = a.clone()
        assert b.add_(1) is b
        return b

    vmap(f)(torch.randn(2, 3))


def test_writes_through_views_land_in_the_input():
    x = torch.randn(4, 3)
    original = x.clone()

    def f(a):
        a[0].mul_(2)
        a.narrow(0, 1, 2).zero_()
        return a

    vmap(f)(x)
    expected = original.clone()
    expected[:, 0] *= 2
    expected[:, 1:3] = 0
    torch.testing.assert_close(x, expected)


def test_writes_through_views_with_trailing_in_dim():
    x = torch.randn(3, 4)
    original = x.clone()
    vmap(lambda a: a[1].fill_(7.0), in_dims=1)(x)
    expected = original.clone()
    expected[1] = 7.0
    torch.testing.assert_close(x, expected)


def test_inplace_into_unbatched_tensor_names_the_op():
    w = torch.zeros(3)
    with pytest.raises(RuntimeError, match=r"vmap: aten::add_.Tensor writes in place into a tensor that is not batched"):
        vmap(lambda a: w.add_(a))(torch.randn(4, 3))
    torch.testing.assert_close(w, torch.zeros(3))  # nothing was written


def test_index_assignment_into_unbatched_tensor_raises():
    def f(a):
        buf = torch.zeros(3)
        buf[0] = a[0]
        return buf

    with pytest.raises(RuntimeError, match="not batched at this vmap level"):
        vmap(f)(torch.randn(4, 3))


def test_new_zeros_of_batched_tensor_accepts_batched_writes():
    def f(a):
        buf = a.new_zeros(3)
        buf.copy_(a * 2)
        return buf

    x = torch.randn(4, 3)
    torch.testing.assert_close(vmap(f)(x), x * 2)


# -- data-dependent Python and shapes ----------------------------------------------------
@pytest.mark.parametrize(
    "f",
    [
        lambda a: a.sum().item(),
        lambda a: a if a.sum() > 0 else -a,
        lambda a: int(a[0]),
        lambda a: float(a[0]),
        lambda a: torch.nonzero(a),
        lambda a: a[a > 0],
        lambda a: torch.masked_select(a, a > 0),
        lambda a: torch.unique(a),
    ],
    ids=["item", "bool", "int", "float", "nonzero", "mask_index", "masked_select", "unique"],
)
@pytest.mark.filterwarnings("ignore::functx.PerformanceWarning")
def test_data_dependent_ops_raise_naming_vmap_and_where(f):
    """Shape-dependent ops run per sample and stack equal shapes (test_random_fill_and_data_dependent_ops.py): here
    every row has its own count of nonzero, positive and distinct entries, so the whole
    function's per-sample run (vmap's fallback) has outputs of different shapes: an error. A
    Python value of a sample raises torch.func's error with the fallback mode "error"."""
    x = torch.tensor([[1.0, 0, 2], [0, 0, 3], [1, 1, 1], [-1, 2, -3]])
    try:
        with functx.vmap_fallback("error"):
            vmap(f)(x)
    except RuntimeError as error:
        assert "torch.where" in str(error) or "per-sample fallback is switched off" in str(error)
    else:
        raise AssertionError("no error")
    try:
        out = vmap(f)(x)
    except (RuntimeError, ValueError) as error:  # ragged outputs, or Python numbers returned
        assert "different shapes per sample" in str(error) or "must only return Tensors" in str(error)
    else:  # the `if` returns a tensor of one shape per sample
        torch.testing.assert_close(out, torch.stack([f(a) for a in x]))


def test_fallback_warns_once_and_can_be_made_an_error():
    """An op with neither rule nor decomposition runs per sample with one warning."""
    from functx.vmap import VMAP_RULES
    from functx.vmap import fallback as fallback_module

    op = torch.ops.aten.atan2.default
    saved = VMAP_RULES.rules.get(op)
    VMAP_RULES.set(op, fallback_module.loop_fallback(op))
    fallback_module._warned.discard(op)
    try:
        x, y = torch.randn(4, 3), torch.randn(4, 3)
        with pytest.warns(functx.PerformanceWarning, match="atan2"):
            out = vmap(torch.atan2)(x, y)
        torch.testing.assert_close(out, torch.atan2(x, y))
        with functx.vmap_fallback("error"), pytest.raises(NotImplementedError, match="atan2"):
            vmap(torch.atan2)(x, y)
    finally:
        if saved is None:
            VMAP_RULES.rules.pop(op, None)
            VMAP_RULES._handlers.pop(op, None)
        else:
            VMAP_RULES.set(op, saved)


# -- indexing by batched 0-dim integer tensors (Python would call .item() on them) --------
def test_getitem_with_batched_scalar_index():
    x, i = torch.randn(4, 5), torch.tensor([0, 3, 2, 1])
    torch.testing.assert_close(vmap(lambda a, t: a[t])(x, i), x[torch.arange(4), i])
    table = torch.randn(5, 3)
    torch.testing.assert_close(vmap(lambda t: table[t])(i), table[i])
    m = torch.randn(4, 5, 6)
    j = torch.tensor([5, 0, 1, 2])
    torch.testing.assert_close(vmap(lambda a, t, u: a[t, u])(m, i, j), m[torch.arange(4), i, j])


def test_setitem_with_batched_scalar_index():
    x, i = torch.randn(4, 5), torch.tensor([0, 3, 2, 1])

    def f(a, t):
        a = a.clone()
        a[t] = a.sum()
        return a

    expected = x.clone()
    expected[torch.arange(4), i] = x.sum(1)
    torch.testing.assert_close(vmap(f)(x, i), expected)


def test_dropout_inside_grad_inside_vmap_uses_the_batching_rules():
    """F.dropout's input is a grad wrapper around a BatchedTensor: a batched random op."""
    x = torch.ones(4, 50)
    f = lambda a: (F.dropout(a, 0.5) * a).sum()
    g = vmap(functx.grad(f), randomness="different")(x)
    assert any(not torch.equal(g[0], g[i]) for i in range(1, 4))
    with pytest.raises(RuntimeError, match="randomness"):
        vmap(functx.grad(f))(x)
    torch.testing.assert_close(vmap(functx.grad(lambda a: (F.dropout(a, 0.0) * a).sum()))(x), 2 * x)


@pytest.mark.parametrize(
    "f",
    [
        lambda v: v[1].sin().sum(),
        lambda v: v[:, 1:4:2].exp().sum(),
        lambda v: v.select(-1, 2).pow(2).sum(),
        lambda v: v[-2:, -3:].cos().sum(),
    ],
    ids=["select", "strided_slice", "select_negative_dim", "two_slices"],
)
def test_backward_of_views_is_vectorized(f):
    """select_backward / slice_backward have rules (per-sample gradients through indexing)."""
    x = torch.randn(4, 3, 5, dtype=torch.float64)
    with functx.vmap_fallback("error"):
        got = vmap(functx.grad(f))(x)
        unbatched_input = vmap(functx.grad(lambda v, w: f(v * w)), in_dims=(None, 0))(x[0], x[:, 0, 0])
    torch.testing.assert_close(got, torch.stack([torch.func.grad(f)(s) for s in x]))
    expected = torch.stack([torch.func.grad(lambda v: f(v * w))(x[0]) for w in x[:, 0, 0]])
    torch.testing.assert_close(unbatched_input, expected)


@pytest.mark.parametrize("index", ["select", "slice"])
def test_backward_of_views_of_complex_values_stays_differentiable(index):
    """vmap's select_backward / slice_backward of a batched complex gradient (jacrev's rows
    through an FFT's indexing), differentiated again by the caller: the rules called
    select_scatter / slice_scatter, whose derivatives refuse complex values ("does not
    support automatic differentiation for outputs with complex dtype"). Against plain
    torch.autograd with create_graph, row by row."""
    pick = (lambda z: z[:, 1]) if index == "select" else (lambda z: z[:, 1:3])

    def f(v):
        z = torch.fft.fft(torch.sin(v)).reshape(2, 3)
        return (pick(z) * pick(z).conj()).real.reshape(-1)

    x = torch.randn(6, dtype=torch.float64, requires_grad=True)
    with functx.vmap_fallback("error"):
        got = functx.jacrev(f)(x)
    (got_caller,) = torch.autograd.grad(got.square().sum(), x)

    out = f(x)
    expected = torch.stack([torch.autograd.grad(o, x, create_graph=True)[0] for o in out])
    (expected_caller,) = torch.autograd.grad(expected.square().sum(), x)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got_caller, expected_caller)
