"""A `grad` directly inside `vmap`, run by plain torch autograd on vmap's physical tensors.

Per-sample gradients (`vmap(grad(loss))`) and MAML's inner steps open a grad level right on
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

Used by `grad`/`grad_and_value` only when the vmap level is on top and every level below it
is a plain grad level (the values are then plain tensors) and the inputs are real: a
`vjp_fn` can be called later, under other levels, so `vjp` keeps the wrapping level; a
grad nested inside this one wraps as usual.

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
        out = self._tracked(output)
        physical_leaves = [self._tracked(x) for x in leaves]
        if not out.requires_grad:
            grads = [torch.zeros_like(x) for x in physical_leaves]
        else:
            self.in_backward = True
            try:
                grads = torch.autograd.grad(
                    [out], physical_leaves, [torch.ones_like(out)], create_graph=self.reaches_outside, allow_unused=True
                )
            finally:
                self.in_backward = False
            grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, physical_leaves)]
        return [BatchedTensor(g, self.vmap_level) for g in grads]

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
