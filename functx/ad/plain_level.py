"""The outermost grad level, run by plain torch autograd on plain tensors.

When a `grad`/`vjp` starts with no functx transform active (the common case: the gradient
of a loss in a training loop, the outer gradient of MAML, jacrev/hessian), nothing below it
needs telling apart from it, so it need not wrap anything: its differentiated inputs are
fresh leaves (`x.detach().requires_grad_()`) and torch's autograd records on the plain
tensors directly, in C++. Levels opened inside it (vmap, inner grads) wrap those tensors as
usual and record on them through their `_value`s, as they would over any lower level. An
interpreter still goes on the stack (it handles no ops: no tensor carries it), so the
transforms inside know they are not the outermost.

What wrappers give for free is kept by hand:
- results leave the level detached (no `requires_grad`, no graph to the internal
  leaves), unless the function reached tensors that torch autograd tracks outside the
  transform (a parameter that requires grad, an input that does): then they keep the
  graph, and `grad` builds its gradient with `create_graph=True`, so an outer
  `loss.backward()` differentiates through it (a gradient penalty). Found by walking the
  function's graph once;
- an outer `torch.no_grad()` around the transform holds for those outside tensors:
  results are then always detached.

    >>> import torch
    >>> from functx.core.interpreter import interpreting
    >>> with interpreting(PlainGradLevel()) as level, torch.enable_grad():
    ...     x = level.leaf(torch.tensor(2.0))
    ...     y = x ** 3
    ...     level.seal([y], [x])
    ...     (dy,) = torch.autograd.grad(y, x, create_graph=level.reaches_outside)
    >>> dy.item(), dy.requires_grad
    (12.0, False)
"""

from __future__ import annotations

import optree
import torch

from ..core.interpreter import Interpreter
from ..core.level_tensor import LevelTensor
from .grad_level import autograd_grad, unwrap_level


class PlainGradLevel(Interpreter):
    """The outermost grad level: plain autograd (see the module docstring)."""

    kind = "grad (plain autograd)"
    __slots__ = ("prev_grad_mode", "reaches_outside")

    def __init__(self):
        super().__init__()
        self.prev_grad_mode = torch.is_grad_enabled()
        self.reaches_outside = False

    def leaf(self, x: torch.Tensor) -> torch.Tensor:
        """A tensor standing for input `x` that this level differentiates with respect to."""
        return self._autograd_leaf(x)

    def _autograd_leaf(self, x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad and self.prev_grad_mode:
            return x.view_as(x)  # stays connected to the outside graph
        # a tensor made under torch.inference_mode() cannot require grad: differentiate a copy
        leaf = (x.clone() if x.is_inference() else x.detach()).requires_grad_()
        leaf._functx_leaf_of = self  # "outside" for the levels inside this one, while it lives
        return leaf

    def tracked(self, x):
        """The tensor autograd tracks for `x` (a subclass may keep it under a wrapper)."""
        return x

    def seal(self, outputs, leaves) -> None:
        """After the function ran: does its graph reach tensors tracked outside?"""
        tracked = self.tracked
        self.reaches_outside = self.prev_grad_mode and _reaches_outside(
            [tracked(o) for o in outputs], [tracked(x) for x in leaves]
        )

    def gradient(self, output, leaves):
        """d output / d leaves (output: a scalar)."""
        return autograd_grad([output], leaves, create_graph=self.reaches_outside)

    def vjp(self, outputs, leaves, cotangents, *, create_graph, retain_graph):
        """Cotangents of `leaves` from cotangents of `outputs` (what `vjp_fn` computes)."""
        return autograd_grad(outputs, leaves, cotangents, create_graph=create_graph, retain_graph=retain_graph)

    def depends(self, output) -> bool:
        """Whether `output` depends on this level's differentiated inputs."""
        return self.tracked(output).requires_grad

    def export(self, tree):
        """Results as they leave the level (detached unless they must stay connected)."""
        tree = unwrap_level(tree, self)  # dead levels opened inside may have left wrappers
        if self.reaches_outside:
            return tree
        return optree.tree_map(self._detached, tree)

    def _detached(self, x):
        return x.detach() if isinstance(x, torch.Tensor) and x.requires_grad else x

    def process(self, op, args, kwargs):  # pragma: no cover - no tensor carries this level
        raise AssertionError("the plain grad level has no tensors of its own")


def _is_outside(leaf, own) -> bool:
    """Whether autograd leaf `leaf` is tracked outside a level whose leaves are `own` (ids):
    a user's tensor, or a live level's internal leaf; not the leaves of a finished level
    (a `vjp_fn` used inside a later `grad`)."""
    if id(leaf) in own:
        return False
    level = getattr(leaf, "_functx_leaf_of", None)
    return level is None or level.alive


def _reaches_outside(outputs, leaves) -> bool:
    """Whether the autograd graph of `outputs` reaches a leaf tracked outside (`_is_outside`)."""
    own = {id(x) for x in leaves}
    stack = [o.grad_fn for o in outputs if isinstance(o, torch.Tensor) and o.grad_fn is not None]
    for o in outputs:
        if isinstance(o, torch.Tensor) and o.requires_grad and o.grad_fn is None and _is_outside(o, own):
            return True
    seen = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for child, _ in node.next_functions:
            if child is None:
                continue
            variable = getattr(child, "variable", None)
            if variable is not None:  # AccumulateGrad: a leaf
                if _is_outside(variable, own):
                    return True
            else:
                stack.append(child)
    return False


def is_differentiated(x) -> bool:
    """Whether some autograd (plain or a functx grad level) tracks `x`."""
    while isinstance(x, torch.Tensor):
        if x.requires_grad:
            return True
        if not isinstance(x, LevelTensor):
            return False
        x = x._value
    return False
