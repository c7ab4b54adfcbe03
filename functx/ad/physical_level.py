"""A `grad`, `jacrev` or `jvp` directly inside `vmap`, run by torch's autograd (reverse or
forward) on vmap's physical tensors.

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

Used by `grad`/`grad_and_value` (under one or more vmap levels) and `jacrev` (under one)
only when the levels under it are vmap levels over at most plain grad levels (the values
under the wrappers are then plain tensors) and the inputs are real. Under several vmap
levels the physical tensors carry every level's batch dim, outermost first. A user's
`vjp_fn` can be called later under any levels, so `vjp` keeps the wrapping level; jacrev
calls its own `vjp_fn` in the two ways `vjp` below handles. A grad nested inside this one
wraps as usual. `PhysicalJvpLevel` (below) does the same for `jvp` with torch's forward AD.

    >>> import torch, functx
    >>> x = torch.randn(3, 2)
    >>> g = functx.vmap(functx.grad(lambda r: (r ** 3).sum()))(x)
    >>> torch.allclose(g, 3 * x ** 2)
    True
"""

from __future__ import annotations

import optree
import torch
import torch.autograd.forward_ad as fwAD

from ..core.custom_function import apply_original
from ..core.interpreter import Interpreter, current_stack, functx_code
from ..core.level_tensor import LevelTensor
from ..vmap.batched_tensor import BatchedTensor, VmapInterpreter
from .plain_level import PlainGradLevel


