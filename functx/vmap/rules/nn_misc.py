"""NN ops that are neither elementwise-broadcasting nor reductions: glu, prelu, pixel and
channel shuffles, and scaled dot product attention.

What reaches vmap (torch 2.x, CPU): F.glu -> aten.glu; F.prelu reshapes its weight to
broadcast against the input (1, C, 1, ...) and calls aten._prelu_kernel, which is then an
elementwise broadcasting op; F.pixel_(un)shuffle and F.channel_shuffle arrive as
themselves. F.one_hot on a tensor subclass is composite (unsqueeze, eq against an arange,
_to_copy); with num_classes=-1 it calls .item() on the max, which vmap refuses
(data_dependent.py). F.unfold / F.fold (im2col / col2im) live in nn_pooling.py.

F.scaled_dot_product_attention picks its kernel from the logical inputs: 4-D q/k/v of
equal leading sizes, no dropout and a 2-D or 4-D mask take
aten._scaled_dot_product_flash_attention_for_cpu, whose rule is here; anything else
(3-D inputs, broadcast batch/head dims, dropout > 0, 3-D masks) takes the composite math
path (matmuls, softmax, dropout) that other families batch.
"""

import torch

from ..batched_tensor import VMAP_RULES
from ..fallback import loop_fallback
from ..templates import batch_all_rule, materialize, pad_to_rank

aten = torch.ops.aten


# -- activations ------------------------------------------------------------------------------
# _safe_softmax (softmax that gives 0 for rows that are all -inf) is what the attention
# math path uses.
for _op in (aten.glu.default, aten.glu_backward.default, aten.glu_jvp.default, aten._safe_softmax.default):
    VMAP_RULES.set(_op, batch_all_rule(_op))


@VMAP_RULES.register(aten._prelu_kernel.default)
def _prelu_kernel(interp, x, weight):
    """F.prelu has already viewed the weight to broadcast against x (1, C, 1, ...), so this
    is elementwise. x is expanded to the full shape first: the kernel sizes its output
    like x and would resize it (with a warning) when a batched weight (an ensemble)
    makes the result larger than an unbatched x."""
    rank = max(x.dim(), weight.dim())
    xv, wv = (pad_to_rank(materialize(interp, t), t.dim(), rank) for t in (x, weight))
    return interp.wrap(aten._prelu_kernel.default(xv.expand(torch.broadcast_shapes(xv.shape, wv.shape)), wv))


# -- shuffles -------------------------------------------------------------------------------
def _leading_dims_rule(op, name):
    """pixel_(un)shuffle take any number of leading dims before (C, H, W): the batch dim
    is one more. Only the logical rank must be checked here."""

    def rule(interp, x, factor):
        if x.dim() < 3:
            raise RuntimeError(
                f"{name} expects input to have at least 3 dimensions, but got input with {x.dim()} dimension(s)"
            )
        return interp.wrap(op(x._value, factor))

    rule.__name__ = f"leading_dims_{name}"
    return rule


def _fold_n_rule(op, name):
    """channel_shuffle needs its (N, C, ...) layout: (B, N, C, ...) runs as (B*N, C, ...)."""

    def rule(interp, x, groups):
        if x.dim() <= 2:
            raise RuntimeError(f"{name} expects input with > 2 dims, but got input with sizes {list(x.shape)}")
        value = x._value
        return interp.wrap(op(value.flatten(0, 1), groups).unflatten(0, value.shape[:2]))

    rule.__name__ = f"fold_n_{name}"
    return rule


for _op, _name in ((aten.pixel_shuffle.default, "pixel_shuffle"), (aten.pixel_unshuffle.default, "pixel_unshuffle")):
    VMAP_RULES.set(_op, _leading_dims_rule(_op, _name))
for _op in (aten.channel_shuffle.default, aten.native_channel_shuffle.default):
    VMAP_RULES.set(_op, _fold_n_rule(_op, "channel_shuffle"))


# -- scaled dot product attention -----------------------------------------------------------
def _fold_heads(interp, tensors):
    """(B, N, ...) physical values of the sample-shaped tensors, folded to (B*N, ...).
    Made contiguous: the CPU kernels misread a strided last dim, which a direct call of
    the aten op under in_dims=-1 hands them (F.scaled_dot_product_attention itself picks
    the math path for such inputs)."""
    return [materialize(interp, t).flatten(0, 1).contiguous() for t in tensors]


def _fold_mask(interp, mask, n):
    """The attention mask, logically (L, S) or (N|1, H|1, L, S), laid out to broadcast
    against (B*N, H, L, S). An unbatched mask without an N dim broadcasts as it is."""
    if mask is None:
        return None
    batch = interp.batch_size
    if not interp.is_batched(mask):
        if mask.dim() < 4 or mask.shape[0] == 1:
            return mask
        return mask.expand(batch, *mask.shape).flatten(0, 1)
    value = pad_to_rank(mask._value, mask.dim(), 4)
    return value.expand(batch, n, *value.shape[2:]).flatten(0, 1)


def _unfold_heads(interp, out, n):
    return tuple(interp.wrap(t.unflatten(0, (interp.batch_size, n))) for t in out)


@VMAP_RULES.register(aten._scaled_dot_product_flash_attention_for_cpu.default)
def _sdpa_flash_cpu(interp, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    """Attention is independent per (sample, head): B folds into the sample dim N.
    (The CPU kernel refuses dropout_p > 0, so there is no randomness to handle.)"""
    n = query.shape[0]
    q, k, v = _fold_heads(interp, (query, key, value))
    out = aten._scaled_dot_product_flash_attention_for_cpu.default(
        q, k, v, dropout_p, is_causal, attn_mask=_fold_mask(interp, attn_mask, n), scale=scale
    )
    return _unfold_heads(interp, out, n)


@VMAP_RULES.register(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def _sdpa_flash_cpu_backward(
    interp, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None, scale=None
):
    n = query.shape[0]
    folded = _fold_heads(interp, (grad_out, query, key, value, out, logsumexp))
    grads = aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
        *folded, dropout_p, is_causal, attn_mask=_fold_mask(interp, attn_mask, n), scale=scale
    )
    return _unfold_heads(interp, grads, n)


# -- embedding_bag: the per-sample loop, with autograd --------------------------------------
# torch's embedding_bag picks `_embedding_bag_forward_only` when its weight does not require
# grad, which is what a BatchedTensor reports over a physical weight that a direct grad level
# below differentiates (vjp(vmap(embedding_bag))): per sample the weight then requires grad,
# and the forward-only op's autograd raised "Autograd not support dtype: Long". Each element
# runs `_embedding_bag` (the same schema and outputs, with its backward).
VMAP_RULES.set(aten._embedding_bag_forward_only.default, loop_fallback(aten._embedding_bag.default))
