"""Reverse mode's level: `GradTensor` and `GradInterpreter`.

functx reuses torch's autograd engine once per grad level (design A in DESIGN.md): a
GradTensor is a wrapper that torch autograd records, and the interpreter runs each op on
the values one level down. Derivative formulas then run on GradTensors and re-dispatch
through the lower levels, so every torch derivative, `autograd.Function.backward` and
`torch.library` autograd registration works at every level and composes.

Two traps, both handled in `process`:
- autograd is switched off inside `__torch_dispatch__`; the op one level down runs with it
  restored (`_RestorePythonTLSSnapshot`) so lower grad levels record their own graphs;
- autograd detaches saved outputs through `aten.detach`: at a grad level that must cut
  only this level's graph (a new wrapper of the same value), or `grad(grad(exp))` is 0.
"""

from __future__ import annotations

import contextlib

import optree
import torch

from ..core.interpreter import Interpreter
from ..core.level_tensor import LevelTensor, mutated_argument, replay_inplace_view
from ..vmap.batched_tensor import wrapper_requires_grad

_restore_autograd = torch._C._RestorePythonTLSSnapshot
_view_as_real = torch.ops.aten.view_as_real.default
_META = torch.device("meta")
_no_context = contextlib.nullcontext()
aten = torch.ops.aten


def _new_wrapper(interp, args, kwargs):
    """`detach` cuts this level's graph only: a fresh wrapper of the same (still attached)
    value. Making a dual and taking its primal alias the wrapper: torch attaches or drops
    the tangent on the new wrapper, the values below are not involved."""
    x = args[0]
    if type(x) is GradTensor and x._interp is interp:
        return GradTensor(x._value, interp)
    return None


def _same_size(interp, args, kwargs):
    return args[0].shape == args[1].shape


def _same_storage_numel(interp, args, kwargs):
    # About this level's wrappers, which mirror their values' sizes, strides and offsets.
    a, b = args
    return a.untyped_storage().nbytes() // a.element_size() == b.untyped_storage().nbytes() // b.element_size()


def _to_meta(interp, args, kwargs):
    # torch's ZeroTensor arithmetic (the tangent of an input that has none) finds a
    # result's shape by running the op on `.to("meta")` copies: metadata only.
    if kwargs.get("device") != _META:
        return None
    x = args[0]
    return torch.empty_strided(x.shape, x.stride(), dtype=kwargs.get("dtype") or x.dtype, device=_META)


# Ops a grad/jvp level answers itself, without going down the levels (None: go down).
# Except `detach`, they are the bookkeeping torch's forward AD does on the wrappers.
_AT_THIS_LEVEL = {
    aten.detach.default: _new_wrapper,
    aten._make_dual.default: _new_wrapper,
    aten._fw_primal.default: _new_wrapper,
    aten.is_same_size.default: _same_size,
    aten._has_same_storage_numel.default: _same_storage_numel,
    aten.to.dtype_layout: _to_meta,
}


def _lands_in_vmap(values) -> bool:
    """Whether an op on `values` goes to a vmap level's rule and to nothing that records
    autograd on its own wrappers: some value is a BatchedTensor, none requires grad at its
    wrapper level, and no other level's tensor is among them."""
    batched = False
    for v in values:
        if isinstance(v, LevelTensor):
            if v._interp.kind != "vmap" or wrapper_requires_grad(v):
                return False
            batched = True
        elif type(v) is list or type(v) is tuple:
            return False
    return batched


def outside_inference_mode():
    """Inference mode off for the block, if it is on: it switches autograd's recording
    (reverse and forward) off for every tensor whatever the grad mode, so under
    `torch.inference_mode()` the AD transforms would silently return zeros."""
    return torch.inference_mode(False) if torch.is_inference_mode_enabled() else _no_context


@contextlib.contextmanager
def recording():
    """What a grad level needs around the function and its backward: grad mode on, and
    inference mode off."""
    with torch.enable_grad(), outside_inference_mode():
        yield


