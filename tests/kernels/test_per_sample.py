"""functx/kernels/per_sample.py: every layer's per-sample gradient norms, clipped sums and
per-sample gradients against the materialised reference (torch.func's vmap(grad) of the
layer alone, float64), on hypothesis-drawn shapes; the ghost and materialised Linear paths
both; repeated and padding embedding ids."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import functx.kernels.ops as ops
import functx.kernels.per_sample as per_sample
from functx.kernels import layer_gradients

DT = torch.float64


def reference(layer, args, grad_output):
    """Per-sample gradients of the layer's own parameters: torch.func's vmap of the vjp of
    the layer called on one sample (an independent implementation)."""
    params = {n: p.detach() for n, p in layer.named_parameters(recurse=False)}

    def one(g_b, a_b):
        out, pullback = torch.func.vjp(lambda p: torch.func.functional_call(layer, p, (a_b[None],)), params)
        return pullback(g_b[None])[0]

    return torch.func.vmap(one)(grad_output, args[0])


def check(layer, a, g, weights, kernel=None):
    expected = reference(layer, (a,), g)
    kernel = kernel or layer_gradients(layer, (a,), g)
    got = kernel.per_sample()
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], msg=name)
    norms = sum(e.flatten(1).pow(2).sum(1) for e in expected.values())
    torch.testing.assert_close(kernel.norms_sq(), norms)
    summed = kernel.weighted_sum(weights)
    for name in expected:
        torch.testing.assert_close(summed[name], torch.tensordot(weights, expected[name], dims=1), msg=name)
    # as functx.dp runs it: the norms, then `release` (what the sum does not read is
    # dropped in the backward), then the sum
    fresh = type(kernel)(kernel.module, (a,), g)
    torch.testing.assert_close(fresh.norms_sq(), norms)
    fresh.release()
    summed = fresh.weighted_sum(weights)
    for name in expected:
        torch.testing.assert_close(summed[name], torch.tensordot(weights, expected[name], dims=1), msg=name)
    return fresh


dims = st.integers(1, 6)


@settings(max_examples=25, deadline=None)
@given(batch=dims, steps=st.integers(0, 7), d_in=dims, d_out=dims, bias=st.booleans(), seed=st.integers(0, 2**16))
def test_linear(batch, steps, d_in, d_out, bias, seed):
    torch.manual_seed(seed)
    layer = nn.Linear(d_in, d_out, bias=bias).to(DT)
    shape = (batch, d_in) if steps == 0 else (batch, steps, d_in)  # 2-D input, or sequences
    a = torch.randn(shape, dtype=DT)
    g = torch.randn(*shape[:-1], d_out, dtype=DT)
    check(layer, a, g, torch.rand(batch, dtype=DT))


@pytest.mark.parametrize("path", ["ghost", "materialised", "ghost in blocks"])
def test_linear_sequence_paths(path, monkeypatch):
    """Per-sample gradients no larger than the inputs and output gradient (B·d_out·d_in <=
    B·T·(d_in + d_out): long sequences) are materialised, and only they kept after the norms;
    otherwise the ghost norm (2T² < d_in·d_out then holds), the inputs and output gradient
    kept for the sum; a small block budget splits the T×T products into row blocks."""
    torch.manual_seed(1)
    steps, d = (3, 8) if path != "materialised" else (9, 2)
    if path == "ghost in blocks":
        monkeypatch.setattr(ops, "BLOCK_ELEMENTS", 7)
    layer = nn.Linear(d, d).to(DT)
    a, g = torch.randn(4, steps, d, dtype=DT), torch.randn(4, steps, d, dtype=DT)
    kernel = check(layer, a, g, torch.rand(4, dtype=DT))
    assert kernel._materialised == (path == "materialised")
    assert (kernel.grad_output is None) == (path == "materialised")  # released, or kept for the sum
    if path != "materialised":
        assert 2 * steps * steps < d * d  # the ghost norm pays


@settings(max_examples=25, deadline=None)
@given(batch=dims, steps=st.integers(1, 8), vocab=st.integers(1, 6), dim=dims, padding=st.booleans(), seed=st.integers(0, 2**16))
def test_embedding_repeated_and_padding_ids(batch, steps, vocab, dim, padding, seed):
    torch.manual_seed(seed)
    layer = nn.Embedding(vocab, dim, padding_idx=0 if padding else None).to(DT)
    ids = torch.randint(0, vocab, (batch, steps))  # a small vocabulary: ids repeat
    g = torch.randn(batch, steps, dim, dtype=DT)
    check(layer, ids, g, torch.rand(batch, dtype=DT))


@settings(max_examples=20, deadline=None)
@given(batch=dims, kind=st.sampled_from(["layer", "group"]), affine=st.booleans(), seed=st.integers(0, 2**16))
def test_norm_affine(batch, kind, affine, seed):
    torch.manual_seed(seed)
    if kind == "layer":
        layer = nn.LayerNorm((3, 4), elementwise_affine=True, bias=affine).to(DT)
        a = torch.randn(batch, 2, 3, 4, dtype=DT)
    else:
        layer = nn.GroupNorm(2, 4, affine=True).to(DT)
        a = torch.randn(batch, 4, 5, dtype=DT)
    with torch.no_grad():  # not the initial ones and zeros
        for p in layer.parameters():
            p.normal_()
    check(layer, a, torch.randn_like(a), torch.rand(batch, dtype=DT))


CONV_SETTINGS = dict(
    batch=st.integers(1, 4),
    kernel=st.integers(1, 3),
    stride=st.integers(1, 2),
    padding=st.integers(0, 2),
    dilation=st.integers(1, 2),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)


@settings(max_examples=25, deadline=None)
@given(spatial=st.sampled_from([1, 2]), channels=st.integers(1, 3), out=st.integers(1, 4), **CONV_SETTINGS)
def test_conv_unfolded(batch, spatial, channels, out, kernel, stride, padding, dilation, bias, seed):
    torch.manual_seed(seed)
    conv = (nn.Conv1d if spatial == 1 else nn.Conv2d)(channels, out, kernel, stride, padding, dilation, bias=bias).to(DT)
    a = torch.randn(batch, channels, *(7,) * spatial, dtype=DT)
    g = torch.randn_like(conv(a))
    check(conv, a, g, torch.rand(batch, dtype=DT), kernel=per_sample.ConvGradients(conv, (a,), g))


def test_conv_kernel_chosen_by_cost():
    """The ghost norm (unfolded) where 2L² < C·k·O: a large weight, few output positions."""
    deep, shallow = nn.Conv2d(32, 32, 3), nn.Conv2d(1, 4, 3, padding=1)
    a_deep, a_shallow = torch.randn(2, 32, 5, 5), torch.randn(2, 1, 12, 12)
    chosen = [type(layer_gradients(c, (a,), c(a).detach())).__name__ for c, a in ((deep, a_deep), (shallow, a_shallow))]
    assert chosen == ["ConvGradients", "GroupedConvGradients"]


@settings(max_examples=20, deadline=None)
@given(spatial=st.sampled_from([1, 2, 3]), groups=st.sampled_from([1, 2]), **CONV_SETTINGS)
def test_conv_grouped(batch, spatial, groups, kernel, stride, padding, dilation, bias, seed):
    torch.manual_seed(seed)
    cls = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[spatial - 1]
    conv = cls(2 * groups, 2 * groups, kernel, stride, padding, dilation, groups=groups, bias=bias).to(DT)
    a = torch.randn(batch, 2 * groups, *(6,) * spatial, dtype=DT)
    g = torch.randn_like(conv(a))
    check(conv, a, g, torch.rand(batch, dtype=DT), kernel=per_sample.GroupedConvGradients(conv, (a,), g))


@pytest.mark.parametrize(
    "layer",
    [nn.Conv1d(3, 4, 3, padding="same"), nn.Conv1d(3, 4, 3, padding=1, padding_mode="reflect"), nn.ConvTranspose1d(3, 2, 2)],
    ids=["same", "reflect", "transposed"],
)
def test_other_layers_materialise(layer):
    torch.manual_seed(2)
    layer = layer.to(DT)
    a = torch.randn(5, layer.in_channels, *(6,) * (layer.weight.dim() - 2), dtype=DT)
    g = torch.randn_like(layer(a))
    assert type(layer_gradients(layer, (a,), g)).__name__ == "MaterializedGradients"
    check(layer, a, g, torch.rand(5, dtype=DT))


def test_frozen_parameters_are_left_out():
    layer = nn.Linear(3, 2).to(DT)
    layer.bias.requires_grad_(False)
    a, g = torch.randn(4, 3, dtype=DT), torch.randn(4, 2, dtype=DT)
    kernel = layer_gradients(layer, (a,), g)
    assert list(kernel.per_sample()) == ["weight"] and list(kernel.weighted_sum(torch.ones(4, dtype=DT))) == ["weight"]
    torch.testing.assert_close(kernel.norms_sq(), g.pow(2).sum(1) * a.pow(2).sum(1))


# -- the registry: users' layer types, and a kernel that declines a call ---------------------------
class _Scale(nn.Module):
    """y = weight ⊙ x (per feature): sample b's weight gradient is g_b ⊙ x_b."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, dtype=DT))

    def forward(self, x):
        return self.weight * x


