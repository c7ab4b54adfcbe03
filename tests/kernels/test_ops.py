"""functx/kernels/ops.py: every kernel operator passes `torch.library.opcheck` (schema, fake
kernel, autograd registration, AOT dispatch) and agrees with a materialised reference; its
functx batching rule against a per-element loop."""

from __future__ import annotations

import pytest
import torch

import functx
import functx.kernels.ops as ops

DT = torch.float64


def _linear_args(batch=3, steps=4, d_in=5, d_out=2, dtype=DT):
    return torch.randn(batch, steps, d_in, dtype=dtype), torch.randn(batch, steps, d_out, dtype=dtype)


def _embedding_args(batch=3, steps=6, vocab=5, dim=4, dtype=DT):
    return torch.randint(0, vocab, (batch, steps)), torch.randn(batch, steps, dim, dtype=dtype)


def _per_sample_linear(a, g):
    return torch.einsum("bto,bti->boi", g, a)  # (B, d_out, d_in)


def _per_sample_embedding(ids, g, vocab, padding_idx):
    out = g.new_zeros(ids.shape[0], vocab, g.shape[-1])
    for b in range(ids.shape[0]):
        for t in range(ids.shape[1]):
            if ids[b, t] != padding_idx:
                out[b, ids[b, t]] += g[b, t]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("steps, d", [(1, 3), (3, 8), (9, 2)], ids=["outer", "ghost", "materialised"])
