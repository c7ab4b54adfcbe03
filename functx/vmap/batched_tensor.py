"""`BatchedTensor` (vmap's level tensor) and the batching-rule tables (`VMAP_RULES`,
`SPECIAL_RULES`) its level, `VmapInterpreter` (vmap/interpreter.py), runs ops through.

A BatchedTensor's `_value` always holds the batch dimension at position 0; its logical
shape, the one user code sees, is `_value.shape[1:]`. Keeping the batch dim in front lets
view rules return views of `_value`, so writes through views land where they should.
"""

from __future__ import annotations

import torch

from ..core.errors import NeedsPerSampleValues
from ..core.level_tensor import LevelTensor, is_user_detach
from ..core.rules import Overrides, RuleTable
from .per_sample_check import per_sample_checked

_DETACH = torch.ops.aten.detach.default
_make_wrapper = torch.Tensor._make_wrapper_subclass
_wrapper_requires_grad = torch._C.TensorBase.__dict__["requires_grad"]  # the C++ flag itself
wrapper_requires_grad = _wrapper_requires_grad.__get__


class BatchedTensor(LevelTensor):
    """A tensor inside `functx.vmap`: one value per batch element, batch dim first."""

    @staticmethod
    def __new__(cls, value: torch.Tensor, interp):
        wrapper = _make_wrapper(
            cls, value.shape[1:], value.stride()[1:], value.storage_offset(), dtype=value.dtype, device=value.device
        )
        wrapper._value = value
        wrapper._interp = interp
        return wrapper

    def __repr__(self):
        return f"BatchedTensor(level={self._interp.level}, value={self._value!r})"

    # A conjugate view is materialized (rules/pointwise.py: kernels called from a rule would
    # ignore a lazy bit); `is_conj()` still reports what one sample's tensor would.
    _conj_view = False

    def is_conj(self):
        return self._conj_view

    def resolve_conj(self):
        return torch.ops.aten.clone.default(self) if self._conj_view else self

    @property
    def requires_grad(self):
        """Whether autograd tracks this tensor: the wrapper itself (user code called
        `requires_grad_()` inside vmap), or its physical value: inside `vmap(grad(f))` (a
        direct grad level records on the physical tensors, ad/direct_reverse.py) the inputs
        report True, as torch.func's do, and so does a slice of an input that requires grad
        from outside (what one sample's tensor would report, and `torch.autograd.grad` works
        there: vmap/autograd_calls.py; torch.func reports False, pytorch#158610). Not under
        a direct jvp level, whose physical tensors carry tangents, not a graph."""
        if wrapper_requires_grad(self):
            return True
        return self._interp.values_record_graphs and self._value.requires_grad

    @requires_grad.setter
    def requires_grad(self, flag):
        _wrapper_requires_grad.__set__(self, flag)

    __str__ = __repr__

    def tolist(self):
        raise NeedsPerSampleValues(
            "vmap: .tolist() of a batched tensor: it needs one Python value per element, but "
            "inside vmap the tensor holds one value per batch element. Return the tensor from the "
            "vmapped function and call .tolist() on the result.",
            self._interp,
            ".tolist() needs each sample's Python values",
        )


def _fallback_factory(op):
    from .fallback import loop_fallback

    return loop_fallback(op)


VMAP_RULES = RuleTable("vmap", fallback=_fallback_factory, guard=per_sample_checked)
"""The batching-rule table: `@VMAP_RULES.register(aten.op.overload)` in family files."""

WHOLE_CALL_RULES: dict = {}
"""Torch functions a vmap level takes whole before they decompose, `rule(interp, args,
kwargs)` (NotImplemented: not here), filled by vmap/rules/whole_calls.py; the level's call
handler consults them while nothing rides on the level (`VmapInterpreter.whole_calls`)."""

UNDER_DIRECT_GRAD = Overrides("vmap under a direct grad level", rider="direct_ad")
"""What a direct grad level (ad/direct_reverse.py) changes about vmap's rules while it rides
on the physical tensors (`VmapInterpreter.direct_ad`): products, embeddings and shared-weight
convolutions torch's autograd records as Functions whose backward lays each element's
gradient out like its operand, batch norm training with running statistics the level
lifted. `@UNDER_DIRECT_GRAD.register(op)` on `rule(direct, interp, *args, **kwargs)`, in the
family files next to the op's batching rule."""

UNDER_DIRECT_JVP = Overrides("vmap under a direct jvp level", rider="direct_ad")
"""The same for a direct jvp level (ad/direct_forward.py): the normalizations' backward
recomputing their statistics so forward AD gives them tangents; batch norm as above."""


RULES_USING_AUTOGRAD: set = set()
"""Ops whose rule runs torch's autograd itself on this level's tensors (a backward that
recomputes its forward: rules/nn_rnn.py): they keep autograd on under `ad_above`."""


def _autograd_detach(interp, args, kwargs):
    """torch's autograd detaching a saved output it recorded on this wrapper (user code
    called `requires_grad_()` inside vmap): cut only the wrapper's graph. Told apart from a
    user's detach (which goes on to its rule) before the outside dispatch state is restored."""
    if is_user_detach():
        return NotImplemented
    return BatchedTensor(args[0]._value, interp)


def metadata_question(rule):
    """A special rule from `rule(interp, *args)` that reads metadata only (no state, no checks)."""
    return lambda interp, args, kwargs: rule(interp, *args)


SPECIAL_RULES: dict = {_DETACH: _autograd_detach}
"""op -> rule(interp, args, kwargs) that `process` answers first, in __torch_dispatch__'s own
state, before `lower` and the rule table (NotImplemented: go on to the op's rule): autograd's
detach of a saved output, and the ops torch's autograd calls to compare layouts before it
attaches a tangent (`is_same_size`, `_has_same_storage_numel`: two per op result whose tangent
is batched, under forward-over-reverse Hessian-vector products inside vmap;
vmap/rules/autograd_meta.py)."""