class _ScaleGradients(per_sample.LayerGradients):
    made = 0

    def _per_sample(self):
        _ScaleGradients.made += 1
        return {"weight": self.grad_output * self.args[0]}


@pytest.fixture
def registry(monkeypatch):
    monkeypatch.setattr(per_sample, "_KERNELS", dict(per_sample._KERNELS))
    return per_sample._KERNELS


def test_a_registered_kernel_serves_its_layer_type_in_clipped_grad(registry):
    import functx.dp as dp
    from functx.kernels import register_layer_gradients

    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 3).to(DT), _Scale(3))
    x, y = torch.randn(6, 4, dtype=DT), torch.randn(6, 3, dtype=DT)
    loss_fn = lambda out, target: (out - target).pow(2).sum(1)
    materialised, norms_m = dp.clipped_grad(model, loss_fn, x, y, max_norm=0.5)
    assert register_layer_gradients(_Scale)(_ScaleGradients) is _ScaleGradients  # (decorator form)
    _ScaleGradients.made = 0
    kernel, norms_k = dp.clipped_grad(model, loss_fn, x, y, max_norm=0.5)
    assert _ScaleGradients.made == 1
    torch.testing.assert_close(norms_k, norms_m)
    for name in materialised:
        torch.testing.assert_close(kernel[name], materialised[name], msg=name)
    # the reference: per-sample gradients of the whole model by plain autograd, clipped and summed
    per = [torch.autograd.grad(loss_fn(model(x[b : b + 1]), y[b : b + 1]).sum(), list(model.parameters())) for b in range(6)]
    norms = torch.stack([torch.sqrt(sum(g.pow(2).sum() for g in gs)) for gs in per])
    torch.testing.assert_close(norms_k, norms)
    factors = (0.5 / (norms + 1e-6)).clamp(max=1)
    for i, name in enumerate(dict(model.named_parameters())):
        torch.testing.assert_close(kernel[name], sum(f * gs[i] for f, gs in zip(factors, per)), msg=name)


