"""Random ops, fills and data-dependent ops under vmap: functx may raise where it cannot do something, but never returns a
value that differs from what one sample gives in plain PyTorch; where torch.func runs an
op, functx does too.

- dropout (all variants) on an *unbatched* input under randomness="different": one mask
  per batch element, with the per-channel structure of the feature dropouts;
- fill_ / fill / masked_fill with a batched 0-dim value;
- bernoulli_(p) / bernoulli(x, p) under randomness="same" when p is not batched;
- ops whose output shape depends on values (nonzero, bincount, unique, masked_select) run
  per sample and stack equal shapes; ctc_loss folds the vmap batch into its own.

Random results are checked structurally and statistically (masks differ between batch
elements under "different", are equal under "same", zero whole channels, scale kept
values); everything else against a per-sample loop of plain PyTorch.
"""

import re

import pytest
import torch
import torch.nn.functional as F

import functx
from functx import vmap

from .loop_reference import loop

pytestmark = pytest.mark.filterwarnings("ignore::functx.PerformanceWarning", "ignore:There is a performance drop")

aten = torch.ops.aten
RANDOM_ERROR = "called random operation while in randomness error mode"


# -- 1. dropout on batched and unbatched inputs ----------------------------------------------
# (function, per-sample shape, the dim of channels that are kept or dropped whole, or None)
DROPOUTS = {
    "dropout": (F.dropout, (2, 16, 4, 4, 4), None),
    "alpha_dropout": (F.alpha_dropout, (2, 16, 4, 4, 4), None),
    "dropout1d": (F.dropout1d, (4, 64, 4), 1),
    "dropout1d_without_n": (F.dropout1d, (256, 8), 0),
    "dropout2d": (F.dropout2d, (4, 64, 4, 4), 1),
    "dropout3d": (F.dropout3d, (4, 64, 2, 2, 2), 1),
    "dropout3d_without_n": (F.dropout3d, (256, 2, 2, 2), 0),
    "feature_alpha_dropout": (F.feature_alpha_dropout, (4, 64, 2, 2, 2), 1),
}
P = 0.5
BATCH = 6


def _values_of_one_sample(name):
    """The two values plain PyTorch's dropout gives for an input of ones: kept and dropped
    (the feature variants scale and shift as their elementwise counterparts do)."""
    fn = F.alpha_dropout if "alpha" in name else F.dropout
    return fn(torch.ones(4096), P, training=True).unique()


def _run_dropout(fn, shape, batched, randomness):
    if batched:
        return vmap(lambda x: fn(x, P, training=True), randomness=randomness)(torch.ones(BATCH, *shape))
    x = torch.ones(shape)
    return vmap(lambda _: fn(x, P, training=True), randomness=randomness)(torch.ones(BATCH))


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
@pytest.mark.parametrize("randomness", ["different", "same"])
@pytest.mark.parametrize("name", list(DROPOUTS))
def test_dropout_masks_follow_randomness(name, randomness, batched):
    fn, shape, channel_dim = DROPOUTS[name]
    out = _run_dropout(fn, shape, batched, randomness)
    assert out.shape == (BATCH, *shape)
    same = [torch.equal(out[0], out[b]) for b in range(1, BATCH)]
    if randomness == "same":
        assert all(same)
    else:
        assert not any(same), "every batch element must draw its own mask"
    # only the values one sample can take: the kept ones scaled, the dropped ones
    possible = _values_of_one_sample(name)
    assert len(possible) == 2
    assert torch.isin(out, possible).all()
    kept = out == possible.max()
    if channel_dim is not None:  # a whole channel is kept or dropped
        channels = kept.flatten(channel_dim + 2)  # (B, [N,] C, spatial)
        assert (channels == channels[..., :1]).all()
    # about 1 - p kept: 256+ independent channels or elements, 6 sigma below 0.2 even for "same"
    assert abs(kept.double().mean().item() - (1 - P)) < 0.2


