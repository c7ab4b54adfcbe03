"""The per-sample kernels as operators (`torch.library.custom_op`, namespace `functx`).

As operators they are one node to every transform and to torch.compile (fake kernels give
their shapes), `torch.library.opcheck` checks each, and a device can get a kernel of its own
(the CPU one is the torch code here; CUDA's ghost norm is Triton's, triton_kernels.py). Each
has a functx batching rule: the norms fold a vmap
dimension into the sample dimension (samples are independent), the sums run per element.

    linear_weight_norms_sq(a, g)                 (B, T, d_in), (B, T, d_out) -> (B,):
                                                 ‖Σ_t g_bt a_btᵀ‖² per sample
    linear_weight_weighted_sum(a, g, w)          -> (d_out, d_in): Σ_b w_b Σ_t g_bt a_btᵀ
    embedding_norms_sq(ids, g, V, padding_idx)   (B, T), (B, T, D) -> (B,): the squared norm of
                                                 sample b's embedding gradient
    embedding_weighted_sum(ids, g, w, V, padding_idx)  -> (V, D)
    conv_per_sample_weight_grads(x, g, weight_shape, stride, padding, dilation, groups)
                                                 -> (B, *weight_shape)
    layer_norm_affine_grads(x, g, normalized_ndim, eps)
                                                 (B, *, *N), same -> (B, *N), (B, *N): each
                                                 sample's LayerNorm weight and bias gradients
    group_norm_affine_grads(x, g, num_groups, eps)
                                                 (B, C, *s), same -> (B, C), (B, C): GroupNorm's

    >>> import torch, functx.kernels.ops as ops
    >>> a, g = torch.randn(4, 1, 3), torch.randn(4, 1, 2)
    >>> torch.allclose(ops.linear_weight_norms_sq(a, g), (a ** 2).sum((1, 2)) * (g ** 2).sum((1, 2)))
    True
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..library import register_vmap
from ..vmap.rules.nn_conv import unfolded_weight_grads, unfolding_pays
from . import triton_kernels

# Working memory per block of the ghost norm's T×T products and per chunk of materialised
# per-sample weight gradients, in elements (16 Mi floats: 64 MiB in float32).
BLOCK_ELEMENTS = 1 << 24


@torch.library.custom_op("functx::linear_weight_norms_sq", mutates_args=())
def linear_weight_norms_sq(a: Tensor, g: Tensor) -> Tensor:
    return _linear_weight_norms_sq(a, g)


def _ghost_pays(a: Tensor, g: Tensor) -> bool:
    steps = a.shape[1]
    return steps > 1 and 2 * steps * steps < a.shape[2] * g.shape[2]


def _linear_weight_norms_sq(a: Tensor, g: Tensor) -> Tensor:
    """The torch code: an outer product's norm, the ghost norm in row blocks, or the
    per-sample gradients materialised a few samples at a time, whichever costs least."""
    batch, steps, d_in = a.shape
    d_out = g.shape[2]
    if steps == 1:  # an outer product: ‖g aᵀ‖ = ‖g‖ ‖a‖
        return g.pow(2).sum((1, 2)) * a.pow(2).sum((1, 2))
    if _ghost_pays(a, g):  # the ghost norm ⟨A Aᵀ, G Gᵀ⟩, in blocks of rows
        total = g.new_zeros(batch)
        block = max(1, BLOCK_ELEMENTS // max(1, batch * steps))
        for start in range(0, steps, block):
            rows = slice(start, start + block)
            total = total + (torch.bmm(a[:, rows], a.mT) * torch.bmm(g[:, rows], g.mT)).sum((1, 2))
        return total
    chunk = max(1, BLOCK_ELEMENTS // (d_in * d_out))  # materialised, a few samples at a time
    parts = [torch.bmm(g[i : i + chunk].mT, a[i : i + chunk]).pow(2).sum((1, 2)) for i in range(0, batch, chunk)]
    return torch.cat(parts) if parts else g.new_zeros(0)


@linear_weight_norms_sq.register_fake
def _(a, g):
    return g.new_empty(a.shape[0])


def linear_weight_norms_sq_cuda(a: Tensor, g: Tensor) -> Tensor:
    """The CUDA kernel: the ghost norm by Triton (one kernel, no T×T matrix in memory) where
    it pays and triton is installed; the torch code otherwise. (Runs on CPU tensors too with
    TRITON_INTERPRET=1: how the tests check it without a GPU.)"""
    if triton_kernels.available and _ghost_pays(a, g):
        return triton_kernels.ghost_norms_sq(a, g)
    return _linear_weight_norms_sq(a, g)


linear_weight_norms_sq.register_kernel("cuda")(linear_weight_norms_sq_cuda)


@torch.library.custom_op("functx::linear_weight_weighted_sum", mutates_args=())
def linear_weight_weighted_sum(a: Tensor, g: Tensor, weights: Tensor) -> Tensor:
    scaled = g * weights.to(g.dtype)[:, None, None]
    return scaled.reshape(-1, g.shape[2]).T @ a.reshape(-1, a.shape[2])


@linear_weight_weighted_sum.register_fake
def _(a, g, weights):
    return g.new_empty(g.shape[2], a.shape[2])


def token_keys(ids: Tensor, num_embeddings: int, padding_idx: int | None):
    """Each token's (sample, id) key, and which tokens count (padding ids do not)."""
    samples = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(ids)
    keys = (samples * num_embeddings + ids).reshape(-1)
    keep = None if padding_idx is None else (ids != padding_idx).reshape(-1)
    return keys, keep


