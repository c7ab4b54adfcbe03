"""The one place that picks the AD level for a transform call (level.py lists the four),
from what the call needs of it (`Needs`: which way derivatives flow, and how the transform
uses its level's pullback or tangents), not from the transform's name.

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
  cannot be differentiated right, see jvp_rules._DECOMPOSED_WHEN_NESTED) and the
  inputs are real; for `jvp` only when some primal is batched there (the physical level
  copies every primal to each batch element: with shared primals and batched tangents,
  the Hessian times a matrix, that computed the primal k times, 2.2x torch.func);
- direct on values (no vmap levels of its own; torch's autograd or forward AD on the
  tensors the function computes with, the BatchedTensors of vmap levels below included,
  whose rules then run below autograd: `VmapInterpreter.ad_above`):
  `jvp` of plain primals when no AD level is open (only vmap levels: the tangents may be
  batched, the primal is then computed once); `grad` right over such levels or over an
  outermost grad/vjp level (forward-over-reverse and reverse-over-reverse HVPs: no Python
  dispatch); `vjp` of plain inputs under vmap levels and such levels (its `vjp_fn` is
  a backward on values, right under whatever levels it is called later, as the outermost
  vjp's is). A `jvp` inside any AD level wraps (reverse over torch's forward formulas is not
  always right on plain tensors, wrapped_forward.py). Levels opened inside a jvp on values
  keep its tangents off their wrappers (core/dual_values.py);
- everything else wraps. `vjp` of batched inputs does because a user's `vjp_fn` may be called
  later under any levels (linearize and jvp's fallback call it under a new grad level, which
  a physical graph cannot serve); `jacfwd` because its columns would each recompute the
  primal on the physical tensors, where a wrapped level computes it once (measured: the R^256
  jacfwd benchmark 1.44x -> 2.4x torch.func); `jacrev` under two vmaps because its rows'
  vmap would sit over two physical batch dims.
"""

from __future__ import annotations

from dataclasses import dataclass

import optree
import torch

from ..core.interpreter import current_stack
from ..core.level_tensor import LevelTensor
from ..vmap.batched_tensor import BatchedTensor
from ..vmap.interpreter import VmapInterpreter
from ..vmap.interpreter import vmap_levels_on_top
from .direct_forward import DirectJvpLevel
from .direct_reverse import DirectGradLevel
from .wrapped_forward import WrappedJvpLevel
from .wrapped_reverse import WrappedGradLevel


@dataclass(frozen=True)
class Needs:
    """What one transform call needs of its AD level.

    `pullback` (reverse mode): "once", one gradient of a scalar, taken inside the call
    (grad); "rows", cotangents pulled back inside the call, one row at a time or as a batch
    of rows under one vmap opened right on top (jacrev, DirectGradLevel.vjp); "anywhere", a
    pullback the user may call later under any levels (vjp, whose `vjp_fn` linearize and
    jvp's fallback call under a new grad level). `tangents` (forward mode): "given", the
    caller's tangents, maybe batched (jvp); "columns", a basis pushed through under the
    transform's own vmap, so that the primal must be computed once (jacfwd)."""

    pullback: str | None = None
    tangents: str | None = None

    def __post_init__(self):
        one_way = (self.pullback is None) != (self.tangents is None)
        if not one_way or self.pullback not in (None, "once", "rows", "anywhere") or self.tangents not in (None, "given", "columns"):
            raise ValueError(
                f"choose.Needs: give one of pullback ('once', 'rows', 'anywhere') or tangents "
                f"('given', 'columns'), got {self}"
            )


GRAD = Needs(pullback="once")
JACREV = Needs(pullback="rows")
VJP = Needs(pullback="anywhere")
JVP = Needs(tangents="given")
JACFWD = Needs(tangents="columns")


def _outermost_direct_grad(level) -> bool:
    return type(level) is DirectGradLevel and not level.vmap_levels


def _nothing(level) -> bool:
    return False


def _on_values(level) -> bool:
    """A direct AD level with no vmap levels of its own: it records (reverse: torch's
    autograd; forward: torch's forward AD) on the tensors the function computes with."""
    return (type(level) is DirectGradLevel or type(level) is DirectJvpLevel) and not level.vmap_levels


def _plain_real(tensors) -> bool:
    for x in optree.tree_leaves(tensors):
        if isinstance(x, torch.Tensor) and (isinstance(x, LevelTensor) or x.is_complex()):
            return False
    return True


def _over_values(stack, differentiated) -> bool:
    """Whether a `grad` may open right over the direct levels on values on top of `stack`
    (forward-over-reverse and reverse-over-reverse Hessian-vector products, grad of grad):
    everything in the stack records on values, or is a vmap level under them with no AD
    level of its own, the top is such a level, and the inputs are plain and real. Then
    the inner level is one too: torch's autograd nests (a gradient built with
    create_graph=True is differentiated again, its backward formulas carry forward-AD
    tangents), and the levels stay apart because a level's leaves are its own nodes."""
    if not _on_values(stack[-1]):
        return False
    for level in stack:
        if not (_on_values(level) or type(level) is VmapInterpreter and level.direct_ad is None):
            return False
    return _plain_real(differentiated)