def test_issue_repro_dropout3d_of_unbatched_input():
    x = torch.ones(2, 16, 4, 4, 4)
    r = vmap(lambda _: F.dropout3d(x, 0.5, training=True), randomness="different")(torch.ones(5))
    assert not torch.equal(r[0], r[1])
    assert torch.isin(r, torch.tensor([0.0, 2.0])).all()
    assert (r.flatten(3) == r.flatten(3)[..., :1]).all()  # whole channels


@pytest.mark.parametrize("name", list(DROPOUTS))
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
def test_dropout_in_error_mode_raises(name, batched):
    fn, shape, _ = DROPOUTS[name]
    with pytest.raises(RuntimeError, match=RANDOM_ERROR):
        _run_dropout(fn, shape, batched, "error")


def test_inplace_dropout_of_unbatched_input_with_different_randomness_raises():
    x = torch.ones(4, 8)
    with pytest.raises(RuntimeError, match="different inplace randomness on an unbatched tensor"):
        vmap(lambda _: F.dropout(x, 0.5, training=True, inplace=True), randomness="different")(torch.ones(3))


def test_feature_dropout_of_unbatched_input_inside_grad_inside_vmap():
    """The unbatched input is a grad level's wrapper (above the vmap level): it gets its
    batch dim under the wrapper; the gradient is each element's mask, scaled."""
    w = torch.ones(2, 3, 4, 4)

    def per_element(_):
        inner = functx.grad(lambda w: (F.dropout2d(w, P, training=True) * w).sum())
        return functx.grad(lambda v: inner(v).sum())(w)

    g = vmap(per_element, randomness="different")(torch.ones(BATCH))
    assert not any(torch.equal(g[0], g[b]) for b in range(1, BATCH))
    # d/dv sum(d/dw sum(mask * w * w / (1 - p)) at v) = 2 * mask / (1 - p)
    assert torch.isin(g, torch.tensor([0.0, 2 / (1 - P)])).all()
    assert (g.flatten(3) == g.flatten(3)[..., :1]).all()


def test_feature_dropout_of_unbatched_input_inside_vjp_inside_vmap():
    """The cotangent pulled back through dropout is masked by the mask of the output."""
    w = torch.ones(2, 3, 4, 4)

    def per_element(_):
        out, pullback = functx.vjp(lambda w: F.dropout2d(w, P, training=True), w)
        return out, pullback(torch.full_like(out, 3.0))[0]

    out, grad = vmap(per_element, randomness="different")(torch.ones(BATCH))
    torch.testing.assert_close(grad, 3 * out)
    assert not any(torch.equal(out[0], out[b]) for b in range(1, BATCH))
    assert (out.flatten(3) == out.flatten(3)[..., :1]).all()


@pytest.mark.parametrize("randomness", ["different", "same"])
def test_multinomial_of_unbatched_2d_probabilities(randomness):
    """torch.func draws per element; the expanded 3-D probabilities multinomial refuses
    must not reach the kernel."""
    probs = torch.full((4, 50), 1.0)
    out = vmap(lambda _: torch.multinomial(probs, 10), randomness=randomness)(torch.ones(BATCH))
    assert out.shape == (BATCH, 4, 10)
    for b in range(BATCH):  # without replacement: distinct classes per row
        assert all(len(row.unique()) == 10 for row in out[b])
    same = [torch.equal(out[0], out[b]) for b in range(1, BATCH)]
    assert all(same) if randomness == "same" else not any(same)


# -- 2. fill with a batched value ---------------------------------------------------------------
FILLS = {
    "fill_": lambda x, v: x.clone().fill_(v),
    "fill": lambda x, v: aten.fill.Tensor(x, v),
    "masked_fill": lambda x, v: x.masked_fill(x > 0, v),
    "masked_fill_": lambda x, v: x.clone().masked_fill_(x > 0, v),
}


@pytest.mark.parametrize("name", list(FILLS))
def test_fill_with_batched_value(name):
    x, v = torch.randn(3, 4, 5), torch.randn(3)
    with functx.vmap_fallback("error"):
        out = vmap(FILLS[name])(x, v)
    torch.testing.assert_close(out, loop(FILLS[name], (x, v), (0, 0)))