@torch.library.custom_op("functx::embedding_norms_sq", mutates_args=())
def embedding_norms_sq(ids: Tensor, g: Tensor, num_embeddings: int, padding_idx: int | None) -> Tensor:
    return _embedding_norms_sq(ids, g, num_embeddings, padding_idx)


def _embedding_norms_sq(ids: Tensor, g: Tensor, num_embeddings: int, padding_idx: int | None) -> Tensor:
    """Sums per (sample, id) key by unique + index_add, then their squared norms per sample."""
    keys, keep = token_keys(ids, num_embeddings, padding_idx)
    rows = g.reshape(-1, g.shape[-1])
    if keep is not None:
        keys, rows = keys[keep], rows[keep]
    unique, inverse = torch.unique(keys, return_inverse=True)
    sums = rows.new_zeros(unique.shape[0], rows.shape[1]).index_add_(0, inverse, rows)
    return sums.new_zeros(ids.shape[0]).index_add_(0, unique // num_embeddings, sums.pow(2).sum(1))


@embedding_norms_sq.register_fake
def _(ids, g, num_embeddings, padding_idx):
    return g.new_empty(ids.shape[0])


def embedding_norms_sq_cuda(ids: Tensor, g: Tensor, num_embeddings: int, padding_idx: int | None) -> Tensor:
    """The CUDA kernel: Triton's walk over each sample's tokens sorted by id where triton is
    installed; the torch code (unique + index_add) otherwise."""
    if triton_kernels.available:
        return triton_kernels.embedding_norms_sq(ids, g, num_embeddings, padding_idx)
    return _embedding_norms_sq(ids, g, num_embeddings, padding_idx)


embedding_norms_sq.register_kernel("cuda")(embedding_norms_sq_cuda)


@torch.library.custom_op("functx::embedding_weighted_sum", mutates_args=())
def embedding_weighted_sum(
    ids: Tensor, g: Tensor, weights: Tensor, num_embeddings: int, padding_idx: int | None
) -> Tensor:
    scaled = g * weights.to(g.dtype)[:, None, None]
    if padding_idx is not None:
        scaled = scaled * (ids != padding_idx)[..., None]
    out = scaled.new_zeros(num_embeddings, g.shape[-1])
    return out.index_add_(0, ids.reshape(-1), scaled.reshape(-1, g.shape[-1]))


@embedding_weighted_sum.register_fake
def _(ids, g, weights, num_embeddings, padding_idx):
    return g.new_empty(num_embeddings, g.shape[-1])


@torch.library.custom_op("functx::conv_per_sample_weight_grads", mutates_args=())
def conv_per_sample_weight_grads(
    x: Tensor, g: Tensor, weight_shape: list[int], stride: list[int], padding: list[int], dilation: list[int], groups: int
) -> Tensor:
    """(B, C, *s_in), (B, O, *s_out) -> (B, *weight_shape): each sample's convolution weight
    gradient, by whichever of two costs less for the shape (`_unfolding_pays`): one grouped
    convolution backward with the batch folded into the channels and the groups (sample b's
    channels form block b; only the weight's gradient asked for, so the weight passed is
    zeros of its shape), or, for 1-d/2-d convolutions of one group, one batched GEMM of the
    output gradient against the unfolded input."""
    if _unfolding_pays(x, g, weight_shape, groups):
        return _unfolded_weight_grads(x.to(g.dtype), g, weight_shape, stride, padding, dilation)
    batch = x.shape[0]
    weight = g.new_zeros(weight_shape).expand(batch, *weight_shape).flatten(0, 1)
    grouped = torch.ops.aten.convolution_backward.default(
        g.flatten(0, 1).unsqueeze(0), x.to(g.dtype).flatten(0, 1).unsqueeze(0), weight, None,
        stride, padding, dilation, False, [0] * (x.dim() - 2), groups * batch, [False, True, False],
    )[1]  # fmt: skip
    return grouped.unflatten(0, (batch, -1))


def _unfolding_pays(x: Tensor, g: Tensor, weight_shape, groups: int) -> bool:
    """vmap's measured rule (vmap/rules/nn_conv.py), for samples without an N dim."""
    return unfolding_pays(x.unsqueeze(1), g.unsqueeze(1), groups)


def _unfolded_weight_grads(x, g, weight_shape, stride, padding, dilation):
    return unfolded_weight_grads(x.unsqueeze(1), g.unsqueeze(1), weight_shape, stride, padding, dilation)


@conv_per_sample_weight_grads.register_fake
def _(x, g, weight_shape, stride, padding, dilation, groups):
    return g.new_empty(x.shape[0], *weight_shape)


@torch.library.custom_op("functx::layer_norm_affine_grads", mutates_args=())
def layer_norm_affine_grads(x: Tensor, g: Tensor, normalized_ndim: int, eps: float) -> tuple[Tensor, Tensor]:
    return _layer_norm_affine_grads(x, g, normalized_ndim, eps)


def _layer_norm_affine_grads(x: Tensor, g: Tensor, normalized_ndim: int, eps: float) -> tuple[Tensor, Tensor]:
    """Per sample: Σ g ⊙ x̂ and Σ g over the positions between the sample dim and the
    normalized dims (x̂ the normalised input, recomputed by the layer's own kernel without
    its affine parameters: the mean and variance written out took 10x longer)."""
    normalized = torch.nn.functional.layer_norm(x.to(g.dtype), x.shape[x.dim() - normalized_ndim :], eps=eps)
    return _affine_sums(normalized, g, tuple(range(1, x.dim() - normalized_ndim)))


@layer_norm_affine_grads.register_fake
def _(x, g, normalized_ndim, eps):
    shape = (x.shape[0], *x.shape[x.dim() - normalized_ndim :])
    return g.new_empty(shape), g.new_empty(shape)


@torch.library.custom_op("functx::group_norm_affine_grads", mutates_args=())
def group_norm_affine_grads(x: Tensor, g: Tensor, num_groups: int, eps: float) -> tuple[Tensor, Tensor]:
    """Per sample and channel: Σ g ⊙ x̂ and Σ g over the spatial positions (x̂ normalised per
    (sample, group))."""
    normalized = torch.nn.functional.group_norm(x.to(g.dtype), num_groups, eps=eps)
    return _affine_sums(normalized, g, tuple(range(2, x.dim())))


@group_norm_affine_grads.register_fake
def _(x, g, num_groups, eps):
    return g.new_empty(x.shape[:2]), g.new_empty(x.shape[:2])


def _affine_sums(normalized: Tensor, g: Tensor, positions: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    weight = g * normalized
    return (weight.sum(positions), g.sum(positions)) if positions else (weight, g.clone())


def layer_norm_affine_grads_cuda(x: Tensor, g: Tensor, normalized_ndim: int, eps: float) -> tuple[Tensor, Tensor]:
    """The CUDA kernel: Triton's one pass (statistics, x̂ and both sums per row block, never
    x̂ in memory) where triton is installed and a row fits one block; the torch code otherwise."""
    if triton_kernels.available and triton_kernels.fits_one_block(x, normalized_ndim):
        return triton_kernels.layer_norm_affine_grads(x, g, normalized_ndim, eps)
    return _layer_norm_affine_grads(x, g, normalized_ndim, eps)


layer_norm_affine_grads.register_kernel("cuda")(layer_norm_affine_grads_cuda)


# -- functx batching rules --------------------------------------------------------------------
def _batched(x, dim, size):
    """x with its vmap dimension first (expanded where it has none)."""
    return x.movedim(dim, 0) if dim is not None else x.expand(size, *x.shape)


def _norms_rule(op):
    """Norms per sample: a vmap dimension joins the sample dimension."""

    def rule(info, in_dims, first, g, *rest):
        size = info.batch_size
        first, g = _batched(first, in_dims[0], size), _batched(g, in_dims[1], size)
        out = op(first.flatten(0, 1), g.flatten(0, 1), *rest)
        return out.unflatten(0, (size, -1)), 0

    return rule


def _per_sample_outputs_rule(op):
    """Per-sample results (a tuple of (B, ...) tensors): a vmap dimension joins the samples."""

    def rule(info, in_dims, x, g, *rest):
        size = info.batch_size
        x, g = _batched(x, in_dims[0], size), _batched(g, in_dims[1], size)
        outs = op(x.flatten(0, 1), g.flatten(0, 1), *rest)
        return tuple(o.unflatten(0, (size, -1)) for o in outs), (0,) * len(outs)

    return rule


def _per_element_rule(op, tensors: int):
    """Sums over the samples: one call per vmap element."""

    def rule(info, in_dims, *args):
        size = info.batch_size
        batched = [_batched(a, d, size) for a, d in zip(args[:tensors], in_dims[:tensors])]
        return torch.stack([op(*(b[i] for b in batched), *args[tensors:]) for i in range(size)]), 0

    return rule


register_vmap(linear_weight_norms_sq, _norms_rule(linear_weight_norms_sq))
register_vmap(embedding_norms_sq, _norms_rule(embedding_norms_sq))
register_vmap(conv_per_sample_weight_grads, _norms_rule(conv_per_sample_weight_grads))  # per sample too
register_vmap(linear_weight_weighted_sum, _per_element_rule(linear_weight_weighted_sum, 3))
register_vmap(embedding_weighted_sum, _per_element_rule(embedding_weighted_sum, 3))
register_vmap(layer_norm_affine_grads, _per_sample_outputs_rule(layer_norm_affine_grads))
register_vmap(group_norm_affine_grads, _per_sample_outputs_rule(group_norm_affine_grads))
