"""vmap of glu, prelu, pixel/channel shuffles, one_hot and scaled dot product attention
(functx/vmap/rules/nn_misc.py) against per-sample loops.

Every case runs for each non-empty set of batched arguments (e.g. prelu's weight batched
alone = a model ensemble on one input), with the batch dim at 0 and at the last dim,
under `vmap_fallback("error")`, which proves that no per-sample loop ran. Gradients taken
inside vmap send the backward ops (glu_backward, the attention backward) to vmap too.
"""

from functools import partial

import pytest
import torch
import torch.nn.functional as F

import functx
from functx import vmap
from .loop_reference import loop, stack_tree, batched_inputs, check, with_patterns_and_dims as with_patterns  # noqa: F401

B = 3  # batch size of every test
f64 = torch.float64
aten = torch.ops.aten


# -- the check -------------------------------------------------------------------------------
def randn(*shape, dtype=f64):
    return lambda: torch.randn(shape, dtype=dtype)


def boolean(*shape):
    """A random mask with at least one True per row (an all-False attention row is NaN)."""
    return lambda: (torch.rand(shape) > 0.4) | torch.eye(shape[-2], shape[-1], dtype=torch.bool)


def grad_of(fn, *wrt):
    """x, *rest -> d sum(fn(x, *rest) * cotangent) / d (args at `wrt`), for one sample."""

    def grads(*args):
        args = [a.detach().requires_grad_() if i in wrt else a for i, a in enumerate(args)]
        out = fn(*args)
        cotangent = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
        return torch.autograd.grad(out, [args[i] for i in wrt], cotangent)

    return grads


# -- activations and shuffles -----------------------------------------------------------------
CASES = [
    ("glu", F.glu, (randn(4, 6),)),
    ("glu_dim0", partial(F.glu, dim=0), (randn(4, 3),)),
    ("glu_1d", F.glu, (randn(6),)),
    ("glu_grad", grad_of(partial(F.glu, dim=1), 0), (randn(2, 4, 3),)),
    ("prelu", F.prelu, (randn(2, 3, 4), randn(3))),
    ("prelu_shared_weight", F.prelu, (randn(2, 3, 4, 2), randn(1))),
    ("prelu_2d", F.prelu, (randn(4, 3), randn(3))),
    ("prelu_1d", F.prelu, (randn(5), randn(1))),
    ("prelu_grad", grad_of(F.prelu, 0, 1), (randn(2, 3, 4), randn(3))),
    ("pixel_shuffle", partial(F.pixel_shuffle, upscale_factor=2), (randn(2, 8, 3, 3),)),
    ("pixel_shuffle_one_image", partial(F.pixel_shuffle, upscale_factor=2), (randn(4, 2, 3),)),
    ("pixel_shuffle_grad", grad_of(partial(F.pixel_shuffle, upscale_factor=2), 0), (randn(1, 4, 2, 2),)),
    ("pixel_unshuffle", partial(F.pixel_unshuffle, downscale_factor=2), (randn(2, 2, 4, 6),)),
    ("pixel_unshuffle_one_image", partial(F.pixel_unshuffle, downscale_factor=2), (randn(1, 4, 2),)),
    ("channel_shuffle", partial(F.channel_shuffle, groups=2), (randn(2, 4, 3, 3),)),
    ("channel_shuffle_1d", partial(F.channel_shuffle, groups=3), (randn(2, 6, 5),)),
    ("native_channel_shuffle", lambda x: aten.native_channel_shuffle(x, 2), (randn(2, 4, 3),)),
    ("one_hot", lambda t: F.one_hot(t, 5), (lambda: torch.randint(0, 5, (4,)),)),
]


@pytest.mark.parametrize("fn, makers, pattern, dim", list(with_patterns(CASES)))
def test_activations_and_shuffles(fn, makers, pattern, dim):
    check(fn, makers, pattern, dim)


@pytest.mark.parametrize(
    "fn, match",
    [
        (partial(F.pixel_shuffle, upscale_factor=2), "pixel_shuffle expects input to have at least 3 dimensions"),
        (partial(F.pixel_unshuffle, downscale_factor=2), "pixel_unshuffle expects input to have at least 3 dimensions"),
        (partial(F.channel_shuffle, groups=2), "channel_shuffle expects input with > 2 dims"),
    ],
    ids=["pixel_shuffle", "pixel_unshuffle", "channel_shuffle"],
)
def test_shuffles_check_the_logical_rank(fn, match):
    """The physical value has one more dim, which the kernel alone would accept."""
    with pytest.raises(RuntimeError, match=match):
        vmap(fn)(torch.randn(B, 4, 4))