def test_fill_of_integer_tensor_with_batched_float_value():
    x, v = torch.arange(12).view(3, 4), torch.tensor([1.7, -2.2, 3.9])
    f = FILLS["fill_"]
    torch.testing.assert_close(vmap(f)(x, v), loop(f, (x, v), (0, 0)))


@pytest.mark.parametrize("name", ["fill", "masked_fill"])
def test_out_of_place_fill_of_unbatched_tensor_with_batched_value(name):
    x, v = torch.randn(4, 5), torch.randn(3)
    out = vmap(FILLS[name], in_dims=(None, 0))(x, v)
    torch.testing.assert_close(out, loop(FILLS[name], (x, v), (None, 0)))
    torch.testing.assert_close(out, torch.func.vmap(FILLS[name], in_dims=(None, 0))(x, v))


@pytest.mark.parametrize("name", ["fill_", "masked_fill_"])
def test_inplace_fill_of_unbatched_tensor_with_batched_value_raises(name):
    """Each element would need its own copy of the unbatched tensor (torch.func raises too)."""
    x, v = torch.randn(4, 5), torch.randn(3)
    with pytest.raises(RuntimeError):
        torch.func.vmap(FILLS[name], in_dims=(None, 0))(x, v)
    with pytest.raises(RuntimeError, match="writes in place into a tensor that is not batched"):
        vmap(FILLS[name], in_dims=(None, 0))(x, v)


@pytest.mark.filterwarnings("ignore::functx.PerformanceWarning")
def test_full_like_with_batched_value():
    """full_like takes a Python number: a batched one needs .item(). torch.func raises; functx
    runs per sample (vmap's whole-function fallback), or raises with the fallback mode "error"."""
    x, v = torch.randn(3, 4), torch.randn(3)
    with pytest.raises(RuntimeError):
        torch.func.vmap(torch.full_like)(x, v)
    torch.testing.assert_close(vmap(torch.full_like)(x, v), torch.stack([torch.full_like(a, b.item()) for a, b in zip(x, v)]))
    with functx.vmap_fallback("error"), pytest.raises(RuntimeError, match=r"vmap.*\.item\(\)"):
        vmap(torch.full_like)(x, v)


def test_fill_with_batched_value_gradients_match_torch_func():
    x, v = torch.randn(3, 4), torch.randn(3)
    f = lambda x, v: (x.clone().fill_(v) * x).sum()
    ours = vmap(functx.grad(f, argnums=(0, 1)))(x, v)
    theirs = torch.func.vmap(torch.func.grad(f, argnums=(0, 1)))(x, v)
    torch.testing.assert_close(ours, theirs)


# -- 3. bernoulli under randomness="same" -------------------------------------------------------
def _rows_equal(out):
    return all(torch.equal(out[0], out[b]) for b in range(1, out.shape[0]))


SAME_BERNOULLI = {
    "bernoulli_(0-dim tensor p)": lambda x: x.clone().bernoulli_(torch.tensor(0.5)),
    "bernoulli_(broadcast tensor p)": lambda x: x.clone().bernoulli_(torch.full((64,), 0.5)),
    "bernoulli_(float p)": lambda x: x.clone().bernoulli_(0.5),
    "bernoulli(x, float p)": lambda x: torch.bernoulli(x, 0.5),
    "bernoulli(x, tensor p)": lambda x: aten.bernoulli.Tensor(x, torch.tensor(0.5)),
}


@pytest.mark.parametrize("name", list(SAME_BERNOULLI))
def test_bernoulli_with_unbatched_p_same_and_different(name):
    """p not batched: the draws do not depend on the batched values, so "same" is one draw
    for every element; "different" draws per element."""
    f, x = SAME_BERNOULLI[name], torch.rand(BATCH, 32, 64)
    same = vmap(f, randomness="same")(x)
    assert same.shape == x.shape and _rows_equal(same)
    assert torch.isin(same, torch.tensor([0.0, 1.0])).all()
    assert abs(same.mean().item() - 0.5) < 0.1
    different = vmap(f, randomness="different")(x)
    assert not any(torch.equal(different[0], different[b]) for b in range(1, BATCH))
    with pytest.raises(RuntimeError, match=RANDOM_ERROR):
        vmap(f)(x)


