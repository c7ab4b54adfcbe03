"""Reverse mode, direct strategy: the level owns no tensors; torch's autograd records the
values under the k >= 0 vmap levels below it.

k = 0, the outermost grad level. When a `grad`/`vjp` starts with no functx transform active
(the gradient of a loss in a training loop, the outer gradient of MAML, jacrev/hessian),
nothing below it needs telling apart from it, so it need not wrap anything: its
differentiated inputs are fresh leaves and torch's autograd records on the plain tensors
directly, in C++. Levels opened inside wrap those tensors as usual.

k >= 1, right inside vmap (per-sample gradients `vmap(grad(loss))`, per-sample Jacobians
`vmap(jacrev(f))`, MAML's inner steps). Under vmap the batch elements cannot interact, so
the gradient of each element's output with respect to that element's inputs is the gradient
of the *sum* of the outputs with respect to the physical (batch-first) inputs, and torch's
autograd computes it on the physical tensors: the forward goes through vmap's rules once,
the backward never reaches Python. An unbatched differentiated input is given the batch dim
(an `expand`, no copy) before it becomes a leaf, so its gradient comes out per element. Each
tensor of the function is then a chain of BatchedTensors, one per vmap level where it is
batched, over a plain tensor (vmap/chain.py).

What wrappers would give for free is kept by hand:
- results leave detached (no `requires_grad`, no graph to the internal leaves) unless the
  function reached tensors that torch autograd tracks outside the transform (a parameter
  that requires grad, an outer level's leaf): then the gradient is built with
  `create_graph=True`, so the outside differentiates through it (a gradient penalty, MAML).
  Found by walking the function's graph once (`seal`);
- an outer `torch.no_grad()` around the transform holds for those outside tensors;
- a user's `detach()` is plain `detach` of the values: it cuts this level and every level
  below, as torch.func's does;
- an in-place write of a differentiated value into a tensor from outside the function
  (`captured.copy_(x)`, `captured[0:2] = x`) is refused while the function runs
  (lifting.CapturedWrites), as wrapped levels and torch.func refuse it: recorded on the
  values, it would leave the caller's tensor holding this level's graph.

    >>> import torch
    >>> from functx.core.interpreter import interpreting
    >>> with interpreting(DirectGradLevel(())) as level, torch.enable_grad():
    ...     x = level.leaf(torch.tensor(2.0))
    ...     y = x ** 3
    ...     level.seal([y], [x])
    ...     (dy,) = level.gradient(y, [x])
    >>> dy.item(), dy.requires_grad
    (12.0, False)
"""

from __future__ import annotations

import optree
import torch

from ..core.interpreter import current_stack, functx_code
from ..core.level_tensor import LevelTensor
from ..vmap.batched_tensor import UNDER_DIRECT_GRAD, BatchedTensor
from ..vmap.interpreter import VmapInterpreter
from ..vmap.chain import batched_copy, batched_everywhere, is_batched_everywhere, peel, wrap_chain
from .level import ADLevel, autograd_grad, unwrap_level
from .lifting import CapturedWrites

_make_dual = torch._make_dual
_unpack_dual = torch._VF._unpack_dual
_DUAL_LEVEL = 0
_ACCUMULATE_GRAD = torch._C._functions.AccumulateGrad  # the node of an autograd leaf


def install_direct_level(vmap_levels, level):
    """Point the `direct_ad` slot of `vmap_levels` at `level`; return what was there."""
    previous = tuple(v.direct_ad for v in vmap_levels)
    for v in vmap_levels:
        v.ride(direct_ad=level)
    return previous


def restore_direct_level(vmap_levels, previous):
    for v, value in zip(vmap_levels, previous):
        v.ride(direct_ad=value)


def install_above(level):
    """Mark the vmap levels under a direct level on values (no vmap levels of its own) as
    having AD above them: torch records on their BatchedTensors, so their rules run below
    autograd (vmap/interpreter.py `ad_above`). Returns what was there."""
    below = [v for v in current_stack() if type(v) is VmapInterpreter]
    previous = [(v, v.ad_above) for v in below]
    for v in below:
        v.ride(ad_above=True)
    return previous


def restore_above(previous):
    for v, flag in previous:
        v.ride(ad_above=flag)


# the key in an autograd node's metadata naming the direct grad level whose leaf for an
# unbatched input (batched by expansion for per-element gradients) the node makes
EXPANDED_LEAF_OF = "functx_expanded_leaf_of"