def test_a_kernel_that_declines_leaves_the_layer_materialised(registry):
    from functx.kernels import register_layer_gradients

    register_layer_gradients(nn.Linear, lambda module, args, grad_output, kwargs: None)
    layer = nn.Linear(3, 2).to(DT)
    a, g = torch.randn(4, 3, dtype=DT), torch.randn(4, 2, dtype=DT)
    assert type(layer_gradients(layer, (a,), g)).__name__ == "MaterializedGradients"
    check(layer, a, g, torch.rand(4, dtype=DT))


def test_functx_kernels_are_registered_for_exact_types():
    layer = nn.Linear(3, 2).to(DT)
    a, g = torch.randn(4, 3, dtype=DT), torch.randn(4, 2, dtype=DT)
    assert type(layer_gradients(layer, (a,), g)).__name__ == "LinearGradients"

    class MyLinear(nn.Linear):  # a subclass may change forward: materialised unless registered
        pass

    mine = MyLinear(3, 2).to(DT)
    assert type(layer_gradients(mine, (a,), g)).__name__ == "MaterializedGradients"


@pytest.mark.parametrize("bad", [nn.Linear(2, 2), "Linear"])
def test_register_refuses_what_is_not_a_type_or_a_kernel(bad, registry):
    from functx.kernels import register_layer_gradients

    with pytest.raises(TypeError, match="register_layer_gradients"):
        register_layer_gradients(bad, _ScaleGradients)
    with pytest.raises(TypeError, match="must be callable"):
        register_layer_gradients(nn.Linear, 3)
    assert registry[nn.Linear].__name__ == "_linear"