def test_bernoulli_same_matches_torch_func_support():
    """The issue's case: torch.func gives the same draws for every element; so does functx."""
    f = lambda x: x.clone().bernoulli_(torch.tensor(0.5))
    x = torch.rand(3, 4)
    assert _rows_equal(torch.func.vmap(f, randomness="same")(x))
    assert _rows_equal(vmap(f, randomness="same")(x))


def test_bernoulli_same_keeps_positionwise_probabilities():
    """p of 0 and 1 makes the draws exact: every element gets p itself."""
    p = torch.tensor([0.0, 1.0, 1.0, 0.0])
    out = vmap(lambda x: x.clone().bernoulli_(p), randomness="same")(torch.rand(BATCH, 4))
    torch.testing.assert_close(out, p.expand(BATCH, 4))


BATCHED_P = {
    "bernoulli_(batched p)": (lambda x, p: x.clone().bernoulli_(p), (0, 0)),
    "bernoulli(batched probabilities)": (lambda x, p: torch.bernoulli(p), (0, 0)),
}


@pytest.mark.parametrize("name", list(BATCHED_P))
def test_bernoulli_with_batched_p(name):
    """Draws depend on per-element probabilities: "same" is refused (torch.func refuses
    too); "different" with p of 0 and 1 gives p exactly."""
    f, in_dims = BATCHED_P[name]
    x = torch.rand(BATCH, 6)
    p = torch.randint(0, 2, (BATCH, 6)).float()
    with pytest.raises(RuntimeError):
        torch.func.vmap(f, in_dims=in_dims, randomness="same")(x, p)
    with pytest.raises(RuntimeError, match="randomness='same' is not supported"):
        vmap(f, in_dims=in_dims, randomness="same")(x, p)
    torch.testing.assert_close(vmap(f, in_dims=in_dims, randomness="different")(x, p), p)


def test_bernoulli_into_unbatched_tensor_with_batched_p_raises():
    x, p = torch.rand(6), torch.rand(BATCH, 6)
    with pytest.raises(RuntimeError, match="writes in place into a tensor that is not batched"):
        vmap(lambda p: x.clone().bernoulli_(p), randomness="different")(p)


# -- 4. data-dependent output shapes: per sample, stacked when the shapes agree ----------------
AGREE = {
    # (function, batch whose elements give equal shapes)
    "argwhere": (torch.argwhere, torch.tensor([[1.0, 0], [0, 2]])),
    "nonzero": (torch.nonzero, torch.tensor([[1.0, 0, 3], [0, 2, 5]])),
    "nonzero_as_tuple": (
        lambda x: torch.nonzero(x, as_tuple=True),
        torch.tensor([[[1.0, 0], [0, 3]], [[0, 2], [5, 0]]]),
    ),
    "where_one_argument": (lambda x: torch.where(x)[0], torch.tensor([[1.0, 0, 3], [0, 2, 5]])),
    "bincount": (torch.bincount, torch.tensor([[0, 1, 1], [0, 0, 1]])),
    "bincount_minlength": (lambda x: torch.bincount(x, minlength=6), torch.tensor([[0, 1, 1], [2, 0, 4]])),
    "bincount_weights": (lambda x: torch.bincount(x, weights=x * 0.5), torch.tensor([[0, 1, 2], [2, 2, 0]])),
    "unique": (lambda x: torch.unique(x, return_counts=True), torch.tensor([[3, 1, 1], [2, 2, 7]])),
    "masked_select": (lambda x: torch.masked_select(x, x > 0), torch.tensor([[1.0, -1, 3], [-2, 2, 5]])),
}
DIFFER = {
    "argwhere": (torch.argwhere, torch.tensor([[1.0, 0], [2, 2]]), "aten::nonzero"),
    "nonzero": (torch.nonzero, torch.tensor([[1.0, 0, 3], [0, 0, 5]]), "aten::nonzero"),
    "bincount": (torch.bincount, torch.tensor([[0, 1, 1], [2, 0, 1]]), "aten::bincount"),
    "unique": (torch.unique, torch.tensor([[3, 1, 1], [2, 4, 7]]), "aten::_unique2"),
    "masked_select": (
        lambda x: torch.masked_select(x, x > 0),
        torch.tensor([[1.0, -1, 3], [-2, -2, 5]]),
        "aten::masked_select",
    ),
}


