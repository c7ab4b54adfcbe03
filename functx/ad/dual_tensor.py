"""`DualTensor`, the wrapped jvp level's tensor, and what makes torch duals of values.

A `DualTensor` holds a primal (`_value`) and a tangent (`_tangent`, None for zero), both one
level down (ad/wrapped_forward.py is its level). Here too: how a tangent is laid out like its
primal through the levels both are made of (`tangent_like`), the part of a base's tangent a
view sees (`view_like`), and torch duals made of primals and tangents for one op or one
autograd.Function (`make_duals`, `function_inputs`), which the wrapped jvp level and the
Function rules (ad/custom_function.py) share.

    >>> import torch
    >>> overlaps(torch.zeros(3).expand(2, 3)), overlaps(torch.zeros(2, 3))
    (True, False)
"""

from __future__ import annotations

import contextlib

import torch

from ..core.interpreter import EnteredTogether, functx_code
from ..core.level_tensor import LevelTensor, wrapper_like
from ..vmap.batched_tensor import BatchedTensor

_restore_autograd = torch._C._RestorePythonTLSSnapshot
make_dual = torch._make_dual
unpack_dual = torch._VF._unpack_dual
DUAL_LEVEL = 0  # torch has exactly one forward-AD level
_zeros_like_layout = torch.ops.aten._new_zeros_with_same_feature_meta.default
_ADInplaceOrView = torch._C.DispatchKey.ADInplaceOrView
_AUTOGRAD_CPU = torch._C.DispatchKey.AutogradCPU
_tls_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded
_no_context = contextlib.nullcontext()


def views_tracked():
    """`ADInplaceOrView` on: `_make_dual` makes its dual a view there. Restoring the outside
    dispatch state is not always enough: under a call that torch's autograd itself made
    (`torch.autograd.grad` making its default cotangent) the saved state has it excluded."""
    return torch._C._SetExcludeDispatchKeyGuard(_ADInplaceOrView, False)


class _InsideOut(EnteredTogether):
    __slots__ = ()

    def guards(self):
        return _restore_autograd(), views_tracked()


def as_outside():
    """Inside `__torch_dispatch__` (autograd excluded), the dispatch state of outside for a
    block: tensors made there are recorded by the levels below and tracked as views, as the
    op's own results are. Outside, nothing to do."""
    if _tls_excluded(_AUTOGRAD_CPU) or _tls_excluded(_ADInplaceOrView):
        return _InsideOut()
    return _no_context


def overlaps(x) -> bool:
    """Whether elements of `x` share memory (an expand: a tangent laid out like it could not
    hold a value per element); 0 is torch's "no overlap". A level's wrapper has no storage of
    its own: there, a stride of 0 over more than one element (its strides are its value's,
    per element)."""
    if x.layout != torch.strided:
        return False
    if isinstance(x, LevelTensor):
        return any(stride == 0 and size > 1 for stride, size in zip(x.stride(), x.shape))
    return torch._debug_has_internal_overlap(x) != 0


class DualTensor(LevelTensor):
    """A tensor inside a wrapped `jvp` level: primal and tangent (None: zero), one level down."""

    @staticmethod
    def __new__(cls, primal: torch.Tensor, tangent, level):
        wrapper = wrapper_like(cls, primal, level)
        wrapper._tangent = tangent
        return wrapper

    def __repr__(self):
        return f"DualTensor(level={self._interp.level}, primal={self._value!r}, tangent={self._tangent!r})"

    __str__ = __repr__


def tangent_of(x: DualTensor):
    """`x`'s tangent. A view of a DualTensor whose base got a tangent after the view was made
    (an in-place write into the base or a sibling view) sees its part of the base's tangent,
    as torch's forward AD does for views."""
    tangent = x._tangent
    if tangent is None and x._is_view():
        base = x._base
        if type(base) is DualTensor and base._interp is x._interp and base._tangent is not None:
            tangent = x._tangent = view_like(base._tangent, base, x)
    return tangent


def levels_of(x) -> set:
    """The levels whose tensors `x` is made of (its chain of wrappers)."""
    levels = set()
    while isinstance(x, LevelTensor):
        levels.add(x._interp)
        x = x._value
    return levels


def tangent_like(like, primal, old):
    """Zeros laid out like `primal`, made through `primal`'s levels and `like`'s (a tensor, or
    a list of tensors whose levels the zeros must all take), holding `old` if there is one."""
    if type(like) is not list:
        tangent = _zeros_like_layout(like, primal)
    else:
        tangent = _zeros_like_layout(like[0], primal)
        for other in like[1:]:
            if not levels_of(other) <= levels_of(tangent):
                tangent = _zeros_like_layout(other, tangent)  # laid out like `tangent`, so like `primal`
    return tangent if old is None else tangent.copy_(old)