def _vjp_over_values(stack, differentiated) -> bool:
    """Whether a `vjp` may record on its plain inputs directly under the levels of `stack`:
    each is a vmap level with no AD level of its own (then torch records on its
    BatchedTensors, `VmapInterpreter.ad_above`: a vjp of shared primals inside vmap, a
    Gauss-Newton product) or a direct level on values. Its `vjp_fn` can be called later
    under any levels, as the outermost vjp's can: a backward on the values themselves."""
    for level in stack:
        if not (_on_values(level) or type(level) is VmapInterpreter and level.direct_ad is None):
            return False
    return _plain_real(differentiated)


def _jvp_on_values(stack, primals, tangents) -> bool:
    """Whether a `jvp` may run torch's forward AD on its plain primals directly: no AD level
    is open (only vmap levels with none of their own, which batch the tangents), the primals
    are plain, real and not tracked by torch's autograd (reverse-over-forward through torch's
    formulas is not always right: they write into saved tensors in place, and the
    normalizations' statistics carry no tangent), and the tangents are real."""
    for level in stack:
        if type(level) is not VmapInterpreter or level.direct_ad is not None:
            return False
    for p in primals:
        if isinstance(p, LevelTensor) or p.is_complex() or p.requires_grad:
            return False
    for t in tangents:
        if t.is_complex() or t.requires_grad:
            return False
    return True


def _jacrev_on_values(stack, differentiated) -> bool:
    """Whether a `jacrev` may record on its plain inputs as a vjp on values does: right
    inside the outermost grad level alone (`hessian` = jacrev(jacrev)), or inside forward
    mode on values only (`jvp(jacrev(f))`, `jacfwd(jacrev(f))`: jvp levels on values and
    vmap levels with no AD level of their own, the top a jvp level, no grad level below).
    Then jacrev's rows are torch's autograd over torch's autograd (or forward AD), as plain
    torch: hessian 1.31x -> 1.00x torch.func back to back (one quick run; earlier full runs
    of the old code gave 0.88-1.08x), and the third derivative of det no longer
    meets, through a wrapped level, the NaN tangent of an SVD branch torch's det backward
    computes and does not select. Deeper (a 3,000-example fuzz run, with any grad level on
    values below): inside vmap a jacrev on values lost the outer gradient, and under
    hessian(hessian(jvp)) one met a dead vmap level's tensor: not there."""
    if len(stack) == 1 and type(stack[0]) is DirectGradLevel and not stack[0].vmap_levels:
        return _plain_real(differentiated)
    if type(stack[-1]) is not DirectJvpLevel:
        return False
    for level in stack:
        jvp_on_values = type(level) is DirectJvpLevel and _on_values(level)
        if not (jvp_on_values or type(level) is VmapInterpreter and level.direct_ad is None):
            return False
    return _plain_real(differentiated)


def _batched_by(vmap_levels, x) -> bool:
    """Whether `x` is batched at any of `vmap_levels` (their wrappers are outermost on it)."""
    return type(x) is BatchedTensor and x._interp in vmap_levels


def choose_level(needs: Needs, differentiated):
    """A new AD level for one transform call that needs `needs` (GRAD, JACREV, VJP, JVP,
    JACFWD) and whose differentiated inputs are the tensors in `differentiated` (forward
    mode: the pair (primals, tangents))."""
    stack = current_stack()
    pullback = needs.pullback
    if pullback is not None:
        if not stack:
            if pullback == "anywhere" and not torch.is_grad_enabled():
                return WrappedGradLevel()
            if any(isinstance(x, torch.Tensor) and x.is_complex() for x in optree.tree_leaves(differentiated)):
                return WrappedGradLevel()
            return DirectGradLevel(())
        if pullback == "once" and _over_values(stack, differentiated):
            return DirectGradLevel((), over_values=True)
        if pullback == "anywhere" and torch.is_grad_enabled() and _vjp_over_values(stack, differentiated):
            return DirectGradLevel((), over_values=True)
        if pullback == "rows" and torch.is_grad_enabled() and _jacrev_on_values(stack, differentiated):
            return DirectGradLevel((), over_values=True)
        if pullback != "anywhere":
            vmap_levels = vmap_levels_on_top(stack, _outermost_direct_grad, differentiated)
            if vmap_levels is not None and (pullback == "once" or len(vmap_levels) == 1):
                return DirectGradLevel(vmap_levels)
        return WrappedGradLevel()
    if needs.tangents == "given":
        primals, tangents = differentiated
        if _jvp_on_values(stack, primals, tangents):
            return DirectJvpLevel(())
        if stack:
            vmap_levels = vmap_levels_on_top(stack, _nothing, differentiated)
            # (not where the caller's autograd tracks a primal: reverse over torch's forward
            # formulas is not always right, as in _jvp_on_values; the softmaxes' raised)
            if (
                vmap_levels is not None
                and any(_batched_by(vmap_levels, p) for p in primals)
                and not any(p.requires_grad for p in primals)
            ):
                return DirectJvpLevel(vmap_levels)
    return WrappedJvpLevel()
