"""A `grad` or `jacrev` directly inside `vmap`, run by plain torch autograd on vmap's
physical tensors.

Per-sample gradients (`vmap(grad(loss))`), per-sample Jacobians and Hessians
(`vmap(jacrev(f))`, `vmap(hessian(f))`) and MAML's inner steps open a grad level right on
top of a vmap level. A wrapping grad level (grad_level.py) would send every op, forward and
backward, through two Python dispatches (its own, then vmap's). But under vmap the batch
elements cannot interact: the physical computation of a vmap level is the per-element
computations side by side. So the gradient of each element's output with respect to that
element's inputs is the gradient of the *sum* of the outputs with respect to the physical
inputs (the batch dim first), and torch's autograd computes it on the physical tensors, in
C++: the forward goes through vmap's rules once, the backward never reaches Python.

An unbatched differentiated input is given the batch dim (an `expand`, no copy) before it
becomes a leaf, so its gradient comes out per element, as `vmap(grad)` asks.

What the wrapping level gives for free is kept by hand, as on the outermost plain level
(plain_level.py, whose seal/export this level shares):
- results leave detached unless the function reached tensors tracked outside (an outer
  grad level, a parameter that requires grad): then the gradient is built with
  `create_graph=True` so the outer level differentiates through it (MAML);
- `detach()` inside the function cuts this level only: the vmap level's detach rule asks
  `stop_gradient` for a node that blocks this level's backward and lets every other
  backward through (so an outer level still sees the dependence).

Used by `grad`/`grad_and_value` and `jacrev` only when the vmap level is on top and every
level below it is a plain grad level (the values are then plain tensors) and the inputs are
real. A user's `vjp_fn` can be called later under any levels, so `vjp` keeps the wrapping
level; jacrev calls its own `vjp_fn` in the two ways `vjp` below handles. A grad nested
inside this one wraps as usual.

    >>> import torch, functx
    >>> x = torch.randn(3, 2)
    >>> g = functx.vmap(functx.grad(lambda r: (r ** 3).sum()))(x)
    >>> torch.allclose(g, 3 * x ** 2)
    True
"""

from __future__ import annotations

import optree
import torch

from ..core.custom_function import apply_original
from ..core.interpreter import current_stack, functx_code
from ..core.level_tensor import LevelTensor
from ..vmap.batched_tensor import BatchedTensor, VmapInterpreter
from .plain_level import PlainGradLevel


