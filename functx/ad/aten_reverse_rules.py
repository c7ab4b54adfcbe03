"""Reverse rules for ATen operators whose derivative formula in torch fails at a higher order
under transforms.

`linalg.det`: torch's backward of `_linalg_det` under `create_graph` uses, for tensor
subclasses (every functx level's wrapper, vmap's BatchedTensor; torch.func's too), its SVD
formula for every matrix, where plain tensors get the solve formula and an SVD only for
singular matrices. Differentiated once more, that formula takes the SVD of det's orthogonal
factor U, whose repeated singular values make torch's SVD backward divide by zero gaps:
`vjp(vmap(hessian(det)))`, the caller's gradient through `jacrev(jacrev(det))`, any third
derivative, were NaN (torch.func's are); so were those of a det on plain values whose
backward a transform runs on batched cotangents (jacrev's rows: the subclass path again).
Inside a transform, where autograd records det and every matrix is invertible, functx
computes det as sign · exp(log|det|) through `slogdet` (torch's value to rounding; its
backward solves with A^H at every order); a singular matrix keeps
torch's formula (its first derivative, the adjugate, is right there), as do code outside
transforms and traced (fake) values.

    >>> import torch, functx
    >>> a = torch.tensor([[2.0, 1.0], [1.0, 3.0]], dtype=torch.float64)
    >>> third = functx.jacrev(functx.jacrev(functx.jacrev(torch.linalg.det)))(a)
    >>> bool(torch.isfinite(third).all()), float(third.abs().max()) < 1e-12  # det of 2x2: quadratic
    (True, True)
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch

from ..core.interpreter import FIRST_TRANSFORM_HOOKS, current_stack
from ..core.level_tensor import LevelTensor
from ..core.recompute import register_context
from . import library_ops
from .aten_forward_rules import _attention_in_blocks
from .level import ADLevel, backward_differentiated

_linalg_det = torch.ops.aten._linalg_det.default
_forward_ad_off = functools.partial(torch.autograd.forward_ad._set_fwd_grad_enabled, False)


def _plain(x):
    while isinstance(x, LevelTensor):
        x = x._value
    return x


def _invertible_under_a_transform(A) -> bool:
    """Inside a transform, A recorded by autograd (a level's wrapper, or a plain tensor whose
    backward a transform may run on its batched cotangents: jacrev's rows, where torch's
    formula takes its subclass path too), every matrix invertible (checked on the plain
    values: a singular one keeps torch's formula)."""
    if not (A.requires_grad and torch.is_grad_enabled() and current_stack()):
        return False
    values = _plain(A)
    if values.device.type == "meta" or isinstance(values, torch._subclasses.FakeTensor):
        return False
    with torch.no_grad():
        return bool((_linalg_det(values.detach())[0] != 0).all())


def _det_through_slogdet(A):
    """`_linalg_det(A)` as sign · exp(log|det|) (torch's value to rounding), with torch's LU
    and pivots as constants (outputs without derivatives, as the op's own). Every level
    differentiates the one expression: adding torch's value to a zero made with `detach()`
    counted the tangent twice under `jvp(grad)` (forward AD kept the value's tangent)."""
    with torch.no_grad(), _forward_ad_off():
        _, lu, pivots = _linalg_det(A)
    sign, logabsdet = torch.linalg.slogdet(A)
    return sign * torch.exp(logabsdet), lu, pivots


library_ops.register_reverse_decomposition(_linalg_det, _invertible_under_a_transform, _det_through_slogdet)
FIRST_TRANSFORM_HOOKS.append(lambda: library_ops.wrap_existing(_linalg_det))


# Fused attention differentiated twice. torch's backward of the CPU kernel behind
# F.scaled_dot_product_attention (`_scaled_dot_product_flash_attention_for_cpu_backward`) has
# no derivative: hessian, jacrev(jacrev(f)), vmap(jvp(grad(f))), a caller differentiating a
# functx gradient through attention raised (as torch.func does). Inside a transform, where
# autograd records the op:
# - where the backward will be differentiated by the levels themselves (two AD levels live,
#   linearize, the double-VJP identity: ad/level.py `backward_differentiated`), the op runs
#   as its math form over blocks of query rows (ad/aten_forward_rules.py);
# - elsewhere (one reverse level, whose gradient the caller's autograd may differentiate or
#   not) it runs as `_FusedAttention`: torch's kernel forward, and a backward that is
#   torch's fused one (O(L) memory) unless autograd records the backward itself
#   (`create_graph`), where it is the same gradient in differentiable torch ops.
_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _scores(query, key, is_causal, attn_mask, scale):
    """scale · q kᵀ with the causal mask (top-left, as torch's) and `attn_mask` applied."""
    scores = (query @ key.transpose(-2, -1)) * scale
    if is_causal:
        rows, keys = query.shape[-2], key.shape[-2]
        scores = scores.masked_fill(torch.ones(rows, keys, dtype=torch.bool, device=query.device).triu(1), float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    return scores


class _FusedAttention(torch.autograd.Function):
    """The fused CPU attention kernel with a backward that has derivatives where recorded."""

    generate_vmap_rule = True  # vmap maps its forward and backward (both ops have rules)

    @staticmethod
    def forward(query, key, value, is_causal, attn_mask, scale):
        return _FLASH_CPU(query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale)

    @staticmethod
    def setup_context(ctx, inputs, output):
        query, key, value, is_causal, attn_mask, scale = inputs
        ctx.save_for_backward(query, key, value, *output)
        ctx.save_for_forward(query, key, value)
        ctx.is_causal, ctx.attn_mask, ctx.scale = is_causal, attn_mask, scale
        ctx.mark_non_differentiable(output[1])  # the logsumexp: kept for the backward only

    @staticmethod
    def jvp(ctx, tangent_query, tangent_key, tangent_value, *_):
        """Forward mode through the fused kernel (a jvp level over values the caller's
        autograd tracks reaches it; it raised "You must implement the jvp function"):
        with P = softmax(S), S = scale q kᵀ, the output's tangent is dP v + P dv, where
        dP = P ⊙ (dS - rowsum(P ⊙ dS)), dS = scale (dq kᵀ + q dkᵀ). P is L x L here, as in
        torch's math backend (forward mode only)."""
        query, key, value = ctx.saved_tensors
        scale = query.shape[-1] ** -0.5 if ctx.scale is None else ctx.scale
        probs = _scores(query, key, ctx.is_causal, ctx.attn_mask, scale).softmax(-1)
        tangent_out = 0
        if tangent_query is not None or tangent_key is not None:
            tangent_scores = 0
            if tangent_query is not None:
                tangent_scores = tangent_query @ key.transpose(-2, -1)
            if tangent_key is not None:
                tangent_scores = tangent_scores + query @ tangent_key.transpose(-2, -1)
            tangent_scores = tangent_scores * scale
            weighted = probs * tangent_scores
            tangent_probs = weighted - probs * weighted.sum(-1, keepdim=True)
            tangent_out = tangent_probs @ value
        if tangent_value is not None:
            tangent_out = tangent_out + probs @ tangent_value
        if not isinstance(tangent_out, torch.Tensor):  # no input carries a tangent
            tangent_out = probs @ torch.zeros_like(value)
        return tangent_out, None

    @staticmethod
    def backward(ctx, grad_out, _):
        query, key, value, out, logsumexp = ctx.saved_tensors
        if not torch.is_grad_enabled():  # first order: torch's fused backward
            grads = _FLASH_CPU_BACKWARD(
                grad_out.contiguous(), query, key, value, out, logsumexp, 0.0, ctx.is_causal, attn_mask=ctx.attn_mask, scale=ctx.scale
            )
            return (*grads, None, None, None)
        # recorded (create_graph): softmax's backward written out, P recomputed from q and k
        scale = query.shape[-1] ** -0.5 if ctx.scale is None else ctx.scale
        probs = _scores(query, key, ctx.is_causal, ctx.attn_mask, scale).softmax(-1)
        grad_probs = grad_out @ value.transpose(-2, -1)
        grad_scores = probs * (grad_probs - (grad_probs * probs).sum(-1, keepdim=True))
        grad_query = (grad_scores @ key) * scale
        grad_key = (grad_scores.transpose(-2, -1) @ query) * scale
        return grad_query, grad_key, probs.transpose(-2, -1) @ grad_out, None, None, None


_decided = threading.local()  # .as_of: the decision a checkpoint's recomputation re-enters


def _inside_and_differentiated() -> tuple[bool, bool]:
    """(inside an AD transform, backward differentiated): now, or as of the first run of the
    checkpointed function being recomputed (its backward may run outside the transform, and
    the recomputation must save what the first run saved)."""
    as_of = getattr(_decided, "as_of", None)
    if as_of is not None:
        return as_of
    return any(isinstance(level, ADLevel) for level in current_stack()), backward_differentiated()


def _capture_decision():
    decision = _inside_and_differentiated()
    if decision == (False, False):
        return None

    @contextlib.contextmanager
    def decided():
        before, _decided.as_of = getattr(_decided, "as_of", None), decision
        try:
            yield
        finally:
            _decided.as_of = before

    return decided


register_context(_capture_decision)


def _recorded_inside_a_transform(query, key, value, dropout_p=0.0, *args, **kwargs) -> bool:
    """Inside an AD transform (vmap alone: torch's autograd under it, as in plain torch),
    autograd records the op, without dropout (whose mask neither
    replacement can draw as the kernel does)."""
    if dropout_p > 0 or not torch.is_grad_enabled() or not _inside_and_differentiated()[0]:
        return False
    return query.requires_grad or key.requires_grad or value.requires_grad


def _attention_with_a_differentiable_backward(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    if _inside_and_differentiated()[1]:
        return _attention_in_blocks(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    return _FusedAttention.apply(query, key, value, is_causal, attn_mask, scale)


library_ops.register_reverse_decomposition(_FLASH_CPU, _recorded_inside_a_transform, _attention_with_a_differentiable_backward)
FIRST_TRANSFORM_HOOKS.append(lambda: library_ops.wrap_existing(_FLASH_CPU))