class DirectGradLevel(ADLevel):
    """A grad level run by plain autograd on the tensors under `vmap_levels` (the vmap levels
    on top of the stack when it opened, innermost last; empty for the outermost level)."""

    __slots__ = (
        "vmap_levels", "reaches_outside", "lifts_buffers", "over_values", "connected", "_outer",
        "_writes", "_own_nodes", "_leaf_bases",
    )
    forward_mode = False
    # what this level changes about vmap's rules while it rides on vmap levels (VmapInterpreter.refresh)
    vmap_overrides = UNDER_DIRECT_GRAD

    def __init__(self, vmap_levels=(), over_values=False):
        super().__init__()
        self.vmap_levels = tuple(vmap_levels)
        self.reaches_outside = False
        # Set when an input not batched at every vmap level got its batch dims here (`leaf`):
        # then the function's own buffers are batched too (`lift_buffer`).
        self.lifts_buffers = False
        # Opened right over other direct levels on values (choose.py): a grad of a grad, or
        # inside a jvp on values, whose forward-AD tangents its leaves and results keep.
        self.over_values = over_values
        # Set when a leaf stays connected to a graph tracked outside (`leaf`): the gradient
        # will most likely be built with create_graph=True (MAML's inner steps), and the
        # vmap rules keep to ops whose double backward torch runs in C++ (rules/linalg.py).
        self.connected = False
        self._outer = ()
        # While the function runs: the mode refusing writes into captured tensors, and the
        # graph nodes of the leaves that stay connected to an outside graph (`differentiates`)
        self._writes = None
        self._own_nodes = set()
        self._leaf_bases = []  # the tensors those leaves view (`is_own_leaf`)

    def pushed(self):
        if self.over_values:
            self._outer = install_above(self)
        else:
            # vmap's `requires_grad` and its routing of torch.autograd.grad ask this level
            self._outer = install_direct_level(self.vmap_levels, self)
        self._writes = CapturedWrites(self, "grad")
        self._writes.__enter__()

    def popped(self):
        self._stop_checking_writes()  # the function raised before `seal`
        if self.over_values:
            restore_above(self._outer)
            return
        restore_direct_level(self.vmap_levels, self._outer)

    def _stop_checking_writes(self):
        if self._writes is not None:
            self._writes.__exit__(None, None, None)
            self._writes = None
        self._own_nodes = set()  # no longer needed: do not keep an outside graph alive
        self._leaf_bases = []

    def recorded(self, x):
        """The tensor under `x` that torch's autograd records this level on: under the
        wrappers of levels opened inside this one and of its own vmap levels (the vmap levels
        under a level on values have autograd above them: it records their BatchedTensors)."""
        return recorded_at(self, self.vmap_levels, x)

    def is_own_leaf(self, x) -> bool:
        """Whether `x` is one of this level's leaves itself (not a view of one, nor a value
        computed from one): a detached copy it made, or the view that keeps an input the
        caller tracks connected (its node is the level's own)."""
        t = self.recorded(x)
        if not isinstance(t, torch.Tensor) or not t.requires_grad:
            return False
        if t.grad_fn is None:
            return getattr(t, "_functx_leaf_of", None) is self
        own = self._own_nodes
        if t.grad_fn in own:
            return True
        # a view of a connected leaf (`v[0]`): a view of the same base whose chain of first
        # inputs reaches the leaf's node (torch refuses views of leaves too)
        base = t._base
        if base is None or not any(base is b for b in self._leaf_bases):
            return False
        node = t.grad_fn
        for _ in range(16):
            functions = node.next_functions
            if not functions or functions[0][0] is None:
                return False
            node = functions[0][0]
            if node in own:
                return True
        return False

    def differentiates(self, x) -> bool:
        """Whether `x` (any tensor of the function) depends on this level's differentiated
        inputs: autograd's graph of the plain tensor under its wrappers reaches one of this
        level's leaves. (A tensor tracked only by an outside graph, a parameter closed over,
        does not.) Asked for the in-place writes into tensors from outside the function."""
        t = self.recorded(x)
        if not (isinstance(t, torch.Tensor) and t.requires_grad):
            return False
        if t.grad_fn is None:
            return getattr(t, "_functx_leaf_of", None) is self
        own, seen, stack = self._own_nodes, set(), [t.grad_fn]
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            if node in own:
                return True
            variable = getattr(node, "variable", None)
            if variable is not None:  # AccumulateGrad: a leaf
                if getattr(variable, "_functx_leaf_of", None) is self:
                    return True
                continue
            stack.extend(child for child, _ in node.next_functions if child is not None)
        return False

    def tracked(self, x):
        """The tensor autograd tracks for `x`: the plain tensor under its wrappers of these levels."""
        return peel(self.vmap_levels, x)

    # -- the AD level protocol (level.py) ------------------------------------------------------
    def leaf(self, x: torch.Tensor) -> torch.Tensor:
        """A tensor standing for input `x` that this level differentiates with respect to:
        batched at every level (so an unbatched input's gradient comes out per element)."""
        physical = batched_everywhere(self.vmap_levels, x)
        expanded = self.vmap_levels and not is_batched_everywhere(self.vmap_levels, x)
        if expanded:
            self.lifts_buffers = True
        if self.over_values:
            primal, tangent = _unpack_dual(x, _DUAL_LEVEL)
            if tangent is not None:  # a jvp on values below: the leaf keeps the tangent
                if x.requires_grad and self.prev_grad_mode:
                    leaf = x.view_as(x)  # a view keeps both the outside graph and the tangent
                    self._own_nodes.add(leaf.grad_fn)
                    self._leaf_bases.append(leaf._base)
                    return leaf
                leaf = primal.detach().requires_grad_()
                leaf._functx_leaf_of = self
                return _make_dual(leaf, tangent, level=_DUAL_LEVEL)
        if physical.requires_grad and self.prev_grad_mode:
            self.connected = True
            leaf = physical.view_as(physical)  # stays connected to the outside graph
            self._own_nodes.add(leaf.grad_fn)
            self._leaf_bases.append(leaf._base)
            if expanded:  # the same value per element, up to here (vmap's unwrap_dead)
                leaf.grad_fn.metadata[EXPANDED_LEAF_OF] = self
        else:
            # a tensor made under torch.inference_mode() cannot require grad: differentiate a copy
            leaf = (physical.clone() if physical.is_inference() else physical.detach()).requires_grad_()
            leaf._functx_leaf_of = self  # "outside" for the levels inside this one, while it lives
        return wrap_chain(self.vmap_levels, leaf)

    def lift_buffer(self, x):
        """A tensor the function made (`torch.zeros(3)`), batched at every vmap level as a
        copy. An input this level batched for its per-element gradients (an unbatched
        parameter) is batched in user code, so writing it into the function's own buffer
        (`h[0] = p`, `buf.copy_(p)`) needs a batched buffer: torch.func's grad level wraps
        the buffer and keeps it unbatched, this level records on physical tensors, where
        the buffer must hold each element's copy for each element's derivative. Called by
        the innermost vmap level's torch function mode (vmap/randomness.py) for plain
        floating-point factory results, only while `lifts_buffers`."""
        return batched_copy(self.vmap_levels, x)

    def seal(self, outputs, leaves) -> None:
        """After the function ran: does its graph reach tensors tracked outside?"""
        self._stop_checking_writes()
        tracked = self.tracked
        self.reaches_outside = self.prev_grad_mode and _reaches_outside(
            [tracked(o) for o in outputs], [tracked(x) for x in leaves], self
        )

    def gradient(self, output, leaves):
        """d output / d leaves, per batch element (output: this level's scalar)."""
        create_graph = self.reaches_outside or self.under_forward  # (level.py: ADLevel)
        if not self.vmap_levels:
            return autograd_grad([output], leaves, create_graph=create_graph)
        with functx_code():
            one = torch.ones((), dtype=output.dtype, device=output.device)
        return self.vjp([output], leaves, [one], create_graph=create_graph, retain_graph=None)

    def vjp(self, outputs, leaves, cotangents, *, create_graph, retain_graph):
        """Cotangents of `leaves`, per batch element. Besides `gradient`, only `vjp` (k = 0)
        and jacrev (k = 1) call it; jacrev in two ways: with one cotangent row (these levels'
        tensors or plain ones), or under a vmap `rows` opened right on top over a batch of
        rows. Then the backward runs on the physical tensors with the cotangents batched at
        `rows`: the engine's derivative formulas go through `rows`' batching rules once per op
        and meet plain saved tensors, whose shapes (the batch dim first) are what `rows`
        sees as logical."""
        if not self.vmap_levels:
            return autograd_grad(outputs, leaves, cotangents, create_graph=create_graph, retain_graph=retain_graph)
        with functx_code():
            rows = None
            for c in cotangents:
                if isinstance(c, LevelTensor) and c._interp not in self.vmap_levels:
                    rows = c._interp
            if rows is not None:
                assert len(self.vmap_levels) == 1 and type(rows) is VmapInterpreter, "only as jacrev calls it"
            pairs = []
            for out, cot in zip(outputs, cotangents):
                if not self.depends(out):
                    continue  # an output independent of the (per-element) leaves adds nothing
                out = self.tracked(out)
                pairs.append((out, self._physical_cotangent(cot, out, rows)))
            physical_leaves = [self.tracked(x) for x in leaves]
        if pairs:
            grads = torch.autograd.grad(
                [o for o, _ in pairs], physical_leaves, [c for _, c in pairs],
                create_graph=create_graph, retain_graph=retain_graph, allow_unused=True,
            )
        else:
            grads = [None] * len(physical_leaves)
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

    def depends(self, output) -> bool:
        """Whether `output` may depend on this level's differentiated inputs. Its tensor may
        require grad for an outer level alone (a tensor an outermost grad level tracks, closed
        over by the function): below vmap levels, only a tensor batched at every one of them
        can depend on the leaves, which are; one that is not has no batch dim of this level's
        physical tensors to take a per-element cotangent for."""
        if not is_batched_everywhere(self.vmap_levels, output):
            return False
        return self.tracked(output).requires_grad

    def export(self, tree):
        """Results as they leave the level (detached unless they must stay connected)."""
        tree = unwrap_level(tree, self)  # dead levels opened inside may have left wrappers
        if self.reaches_outside:
            return tree
        return optree.tree_map(self._detached, tree)

    def _detached(self, x):
        if type(x) is BatchedTensor and x._interp in self.vmap_levels:
            return BatchedTensor(self._detached(x._value), x._interp)
        if not (isinstance(x, torch.Tensor) and x.requires_grad):
            return x
        if self.over_values:
            tangent = _unpack_dual(x, _DUAL_LEVEL)[1]
            if tangent is not None:  # a jvp on values below differentiates it: keep its tangent
                # (detached too: the backward recorded for the tangents, `under_forward`, is
                # this level's own graph)
                return _make_dual(x.detach(), tangent.detach(), level=_DUAL_LEVEL)
        return x.detach()

    def process(self, op, args, kwargs):  # pragma: no cover - no tensor carries this level
        raise AssertionError("a direct grad level has no tensors of its own")