@pytest.mark.parametrize("name", list(AGREE))
def test_data_dependent_shape_ops_stack_equal_shapes(name):
    f, x = AGREE[name]
    torch.testing.assert_close(vmap(f)(x), loop(f, (x,), (0,)))


@pytest.mark.parametrize("name", list(DIFFER))
def test_data_dependent_shape_ops_with_different_shapes_raise(name):
    """The op's per-element loop meets different shapes, so the whole function runs per
    sample (vmap's fallback), whose output then has different shapes per sample: an error."""
    f, x, op = DIFFER[name]
    with pytest.warns(functx.PerformanceWarning, match=rf"{re.escape(op)}'s output shape differs between samples"):
        with pytest.raises(RuntimeError, match=r"output 0 has different shapes per sample.*per-sample fallback"):
            vmap(f)(x)


def test_torch_func_oracle_for_argwhere_and_bincount():
    """What torch.func runs, functx runs (and gives the same values)."""
    x = torch.tensor([[1.0, 0], [0, 2]])
    torch.testing.assert_close(vmap(torch.argwhere)(x), torch.func.vmap(torch.argwhere)(x))
    counts = torch.tensor([[0, 1, 1], [0, 0, 1]])
    torch.testing.assert_close(vmap(torch.bincount)(counts), torch.func.vmap(torch.bincount)(counts))
    with pytest.raises(RuntimeError):
        torch.func.vmap(torch.bincount)(torch.tensor([[0, 1, 1], [2, 0, 1]]))


def test_masked_select_with_batched_mask_has_gradients():
    x = torch.tensor([[1.0, -1, 3], [-2, 2, 5]])
    f = lambda x: (torch.masked_select(x, x > 0) ** 2).sum()
    g = vmap(functx.grad(f))(x)
    torch.testing.assert_close(g, torch.where(x > 0, 2 * x, 0))


def test_nonzero_static_keeps_working():
    x = torch.tensor([[[1.0, 0], [0, 2]], [[0, 0], [3, 0]], [[4, 5], [6, 7]]])
    f = lambda x: torch.nonzero_static(x, size=3, fill_value=-7)
    with functx.vmap_fallback("error"):
        out = vmap(f)(x)
    torch.testing.assert_close(out, loop(f, (x,), (0,)))


@pytest.mark.parametrize("shape", [(3, 0), (2, 3, 0), (4, 0, 2), (3, 1)])
@pytest.mark.parametrize("size", [0, 1, 3])
def test_nonzero_static_of_empty_samples(shape, size):
    """Issue 27: samples with no elements raised ZeroDivisionError (unravelling flat positions
    by a 0 extent); plain torch gives `size` rows of fill_value. Against the per-sample loop."""
    x = torch.zeros(shape) if 0 in shape else torch.tensor([[1.0], [0.0], [2.0]])
    f = lambda x: torch.nonzero_static(x, size=size, fill_value=-5)
    with functx.vmap_fallback("error"):
        out = vmap(f)(x)
    torch.testing.assert_close(out, loop(f, (x,), (0,)))


