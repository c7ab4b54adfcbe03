"""Forward rules for ATen operators whose forward formula in torch fails on valid programs.

torch computes an operator's tangent in its autograd kernel, from the formula in
derivatives.yaml. A formula that writes in place into a product with a tangent that is
absent fails: an absent tangent is an immutable ZeroTensor there. `mse_loss_backward` with
`reduction="mean"` is one: its formula divides `2 * target_t * grad_output` in place, so
any forward-over-reverse product through an MSE loss whose target carries no tangent (every
regression loss: `jvp(grad(loss))`, `jvp(jacrev(loss))`, `vmap(jvp(jacrev(loss)))` Hessian
and GGN products, curvlinops' pattern) raised "ZeroTensors are immutable" (torch.func's
jvp(grad) does too).

functx shadows the autograd kernel of each operator here (library_ops.wrap_existing, at the
first forward transform: a plain program pays nothing before one): where an input carries a
tangent, the operator runs as a decomposition into ops whose formulas are right, on the dual
inputs themselves, so its tangent and the reverse graph of both (differentiated again by
`vjp(grad)` under `jvp`) are theirs. (A rule giving the tangent beside the operator's own
kernel on the primals was right to first order, but the reverse graph it recorded saved
primals without tangents: jvp(vjp(grad)) through an MSE loss came out wrong, found by a
10,000-example fuzz run.) Without a tangent the operator's own kernel runs.

    >>> import torch, functx
    >>> import torch.nn.functional as F
    >>> X, y = torch.eye(2), torch.zeros(2)
    >>> loss = lambda w: F.mse_loss(X @ w, y)  # the mean of w², Hessian = I
    >>> functx.jvp(functx.grad(loss), (torch.ones(2),), (torch.tensor([1.0, 2.0]),))[1]
    tensor([1., 2.])
"""

from __future__ import annotations

import torch

from . import library_ops

_MEAN = 1  # torch's Reduction::Mean


def _mse_loss_backward(grad, input, target, reduction):
    """mse_loss_backward(g, x, t, reduction) = norm (x - t) g, norm = 2 (/ numel for mean):
    ATen's kernel's arithmetic, in its order (so the values are the kernel's)."""
    norm = 2.0 / input.numel() if reduction == _MEAN else 2.0
    return (input - target) * norm * grad


library_ops.register_forward_decomposition(torch.ops.aten.mse_loss_backward.default, _mse_loss_backward)
library_ops.wrap_at_first_forward(torch.ops.aten.mse_loss_backward.default)


# Fused attention. torch gives `_scaled_dot_product_flash_attention_for_cpu` (the CPU kernel
# behind F.scaled_dot_product_attention) no forward formula, and its backward no derivative,
# so forward mode through attention failed everywhere: jvp, jacfwd, linearize, and the
# forward-over-reverse Hessian-vector product (torch.func raises too). Where an input carries
# a tangent it runs as attention over blocks of `_QUERY_BLOCK` query rows (each row's softmax
# is its own), in ops whose formulas are right: the tangent of each block is made and freed
# with it, so a jvp holds O(block x keys) scores, not the O(queries x keys) of the math form
# (reverse mode over it saves each block's probabilities, as the math form does).
_QUERY_BLOCK = 256


def _attention_in_blocks(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    """(output, logsumexp) of scaled dot-product attention, block by block of query rows."""
    if dropout_p > 0:
        raise RuntimeError(
            "functx: forward mode through scaled_dot_product_attention with dropout_p > 0 needs "
            "the dropout mask the fused kernel draws and does not return: under jvp/jacfwd, "
            "use dropout_p=0, or apply F.dropout to the attention weights of the math form."
        )
    rows, keys = query.shape[-2], key.shape[-2]
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    key_t = key.transpose(-2, -1)
    outputs, logsumexps = [], []
    for start in range(0, rows, _QUERY_BLOCK):
        stop = min(start + _QUERY_BLOCK, rows)
        scores = (query[..., start:stop, :] @ key_t) * scale
        if is_causal:  # row i sees keys 0..i (torch's top-left causal mask)
            row = torch.arange(start, stop, device=query.device).unsqueeze(-1)
            scores = scores.masked_fill(torch.arange(keys, device=query.device) > row, float("-inf"))
        if attn_mask is not None:
            mask = attn_mask[..., start:stop, :] if attn_mask.shape[-2] == rows else attn_mask
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        logsumexp = torch.logsumexp(scores, -1)
        outputs.append(torch.exp(scores - logsumexp.unsqueeze(-1)) @ value)
        logsumexps.append(logsumexp)
    return torch.cat(outputs, -2), torch.cat(logsumexps, -1)


_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
library_ops.register_forward_decomposition(_FLASH_CPU, _attention_in_blocks)
library_ops.wrap_at_first_forward(_FLASH_CPU)
