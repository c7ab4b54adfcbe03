"""Forward mode, direct strategy: a `jvp` right inside k >= 1 vmap levels over plain
tensors, run by torch's forward AD on vmap's physical tensors.

The same argument as for reverse mode (direct_reverse.py): each batch element's tangent is
the tangent of the physical computation, so the function's ops make one Python dispatch
each (vmap's rule), with torch's forward formulas in C++. Primals get every level's batch
dim as a copy, not an expand: each element's tangent needs its own memory under the
primal. A user's `detach()` is plain `detach` of the physical value: it drops the tangent
(and every level's gradient), as torch.func's does.

k = 0, on the values themselves (forward-over-reverse Hessian-vector products, Gauss-Newton
products, `jvp` of a model): when no AD level is open and the primals are plain, torch's
forward AD runs on them directly, the tangents attached at torch's single dual level for
the whole function, so the function's ops make no Python dispatch at all. The tangents may
be batched by vmap levels below (`vmap(jvp(f))` over k tangents with shared primals: the
Hessian times a matrix): the primal is computed once, and only the tangents' formulas go
through vmap's rules, which then run below autograd (`ad_above`, vmap/interpreter.py), as
torch.func's C++ levels do. Levels opened inside keep apart from it: a `grad` inside is
direct too (torch's autograd records on the dual tensors, and its backward formulas carry
their tangents: forward-over-reverse), a `jvp` inside wraps with carriers (its level is
`nested`, wrapped_forward.py), so its own tangents never meet this level's plain tensors,
and no level opened inside lets this level's tangents onto its wrappers, where they would
be confused with its own (core/dual_values.py).

As at every AD level, an in-place write of a value with this level's tangent into a tensor
from outside the function (`captured.copy_(x)`, `captured[0:2] = x`) is refused while the
function runs (lifting.CapturedWrites), as torch.func refuses it: the caller's tensor would
carry the level's tangent (and, under a grad on values, its graph).

    >>> import torch, functx
    >>> x = torch.randn(3, 2)
    >>> _, t = functx.vmap(lambda r: functx.jvp(torch.sin, (r,), (torch.ones(2),)))(x)
    >>> torch.allclose(t, torch.cos(x))
    True
"""

from __future__ import annotations

import optree
import torch

from ..vmap.batched_tensor import UNDER_DIRECT_JVP
from ..vmap.chain import batched_copy, batched_everywhere, is_batched_everywhere, peel, rewrap_like, wrap_chain
from ..core.custom_function import apply_original
from ..core.forward_ad_state import applying_at_torch_level, user_forward_ad
from .custom_function import no_jvp_message
from .dual_tensor import DUAL_LEVEL, load_forward_decompositions, make_dual, overlaps, tangent_like, unpack_dual
from .direct_reverse import install_above, install_direct_level, recorded_at, restore_above, restore_direct_level
from .level import ADLevel, unwrap_level
from .lifting import CapturedWrites



def _same_layout(tangent, primal) -> bool:
    """torch's forward-AD layout rule (`has_same_meta`): strides, storage offset and the
    storage's size."""
    return (
        tangent.stride() == primal.stride()
        and tangent.storage_offset() == primal.storage_offset()
        and torch.ops.aten._has_same_storage_numel(tangent, primal)
    )