def test_multinomial_on_2d_samples_keeps_working():
    """One-hot rows make draws with replacement exact; without replacement, drawing as many
    as there are nonzero classes draws each of them once."""
    classes = torch.tensor([[[0, 2], [3, 1]], [[1, 4], [0, 4]], [[4, 0], [2, 3]]])  # (B, rows, 2)
    one_hot = F.one_hot(classes[..., 0], 5).float()
    with functx.vmap_fallback("error"):
        out = vmap(lambda p: torch.multinomial(p, 4, replacement=True), randomness="different")(one_hot)
    torch.testing.assert_close(out, classes[..., :1].expand(3, 2, 4))
    two_hot = F.one_hot(classes, 5).sum(-2).float()
    with functx.vmap_fallback("error"):
        drawn = vmap(lambda p: torch.multinomial(p, 2), randomness="different")(two_hot)
    torch.testing.assert_close(drawn.sort(-1).values, classes.sort(-1).values)


# -- ctc_loss: the vmap batch folds into ctc's own ---------------------------------------------
T, N, C, S = 12, 3, 6, 5


def _ctc_case(form):
    """(args, in_dims) of one batch for F.ctc_loss(log_probs, targets, input_lengths,
    target_lengths); padded targets, concatenated ones, and the single-sequence form."""
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(BATCH, T, N, C, generator=g, dtype=torch.float64).log_softmax(-1)
    tg = torch.randint(1, C, (BATCH, N, S), generator=g)
    il = torch.randint(8, T + 1, (BATCH, N), generator=g)
    tl = torch.tensor([[5, 3, 2], [1, 5, 4], [5, 5, 5], [2, 2, 5], [5, 1, 1], [4, 5, 3]])  # max 5 everywhere
    if form == "padded":
        return (lp, tg, il, tl), (0, 0, 0, 0)
    if form == "padded_lengths_unbatched":
        return (lp, tg, il[0], tl[1]), (0, 0, None, None)
    if form == "padded_log_probs_unbatched":
        return (lp[0], tg, il, tl), (None, 0, 0, 0)
    if form == "int_list_lengths":
        return (lp, tg, il[0].tolist(), tl[0].tolist()), (0, 0, None, None)
    if form == "concatenated":
        lengths = torch.tensor([2, 3, 1])
        return (lp, torch.randint(1, C, (BATCH, 6), generator=g), il, lengths), (0, 0, 0, None)
    if form == "one_sequence":  # (T, C) log_probs, (S,) targets, 0-dim lengths
        return (lp[:, :, 0], tg[:, 0], il[:, 0], torch.full((BATCH,), S)), (0, 0, 0, 0)
    raise ValueError(form)


CTC_FORMS = [
    "padded", "padded_lengths_unbatched", "padded_log_probs_unbatched", "int_list_lengths", "concatenated", "one_sequence"
]


def _loop_ctc(f, args, in_dims):
    def select(a, d, b):
        return a if d is None or not isinstance(a, torch.Tensor) else a.select(d, b)

    return torch.stack([f(*(select(a, d, b) for a, d in zip(args, in_dims))) for b in range(BATCH)])


@pytest.mark.parametrize("zero_infinity", [False, True])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("form", CTC_FORMS)
def test_ctc_loss_matches_loop_and_is_vectorized(form, reduction, zero_infinity):
    args, in_dims = _ctc_case(form)
    f = lambda *a: F.ctc_loss(*a, reduction=reduction, zero_infinity=zero_infinity)
    with functx.vmap_fallback("error"):
        out = vmap(f, in_dims=in_dims)(*args)
    torch.testing.assert_close(out, _loop_ctc(f, args, in_dims))


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("form", CTC_FORMS)
def test_ctc_loss_per_sample_gradients_match_autograd_loop(form, reduction):
    args, in_dims = _ctc_case(form)
    loss = lambda lp, *rest: F.ctc_loss(lp, *rest, reduction=reduction).sum()
    def autograd_grad(lp, *rest):
        lp = lp.detach().requires_grad_()
        return torch.autograd.grad(loss(lp, *rest), lp)[0]

    with functx.vmap_fallback("error"):
        grads = vmap(functx.grad(loss), in_dims=in_dims)(*args)
    torch.testing.assert_close(grads, _loop_ctc(autograd_grad, args, in_dims))