class PhysicalGradLevel(PlainGradLevel):
    """A grad level run by plain autograd on the physical tensors of `vmap_level`: the
    plain level's seal and export, on the tensors under this vmap level's wrappers."""

    kind = "grad (plain autograd under vmap)"
    __slots__ = ("vmap_level", "in_backward", "_outer")

    def __init__(self, vmap_level: VmapInterpreter):
        super().__init__()
        self.vmap_level = vmap_level
        self.in_backward = False
        self._outer = None

    def pushed(self):
        # the vmap level's detach rule asks its physical grad level (see stop_gradient)
        self._outer, self.vmap_level.physical_grad = self.vmap_level.physical_grad, self

    def popped(self):
        self.vmap_level.physical_grad = self._outer

    @staticmethod
    def applies(stack, differentiated) -> bool:
        """Whether a grad opened over `stack` on inputs `differentiated` can run here."""
        top = stack[-1]
        if type(top) is not VmapInterpreter:
            return False
        for level in stack[:-1]:
            if type(level) is not PlainGradLevel:
                return False
        for x in optree.tree_leaves(differentiated):
            if isinstance(x, torch.Tensor):
                value = x._value if type(x) is BatchedTensor and x._interp is top else x
                if isinstance(value, LevelTensor) or value.is_complex():
                    return False
        return True

    def leaf(self, x: torch.Tensor) -> torch.Tensor:
        vmap_level = self.vmap_level
        if type(x) is BatchedTensor and x._interp is vmap_level:
            physical = x._value
        else:  # unbatched: one copy per element (a view), so its gradient is per element
            physical = x.expand(vmap_level.batch_size, *x.shape)
        return BatchedTensor(self._autograd_leaf(physical), vmap_level)

    def _tracked(self, x):
        vmap_level = self.vmap_level
        return x._value if type(x) is BatchedTensor and x._interp is vmap_level else x

    def gradient(self, output, leaves):
        """d output / d leaves, per batch element (output: this level's scalar)."""
        with functx_code():
            one = torch.ones((), dtype=output.dtype, device=output.device)
        return self.vjp([output], leaves, [one], create_graph=self.reaches_outside, retain_graph=None)

    def vjp(self, outputs, leaves, cotangents, *, create_graph, retain_graph):
        """Cotangents of `leaves`, per batch element. Besides `gradient`, only jacrev calls
        it (its `vjp_fn`), in two ways: with one cotangent row (this vmap level's tensors
        or plain ones), or under a vmap `rows` opened right on top of this vmap level over
        a batch of rows. Then the backward runs on the physical tensors with the
        cotangents batched at `rows`: the engine's derivative formulas go through `rows`'
        batching rules once per op and meet plain saved tensors, whose shapes (this
        level's batch dim first) are what `rows` sees as logical."""
        vmap_level = self.vmap_level
        with functx_code():
            rows = None
            for c in cotangents:
                if isinstance(c, LevelTensor) and c._interp is not vmap_level:
                    rows = c._interp
            if rows is not None:
                assert type(rows) is VmapInterpreter and current_stack()[-2:] == (vmap_level, rows), "only as jacrev calls it"
            pairs = []
            for out, cot in zip(outputs, cotangents):
                out = self._tracked(out)
                if not out.requires_grad:
                    continue  # an output independent of the (per-element) leaves adds nothing
                pairs.append((out, self._physical_cotangent(cot, out, rows)))
            physical_leaves = [self._tracked(x) for x in leaves]
        grads = [None] * len(physical_leaves)
        if pairs:
            self.in_backward = True  # `detach` inside the function holds for this backward
            try:
                grads = torch.autograd.grad(
                    [o for o, _ in pairs], physical_leaves, [c for _, c in pairs],
                    create_graph=create_graph, retain_graph=retain_graph, allow_unused=True,
                )
            finally:
                self.in_backward = False
        with functx_code():
            results = []
            for g, leaf in zip(grads, physical_leaves):
                if g is None:
                    g = torch.zeros_like(leaf)
                if type(g) is BatchedTensor and g._interp is rows:  # back to rows over this level
                    results.append(BatchedTensor(BatchedTensor(g._value.movedim(1, 0), vmap_level), rows))
                else:
                    results.append(BatchedTensor(g, vmap_level))
            return results

    def _physical_cotangent(self, cot, out, rows):
        """`cot` for the physical output `out`; with `rows`, batched at rows, rows' batch
        dim first and this level's second."""
        vmap_level = self.vmap_level
        if rows is None:
            if type(cot) is BatchedTensor and cot._interp is vmap_level:
                return cot._value
            return cot.expand(out.shape)  # the same cotangent for every element
        value = cot._value if type(cot) is BatchedTensor and cot._interp is rows else cot.expand(rows.batch_size, *cot.shape)
        if type(value) is BatchedTensor and value._interp is vmap_level:
            value = value._value.movedim(0, 1)
        else:
            value = value.unsqueeze(1).expand(value.shape[0], *out.shape)
        return BatchedTensor(value, rows)

    def _detached(self, x):
        # not `x.detach()`: while this level is open, vmap's detach rule stops only its gradient
        if type(x) is BatchedTensor and x._interp is self.vmap_level:
            return BatchedTensor(x._value.detach(), self.vmap_level) if x._value.requires_grad else x
        return super()._detached(x)

    def stop_gradient(self, physical: torch.Tensor) -> torch.Tensor:
        """`physical.detach()` as this level sees it: constant for its gradient, unchanged
        for the levels below (an outer grad still differentiates through it)."""
        return apply_original(_StopGradientHere, physical, self)



class _StopGradientHere(torch.autograd.Function):
    """Identity whose backward is zero for one physical grad level's gradient only."""

    @staticmethod
    def forward(x, level):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.level = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return (None if ctx.level.in_backward else grad), None