def test_linear_ops(dtype, steps, d):
    a, g = _linear_args(steps=steps, d_in=d, d_out=d, dtype=dtype)
    w = torch.rand(3, dtype=dtype)
    per = _per_sample_linear(a, g)
    torch.testing.assert_close(ops.linear_weight_norms_sq(a, g), per.flatten(1).pow(2).sum(1))
    torch.testing.assert_close(ops.linear_weight_weighted_sum(a, g, w), torch.einsum("b,boi->oi", w, per))
    torch.library.opcheck(ops.linear_weight_norms_sq, (a, g))
    torch.library.opcheck(ops.linear_weight_weighted_sum, (a, g, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("padding_idx", [None, 0])
def test_embedding_ops(dtype, padding_idx):
    ids, g = _embedding_args(dtype=dtype)
    ids[0, :3] = 2  # repeated
    w = torch.rand(3, dtype=dtype)
    per = _per_sample_embedding(ids, g, 5, padding_idx)
    torch.testing.assert_close(ops.embedding_norms_sq(ids, g, 5, padding_idx), per.flatten(1).pow(2).sum(1))
    torch.testing.assert_close(ops.embedding_weighted_sum(ids, g, w, 5, padding_idx), torch.einsum("b,bvd->vd", w, per))
    torch.library.opcheck(ops.embedding_norms_sq, (ids, g, 5, padding_idx))
    torch.library.opcheck(ops.embedding_weighted_sum, (ids, g, w, 5, padding_idx))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("spatial, groups, stride, padding, dilation", [(1, 1, 1, 0, 1), (2, 2, 2, 1, 1), (2, 1, 1, 2, 2), (3, 1, 1, 1, 1)])
def test_conv_op(dtype, spatial, groups, stride, padding, dilation):
    conv = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)[spatial - 1](
        4, 4, 3, stride, padding, dilation, groups=groups, bias=False
    ).to(dtype)
    x = torch.randn(3, 4, *(7,) * spatial, dtype=dtype)
    g = torch.randn_like(conv(x))
    expected = torch.stack(
        [torch.autograd.grad(conv(x[b : b + 1]), conv.weight, g[b : b + 1])[0] for b in range(3)]
    )  # a per-sample autograd loop
    settings = ([*conv.weight.shape], [stride] * spatial, [padding] * spatial, [dilation] * spatial, groups)
    torch.testing.assert_close(ops.conv_per_sample_weight_grads(x, g, *settings), expected)
    torch.library.opcheck(ops.conv_per_sample_weight_grads, (x, g, *settings))
    folded = functx.vmap(lambda a, b: ops.conv_per_sample_weight_grads(a, b, *settings))(x[None].expand(2, *x.shape), g[None].expand(2, *g.shape))
    torch.testing.assert_close(folded, expected[None].expand(2, *expected.shape))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("spatial, stride, padding, dilation", [(1, 1, 0, 1), (2, 2, 1, 1), (2, 1, 2, 2), (1, 2, 1, 2)])
def test_conv_op_takes_the_unfolded_path_for_wide_inputs(dtype, spatial, stride, padding, dilation):
    """Many input channels on a small map: the operator unfolds (cheaper there); same values."""
    conv = (torch.nn.Conv1d, torch.nn.Conv2d)[spatial - 1](24, 5, 3, stride, padding, dilation, bias=False).to(dtype)
    x = torch.randn(3, 24, *(3,) * spatial, dtype=dtype)
    g = torch.randn_like(conv(x))
    assert ops._unfolding_pays(x, g, list(conv.weight.shape), 1)
    expected = torch.stack([torch.autograd.grad(conv(x[b : b + 1]), conv.weight, g[b : b + 1])[0] for b in range(3)])
    settings = ([*conv.weight.shape], [stride] * spatial, [padding] * spatial, [dilation] * spatial, 1)
    torch.testing.assert_close(ops.conv_per_sample_weight_grads(x, g, *settings), expected)
    torch.library.opcheck(ops.conv_per_sample_weight_grads, (x, g, *settings))


def _affine_problem(layer, shape, dtype):
    """The layer in `dtype` with random affine parameters; an input and an output gradient."""
    layer = layer.to(dtype)
    with torch.no_grad():
        layer.weight.normal_(), layer.bias.normal_()
    return layer, torch.randn(*shape, dtype=dtype), torch.randn(*shape, dtype=dtype)


def _per_sample_affine_reference(layer, x, g):
    """Each sample's (weight, bias) gradient by a torch.autograd loop."""
    grads = [torch.autograd.grad(layer(x[b : b + 1]), (layer.weight, layer.bias), g[b : b + 1]) for b in range(x.shape[0])]
    return tuple(torch.stack(parts) for parts in zip(*grads))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "shape, normalized_ndim", [((3, 5, 4), 1), ((2, 3, 4, 5), 2), ((3, 6), 1), ((1, 2, 7), 1)], ids=["seq", "2d", "flat", "one"]
)
def test_layer_norm_affine_op(dtype, shape, normalized_ndim):
    layer, x, g = _affine_problem(torch.nn.LayerNorm(shape[len(shape) - normalized_ndim :], eps=1e-3), shape, dtype)
    got = ops.layer_norm_affine_grads(x, g, normalized_ndim, 1e-3)
    torch.testing.assert_close(got, _per_sample_affine_reference(layer, x, g))
    torch.library.opcheck(ops.layer_norm_affine_grads, (x, g, normalized_ndim, 1e-3))
    stacked = functx.vmap(lambda a, b: ops.layer_norm_affine_grads(a, b, normalized_ndim, 1e-3))(torch.stack([x, 2 * x]), torch.stack([g, -g]))
    for i, (xi, gi) in enumerate(((x, g), (2 * x, -g))):
        torch.testing.assert_close(tuple(o[i] for o in stacked), ops.layer_norm_affine_grads(xi, gi, normalized_ndim, 1e-3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape, groups", [((3, 4, 5, 5), 2), ((2, 6, 7), 3), ((3, 4), 2), ((1, 2, 3), 1)])
def test_group_norm_affine_op(dtype, shape, groups):
    layer, x, g = _affine_problem(torch.nn.GroupNorm(groups, shape[1], eps=1e-4), shape, dtype)
    got = ops.group_norm_affine_grads(x, g, groups, 1e-4)
    torch.testing.assert_close(got, _per_sample_affine_reference(layer, x, g))
    torch.library.opcheck(ops.group_norm_affine_grads, (x, g, groups, 1e-4))
    stacked = functx.vmap(lambda a, b: ops.group_norm_affine_grads(a, b, groups, 1e-4), in_dims=(None, 0))(x, torch.stack([g, 3 * g]))
    torch.testing.assert_close(tuple(o[1] for o in stacked), tuple(3 * o for o in got))


def test_batching_rules():
    """vmap over a leading dim of models (e.g. an ensemble's layers): the norms fold it into
    the samples, the sums run per element; both against a loop, shared inputs included."""
    a, g = torch.randn(2, 3, 4, 5, dtype=DT), torch.randn(2, 3, 4, 2, dtype=DT)
    w = torch.rand(3, dtype=DT)
    norms = functx.vmap(ops.linear_weight_norms_sq)(a, g)
    torch.testing.assert_close(norms, torch.stack([ops.linear_weight_norms_sq(a[i], g[i]) for i in range(2)]))
    shared = functx.vmap(ops.linear_weight_weighted_sum, in_dims=(0, 0, None))(a, g, w)
    torch.testing.assert_close(shared, torch.stack([ops.linear_weight_weighted_sum(a[i], g[i], w) for i in range(2)]))
    ids, ge = torch.randint(0, 5, (2, 3, 6)), torch.randn(2, 3, 6, 4, dtype=DT)
    for padding_idx in (None, 1):
        got = functx.vmap(lambda i, x: ops.embedding_norms_sq(i, x, 5, padding_idx))(ids, ge)
        torch.testing.assert_close(got, torch.stack([ops.embedding_norms_sq(ids[k], ge[k], 5, padding_idx) for k in range(2)]))
        got = functx.vmap(lambda i, x: ops.embedding_weighted_sum(i, x, w, 5, padding_idx), in_dims=(None, 0))(ids[0], ge)
        expected = torch.stack([ops.embedding_weighted_sum(ids[0], ge[k], w, 5, padding_idx) for k in range(2)])
        torch.testing.assert_close(got, expected)


def test_fake_kernels_give_the_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a, g = torch.empty(3, 4, 5), torch.empty(3, 4, 2)
        assert ops.linear_weight_norms_sq(a, g).shape == (3,)
        assert ops.linear_weight_weighted_sum(a, g, torch.empty(3)).shape == (2, 5)
        ids, ge = torch.empty(3, 6, dtype=torch.long), torch.empty(3, 6, 4)
        assert ops.embedding_norms_sq(ids, ge, 7, None).shape == (3,)
        assert ops.embedding_weighted_sum(ids, ge, torch.empty(3), 7, 0).shape == (7, 4)
        x = torch.empty(3, 5, 2, 4)
        assert [o.shape for o in ops.layer_norm_affine_grads(x, x, 2, 1e-5)] == [(3, 2, 4)] * 2
        assert [o.shape for o in ops.group_norm_affine_grads(x, x, 1, 1e-5)] == [(3, 5)] * 2