class DirectJvpLevel(ADLevel):
    """A jvp level run by torch's forward AD on the tensors under `vmap_levels`."""

    __slots__ = ("vmap_levels", "lifts_buffers", "_outer", "_writes")
    forward_mode = True
    # what this level changes about vmap's rules while it rides on vmap levels (VmapInterpreter.refresh)
    vmap_overrides = UNDER_DIRECT_JVP

    def __init__(self, vmap_levels):
        super().__init__()
        load_forward_decompositions()
        self.vmap_levels = tuple(vmap_levels)
        self.lifts_buffers = False  # as DirectGradLevel's: set when `dual` batches a primal
        self._outer = ()
        self._writes = None  # lifting.CapturedWrites while the function runs

    @property
    def dual_values(self) -> bool:
        """Whether this level attaches its tangents to plain values (k = 0): every jvp level
        opened inside must keep its own tangents off them (wrapped_forward.py)."""
        return not self.vmap_levels

    @property
    def functions_on_plain_values(self) -> bool:
        """On values, torch's forward AD applies autograd.Functions to them: `apply_function`
        sees those (a level on vmap's physical tensors sees them through vmap's rule)."""
        return not self.vmap_levels

    def apply_function(self, function, args, kwargs):
        """An autograd.Function applied to values (this level on values): torch's own apply,
        which calls its `jvp`. Refused clearly where there is none and an argument carries a
        tangent (torch's own error names no function)."""
        if function.jvp is torch.autograd.Function.jvp:
            for a in optree.tree_leaves(args, none_is_leaf=True):
                if isinstance(a, torch.Tensor) and unpack_dual(a, DUAL_LEVEL)[1] is not None:
                    raise RuntimeError(no_jvp_message(function.__name__))
        if not torch._C._is_fwd_grad_enabled() and user_forward_ad():
            # applied inside another Function's jvp (or forward) at a level above, where torch
            # switched forward AD off for that level: this level's tangents still flow (torch's
            # apply with it off dropped them: jvp(jvp(F)) of an F whose jvp applies a
            # Function was zero)
            with torch.autograd.forward_ad._set_fwd_grad_enabled(True), applying_at_torch_level():
                return apply_original(function, *args, **kwargs)
        return NotImplemented

    def pushed(self):
        if not self.vmap_levels:
            self._outer = install_above(self)
        else:
            # vmap's rules keep forward AD on for these tangents (vmap/interpreter.py)
            self._outer = install_direct_level(self.vmap_levels, self)
        self._writes = CapturedWrites(self, "jvp")
        self._writes.__enter__()

    def popped(self):
        self._writes.__exit__(None, None, None)
        self._writes = None
        if not self.vmap_levels:
            restore_above(self._outer)
            return
        restore_direct_level(self.vmap_levels, self._outer)

    def dual(self, primal, tangent):
        """The function's input for `primal` with `tangent` (these levels' tensors)."""
        levels = self.vmap_levels
        if not levels:
            # made under torch.inference_mode() (cannot carry a tangent), or overlapping in
            # memory (`x.expand(3, 4)`: a tangent laid out like it could not hold a value per
            # element): differentiate a copy, as plain torch's forward AD needs
            if primal.is_inference() or overlaps(primal):
                primal = primal.clone()
            if tangent.stride() != primal.stride() or tangent.is_inference():
                # laid out like the primal (torch's rule for tangents), made through the
                # tangent's vmap levels (a batched tangent: BatchedTensor strides are per
                # element, and torch checks the rest, `_has_same_storage_numel`)
                tangent = tangent_like(tangent, primal, tangent)
            return make_dual(primal, tangent, level=DUAL_LEVEL)
        if not is_batched_everywhere(levels, primal):
            self.lifts_buffers = True
        physical = batched_everywhere(levels, primal)
        if any(stride == 0 for stride in physical.stride()[: len(levels)]):
            physical = physical.clone()  # an expanded batch dim: give each element its memory
        physical_tangent = batched_everywhere(levels, tangent)
        if not _same_layout(physical_tangent, physical):
            # laid out like the primal here too (strides, storage offset and size): a tangent
            # batched only by expansion (stride 0), or a primal that is a chunk of a bigger
            # input (vmap's chunk_size), made torch's forward-AD view check assert on the
            # primal's first view where torch does not relayout the tangent itself (under
            # functx.jit's fake tensors: "the tangent have the same layout as primal")
            physical_tangent = tangent_like(physical_tangent, physical, physical_tangent)
            if not _same_layout(physical_tangent, physical):
                # functionalization's zeros lose a chunk's storage offset: differentiate a
                # copy of the chunk, whose layout the tangent can take
                physical = physical.clone()
                physical_tangent = tangent_like(physical_tangent, physical, physical_tangent)
        return wrap_chain(levels, make_dual(physical, physical_tangent, level=DUAL_LEVEL))

    def lift_buffer(self, x):
        """A buffer the function made, batched like the primals (DirectGradLevel.lift_buffer)."""
        return batched_copy(self.vmap_levels, x)

    def unpack(self, x):
        """`(primal, tangent or None)` of a result, without this level's tangents."""
        if not self.vmap_levels:
            x = unwrap_level(x, self)  # wrappers of levels opened inside and finished
            if not isinstance(x, torch.Tensor):
                return x, None
            return unpack_dual(x, DUAL_LEVEL)
        physical = peel(self.vmap_levels, x)
        if not isinstance(physical, torch.Tensor):
            return x, None
        primal, tangent = unpack_dual(physical, DUAL_LEVEL)
        return (
            rewrap_like(x, self.vmap_levels, primal),
            None if tangent is None else rewrap_like(x, self.vmap_levels, tangent),
        )

    def depends(self, output) -> bool:
        return self.unpack(output)[1] is not None

    def differentiates(self, x) -> bool:
        """Whether `x` (any tensor of the function) carries this level's tangent: the tensor
        torch's forward AD records it on (DirectGradLevel.recorded) has one."""
        t = recorded_at(self, self.vmap_levels, x)
        return isinstance(t, torch.Tensor) and unpack_dual(t, DUAL_LEVEL)[1] is not None

    def export(self, tree):
        return tree  # `unpack` already took this level's tangents off

    def process(self, op, args, kwargs):  # pragma: no cover - no tensor carries this level
        raise AssertionError("a direct jvp level has no tensors of its own")