@pytest.mark.filterwarnings("ignore::functx.PerformanceWarning")
def test_one_hot_without_num_classes_is_data_dependent():
    """Its width is each sample's max + 1, a Python value: per sample (vmap's fallback), an
    error where the widths differ, torch.func's error with the fallback mode "error"."""
    x = torch.randint(0, 4, (B, 4))
    x[:, 0] = 4
    with functx.vmap_fallback("error"), pytest.raises(RuntimeError, match="item"):
        vmap(F.one_hot)(x)
    torch.testing.assert_close(vmap(F.one_hot)(x), torch.stack([F.one_hot(r) for r in x]))
    x[0, 0] = 6
    with pytest.raises(RuntimeError, match="different shapes per sample"):
        vmap(F.one_hot)(x)


def test_nested_prelu_ensemble():
    x = torch.randn(B, 2, 3, 4, dtype=f64)
    w = torch.randn(2, 3, dtype=f64)
    with functx.vmap_fallback("error"):
        out = vmap(vmap(F.prelu, in_dims=(None, 0)), in_dims=(0, None))(x, w)
    expected = torch.stack([torch.stack([F.prelu(x[i], w[j]) for j in range(2)]) for i in range(B)])
    torch.testing.assert_close(out, expected)


# -- scaled dot product attention ----------------------------------------------------------------
def sdpa(q, k, v, mask=None, **options):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **options)


def sdpa_flash_with_lse(q, k, v):
    """The aten op: also returns the logsumexp, which the backward reads. Like
    F.scaled_dot_product_attention, give it contiguous inputs: the CPU kernel misreads a
    strided last dim (which the per-sample slices at in_dims=-1 have)."""
    q, k, v = (t.contiguous() for t in (q, k, v))
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, scale=0.5)


ATTENTION = [
    ("sdpa", sdpa, (randn(2, 3, 4, 8), randn(2, 3, 6, 8), randn(2, 3, 6, 5))),
    ("sdpa_causal_scale", partial(sdpa, is_causal=True, scale=0.3), (randn(2, 2, 5, 4), randn(2, 2, 5, 4), randn(2, 2, 5, 4))),
    ("sdpa_mask_2d", sdpa, (randn(2, 3, 4, 8), randn(2, 3, 6, 8), randn(2, 3, 6, 8), randn(4, 6))),
    ("sdpa_mask_4d", sdpa, (randn(2, 3, 4, 8), randn(2, 3, 6, 8), randn(2, 3, 6, 8), randn(2, 1, 4, 6))),
    ("sdpa_mask_4d_shared", sdpa, (randn(2, 3, 4, 8), randn(2, 3, 6, 8), randn(2, 3, 6, 8), randn(1, 3, 4, 6))),
    ("sdpa_bool_mask", sdpa, (randn(2, 3, 4, 8), randn(2, 3, 4, 8), randn(2, 3, 4, 8), boolean(4, 4))),
    ("sdpa_math_3d", sdpa, (randn(3, 4, 8), randn(3, 6, 8), randn(3, 6, 8), randn(4, 6))),
    ("sdpa_flash_lse", sdpa_flash_with_lse, (randn(2, 3, 4, 8), randn(2, 3, 4, 8), randn(2, 3, 4, 8))),
]


@pytest.mark.parametrize("fn, makers, pattern, dim", list(with_patterns(ATTENTION)))
def test_scaled_dot_product_attention(fn, makers, pattern, dim):
    check(fn, makers, pattern, dim)


ATTENTION_GRADS = [
    ("sdpa_grad", grad_of(sdpa, 0, 1, 2), (randn(2, 3, 4, 8), randn(2, 3, 6, 8), randn(2, 3, 6, 8))),
    ("sdpa_mask_grad", grad_of(sdpa, 0, 1, 2), (randn(2, 2, 4, 8), randn(2, 2, 4, 8), randn(2, 2, 4, 8), randn(2, 1, 4, 4))),
    ("sdpa_causal_grad", grad_of(partial(sdpa, is_causal=True), 0, 2), (randn(1, 2, 5, 4), randn(1, 2, 5, 4), randn(1, 2, 5, 4))),
]


@pytest.mark.parametrize("fn, makers, pattern, dim", list(with_patterns(ATTENTION_GRADS, dims=(0,))))
def test_scaled_dot_product_attention_backward(fn, makers, pattern, dim):
    check(fn, makers, pattern, dim)


