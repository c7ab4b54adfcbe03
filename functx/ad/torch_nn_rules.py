"""Rules for torch.nn's own `torch.library` operators whose autograd is first-order only.

`F.linear_cross_entropy` with `options` runs as `torch_nn::_linear_cross_entropy_batch_
chunked` (mean or sum reduction), which computes the loss and its gradients together in the
forward, keeps the gradients detached, and whose backward scales them by the upstream
gradient. That is one derivative, and only for the arguments whose `compute_*_grad` flags its
caller set from `requires_grad`:

- under forward mode the caller sees `requires_grad=False` (a tensor at a jvp or jet level,
  as in torch.func), so the op's backward gives no gradient at all, and the double-VJP
  identity, functx's tangent for an operator without a forward formula, made it 0
  (`functx.jvp` with a primal the caller's autograd tracks, `functx.jet`);
- a second derivative goes through the detached gradients, so `functx.hessian` and
  `jacrev(jacrev(f))` were 0 (torch's own double backward raises or drops it).

With `reduction="none"` it runs as `..._no_reduction`, whose backward (out= ops, writes into
buffers) has no derivative: torch's forward AD gave it no tangent, and `functx.jvp` was 0.

Inside a transform, where forward mode meets the op or its backward will be differentiated
(ad/level.py `backward_differentiated`, or the caller's autograd tracks the values), functx computes the loss as `cross_entropy(linear(x))`
instead (torch's value to rounding, its derivatives right at every order); the gradient outputs
are the op's own values, as constants. A single reverse level (per-sample gradients, training)
keeps torch's chunked op and its memory.

    >>> import torch, torch.nn.functional as F, functx
    >>> from torch.nn import LinearCrossEntropyOptions
    >>> x, w = torch.randn(4, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    >>> target = torch.tensor([0, 2, 4, 1])
    >>> options = LinearCrossEntropyOptions(batch_chunk_size=2)
    >>> loss = lambda x: F.linear_cross_entropy(x, w, target, options=options)
    >>> plain = lambda x: F.cross_entropy(x @ w.T, target)
    >>> torch.allclose(functx.hessian(loss)(x), torch.autograd.functional.hessian(plain, x))
    True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.interpreter import FIRST_TRANSFORM_HOOKS, current_stack
from . import library_ops
from ..core.level_tensor import LevelTensor
from .aten_reverse_rules import _inside_and_differentiated, _plain
from .direct_reverse import DirectGradLevel, _reaches_outside, recorded_at
from .level import ADLevel

_unpack_dual = torch._VF._unpack_dual


def _chunked_operators():
    """torch.nn's two operators, where this torch has them (defined on first use of
    `F.linear_cross_entropy`; importing their module here costs ~10 ms)."""
    try:
        import torch.nn.modules.linear_cross_entropy  # noqa: F401
    except ImportError:
        return None, None
    ops = torch.ops.torch_nn
    return ops._linear_cross_entropy_batch_chunked.default, ops._linear_cross_entropy_batch_chunked_no_reduction.default


def _differentiated_beyond_first_order(*args, **kwargs) -> bool:
    """Inside an AD transform, an argument forward mode differentiates (a tangent at torch's
    dual level), or one reverse mode records while the backward will be differentiated: by
    a second level, or by the caller's autograd, which tracks the value under a level's
    wrapper (`torch.autograd.grad` of a `functx.grad`)."""
    tensors = [a for a in args[:5] if isinstance(a, torch.Tensor)]
    inside, backward_differentiated = _inside_and_differentiated()
    if not inside:
        return False
    if any(_unpack_dual(t, 0).tangent is not None for t in tensors):
        return True
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        return False
    return backward_differentiated or _tracked_by_the_caller(tensors)


def _tracked_by_the_caller(tensors) -> bool:
    """Whether the caller's autograd tracks what the one reverse level records: under a
    wrapped level's wrapper, a value that requires grad; for a direct level (on torch's
    autograd, under vmap's wrappers), a graph reaching a leaf that is not the level's own."""
    levels = [level for level in current_stack() if isinstance(level, ADLevel)]
    if len(levels) != 1:  # a checkpoint's recomputation outside the transform: decided as of its first run
        return True  # (the formula is right at every order; only the chunked op's memory is given up)
    (level,) = levels
    if isinstance(level, DirectGradLevel):
        return _reaches_outside([recorded_at(level, level.vmap_levels, t) for t in tensors], [], level)
    values = [t._value if isinstance(t, LevelTensor) and t._interp is level else t for t in tensors]
    return any(_plain(v).requires_grad for v in values)


def _loss(input, linear_weight, target, linear_bias, weight, reduction, ignore_index, label_smoothing, acc_dtype):
    """`cross_entropy(linear(input))` in the operators' accumulation precision."""
    if acc_dtype is None:
        acc_dtype = torch.float32 if input.dtype in (torch.float16, torch.bfloat16) else input.dtype
    bias = None if linear_bias is None else linear_bias.to(acc_dtype)
    logits = F.linear(input.to(acc_dtype), linear_weight.to(acc_dtype), bias)
    loss = F.cross_entropy(
        logits, target, weight=weight, reduction=reduction, ignore_index=ignore_index, label_smoothing=label_smoothing
    )
    return loss.to(input.dtype)


def _cross_entropy_of_linear(input, linear_weight, target, linear_bias, weight, reduction, ignore_index, label_smoothing, *rest):
    """The scalar operator's outputs: the loss by `_loss`, and its gradient outputs from the
    operator itself, as constants (its caller, `F.linear_cross_entropy`, reads the loss).
    Where its caller asked for no gradient (forward mode: `compute_*_grad` False) those
    outputs are the op's empty tensors, made here instead of by a second pass of the op."""
    acc_dtype = rest[2]
    loss = _loss(input, linear_weight, target, linear_bias, weight, reduction, ignore_index, label_smoothing, acc_dtype)
    if not any(rest[-3:]):  # compute_input_grad, compute_linear_weight_grad, compute_linear_bias_grad
        return loss, input.new_empty((0, 0)), input.new_empty((0, 0)), input.new_empty((0,))
    constants = [a.detach() if isinstance(a, torch.Tensor) else a for a in (input, linear_weight, target, linear_bias, weight)]
    with torch.no_grad(), torch.autograd.forward_ad._set_fwd_grad_enabled(False):
        _, *gradients = _CHUNKED(*constants, reduction, ignore_index, label_smoothing, *rest)
    return (loss, *gradients)


def _cross_entropy_of_linear_per_sample(input, linear_weight, target, linear_bias, weight, ignore_index, batch_chunk_size, acc_policy, acc_dtype):
    """The `reduction="none"` operator's output by `_loss`."""
    return _loss(input, linear_weight, target, linear_bias, weight, "none", ignore_index, 0.0, acc_dtype)


_CHUNKED, _CHUNKED_PER_SAMPLE = _chunked_operators()
if _CHUNKED is not None:
    for _op, _decomposition in ((_CHUNKED, _cross_entropy_of_linear), (_CHUNKED_PER_SAMPLE, _cross_entropy_of_linear_per_sample)):
        library_ops.register_reverse_decomposition(_op, _differentiated_beyond_first_order, _decomposition)
        FIRST_TRANSFORM_HOOKS.append(lambda op=_op: library_ops.wrap_existing(op))
