"""The AD level protocol: what every `grad`/`vjp` (reverse) and `jvp` (forward) level does.

An AD level is an interpreter on functx's stack. There are two strategies, each in both
modes, and one function (`choose.py`) picks the strategy for a transform call:

| strategy | reverse (grad, vjp, jacrev) | forward (jvp, jacfwd) |
|---|---|---|
| **wrapped**: the level owns wrapper tensors | `wrapped_reverse.WrappedGradLevel`: `GradTensor`s that torch's autograd records | `wrapped_forward.WrappedJvpLevel`: `DualTensor`s holding primal and tangent |
| **direct**: the level owns nothing | `direct_reverse.DirectGradLevel`: autograd records the values under the k >= 0 vmap levels below it | `direct_forward.DirectJvpLevel`: torch's forward AD on the values under the k >= 1 vmap levels below it, or (k = 0) on the values themselves |

Every AD level answers the same calls, made by the transforms (reverse.py, forward.py):

- `enter`: the tensor standing for a differentiated input (reverse: `leaf(x)`; forward:
  `dual(primal, tangent)`);
- `seal(outputs, inputs)`: after the function ran (reverse: does its graph reach tensors
  tracked outside the transform?);
- pull back / unpack: reverse `gradient(output, inputs)` and `vjp(outputs, inputs,
  cotangents, ...)`; forward `unpack(x) -> (primal, tangent or None)`;
- `depends(output)`: does an output depend on the differentiated inputs?
- `export(tree)`: results as they leave the level;
- stop-gradient: a user's `.detach()` stops the derivative at every level (torch.func's and
  JAX's `stop_gradient`): every level passes it down (direct levels have no tensors of
  their own: plain `detach` already cuts them). torch's autograd also detaches saved
  outputs of the tensors it records (`shallow_copy_and_detach`): that must cut only the
  recorded level's graph, or `grad(grad(exp))` is 0. Both arrive as `aten.detach`; they
  differ in how: a user's call comes down through the dispatcher, which has
  excluded `ADInplaceOrView` by then, autograd's comes straight from C++ with it
  included (`is_user_detach`). Wrapped levels answer the latter with `cut(x)`.
"""

from __future__ import annotations

import contextlib
import threading

import optree
import torch

from ..core.interpreter import Interpreter, current_stack
from ..core.level_tensor import LevelTensor, is_user_detach, refresh_views
from .lifting import FactoryLifting, mark_made_at

_no_context = contextlib.nullcontext()
aten = torch.ops.aten
_META = torch.device("meta")


class ADLevel(Interpreter):
    """Base of the four AD levels (see the module docstring). `prev_grad_mode` is the grad
    mode outside the transform: an outer `torch.no_grad()` is ignored at this level but
    still holds for the levels below it (functorch's rule), an inner one is obeyed.
    `under_forward`: a forward-mode level lies below (forward over reverse, an HVP): this
    level's backward then always records (create_graph), grad mode or not, because some of
    torch's backward formulas take a shortcut without grad mode that carries no tangent
    (linalg.solve and det reuse the forward's LU): jvp(vjp(solve)) was wrong. `under_ad`:
    any AD level lies below (an outer functx transform will differentiate this one's
    results: MAML's meta-gradient)."""

    __slots__ = ("prev_grad_mode", "under_forward", "under_ad")

    def __init__(self):
        super().__init__()
        self.prev_grad_mode = torch.is_grad_enabled()
        below = [level for level in current_stack() if isinstance(level, ADLevel)]
        self.under_forward = any(level.forward_mode for level in below)
        self.under_ad = bool(below)
        self.refresh()

    # Results leave as values one level down; what they carry belongs to lower levels.
    reaches_outside = True
    forward_mode = False  # jvp levels: True

    def seal(self, outputs, inputs) -> None:
        """After the function ran (nothing to do by default)."""

    def is_own_leaf(self, x) -> bool:
        """Whether `x` is one of the inputs this level differentiates, as the function got it
        (a direct grad level's leaves; see direct_reverse.py)."""
        return False

    def own(self, x: torch.Tensor) -> torch.Tensor:
        """A tensor argument of the function that this level does not differentiate, as the
        function sees it: the function's own, so that writing a differentiated value into it
        (`y.copy_(x)` with argnums=0) is a valid program, as in torch.func (which wraps
        every argument at the level). A direct level has no wrappers: the tensor is marked
        made inside for the captured-write check (lifting.CapturedWrites), and torch records
        the write as plain torch does. A view's base is marked too: the check looks at the
        base, and under a jvp on values every input is a view (a dual of its primal)."""
        mark_made_at(x, self.level)
        if x._base is not None:
            mark_made_at(x._base, self.level)
        return x

    def export(self, tree):
        """Results as they leave the level: this level's tensors replaced by their values."""
        return unwrap_level(tree, self)