def recorded_at(level, vmap_levels, x):
    """The tensor under `x` that a direct level records on (see `DirectGradLevel.recorded`)."""
    while isinstance(x, LevelTensor) and (x._interp.level > level.level or x._interp in vmap_levels):
        x = x._value
    return x


def _is_outside(leaf, own, level=None) -> bool:
    """Whether autograd leaf `leaf` is tracked outside `level`, whose leaves are `own` (ids):
    a user's tensor, or a live level's internal leaf; not the leaves of a finished level
    (a `vjp_fn` used inside a later `grad`), nor `level`'s own (under a forward-AD tangent:
    `DirectGradLevel.leaf`)."""
    if id(leaf) in own:
        return False
    owner = getattr(leaf, "_functx_leaf_of", None)
    return owner is None or (owner.alive and owner is not level)


def _reaches_outside(outputs, leaves, level=None) -> bool:
    """Whether the autograd graph of `outputs` reaches a leaf tracked outside (`_is_outside`)."""
    own = {id(x) for x in leaves}
    stack = [o.grad_fn for o in outputs if isinstance(o, torch.Tensor) and o.grad_fn is not None]
    for o in outputs:
        if isinstance(o, torch.Tensor) and o.requires_grad and o.grad_fn is None and _is_outside(o, own, level):
            return True
    seen = set()
    push, pop, see = stack.append, stack.pop, seen.add
    while stack:
        node = pop()
        if node in seen:
            continue
        see(node)
        ends = True
        for child, _ in node.next_functions:
            if child is None:
                continue
            ends = False
            if type(child) is _ACCUMULATE_GRAD:  # a leaf
                if _is_outside(child.variable, own, level):
                    return True
            elif child not in seen:
                push(child)
        if ends:
            # A root that is not a leaf's accumulator: a graph made outside and cut from
            # ours (AOTAutograd's traced inputs hang under such nodes, torch.compile).
            return True
    return False


def without_own_graph(x):
    """A plain result whose autograd graph was recorded only for the forward-mode tangents
    riding on it (`ADLevel.under_forward`): detached, its tangent kept (detached too).
    Under vmap levels with no AD level of their own (a vjp_fn called inside vmap: jacrev,
    `vmap(vjp_fn)`) the plain tensor under the wrappers, rewrapped; other wrappers are left
    as they are (detaching one would stop every level)."""
    if type(x) is BatchedTensor and x._interp.direct_ad is None:
        inner = without_own_graph(x._value)
        return x if inner is x._value else BatchedTensor(inner, x._interp)
    if type(x) is not torch.Tensor or not x.requires_grad:
        return x
    tangent = _unpack_dual(x, _DUAL_LEVEL)[1]
    return x.detach() if tangent is None else _make_dual(x.detach(), tangent.detach(), level=_DUAL_LEVEL)


def is_differentiated(x) -> bool:
    """Whether some autograd (plain or a functx grad level) tracks `x`."""
    while isinstance(x, torch.Tensor):
        if x.requires_grad:
            return True
        if not isinstance(x, LevelTensor):
            return False
        x = x._value
    return False