class PhysicalGradLevel(PlainGradLevel):
    """A grad level run by plain autograd on the physical tensors under `vmap_levels` (the
    vmap levels on top of the stack, innermost last): the plain level's seal and export,
    on the plain tensors under those levels' wrappers. Each tensor of the function is a
    chain of BatchedTensors, one per level where it is batched, over a plain tensor."""

    kind = "grad (plain autograd under vmap)"
    __slots__ = ("vmap_levels", "in_backward", "_outer")

    def __init__(self, vmap_levels):
        super().__init__()
        self.vmap_levels = tuple(vmap_levels)
        self.in_backward = False
        self._outer = ()

    def pushed(self):
        # The vmap levels' detach rules and `requires_grad` ask their physical grad level.
        self._outer = _install(self.vmap_levels, "physical_grad", self)

    def popped(self):
        _restore(self.vmap_levels, "physical_grad", self._outer)

    def tracked(self, x):
        """The plain tensor under `x`'s wrappers of these levels."""
        return peel(self.vmap_levels, x)

    # -- the grad level's side of grad/jacrev ------------------------------------------
    def leaf(self, x: torch.Tensor) -> torch.Tensor:
        # batched everywhere: the gradient of an unbatched input comes out per element
        return wrap_chain(self.vmap_levels, self._autograd_leaf(batched_everywhere(self.vmap_levels, x)))

    def gradient(self, output, leaves):
        """d output / d leaves, per batch element (output: this level's scalar)."""
        with functx_code():
            one = torch.ones((), dtype=output.dtype, device=output.device)
        return self.vjp([output], leaves, [one], create_graph=self.reaches_outside, retain_graph=None)

    def vjp(self, outputs, leaves, cotangents, *, create_graph, retain_graph):
        """Cotangents of `leaves`, per batch element. Besides `gradient`, only jacrev calls
        it (its `vjp_fn`), in two ways: with one cotangent row (these levels' tensors or
        plain ones), or under a vmap `rows` opened right on top over a batch of rows (one
        vmap level below only). Then the backward runs on the physical tensors with the
        cotangents batched at `rows`: the engine's derivative formulas go through `rows`'
        batching rules once per op and meet plain saved tensors, whose shapes (the batch
        dim first) are what `rows` sees as logical."""
        with functx_code():
            rows = None
            for c in cotangents:
                if isinstance(c, LevelTensor) and c._interp not in self.vmap_levels:
                    rows = c._interp
            if rows is not None:
                assert len(self.vmap_levels) == 1 and type(rows) is VmapInterpreter, "only as jacrev calls it"
                assert current_stack()[-2:] == (self.vmap_levels[0], rows), "only as jacrev calls it"
            pairs = []
            for out, cot in zip(outputs, cotangents):
                out = self.tracked(out)
                if not out.requires_grad:
                    continue  # an output independent of the (per-element) leaves adds nothing
                pairs.append((out, self._physical_cotangent(cot, out, rows)))
            physical_leaves = [self.tracked(x) for x in leaves]
        grads = self._backward(pairs, physical_leaves, create_graph=create_graph, retain_graph=retain_graph)
        with functx_code():
            results = []
            for g, leaf in zip(grads, physical_leaves):
                if g is None:
                    g = torch.zeros_like(leaf)
                if type(g) is BatchedTensor and g._interp is rows:  # back to rows over this level
                    results.append(BatchedTensor(wrap_chain(self.vmap_levels, g._value.movedim(1, 0)), rows))
                else:
                    results.append(wrap_chain(self.vmap_levels, g))
            return results

    def user_autograd_grad(self, outputs, inputs, grad_outputs, **options):
        """`torch.autograd.grad` called by the function on these levels' tensors (routed
        here by vmap's TorchFunctionMode, see vmap/autograd_calls.py)."""
        with functx_code():
            pairs = []
            for out, g in zip(outputs, grad_outputs):
                physical = self.tracked(out)
                if g is None:
                    if out.numel() != 1:
                        raise RuntimeError("grad can be implicitly created only for scalar outputs")
                    g = torch.ones((), dtype=out.dtype, device=out.device)
                pairs.append((physical, self._physical_cotangent(g, physical, None)))
            # An unbatched input that autograd tracks makes the wrappers record too (the
            # outputs' wrappers then require grad and the call is not routed here), so a
            # plain input here does not reach the outputs physically.
            physical_inputs = [self.tracked(x) for x in inputs]
        grads = self._backward(pairs, physical_inputs, **options)
        with functx_code():
            return tuple(None if g is None else wrap_chain(self.vmap_levels, g) for g in grads)

    def _backward(self, pairs, physical_inputs, **options):
        if not pairs:
            return [None] * len(physical_inputs)
        was_in_backward, self.in_backward = self.in_backward, True  # `detach` inside f holds here
        try:
            return torch.autograd.grad(
                [o for o, _ in pairs], physical_inputs, [c for _, c in pairs], **{"allow_unused": True, **options}
            )
        finally:
            self.in_backward = was_in_backward

    def _physical_cotangent(self, cot, out, rows):
        """`cot` for the physical output `out`; with `rows`, batched at rows, rows' batch
        dim first and this level's second."""
        if rows is None:
            if self.tracked(cot).shape == out.shape:
                return self.tracked(cot)
            return batched_everywhere(self.vmap_levels, cot).expand(out.shape)  # expanded where not batched
        (vmap_level,) = self.vmap_levels
        value = cot._value if type(cot) is BatchedTensor and cot._interp is rows else cot.expand(rows.batch_size, *cot.shape)
        if type(value) is BatchedTensor and value._interp is vmap_level:
            value = value._value.movedim(0, 1)
        else:
            value = value.unsqueeze(1).expand(value.shape[0], *out.shape)
        return BatchedTensor(value, rows)

    def _detached(self, x):
        # not `x.detach()`: while this level is open, vmap's detach rule stops only its gradient
        if type(x) is BatchedTensor and x._interp in self.vmap_levels:
            return BatchedTensor(self._detached(x._value), x._interp)
        return super()._detached(x)

    def stops_gradient_at(self, vmap_level) -> bool:
        """Whether `vmap_level`'s detach rule must ask `stop_gradient` (the innermost
        values are under the first level; the others pass `detach` down to it)."""
        return vmap_level is self.vmap_levels[0]

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