@pytest.mark.parametrize("form", ["padded_lengths_unbatched", "int_list_lengths"])
def test_ctc_loss_jacrev_runs_the_backward_rule(form):
    """jacrev vmaps _ctc_loss_backward over the basis of cotangents."""
    (lp, tg, il, tl), _ = _ctc_case(form)
    f = lambda x: F.ctc_loss(x, tg[0], il, tl, reduction="none")
    with functx.vmap_fallback("error"):
        jac = functx.jacrev(f)(lp[0])
    torch.testing.assert_close(jac, torch.autograd.functional.jacobian(f, lp[0]))


@pytest.mark.parametrize("form", ["padded", "int_list_lengths"])
def test_ctc_loss_backward_with_batched_grad_matches_loop(form):
    """The backward op itself, with batched cotangents and everything else batched or not."""
    (lp, tg, il, tl), in_dims = _ctc_case(form)
    one = tuple(a[0] if d == 0 else a for a, d in zip((lp, tg, il, tl), in_dims))
    nll, log_alpha = torch._ctc_loss(*one)
    grad = torch.randn(BATCH, N, dtype=lp.dtype)
    f = lambda g, *a: aten._ctc_loss_backward(g, *a, nll, log_alpha, 0)
    dims = (0, None, None, None, None)
    with functx.vmap_fallback("error"):
        out = vmap(f, in_dims=dims)(grad, *one)
    torch.testing.assert_close(out, _loop_ctc(f, (grad, *one), dims))
    if form == "padded":  # and with the forward's inputs batched too
        f = lambda g, *a: aten._ctc_loss_backward(g, *a, *torch._ctc_loss(*a), 0)
        with functx.vmap_fallback("error"):
            out = vmap(f)(grad, lp, tg, il, tl)
        torch.testing.assert_close(out, _loop_ctc(f, (grad, lp, tg, il, tl), (0, 0, 0, 0, 0)))


def test_ctc_loss_gradient_of_vmap_matches_loop():
    args, in_dims = _ctc_case("padded")
    f = lambda *a: F.ctc_loss(*a, reduction="none")
    lp = args[0].clone().requires_grad_()
    expected = torch.autograd.grad(_loop_ctc(f, (lp, *args[1:]), in_dims).sum(), lp)[0]
    got = functx.grad(lambda lp: vmap(f)(lp, *args[1:]).sum())(args[0])
    torch.testing.assert_close(got, expected)


def test_ctc_loss_in_nested_vmap_matches_loop():
    (lp, tg, il, tl), in_dims = _ctc_case("padded")
    f = lambda *a: F.ctc_loss(*a, reduction="none")
    nested = vmap(vmap(f))(*(a.unflatten(0, (2, 3)) for a in (lp, tg, il, tl)))
    torch.testing.assert_close(nested.flatten(0, 1), _loop_ctc(f, (lp, tg, il, tl), in_dims))


@pytest.mark.filterwarnings("ignore::functx.PerformanceWarning")
def test_ctc_loss_with_longest_targets_differing_between_elements():
    """log_alpha is (N, T, 2 * max(target_lengths) + 1): elements whose longest targets
    differ have log_alphas of different shapes, which no batched tensor can hold: the whole
    function runs per sample (vmap's fallback; torch.func loops too), or with the fallback
    mode "error" it raises."""
    (lp, tg, il, tl), in_dims = _ctc_case("padded")
    tl = tl.clone()
    tl[0] = torch.tensor([1, 2, 2])
    f = lambda *a: F.ctc_loss(*a, reduction="none")
    with functx.vmap_fallback("error"), pytest.raises(RuntimeError, match=r"(?s)vmap: aten::_ctc_loss .*log_alpha.*per-sample shapes differ"):
        vmap(f)(lp, tg, il, tl)
    torch.testing.assert_close(vmap(f, in_dims=in_dims)(lp, tg, il, tl), loop(f, (lp, tg, il, tl), in_dims))
