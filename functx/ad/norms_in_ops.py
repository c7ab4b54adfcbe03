"""Layer, batch and instance norm as their formula in torch ops where a third derivative may
be taken.

torch's derivative of these norms' double backward is wrong (plain torch, torch.func, and
functx's direct levels, which are torch's autograd): d/dx <H(x) v, w> of
sum(sin(layer_norm(x))) is off by 25 on a (2, 3, 4) input, batch norm's by 1.5, instance
norm's by 25 (`layer_norm_double_backward` and `batchnorm_double_backward` take the saved
statistics as constants). Their first and second derivatives are right, and group norm's and
rms norm's are right at every order.

Where a backward recorded now may itself be differentiated (`_inside_and_differentiated`:
two AD levels, linearize, the double-VJP identity; ad/level.py), `F.layer_norm`,
`F.batch_norm` in training mode and `F.instance_norm` with the input's statistics (and the
ATen entry points `torch.native_layer_norm`, `torch.native_batch_norm`,
`torch._native_batch_norm_legit`, `aten._batch_norm_with_update` called from Python) run as
their formula in torch ops (`RUN_AS_PYTHON`, at the torch-function level: the ops go through
every level as the user's would), whose derivatives are right at every order; the running
statistics are updated as torch's kernels do, from the detached statistics. Elsewhere (one
level, vmap alone, no transform) torch's fused kernels run.

A checkpointed function recomputed in the backward runs inside functx's handling of
`torch.autograd.grad`, where functx's torch-function mode is off torch's stack: its norms
would run as torch's kernels and save other tensors than the first run (a CheckpointError).
Where the first run took the formula, the recomputation puts that one mode back for its
calls, with no handler live (`run_as_python_only`, registered with core/recompute.py), so that
the norms choose again as they chose then.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.recompute import register_context
from ..core.torch_function import RUN_AS_PYTHON, run_as_python_only
from .aten_reverse_rules import _inside_and_differentiated


def _differentiated_again(*tensors) -> bool:
    if not torch.is_grad_enabled() or _inside_and_differentiated() != (True, True):
        return False
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _affine(out, weight, bias, shape):
    if weight is not None:
        out = out * weight.reshape(shape)
    if bias is not None:
        out = out + bias.reshape(shape)
    return out


def _normalized(input, dims, eps):
    """(input - mean) / sqrt(var + eps) over `dims`, with the mean and biased variance."""
    mean = input.mean(dims, keepdim=True)
    centered = input - mean
    var = (centered * centered).mean(dims, keepdim=True)
    return centered * torch.rsqrt(var + eps), mean, var


def _update_running(running, momentum, statistic):
    """running <- (1 - momentum) running + momentum statistic, as torch's kernels update it
    (from the statistic without its graph)."""
    if running is not None:
        with torch.no_grad():
            running.mul_(1 - momentum).add_(statistic.detach().to(running.dtype), alpha=momentum)


def _layer_norm_parts(input, normalized_shape, weight, bias, eps):
    dims = tuple(range(input.dim() - len(normalized_shape), input.dim()))
    out, mean, var = _normalized(input, dims, eps)
    return _affine(out, weight, bias, tuple(normalized_shape)), mean, torch.rsqrt(var + eps)


def _layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    if not _differentiated_again(input, weight, bias):
        return NotImplemented
    return _layer_norm_parts(input, normalized_shape, weight, bias, eps)[0]


def _native_layer_norm(input, normalized_shape, weight, bias, eps):
    """(output, mean, 1 / std): the statistics are not differentiable outputs, as torch's."""
    if not _differentiated_again(input, weight, bias):
        return NotImplemented
    out, mean, rstd = _layer_norm_parts(input, normalized_shape, weight, bias, eps)
    return out, mean.detach(), rstd.detach()


def _batch_norm_training(input, weight, bias, running_mean, running_var, momentum, eps):
    """(output, mean, 1 / std) per channel, the running statistics updated."""
    dims = (0, *range(2, input.dim()))
    out, mean, var = _normalized(input, dims, eps)
    count = input.numel() // input.shape[1]
    _update_running(running_mean, momentum, mean.flatten())
    _update_running(running_var, momentum, var.flatten() * count / max(count - 1, 1))
    out = _affine(out, weight, bias, (1, -1) + (1,) * (input.dim() - 2))
    return out, mean.flatten(), torch.rsqrt(var + eps).flatten()


def _batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5):
    if not training or input.dim() < 2 or not _differentiated_again(input, weight, bias):
        return NotImplemented
    F._verify_batch_size(input.size())  # torch's message for one value per channel
    return _batch_norm_training(input, weight, bias, running_mean, running_var, momentum, eps)[0]


def _native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    if not training or input.dim() < 2 or not _differentiated_again(input, weight, bias):
        return NotImplemented
    out, mean, invstd = _batch_norm_training(input, weight, bias, running_mean, running_var, momentum, eps)
    return out, mean.detach(), invstd.detach()


def _native_batch_norm_legit(input, weight, bias, *rest):
    """Both overloads: (running_mean, running_var, training, momentum, eps) and (training,
    momentum, eps) without running statistics."""
    running_mean, running_var, training, momentum, eps = rest if len(rest) == 5 else (None, None, *rest)
    return _native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)


def _batch_norm_with_update(input, weight, bias, running_mean, running_var, momentum, eps):
    out = _native_batch_norm(input, weight, bias, running_mean, running_var, True, momentum, eps)
    if out is NotImplemented:
        return out
    return (*out, torch.empty(0, dtype=torch.uint8, device=input.device))  # (cuDNN's reserve space)


def _instance_norm(
    input, running_mean=None, running_var=None, weight=None, bias=None, use_input_stats=True, momentum=0.1, eps=1e-5
):
    if not use_input_stats or input.dim() < 3 or not _differentiated_again(input, weight, bias):
        return NotImplemented
    F._verify_spatial_size(input.size())
    dims = tuple(range(2, input.dim()))
    out, mean, var = _normalized(input, dims, eps)
    count = input[0, 0].numel()
    # torch's kernel: the running statistics move by the batch's average of each instance's
    _update_running(running_mean, momentum, mean.flatten(1).mean(0))
    _update_running(running_var, momentum, (var.flatten(1) * count / max(count - 1, 1)).mean(0))
    return _affine(out, weight, bias, (1, -1) + (1,) * (input.dim() - 2))


_AS_FORMULA = {
    F.layer_norm: _layer_norm,
    torch.layer_norm: _layer_norm,
    torch.native_layer_norm: _native_layer_norm,
    F.batch_norm: _batch_norm,
    torch.native_batch_norm: _native_batch_norm,
    torch._native_batch_norm_legit: _native_batch_norm_legit,
    torch.ops.aten._batch_norm_with_update: _batch_norm_with_update,
    torch.ops.aten._batch_norm_with_update.default: _batch_norm_with_update,
    F.instance_norm: _instance_norm,
}
RUN_AS_PYTHON.update(_AS_FORMULA)


def _capture_for_recomputation():
    return run_as_python_only if _inside_and_differentiated() == (True, True) else None


register_context(_capture_for_recomputation)