def lifted_tangent(tangent, primal):
    """A copy of `tangent` made a tensor of the wrapped jvp levels `primal` is made of and it
    is not, where that is all it lacks, its wrappers are vmap levels' and it is laid out like
    `primal` already: those levels' wrappers with no tangent put around its (copied) values at
    their places in the chain, with no op through the levels (`tangent_like` makes zeros
    through every level and copies into them: under `jacfwd(jacfwd(f))` the inner basis
    column took five dispatches at the outer levels). None where that does not hold."""
    if tangent.stride() != primal.stride():
        return None
    missing = []
    while isinstance(primal, LevelTensor):
        if type(primal) is DualTensor:
            missing.append(primal._interp)
        primal = primal._value
    chain = []
    while isinstance(tangent, LevelTensor):
        if type(tangent) is not BatchedTensor:
            return None
        chain.append(tangent._interp)
        tangent = tangent._value
    missing = [level for level in missing if level not in chain]
    if not missing or not tangent.is_contiguous():
        return None
    levels = sorted(chain + missing, key=lambda level: level.level)  # innermost wrapper first
    value = tangent.clone()  # the caller's tangent stays the caller's
    for level in levels:
        value = DualTensor(value, None, level) if level in missing else BatchedTensor(value, level)
    return value


def view_like(base_tangent, base, view):
    """The part of `base_tangent` that `view` is of `base` (tangents are laid out like their
    primals, so the view's sizes, strides and offset select it)."""
    offset = view.storage_offset() - base.storage_offset() + base_tangent.storage_offset()
    with as_outside():  # a view torch's autograd knows: writes into it reach the base's graph
        return base_tangent.as_strided(view.shape, view.stride(), offset)


class DualList:
    """A list argument some of whose elements carry tangents: made into duals element-wise."""

    __slots__ = ("kind", "primals", "tangents")

    def __init__(self, kind, primals, tangents):
        self.kind, self.primals, self.tangents = kind, primals, tangents


LIST_MARK = object()


def function_inputs(primals, tangents):
    """A Function's differentiated inputs made ready for torch's make_dual, as the level's
    `dual` makes the function's own: an expanded input copied (a tangent laid out like it
    could not hold a value per element), and each tangent laid out like its input, through
    its levels (torch's make_dual would copy a batched tangent into a layout of its own
    making, a tensor of none of its vmap levels: zeros, or a write into shared memory).
    (Not done for every op in `process`: an op writes into its input itself.)"""
    primals, tangents = list(primals), list(tangents)
    with functx_code():  # functx's own tensors: not lifted into the level applying the Function
        for i, (p, t) in enumerate(zip(primals, tangents)):
            if not isinstance(t, torch.Tensor):
                continue
            if overlaps(p):
                primals[i] = p = p.clone()
            if t.layout == torch.strided and (t.stride() != p.stride() or not levels_of(p) <= levels_of(t)):
                tangents[i] = tangent_like(t, p, t)
    return primals, tangents


def make_duals(primals, tangents, carrier=None, every=False):
    """torch duals of `primals` with `tangents` (None: no dual): of the values themselves, or,
    with `carrier` (a level), of fresh tensors of that level holding them. With `every`,
    the primals without a tangent go in as carriers too (`WrappedJvpLevel.over_dual_values`)."""

    def dual(p, t):
        if t is None:
            if every and isinstance(p, torch.Tensor):
                return DualTensor(p, None, carrier)
            return p
        if carrier is not None:
            p, t = DualTensor(p, None, carrier), DualTensor(t, None, carrier)
        return make_dual(p, t, level=DUAL_LEVEL)

    return [
        p.kind(dual(e, t) for e, t in zip(p.primals, p.tangents)) if t is LIST_MARK else dual(p, t)
        for p, t in zip(primals, tangents)
    ]


_forward_decompositions_loaded = False


def load_forward_decompositions():
    """torch's forward AD runs some ops' forward derivative by a TorchScript decomposition
    that torch registers on importing this module (torch.autograd.forward_ad.make_dual does it
    too). It takes 0.3 s: the first jvp pays it, not `import functx`."""
    global _forward_decompositions_loaded
    if not _forward_decompositions_loaded:
        import torch._decomp.decompositions_for_jvp  # noqa: F401  (registers the decompositions)

        _forward_decompositions_loaded = True