class WrappedLevel(ADLevel):
    """An AD level that owns wrapper tensors (wrapped_reverse.py, wrapped_forward.py): while
    its function runs, the tensors made there are its own (lifting.py)."""

    __slots__ = ("_lifting",)
    # torch function -> rule(level, args, kwargs), tried before the function runs (and
    # decomposes into ATen ops); a rule returns NotImplemented for arguments it does not take
    torch_function_rules: dict = {}

    def pushed(self):
        self._lifting = FactoryLifting(self)
        self._lifting.__enter__()

    def popped(self):
        self._lifting.__exit__(None, None, None)

    def lift(self, value: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        """A tensor made inside the function: a constant of this level."""
        raise NotImplementedError

    def own(self, x: torch.Tensor) -> torch.Tensor:
        """A non-differentiated argument (see ADLevel.own): a constant of this level, so a
        write into it is recorded on its wrapper, and the caller's tensor gets the value."""
        return self.lift(x)


def outside_inference_mode():
    """Inference mode off for the block, if it is on: it switches autograd's recording
    (reverse and forward) off for every tensor whatever the grad mode, so under
    `torch.inference_mode()` the AD transforms would silently return zeros."""
    return torch.inference_mode(False) if torch.is_inference_mode_enabled() else _no_context


@contextlib.contextmanager
def recording():
    """What a reverse level needs around the function and its backward: grad mode on, and
    inference mode off."""
    with torch.enable_grad(), outside_inference_mode():
        yield


# torch has one forward-AD level for the whole process, and leaving it is what clears every
# tangent (also those saved in the graphs of reverse levels around a jvp, which the backward
# would otherwise unpack). So forward sections run one thread at a time: a thread holds this
# lock from its outermost functx forward transform until the level is left, as a serial run
# would. Shared, the level was left by whichever thread finished last, and the other
# thread's backward met "a forward AD level with an invalid index", or a stale tangent.
_forward_ad_owner = threading.RLock()
_dual_users = 0  # functx forward transforms inside the dual level they (or the user) entered
_dual_entered_by_functx = False


@contextlib.contextmanager
def dual_level():
    """Be inside torch's (single, process-wide) forward-AD level. The outermost functx
    forward transform enters it and leaves it, which clears every tangent; a dual level the
    user entered is reused and left alone. One thread at a time (`_forward_ad_owner`)."""
    global _dual_users, _dual_entered_by_functx
    with _forward_ad_owner:
        if _dual_users == 0:
            _dual_entered_by_functx = torch.autograd.forward_ad._current_level < 0
            if _dual_entered_by_functx:
                torch.autograd.forward_ad.enter_dual_level()
        _dual_users += 1
        try:
            yield
        finally:
            _dual_users -= 1
            if _dual_users == 0 and _dual_entered_by_functx:
                torch.autograd.forward_ad.exit_dual_level()


def unwrap_level(tree, interp):
    """Replace `interp`'s tensors in a pytree by their values (what leaves the level), and
    strip wrappers of finished levels."""

    if interp.lifted_bases is not None:
        refresh_views(interp, optree.tree_leaves(tree))

    def leaf(x):
        while isinstance(x, LevelTensor) and (x._interp is interp or not x._interp.alive):
            x = x._interp.unwrap_dead(x) if x._interp is not interp else x._value
        return x

    return optree.tree_map(leaf, tree)


def autograd_grad(outputs, inputs, grad_outputs=None, *, create_graph=True, retain_graph=None):
    """`torch.autograd.grad` with torch.func's conventions: outputs that do not require grad
    contribute nothing, inputs that do not reach an output get zeros."""
    if grad_outputs is None:
        grad_outputs = [None] * len(outputs)
    pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad]
    if not pairs:
        return tuple(torch.zeros_like(x) for x in inputs)
    outs, gouts = zip(*pairs)
    grads = torch.autograd.grad(
        outs, inputs, gouts, create_graph=create_graph, retain_graph=retain_graph, allow_unused=True
    )
    return tuple(torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs))


