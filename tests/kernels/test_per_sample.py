"""functx/kernels/per_sample.py: every layer's per-sample gradient norms, clipped sums and
per-sample gradients against the materialised reference (torch.func's vmap(grad) of the
layer alone, float64), on hypothesis-drawn shapes; the ghost and materialised Linear paths
both; repeated and padding embedding ids."""

from __future__ import annotations

import re

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


# -- what layer_gradients is given: grad_output against the output, None entries, args ------------
def _calls():
    """One call per layer type functx registers a kernel for (the check is in layer_gradients,
    ahead of every kernel), and two materialised layers (one with a tuple output)."""
    torch.manual_seed(4)
    return {
        nn.Linear: (nn.Linear(3, 2), torch.randn(4, 3)),
        nn.Embedding: (nn.Embedding(7, 3), torch.randint(0, 7, (4, 5))),
        nn.Conv1d: (nn.Conv1d(2, 3, 3), torch.randn(4, 2, 6)),
        nn.Conv2d: (nn.Conv2d(2, 3, 3), torch.randn(4, 2, 6, 6)),
        nn.Conv3d: (nn.Conv3d(2, 3, 3), torch.randn(4, 2, 5, 5, 5)),
        nn.LayerNorm: (nn.LayerNorm(3), torch.randn(4, 5, 3)),
        nn.GroupNorm: (nn.GroupNorm(1, 3), torch.randn(4, 3, 5)),
        nn.Bilinear: (nn.Bilinear(3, 3, 2), torch.randn(4, 3)),  # materialised
        nn.LSTM: (nn.LSTM(3, 2, batch_first=True), torch.randn(4, 5, 3)),  # materialised, tuple output
    }


def _args(layer, x):
    return (x, x) if isinstance(layer, nn.Bilinear) else (x,)


def test_every_functx_kernel_is_covered_by_the_grad_output_check():
    assert {t for t, k in per_sample._KERNELS.items() if k.__module__ == per_sample.__name__} <= set(_calls())


@pytest.mark.parametrize("layer_type", list(_calls()), ids=lambda t: t.__name__)
def test_a_grad_output_of_another_shape_than_the_output_is_refused(layer_type):
    layer, x = _calls()[layer_type]
    layer = layer.to(DT)
    x = x.to(DT) if x.is_floating_point() else x
    args = _args(layer, x)
    out = layer(*args)
    lstm = isinstance(out, tuple)
    out = out[0] if lstm else out
    wrong = torch.randn(*out.shape[:-1], out.shape[-1] + 1, dtype=DT)  # one feature too many
    item = "[0]" if lstm else ""
    expected = re.escape(
        f"grad_output{item} has shape {tuple(wrong.shape)}, but {layer_type.__name__}'s output{item} has shape "
        f"{tuple(out.shape)}"
    )
    with pytest.raises(ValueError, match=expected):
        grads = layer_gradients(layer, args, (wrong, None) if lstm else wrong)
        grads.norms_sq()  # materialised layers: checked by their own forward, at the first method call
    g = torch.randn(out.shape, dtype=DT)  # the right shape: no error, the reference's values
    grads = layer_gradients(layer, args, (g, None) if lstm else g)
    # the reference: each sample's gradient by plain autograd (torch.func's vmap cannot run an LSTM)
    expected = []
    for b in range(4):
        o = layer(*(a[b : b + 1] for a in args))
        per = torch.autograd.grad(((o[0] if lstm else o) * g[b : b + 1]).sum(), list(layer.parameters()))
        expected.append(sum(v.pow(2).sum() for v in per))
    torch.testing.assert_close(grads.norms_sq(), torch.stack(expected))


def test_grad_output_that_does_not_fit_the_output_is_refused():
    layer = nn.Linear(3, 2).to(DT)
    x = torch.randn(4, 3, dtype=DT)
    with pytest.raises(ValueError, match=r"grad_output has shape \(5, 2\), but Linear's output has shape \(4, 2\)"):
        layer_gradients(layer, (x,), torch.randn(5, 2, dtype=DT))  # another batch size
    with pytest.raises(ValueError, match=r"grad_output has shape \(4,\), but Linear's output has shape \(4, 2\)"):
        layer_gradients(layer, (x,), torch.randn(4, dtype=DT))
    with pytest.raises(ValueError, match="Linear returned one tensor, of shape .*but grad_output is a tuple"):
        layer_gradients(layer, (x,), (torch.randn(4, 2, dtype=DT),))
    with pytest.raises(ValueError, match=r"Linear cannot be called on args of shapes \[\(4, 6\)\]"):
        layer_gradients(layer, (torch.randn(4, 6, dtype=DT),), torch.randn(4, 2, dtype=DT))  # the wrong input
    with pytest.raises(TypeError, match="grad_output must be a tensor, or a tuple"):
        layer_gradients(layer, (x,), 3)
    with pytest.raises(TypeError, match="grad_output's entries must be tensors or None, got float"):
        layer_gradients(layer, (x,), (1.0,))
    with pytest.raises(ValueError, match="0-dim"):
        layer_gradients(layer, (x,), torch.tensor(1.0))
    lstm = nn.LSTM(3, 2, batch_first=True).to(DT)
    xs = torch.randn(4, 5, 3, dtype=DT)
    with pytest.raises(ValueError, match="LSTM returned a tuple of 2 items, but grad_output has 1 entry"):
        layer_gradients(lstm, (xs,), (torch.randn(4, 5, 2, dtype=DT),)).norms_sq()
    with pytest.raises(ValueError, match=r"grad_output\[1\] has shape \(1, 4, 2\), whose first dim is not the batch"):
        layer_gradients(lstm, (xs,), (torch.randn(4, 5, 2, dtype=DT), torch.randn(1, 4, 2, dtype=DT)))
    bilinear = nn.Bilinear(3, 2, 4).to(DT)
    with pytest.raises(ValueError, match=r"args\[1\] has shape \(5, 2\), whose first dim is not the batch \(4"):
        layer_gradients(bilinear, (x, torch.randn(5, 2, dtype=DT)), torch.randn(4, 4, dtype=DT)).norms_sq()


