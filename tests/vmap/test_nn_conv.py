"""vmap of convolutions (functx/vmap/rules/nn_conv.py) against per-sample loops.

Every case runs for each non-empty set of batched arguments (input only = a batch of
inputs, weight/bias only = a model ensemble on one input, all = both), with the batch
dim at 0 and at the last dim, under `vmap_fallback("error")`, which proves that no
per-sample loop ran.
"""

import functools
import itertools
import sys

import pytest
import torch
import torch.nn.functional as F

import functx
from functx import vmap
from .loop_reference import loop, stack_tree, batched_inputs, check  # noqa: F401

B = 3  # batch size of every test
f64 = torch.float64
aten = torch.ops.aten


# -- the check -------------------------------------------------------------------------------
def randn(*shape):
    return lambda: torch.randn(*shape, dtype=f64)


def with_patterns(cases):
    """pytest params: every case times every non-empty set of batched arguments."""
    for name, fn, makers in cases:
        for pattern in itertools.product((False, True), repeat=len(makers)):
            if any(pattern):
                label = "".join("b" if p else "u" for p in pattern)
                yield pytest.param(fn, makers, pattern, id=f"{name}-{label}")


# -- forward -------------------------------------------------------------------------------
def conv(fn, **options):
    """fn(x, w, b, **options), or fn(x, w, **options) for the cases without a bias."""
    return functools.partial(fn, **options)


CONVOLUTIONS = [
    ("conv1d", conv(F.conv1d, stride=2, padding=1), (randn(2, 4, 9), randn(6, 4, 3), randn(6))),
    ("conv1d_unbatched_input", conv(F.conv1d, padding=2, dilation=2), (randn(4, 9), randn(6, 4, 3), randn(6))),
    ("conv2d", conv(F.conv2d, stride=(2, 1), padding=(1, 0)), (randn(2, 4, 6, 5), randn(5, 4, 3, 2), randn(5))),
    (
        "conv2d_groups",
        conv(F.conv2d, padding=2, dilation=2, groups=2),
        (randn(2, 4, 7, 7), randn(6, 2, 3, 3), randn(6)),
    ),
    ("conv2d_depthwise", conv(F.conv2d, groups=4), (randn(2, 4, 5, 5), randn(8, 1, 3, 3), randn(8))),
    ("conv2d_same", conv(F.conv2d, padding="same", groups=2), (randn(2, 4, 6, 6), randn(4, 2, 2, 3), randn(4))),
    ("conv2d_valid_no_bias", conv(F.conv2d, padding="valid"), (randn(4, 6, 6), randn(3, 4, 3, 3))),
    ("conv3d", conv(F.conv3d, stride=(1, 2, 1), padding=1), (randn(2, 2, 4, 4, 4), randn(3, 2, 2, 2, 2), randn(3))),
    (
        "conv_transpose1d",
        conv(F.conv_transpose1d, stride=2, output_padding=1),
        (randn(2, 4, 5), randn(4, 3, 3), randn(3)),
    ),
    (
        "conv_transpose2d_groups",
        conv(F.conv_transpose2d, stride=2, padding=1, output_padding=1, groups=2),
        (randn(2, 4, 4, 5), randn(4, 3, 3, 3), randn(6)),
    ),
    (
        "conv_transpose2d_unbatched_input",
        conv(F.conv_transpose2d, dilation=2, stride=(1, 2), output_padding=(0, 1)),
        (randn(4, 4, 4), randn(4, 2, 2, 3), randn(2)),
    ),
    (
        "conv_transpose3d_no_bias",
        conv(F.conv_transpose3d, stride=2, groups=2),
        (randn(1, 4, 3, 2, 3), randn(4, 1, 2, 2, 2)),
    ),
]


@pytest.mark.parametrize("dim", [0, -1], ids=["dim0", "dimlast"])
@pytest.mark.parametrize("fn, makers, pattern", list(with_patterns(CONVOLUTIONS)))
def test_convolution(fn, makers, pattern, dim):
    check(fn, makers, pattern, dim)


def test_nested_ensemble_of_per_sample_convolutions():
    """Outer vmap over models (weights), inner vmap over samples (inputs)."""
    models, samples = 2, 3
    x = torch.randn(samples, 4, 6, 6, dtype=f64)
    w = torch.randn(models, 6, 2, 3, 3, dtype=f64)
    b = torch.randn(models, 6, dtype=f64)

    def f(x, w, b):
        return F.conv2d(x, w, b, padding=1, groups=2)

    with functx.vmap_fallback("error"):
        per_sample = vmap(f, in_dims=(0, None, None))
        out = vmap(per_sample, in_dims=(None, 0, 0))(x, w, b)
    expected = torch.stack([torch.stack([f(x[i], w[m], b[m]) for i in range(samples)]) for m in range(models)])
    torch.testing.assert_close(out, expected)