def test_nested_scaled_dot_product_attention():
    q = torch.randn(2, B, 1, 2, 4, 8, dtype=f64)
    k = torch.randn(B, 1, 2, 4, 8, dtype=f64)
    mask = torch.randn(2, 4, 4, dtype=f64)
    with functx.vmap_fallback("error"):
        out = vmap(vmap(sdpa, in_dims=(0, 0, 0, None)), in_dims=(0, None, None, 0))(q, k, k, mask)
    expected = torch.stack([torch.stack([sdpa(q[i, j], k[j], k[j], mask[i]) for j in range(B)]) for i in range(2)])
    torch.testing.assert_close(out, expected)


def test_sdpa_dropout_follows_randomness():
    """Dropout takes the composite math path, whose random op follows vmap's policy."""
    q = torch.randn(B, 1, 2, 4, 8, dtype=f64)
    with pytest.raises(RuntimeError, match="randomness"):
        vmap(partial(sdpa, dropout_p=0.5))(q, q, q)
    out = vmap(partial(sdpa, dropout_p=0.5), randomness="different")(q, q, q)
    assert out.shape == q.shape
    repeated = q[:1].expand(B, *q.shape[1:])
    same = vmap(partial(sdpa, dropout_p=0.5), randomness="same")(repeated, repeated, repeated)
    torch.testing.assert_close(same, same[:1].expand_as(same))
    different = vmap(partial(sdpa, dropout_p=0.5), randomness="different")(repeated, repeated, repeated)
    assert not torch.equal(different[0], different[1])


def test_per_sample_gradients_with_functx_grad():
    """Per-sample gradients through attention (flash kernel and its backward) and prelu."""
    wq, a = torch.randn(8, 8, dtype=f64), torch.rand(2, dtype=f64)
    xs = torch.randn(B, 1, 2, 4, 8, dtype=f64)

    def loss(params, x):
        w, slope = params
        q = F.linear(x, w)
        h = F.scaled_dot_product_attention(q, x, x, is_causal=True)
        return F.prelu(h, slope).pow(2).sum()

    with functx.vmap_fallback("error"):
        grads = vmap(functx.grad(loss), in_dims=(None, 0))((wq, a), xs)
    expected = []
    for x in xs:
        p = [q.detach().requires_grad_() for q in (wq, a)]
        expected.append(torch.autograd.grad(loss(p, x), p))
    torch.testing.assert_close(list(grads), [torch.stack(g) for g in zip(*expected)])


@pytest.mark.filterwarnings("ignore::functx.PerformanceWarning")
@pytest.mark.parametrize("mode, per_sample_weights", [("sum", False), ("mean", False), ("max", False), ("sum", True)])
@pytest.mark.parametrize("stack", ["vjp(vmap)", "vmap(grad)", "vmap"])
def test_embedding_bag_under_reverse_mode_and_vmap(mode, stack, per_sample_weights):
    """embedding_bag with a batched weight: under vjp(vmap) torch picked the forward-only op
    (the BatchedTensor weight does not report requires_grad) and the per-sample loop met a
    differentiated weight: "Autograd not support dtype: Long" (op-db embedding_bag vjp_vmap).
    Reference: plain autograd per sample."""
    torch.manual_seed(0)
    weights = torch.randn(3, 10, 4, dtype=torch.float64)
    indices, offsets = torch.tensor([1, 2, 4, 5, 4, 3]), torch.tensor([0, 3])
    psw = torch.rand(6, dtype=torch.float64) if per_sample_weights else None

    def f(w):
        return F.embedding_bag(indices, w, offsets, mode=mode, per_sample_weights=psw)

    cotangents = torch.randn(3, 2, 4, dtype=torch.float64)
    expected_out = torch.stack([f(w) for w in weights])
    expected_grads = []
    for w, c in zip(weights, cotangents):
        leaf = w.clone().requires_grad_()
        expected_grads.append(torch.autograd.grad((f(leaf) * c).sum(), leaf)[0])
    expected_grads = torch.stack(expected_grads)
    if stack == "vjp(vmap)":
        out, vjp_fn = functx.vjp(functx.vmap(f), weights)
        torch.testing.assert_close(out, expected_out)
        torch.testing.assert_close(vjp_fn(cotangents)[0], expected_grads)
    elif stack == "vmap(grad)":
        got = functx.vmap(functx.grad(lambda w, c: (f(w) * c).sum()))(weights, cotangents)
        torch.testing.assert_close(got, expected_grads)
    else:
        torch.testing.assert_close(functx.vmap(f)(weights), expected_out)