# -- ops a wrapped level answers itself, about its own wrappers (None: go down) -----------------
# torch's autograd (reverse and forward) manages its metadata with these: an alias to attach
# a tangent to or take it from, layout checks before it attaches one, `.to("meta")` for
# the shapes of ZeroTensor arithmetic. They are about this level's wrappers, which mirror
# their values' sizes, strides and offsets, so nothing below is involved.
def _alias(level, args, kwargs):
    x = args[0]
    if isinstance(x, LevelTensor) and x._interp is level:
        return level.cut(x)
    return NotImplemented


def _detach(level, args, kwargs):
    return NotImplemented if is_user_detach() else _alias(level, args, kwargs)


def _same_size(level, args, kwargs):
    return args[0].shape == args[1].shape


def _same_storage_numel(level, args, kwargs):
    a, b = args
    return a.untyped_storage().nbytes() // a.element_size() == b.untyped_storage().nbytes() // b.element_size()


def _to_meta(level, args, kwargs):
    if kwargs.get("device") != _META:
        return NotImplemented
    x = args[0]
    return torch.empty_strided(x.shape, x.stride(), dtype=kwargs.get("dtype") or x.dtype, device=_META)


AT_THIS_LEVEL = {
    aten.detach.default: _detach,
    aten._make_dual.default: _alias,
    aten._fw_primal.default: _alias,
    # torch's `_fw_primal` makes its alias with `aten.alias` (and a user's alias is one too): a
    # new wrapper of the same value is an alias at this level, and leaves the levels below
    # alone (an alias there would make the value a view whose in-place writes torch's
    # CopySlices cannot run backward: an internal assert in hessian(jvp(f)) with `w.sin_()`)
    aten.alias.default: _alias,
    aten.is_same_size.default: _same_size,
    aten._has_same_storage_numel.default: _same_storage_numel,
    aten.to.dtype_layout: _to_meta,
}
"""op -> handler(level, args, kwargs) returning the result, or NotImplemented to run the op one
level down (core/rules.answered_first)."""


_backward = threading.local()


@contextlib.contextmanager
def differentiating_the_backward():
    """While the forward runs of a call whose backward is differentiated with one AD level
    (linearize, the double-VJP identity: the VJP of a VJP): `backward_differentiated()` is
    true there, as where two AD levels are live (ad/aten_reverse_rules.py asks)."""
    _backward.depth = getattr(_backward, "depth", 0) + 1
    try:
        yield
    finally:
        _backward.depth -= 1


def backward_differentiated() -> bool:
    """Whether a backward that autograd records now may be differentiated: two AD levels are
    live, or a one-level call differentiates its own backward (`differentiating_the_backward`)."""
    return getattr(_backward, "depth", 0) > 0 or sum(isinstance(level, ADLevel) for level in current_stack()) >= 2