class GradTensor(LevelTensor):
    """A tensor inside `functx.grad` / `functx.vjp`: the value one level down, recorded by
    torch autograd at this level."""

    @staticmethod
    def __new__(cls, value: torch.Tensor, interp: "GradInterpreter", requires_grad: bool = False):
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls,
            value.shape,
            value.stride(),
            value.storage_offset(),
            dtype=value.dtype,
            device=value.device,
            layout=value.layout,
            requires_grad=requires_grad,
        )
        wrapper._value = value
        wrapper._interp = interp
        return wrapper

    def __repr__(self):
        return f"GradTensor(level={self._interp.level}, value={self._value!r}, grad_fn={self.grad_fn})"

    __str__ = __repr__


class GradInterpreter(Interpreter):
    """One `grad`/`vjp` level. `prev_grad_mode` is the grad mode outside the transform:
    an outer `torch.no_grad()` is ignored at this level but still holds for the levels
    below it (functorch's rule), an inner one is obeyed."""

    kind = "grad"
    __slots__ = ("prev_grad_mode",)

    def __init__(self):
        super().__init__()
        self.prev_grad_mode = torch.is_grad_enabled()

    def process(self, op, args, kwargs):
        here = _AT_THIS_LEVEL.get(op)
        if here is not None:
            out = here(self, args, kwargs)
            if out is not None:
                return out
        unwrap = self._unwrap
        values = [
            a._value if type(a) is GradTensor and a._interp is self
            else unwrap(a) if type(a) is list or type(a) is tuple
            else a
            for a in args
        ]
        if op is _view_as_real and values[0].is_conj():
            # The wrapper of a lazily conjugated value does not carry the conj bit itself
            # (copying it breaks second-order gradients of complex ops), so user-level
            # `resolve_conj()` never reached the value: resolve it here.
            values[0] = values[0].resolve_conj()
        kw_values = {k: unwrap(v) for k, v in kwargs.items()} if kwargs else kwargs
        # A vmap rule restores autograd for the physical values itself; restoring it here
        # too would also record the op on the BatchedTensor wrappers: a second graph nobody
        # differentiates (and its saved-tensor detaches).
        with _no_context if _lands_in_vmap(values) else _restore_autograd():
            if self.prev_grad_mode:
                out = op(*values, **kw_values)
            else:
                with torch.no_grad():
                    out = op(*values, **kw_values)
        if isinstance(out, torch.Tensor) and mutated_argument(op) is None:  # the common case
            return GradTensor(out, self)
        return self._wrap_result(op, args, out)

    def _unwrap(self, x):
        if type(x) is GradTensor and x._interp is self:
            return x._value
        if type(x) is list or type(x) is tuple:
            return type(x)(self._unwrap(e) for e in x)
        return x

    def _wrap_result(self, op, args, out):
        mutated = mutated_argument(op)
        if mutated is not None:  # in-place: the value changed under the same wrapper
            if torch.Tag.inplace_view in op.tags:
                replay_inplace_view(op, args, {})
            return args[mutated]
        if isinstance(out, torch.Tensor):
            return GradTensor(out, self)
        if type(out) is tuple or type(out) is list:
            return type(out)(
                GradTensor(o, self) if isinstance(o, torch.Tensor)
                else [GradTensor(e, self) for e in o] if type(o) is list
                else o
                for o in out
            )
        return out

    def rebox_dead(self, value):
        return GradTensor(value, self)

    def detach_dead(self, x):
        return GradTensor(x._value, self)  # cut the dead level's graph only, as in process

    def wrap(self, value, requires_grad=False):
        return GradTensor(value, self, requires_grad)

    # -- the level's side of grad/vjp (the same three as PlainGradLevel's) ---------------
    # Results leave as values one level down, where any graph they have belongs to the
    # levels below: gradients are always built with create_graph=True at this level.
    reaches_outside = True

    def leaf(self, x):
        return GradTensor(x, self, requires_grad=True)

    def seal(self, outputs, leaves):
        pass

    def gradient(self, output, leaves):
        return autograd_grad([output], leaves, create_graph=True)

    def vjp(self, outputs, leaves, cotangents, *, create_graph, retain_graph):
        return autograd_grad(outputs, leaves, cotangents, create_graph=create_graph, retain_graph=retain_graph)

    def depends(self, output) -> bool:
        """Whether `output` depends on this level's differentiated inputs."""
        return output.requires_grad

    def export(self, tree):
        return unwrap_level(tree, self)


def unwrap_level(tree, interp):
    """Replace `interp`'s tensors in a pytree by their values (what leaves the level), and
    strip wrappers of finished levels."""

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