class PhysicalJvpLevel(Interpreter):
    """A `jvp` right inside vmap levels over plain tensors, run by torch's forward AD on
    the physical tensors: the same argument as for grad (each element's tangent is the
    tangent of the physical computation), and the function's ops make one Python dispatch
    each, with torch's forward formulas in C++. Primals get every level's batch dim as a
    copy, not an expand: each element's tangent needs its own memory under the primal.
    `detach()` inside drops this level's tangent only (an outer grad still sees through).
    A jvp or grad nested inside wraps as usual."""

    kind = "jvp (forward AD under vmap)"
    __slots__ = ("vmap_levels", "_outer")

    def __init__(self, vmap_levels):
        super().__init__()
        self.vmap_levels = tuple(vmap_levels)
        self._outer = ()

    def pushed(self):
        # The vmap levels' detach rules ask their physical jvp level.
        self._outer = _install(self.vmap_levels, "physical_jvp", self)

    def popped(self):
        _restore(self.vmap_levels, "physical_jvp", self._outer)

    def dual(self, primal, tangent):
        """The function's input for `primal` with `tangent` (this level's tensors)."""
        levels = self.vmap_levels
        physical = batched_everywhere(levels, primal)
        if any(stride == 0 for stride in physical.stride()[: len(levels)]):
            physical = physical.clone()  # an expanded batch dim: give each element its memory
        return wrap_chain(levels, torch._make_dual(physical, batched_everywhere(levels, tangent), level=fwAD._current_level))

    def unpack(self, x):
        """`(primal, tangent or None)` of a result, without this level's tangents."""
        physical = peel(self.vmap_levels, x)
        if not isinstance(physical, torch.Tensor):
            return x, None
        primal, tangent = fwAD.unpack_dual(physical)
        return (
            rewrap_like(x, self.vmap_levels, primal),
            None if tangent is None else rewrap_like(x, self.vmap_levels, tangent),
        )

    def stops_tangent_at(self, vmap_level) -> bool:
        return vmap_level is self.vmap_levels[0]

    def drop_tangent(self, physical):
        """`physical.detach()` as this level sees it: no tangent, the reverse graph kept."""
        return torch.ops.aten._fw_primal.default(physical, fwAD._current_level)

    def process(self, op, args, kwargs):  # pragma: no cover - no tensor carries this level
        raise AssertionError("a physical jvp level has no tensors of its own")


def _install(vmap_levels, slot: str, level):
    """Point `slot` of every vmap level at `level`; return what was there."""
    previous = tuple(getattr(v, slot) for v in vmap_levels)
    for v in vmap_levels:
        setattr(v, slot, level)
    return previous


def _restore(vmap_levels, slot: str, previous):
    for v, value in zip(vmap_levels, previous):
        setattr(v, slot, value)


# -- between vmap levels' wrappers and the physical tensors under them ----------------------
def vmap_levels_over_plain(stack, tensors):
    """The vmap levels on top of `stack` (innermost last) when everything under them is
    plain: below them only outermost plain grad levels, and `tensors` real tensors over
    plain values. None otherwise."""
    vmap_levels = []
    for level in reversed(stack):
        if type(level) is not VmapInterpreter:
            break
        vmap_levels.append(level)
    if not vmap_levels or any(type(level) is not PlainGradLevel for level in stack[: len(stack) - len(vmap_levels)]):
        return None
    vmap_levels.reverse()
    for x in optree.tree_leaves(tensors):
        if isinstance(x, torch.Tensor):
            x = peel(vmap_levels, x)
            if isinstance(x, LevelTensor) or x.is_complex():
                return None
    return vmap_levels


def peel(vmap_levels, x):
    """The tensor under `x`'s wrappers of `vmap_levels`."""
    while type(x) is BatchedTensor and x._interp in vmap_levels:
        x = x._value
    return x


def batched_everywhere(vmap_levels, x):
    """The plain tensor of `x` batched at every level (batch dims outermost level first):
    a level where `x` is not batched gets its batch dim by an expand, made through the
    levels below so it is a view of what they hold."""
    for level in reversed(vmap_levels):
        if type(x) is BatchedTensor and x._interp is level:
            x = x._value
        else:
            x = x.expand(level.batch_size, *x.shape)
    return x


def wrap_chain(vmap_levels, physical):
    """`physical` (batched at every level) as the innermost level's tensor."""
    for level in vmap_levels:
        physical = BatchedTensor(physical, level)
    return physical


def rewrap_like(like, vmap_levels, physical):
    """`physical` under the same chain of `vmap_levels`' wrappers as `like` has."""
    chain = []
    while type(like) is BatchedTensor and like._interp in vmap_levels:
        chain.append(like._interp)
        like = like._value
    for level in reversed(chain):
        physical = BatchedTensor(physical, level)
    return physical