NESTED = {  # name: (f, x sample shape, w sample shape, b sample shape)
    "conv": (lambda x, w, b: F.conv2d(x, w, b, stride=2, groups=2), (2, 4, 5, 5), (6, 2, 3, 3), (6,)),
    "transposed": (
        lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2, output_padding=1, groups=2),
        (2, 4, 4, 4),
        (4, 3, 3, 3),
        (6,),
    ),
}


@pytest.mark.parametrize("name", NESTED)
def test_nested_both_levels_batch_everything(name):
    """Both levels batch input, weight and bias (B into the groups twice); the weight's
    outer batch dim is its second one."""
    f, x_shape, w_shape, b_shape = NESTED[name]
    outer, inner = 2, 3
    x = torch.randn(outer, inner, *x_shape, dtype=f64)
    w = torch.randn(inner, outer, *w_shape, dtype=f64)
    b = torch.randn(outer, inner, *b_shape, dtype=f64)
    with functx.vmap_fallback("error"):
        out = vmap(vmap(f), in_dims=(0, 1, 0))(x, w, b)
    expected = torch.stack([torch.stack([f(x[o, i], w[i, o], b[o, i]) for i in range(inner)]) for o in range(outer)])
    torch.testing.assert_close(out, expected)


def test_input_without_sample_dim_is_an_error():
    """aten.convolution itself wants (N, C, ...); the batch dim must not stand in for N."""
    x, w = torch.randn(B, 4, 6, 6), torch.randn(3, 4, 3, 3)
    conv2d = functools.partial(
        aten.convolution.default,
        bias=None,
        stride=[1, 1],
        padding=[0, 0],
        dilation=[1, 1],
        transposed=False,
        output_padding=[0, 0],
        groups=1,
    )
    with pytest.raises(RuntimeError, match="Expected 4-dimensional input"):
        vmap(lambda x: conv2d(x, w))(x)


# -- backward (what vmap(grad(...)) of a convolution runs) ------------------------------------
def conv_backward(transposed, groups, stride, padding, output_padding, bias_channels, mask):
    def backward(grad_output, x, w):
        out = aten.convolution_backward.default(
            grad_output, x, w, [bias_channels], stride, padding, [1, 1], transposed, output_padding, groups, mask
        )
        return tuple(r for r in out if r is not None)

    return backward


BACKWARD_LAYOUTS = {  # name: (transposed, groups, stride, padding, output_padding, x shape, w shape)
    "conv": (False, 2, [2, 1], [1, 0], [0, 0], (2, 4, 6, 5), (6, 2, 3, 2)),
    "transposed": (True, 2, [2, 2], [1, 0], [1, 0], (2, 4, 4, 3), (4, 3, 3, 2)),
}
MASKS = {
    "all": [True, True, True],
    "input": [True, False, False],
    "weight": [False, True, False],
    "params": [False, True, True],
}


def backward_cases():
    for (layout, spec), (mask_name, mask) in itertools.product(BACKWARD_LAYOUTS.items(), MASKS.items()):
        transposed, groups, stride, padding, output_padding, x_shape, w_shape = spec
        x, w = torch.randn(x_shape, dtype=f64), torch.randn(w_shape, dtype=f64)
        out = aten.convolution.default(x, w, None, stride, padding, [1, 1], transposed, output_padding, groups)
        fn = conv_backward(transposed, groups, stride, padding, output_padding, out.shape[1], mask)
        yield f"{layout}-{mask_name}", fn, (randn(*out.shape), randn(*x_shape), randn(*w_shape))


@pytest.mark.parametrize("dim", [0, -1], ids=["dim0", "dimlast"])
@pytest.mark.parametrize("fn, makers, pattern", list(with_patterns(backward_cases())))
def test_convolution_backward(fn, makers, pattern, dim):
    check(fn, makers, pattern, dim)


def test_per_sample_weight_gradients_match_autograd():
    """The DP-SGD case: per-sample grads of a conv's weight and bias, written with the
    backward op as grad would run it, against torch.autograd per sample."""
    x, w, b = torch.randn(B, 1, 4, 6, 6, dtype=f64), torch.randn(6, 2, 3, 3, dtype=f64), torch.randn(6, dtype=f64)

    def grads(x):
        out = F.conv2d(x, w, b, padding=1, groups=2)
        grad_output = 2 * out  # d(sum(out**2))/d out
        return aten.convolution_backward.default(
            grad_output, x, w, [6], [1, 1], [1, 1], [1, 1], False, [0, 0], 2, [False, True, True]
        )[1:]

    with functx.vmap_fallback("error"):
        grad_w, grad_b = vmap(grads)(x)
    for i in range(B):
        wi, bi = w.clone().requires_grad_(), b.clone().requires_grad_()
        expected = torch.autograd.grad(F.conv2d(x[i], wi, bi, padding=1, groups=2).pow(2).sum(), (wi, bi))
        torch.testing.assert_close((grad_w[i], grad_b[i]), expected)