def test_the_check_leaves_the_layer_alone():
    """The meta-device call runs no hooks and leaves the parameters as they were."""
    layer = nn.Linear(3, 2).to(DT)
    calls = []
    layer.register_forward_hook(lambda *_: calls.append(1))
    weight = layer.weight
    layer_gradients(layer, (torch.randn(4, 3, dtype=DT),), torch.randn(4, 2, dtype=DT))
    assert calls == [] and layer.weight is weight and weight.device.type == "cpu"


class _ReadsValues(nn.Module):
    """A forward that reads values (cannot run on the meta device)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, dtype=DT))

    def forward(self, x):
        return self.weight * x * float(x.abs().max() > -1)


def test_a_kernel_for_a_layer_the_meta_device_cannot_run_is_not_checked(registry):
    from functx.kernels import register_layer_gradients

    register_layer_gradients(_ReadsValues, _ScaleGradients)
    x, g = torch.randn(4, 3, dtype=DT), torch.randn(4, 3, dtype=DT)
    grads = layer_gradients(_ReadsValues(), (x,), g)
    torch.testing.assert_close(grads.per_sample()["weight"], g * x)


@pytest.mark.parametrize("layer_type", [nn.Linear, nn.Embedding, nn.LSTM], ids=lambda t: t.__name__)
def test_every_grad_output_entry_none_means_zero_gradients(layer_type):
    """As autograd reads a None gradient: zero; the batch size from the inputs."""
    layer, x = _calls()[layer_type]
    layer = layer.to(DT)
    x = x.to(DT) if x.is_floating_point() else x
    entries = 2 if layer_type is nn.LSTM else 1
    grads = layer_gradients(layer, (x,), (None,) * entries)
    norms = grads.norms_sq()
    assert norms.shape == (4,) and norms.dtype == DT and not norms.any()
    params = dict(layer.named_parameters())
    summed = grads.weighted_sum(torch.rand(4, dtype=DT))
    assert summed.keys() == params.keys() and all(not s.any() and s.shape == params[n].shape for n, s in summed.items())
    per = grads.per_sample()
    assert all(per[n].shape == (4, *p.shape) and not per[n].any() for n, p in params.items())
    with pytest.raises(ValueError, match="every grad_output entry is None .* args holds no tensor"):
        layer_gradients(layer, (), (None,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_layer_without_parameters_has_zero_norms(dtype):
    x, g = torch.randn(4, 3, dtype=dtype), torch.randn(4, 3, dtype=dtype)
    grads = layer_gradients(nn.Tanh(), (x,), g)
    norms = grads.norms_sq()
    assert isinstance(norms, torch.Tensor) and norms.shape == (4,) and norms.dtype == dtype
    assert torch.equal(norms, torch.zeros(4, dtype=dtype))
    assert grads.weighted_sum(torch.ones(4, dtype=dtype)) == {} and grads.per_sample() == {}


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("layer_type", [nn.Linear, nn.Conv1d, nn.LSTM], ids=lambda t: t.__name__)
def test_one_input_given_alone_is_a_one_tuple(layer_type, batch):
    """As functional_call's args: `layer_gradients(layer, x, g)` is `layer_gradients(layer, (x,), g)`
    (a batch of one included: the tensor is not read as a tuple of its samples)."""
    layer, x = _calls()[layer_type]
    layer, x = layer.to(DT), x.to(DT)[:batch]
    out = layer(x)
    lstm = isinstance(out, tuple)
    g = torch.randn((out[0] if lstm else out).shape, dtype=DT)
    g = (g, None) if lstm else g
    alone, tupled = layer_gradients(layer, x, g), layer_gradients(layer, (x,), g)
    assert alone.args[0] is x
    torch.testing.assert_close(alone.norms_sq(), tupled.norms_sq())
    weights = torch.rand(batch, dtype=DT)
    expected = tupled.weighted_sum(weights)
    for name, got in alone.weighted_sum(weights).items():
        torch.testing.assert_close(got, expected[name], msg=name)
    if not lstm:  # against torch.func's per-sample gradients
        check(layer, x, g, weights, kernel=layer_gradients(layer, x, g))
