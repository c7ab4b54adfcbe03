"""`torch.utils.checkpoint.checkpoint` inside functx transforms.

Checkpointing trades memory for time: the derivatives must be those of `f(*args)`.

- The reentrant form (`use_reentrant=True`, torch's `CheckpointFunction`) runs `f` under
  no_grad and, in its backward, runs `f` again and calls `torch.autograd.backward` on it,
  which fills the leaves' `.grad`. No functx level can use that: a direct level (the
  outermost `grad`, `vmap(grad)`) takes its gradient with `torch.autograd.grad`, where torch
  refuses the reentrant form, and when no positional input requires grad (parameters passed
  in a dict through `functional_call`) the gradient through `f` was silently zero; torch.func
  refuses the Function. Under a transform it runs as the non-reentrant form
  (`core/custom_function.replace_under_transforms`).
- The non-reentrant form keeps `f`'s saved tensors out of memory with saved-tensor hooks and
  recomputes them in the backward, where its hook `detach()`es each recomputed tensor:
  plain torch restores the graph from the saved variable, but at a wrapped grad level that
  detach is a user's stop-gradient of the wrapper (level.py), which cuts the levels below:
  `hessian`, `jacrev(jacrev(f))`, `jacfwd(jacrev(f))` through it came out wrong. Where every
  level on the stack records on the values (direct AD levels and vmap levels: torch's own
  autograd nests there) it runs as torch's; under a wrapped level, or a vmap inside a grad
  (whose backward would recompute `f` after the vmap returned), `f` runs unchecked (right,
  without the memory saving).

    >>> import torch, functx
    >>> from torch.utils.checkpoint import checkpoint
    >>> f = lambda x: checkpoint(torch.sin, x, use_reentrant=True).sum()
    >>> functx.grad(f)(torch.tensor([0.0]))
    tensor([1.])
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint as _checkpoint

from ..core.custom_function import replace_under_transforms
from ..core.interpreter import current_stack
from ..core.patches import patch
from ..core.recompute import rerun_in_contexts
from ..vmap.interpreter import VmapInterpreter
from .direct_forward import DirectJvpLevel
from .direct_reverse import DirectGradLevel
from .wrapped_reverse import GradTensor

_RECORD_ON_VALUES = (DirectGradLevel, DirectJvpLevel, VmapInterpreter)


def _levels_record_on_values() -> bool:
    """Whether torch's checkpoint can run: every level records on the values, and no grad
    level lies outside a vmap level (`grad(vmap(f))`: its backward, which recomputes `f`,
    runs after the vmap returned, on the vmap's dead tensors)."""
    grad_outside = False
    for level in current_stack():
        kind = type(level)
        if kind not in _RECORD_ON_VALUES or (kind is VmapInterpreter and grad_outside):
            return False
        grad_outside = grad_outside or kind is DirectGradLevel
    return True


def reentrant_checkpoint(run_function, preserve_rng_state, *args):
    """What `CheckpointFunction.apply(run_function, preserve_rng_state, *args)` (the
    reentrant form) runs under a transform: torch's non-reentrant checkpoint."""
    return _checkpoint.checkpoint(run_function, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state)


_torch_generator = _checkpoint._checkpoint_without_reentrant_generator


def _without_reentrant_generator(fn, *args, **kwargs):
    """torch's non-reentrant checkpoint around the forward (`checkpoint` runs `f` between
    its two steps; `fn` is what the backward recomputes, in the contexts `f` runs in now:
    core/recompute.py), or nothing (`f` unchecked) under a wrapped level (module docstring)."""
    if _levels_record_on_values():
        yield from _torch_generator(rerun_in_contexts(fn), *args, **kwargs)
    else:
        yield


replace_under_transforms(_checkpoint.CheckpointFunction, reentrant_checkpoint)
patch(
    _checkpoint,
    "_checkpoint_without_reentrant_generator",
    _without_reentrant_generator,
    "the recomputation's detach does not cut functx's wrapped levels (hessian through checkpoint was "
    "off by ~4); reentrant checkpointing is replaced under transforms through "
    "core/custom_function.replace_under_transforms",
)


# Saved-tensor hooks (`torch.autograd.graph.saved_tensors_hooks`, `save_on_cpu`) see what
# autograd saves, also a wrapped grad level's own tensors (autograd records on its wrappers).
# torch re-attaches the level's graph to what the unpack hook returns, but not the graphs of
# the levels below inside it: a hook that returned a new tensor (a copy, a clone) made there
# under no_grad cut them, and second derivatives through it came out wrong (vmap(hessian),
# vmap(grad(grad)): off by 2). A level's tensors go past the user's hooks: the value they
# wrap is kept (connected below) and wrapped again at unpack, as torch does without hooks.
_LEVEL_VALUE = object()


def _push_hooks_past_levels(pack_hook, unpack_hook):
    """torch's push of saved-tensor hooks, with the user's hooks applied to every tensor but
    a wrapped grad level's own."""

    def pack(tensor):
        if type(tensor) is GradTensor and tensor._interp.alive:
            return (_LEVEL_VALUE, tensor._value, tensor._interp)
        return (None, pack_hook(tensor), None)

    def unpack(packed):
        kind, value, level = packed
        return GradTensor(value, level) if kind is _LEVEL_VALUE else unpack_hook(value)

    return _torch_push_hooks(pack, unpack)


_torch_push_hooks = patch(
    torch._C._autograd,
    "_push_saved_tensors_default_hooks",
    _push_hooks_past_levels,
    "saved-tensor hooks pass a wrapped grad level's own tensors through untouched: a hook's "
    "new tensor there cut the levels below (wrong second derivatives under vmap(hessian))",
)