@pytest.mark.parametrize("spatial, n, w_batched", [(2, 1, False), (2, 3, False), (1, 2, False), (2, 2, True)])
def test_per_sample_weight_gradients_of_wide_inputs_unfold(spatial, n, w_batched, monkeypatch):
    """Many input channels on a small map: the rule takes unfold + one batched GEMM (cheaper
    there, vmap/rules/nn_conv.py's `unfolding_pays`) for the per-sample weight gradients; same
    values as torch.autograd per sample, with an N dim per sample and a batched weight too."""
    conv_module = sys.modules["functx.vmap.rules.nn_conv"]
    calls = []
    unfolded = conv_module.unfolded_weight_grads
    monkeypatch.setattr(conv_module, "unfolded_weight_grads", lambda *a: calls.append(a) or unfolded(*a))
    conv = (F.conv1d, F.conv2d)[spatial - 1]
    x = torch.randn(B, n, 64, *(3,) * spatial, dtype=f64)
    w, b = torch.randn(B if w_batched else 1, 5, 64, *(3,) * spatial, dtype=f64), torch.randn(5, dtype=f64)
    w = w if w_batched else w[0]

    def grads(x, w):
        out = conv(x, w, b, padding=2, dilation=2)
        return aten.convolution_backward.default(
            torch.cos(out), x, w, [5], [1] * spatial, [2] * spatial, [2] * spatial, False, [0] * spatial, 1, [True, True, True]
        )

    with functx.vmap_fallback("error"):
        got = vmap(grads, in_dims=(0, 0 if w_batched else None))(x, w)
    assert len(calls) == 1
    for i in range(B):
        xi, wi, bi = x[i].clone().requires_grad_(), (w[i] if w_batched else w).clone().requires_grad_(), b.clone().requires_grad_()
        expected = torch.autograd.grad(conv(xi, wi, bi, padding=2, dilation=2).sin().sum(), (xi, wi, bi))
        torch.testing.assert_close(tuple(r[i] for r in got), expected)


def test_nested_per_sample_gradients_of_an_ensemble():
    """Outer vmap over models, inner over samples: per-model, per-sample weight, bias and
    input gradients."""
    models, samples = 2, 3
    x = torch.randn(samples, 1, 4, 5, 5, dtype=f64)
    w, b = torch.randn(models, 6, 2, 3, 3, dtype=f64), torch.randn(models, 6, dtype=f64)

    def grads(x, w, b):
        out = F.conv2d(x, w, b, stride=2, groups=2)
        return aten.convolution_backward.default(
            2 * out, x, w, [6], [2, 2], [0, 0], [1, 1], False, [0, 0], 2, [True, True, True]
        )

    with functx.vmap_fallback("error"):
        out = vmap(vmap(grads, in_dims=(0, None, None)), in_dims=(None, 0, 0))(x, w, b)
    for m, i in itertools.product(range(models), range(samples)):
        xi, wm, bm = x[i].clone().requires_grad_(), w[m].clone().requires_grad_(), b[m].clone().requires_grad_()
        expected = torch.autograd.grad(F.conv2d(xi, wm, bm, stride=2, groups=2).pow(2).sum(), (xi, wm, bm))
        torch.testing.assert_close(tuple(o[m, i] for o in out), expected)


@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transposed"])
def test_vmap_of_grad_gives_per_sample_gradients(transposed):
    """The DP-SGD pattern end to end: functx.vmap(functx.grad(loss)) over samples."""
    if transposed:
        w, b = torch.randn(4, 3, 3, 3, dtype=f64), torch.randn(6, dtype=f64)
        conv_fn = functools.partial(F.conv_transpose2d, stride=2, output_padding=1, groups=2)
    else:
        w, b = torch.randn(6, 2, 3, 3, dtype=f64), torch.randn(6, dtype=f64)
        conv_fn = functools.partial(F.conv2d, padding=1, groups=2)
    x = torch.randn(B, 1, 4, 5, 5, dtype=f64)

    def loss(w, b, x):
        return conv_fn(x, w, b).tanh().pow(2).sum()

    with functx.vmap_fallback("error"):
        grads = vmap(functx.grad(loss, argnums=(0, 1, 2)), in_dims=(None, None, 0))(w, b, x)
    for i in range(B):
        args = [t.clone().requires_grad_() for t in (w, b, x[i])]
        expected = torch.autograd.grad(loss(*args), args)
        torch.testing.assert_close(tuple(g[i] for g in grads), expected)
