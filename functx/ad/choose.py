"""The one place that picks the AD level for a transform call (level.py lists the four).

- reverse, outermost (no transform active): direct over plain tensors, except with complex
  inputs (a plain complex leaf's lazy conj bit is materialized by torch below autograd at an
  inner level, cutting the plain graph: vjp of vjp of `torch.polar`), and except `vjp` under
  an outer `no_grad()` (torch.func: the forward stays out of the outside's graph, yet a
  `vjp_fn` called later with grad mode on records its backward there; a direct level records
  both or neither, a wrapped level's backward runs on its dead wrappers under the grad
  mode of the call, core/level_tensor.py);
- `grad` right inside k >= 1 vmap levels, `jacrev` right inside exactly one, `jvp` right
  inside k >= 1: direct on vmap's physical tensors, when everything under those vmap
  levels is plain (below them only outermost direct grad levels; for `jvp` nothing: an AD
  level below would differentiate torch's forward formulas in C++, and some of those
  cannot be differentiated right, see wrapped_forward._DECOMPOSED_WHEN_NESTED) and the
  inputs are real;
- everything else wraps. `vjp` does because a user's `vjp_fn` may be called later under any
  levels (linearize and jvp's fallback call it under a new grad level, which a physical
  graph cannot serve); `jacfwd` because its columns would each recompute the primal on the
  physical tensors, where a wrapped level computes it once (measured: the R^256 jacfwd
  benchmark 1.44x -> 2.4x torch.func); `jacrev` under two vmaps because its rows' vmap
  would sit over two physical batch dims.
"""

from __future__ import annotations

import optree
import torch

from ..core.interpreter import current_stack
from ..vmap.chain import vmap_levels_on_top
from .direct_forward import DirectJvpLevel
from .direct_reverse import DirectGradLevel
from .wrapped_forward import WrappedJvpLevel
from .wrapped_reverse import WrappedGradLevel

REVERSE = ("grad", "vjp", "jacrev")
FORWARD = ("jvp", "jacfwd")


def _outermost_direct_grad(level) -> bool:
    return type(level) is DirectGradLevel and not level.vmap_levels


def _nothing(level) -> bool:
    return False


def choose_level(transform: str, differentiated):
    """A new AD level for one call of `transform` ("grad", "vjp", "jacrev", "jvp" or
    "jacfwd") whose differentiated inputs are the tensors in `differentiated`."""
    stack = current_stack()
    if transform in REVERSE:
        if not stack:
            if transform == "vjp" and not torch.is_grad_enabled():
                return WrappedGradLevel()
            if any(isinstance(x, torch.Tensor) and x.is_complex() for x in optree.tree_leaves(differentiated)):
                return WrappedGradLevel()
            return DirectGradLevel(())
        if transform != "vjp":
            vmap_levels = vmap_levels_on_top(stack, _outermost_direct_grad, differentiated)
            if vmap_levels is not None and (transform == "grad" or len(vmap_levels) == 1):
                return DirectGradLevel(vmap_levels)
        return WrappedGradLevel()
    if transform not in FORWARD:
        raise ValueError(f"unknown transform {transform!r}")
    if transform == "jvp" and stack:
        vmap_levels = vmap_levels_on_top(stack, _nothing, differentiated)
        if vmap_levels is not None:
            return DirectJvpLevel(vmap_levels)
    return WrappedJvpLevel()
