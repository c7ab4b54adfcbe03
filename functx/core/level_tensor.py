"""The level tensor and the dispatcher.

A `LevelTensor` is a `torch.Tensor` wrapper subclass that holds the value one level down
(`_value`: a plain tensor or a lower level's tensor) and the interpreter of its level
(`_interp`). Every ATen op that touches one arrives in `__torch_dispatch__`; the dispatcher
finds the highest live level among the arguments and hands the op to that interpreter,
whose rule computes on values one level down. Those computations dispatch again, through
the lower levels, which is what makes transforms compose.

This is the hot path: no pytree library here, one pass over the arguments.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._mode_utils

from .errors import op_name
from .forward_ad_state import at_wrappers, down_state
from .interpreter import current_stack
from .op_facts import mutated_argument
from .patches import way_in


_detach = torch.ops.aten.detach.default
_to_layout = torch.ops.aten.to.dtype_layout
_META = torch.device("meta")
_VIEW_AS_REAL = torch.ops.aten.view_as_real.default


def view_as_real_resolved(x):
    """`view_as_real` of a lazily conjugated value: the conjugate resolved first."""
    return _VIEW_AS_REAL(x.resolve_conj())
_tls_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded
_AD_INPLACE_OR_VIEW = torch._C.DispatchKey.ADInplaceOrView
_AUTOGRAD_CPU = torch._C.DispatchKey.AutogradCPU
_RESTORE_OUTSIDE = getattr(torch._C, "_RestorePythonTLSSnapshot")  # (not in torch's stubs)
_VIEWS_TRACKED = torch._C._SetExcludeDispatchKeyGuard


def is_user_detach() -> bool:
    """Inside `__torch_dispatch__` for `aten.detach`: did it come from user code (`x.detach()`,
    down through the dispatcher, which has excluded `ADInplaceOrView` by then) rather than
    from torch's autograd detaching a saved output it records (`shallow_copy_and_detach`,
    straight from C++, nothing excluded)? The first stops derivatives at every level; the
    second must cut only the recorded level's graph, or `grad(grad(exp))` is 0."""
    return _tls_excluded(_AD_INPLACE_OR_VIEW)


class LevelTensor(torch.Tensor):
    """Base of every transform's wrapper tensor. Subclasses set `_value` and `_interp`."""

    _value: torch.Tensor
    _interp: Any  # the level (core/interpreter.py's Interpreter: imported by it, not here)
    is_functx_level_tensor = True  # how core/dispatch_modes.py, below this module, knows one

    # Ops reach us as ATen ops only; no Python-level __torch_function__ work per call.
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    # The conjugate bit. torch's Conjugate key runs before the Python key, so a wrapper that
    # carried the bit would have its lazy conjugation resolved by torch on the wrapper's
    # (value-less) metadata and silently lost (measured: every op wrong). Wrappers never carry
    # it; `is_conj()` reports the value's bit instead (AD levels keep a lazy conj view one
    # level down; vmap materializes it and remembers it, vmap/rules/pointwise.py), as torch.func's
    # wrappers report it, and `resolve_conj()` resolves through the levels.
    def is_conj(self):
        return self._value.is_conj()

    def resolve_conj(self):
        if not self.is_conj():
            return self
        return torch.ops.aten.clone.default(self)  # the copy is resolved at every level below

    def tolist(self):
        """The Python values of the value one level down (torch refuses `tolist` on every
        tensor subclass; `.item()` arrives as an op). An AD level's tensor holds one value;
        vmap's BatchedTensor overrides this to refuse, as it refuses `.item()`."""
        return self._value.tolist()

    @classmethod
    def __torch_dispatch__(cls, op, types, args=(), kwargs=None):
        top = None
        for group in (args, kwargs.values()) if kwargs else (args,):
            for a in group:
                if isinstance(a, LevelTensor):
                    interp = a._interp
                    if top is None or interp.level > top.level:
                        top = interp
                elif type(a) is list or type(a) is tuple:
                    for e in a:
                        if isinstance(e, LevelTensor):
                            interp = e._interp
                            if top is None or interp.level > top.level:
                                top = interp
        if not top.alive:
            return _dispatch_with_dead_levels(op, args, kwargs or {})
        return top.process(op, args, kwargs or {})


way_in(
    "an ATen op on a level tensor",
    LevelTensor,
    "its __torch_dispatch__ finds the highest live level among the arguments and calls its process",
)


def wraps_over_dual_values(values) -> bool:
    """Whether `values` (a call's arguments: tensors, or lists of them as `torch.cat` takes)
    include a wrapper of a live level opened inside a jvp level on values
    (core/dual_values.py). (The ops on a
    finished level's wrappers run on their values directly, level_tensor.py: forward AD on.)"""
    for a in values:
        if isinstance(a, LevelTensor):
            if a._interp.over_dual_values and a._interp.alive:
                return True
        elif type(a) is list or type(a) is tuple:
            for e in a:
                if isinstance(e, LevelTensor) and e._interp.over_dual_values and e._interp.alive:
                    return True
    return False


def call_at_values(func, args, kwargs, plain=None):
    """`func(*args, **kwargs)` with torch's forward AD off if it mixes in such wrappers (the
    state it was called in is kept for their level's rule: `down_state`); otherwise in
    forward AD state `plain` (None: as it is)."""
    if wraps_over_dual_values(args) or bool(kwargs) and wraps_over_dual_values(kwargs.values()):
        with at_wrappers():
            return func(*args, **kwargs)
    if plain is None or plain == torch._C._is_fwd_grad_enabled():
        return func(*args, **kwargs)
    with torch.autograd.forward_ad._set_fwd_grad_enabled(plain):
        return func(*args, **kwargs)


def wrapper_like(cls, value: torch.Tensor, interp, requires_grad: bool = False):
    """A new `cls` wrapper of `value` at `interp`'s level, laid out like it (sizes, strides,
    offset, dtype, device, layout): what an AD level's tensors look like from outside."""
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


def promote_for_write(target, args) -> None:
    """Before an in-place op of `target`'s level writes `args` into `target` (its own tensor):
    the value under `target` must be a tensor of every level below that owns wrappers and
    that the written values belong to, or that level would see a write into a tensor not its
    own (a clone of an input that level does not differentiate, made while an inner level
    was running, is plain there). Such a value is lifted into those levels as a constant
    (`level.lift`: the wrapped AD levels), in place of the wrapper's value: the wrapper is
    what user code holds. Levels without `lift` (vmap) batch or refuse in their own rules.

    A view (`h[0] = a`) is lifted through its base: the base's value is lifted and the
    view's value becomes the same view of it, so the write reaches what the base holds (its
    lifted levels' derivatives included). Lifting the view alone gave it a wrapper of its
    own, and the written derivative stayed there: `jacfwd(vmap(f))` of `h = x.clone();
    h[0] = y[0]` was zero."""
    value = target._value
    below = level_of(value)
    top = below
    for a in args:
        for t in a if type(a) is list or type(a) is tuple else (a,):
            if isinstance(t, LevelTensor) and t is not target:
                inner = t._value if t._interp is target._interp else t
                top = max(top, level_of(inner))
    if top == below:
        return
    base = target._base if target._is_view() else None
    interp = target._interp
    if isinstance(base, LevelTensor) and base._interp is interp and level_of(base._value) == below:
        base._value = _lifted(base._value, below, top)
        if interp.lifted_bases is None:
            interp.lifted_bases = {}
            interp.refresh()  # its handlers now refresh views of the lifted base first
        interp.lifted_bases[id(base)] = base
        target._value = _same_view(base._value, value)
        return
    target._value = _lifted(value, below, top)


def _lifted(value, below: int, top: int):
    """`value` lifted as a constant into the levels in (below, top] that lift (AD levels)."""
    for level in current_stack():
        if below < level.level <= top and hasattr(level, "lift"):
            value = level.lift(value)
    return value


def _same_view(base_value, old_view):
    """The view of `base_value` that `old_view` is of the base's old value (same storage)."""
    size, stride, offset = old_view.shape, old_view.stride(), old_view.storage_offset()
    if _tls_excluded(_AD_INPLACE_OR_VIEW) or _tls_excluded(_AUTOGRAD_CPU):
        # inside __torch_dispatch__: outside's dispatch state, so the levels track the view
        with _RESTORE_OUTSIDE(), _VIEWS_TRACKED(_AD_INPLACE_OR_VIEW, False):
            return base_value.as_strided(size, stride, offset)
    return base_value.as_strided(size, stride, offset)


def refresh_views(interp, tensors) -> None:
    """After `promote_for_write` lifted a base of `interp`'s (`interp.lifted_bases`, rare):
    the other views of it made before (`v = h[:2]; h[0] = a`) still hold views of the old,
    unlifted value. Each one met here (an op's argument, a transform's output) gets the same
    view of the lifted value, so it sees what was written through its base. Callers test
    `interp.lifted_bases is not None` first: nothing to do on the hot path otherwise."""
    bases = interp.lifted_bases
    for a in tensors:
        for t in a if type(a) is list or type(a) is tuple else (a,):
            if isinstance(t, LevelTensor) and t._interp is interp and t._is_view():
                base: Any = bases.get(id(t._base))
                lifted = base is not None and base is t._base
                if lifted and level_of(t._value) < level_of(base._value):
                    t._value = _same_view(base._value, t._value)


def debug_unwrap(tensor: torch.Tensor, *, recurse: bool = True) -> torch.Tensor:
    """The tensor under a transform's wrapper, for debugging (printing a value in a
    debugger): `torch.func.debug_unwrap`. Computing with the result inside the transformed
    function bypasses the transforms.

    Under `vmap` it is the physical tensor, its batch dims in front; under a wrapped
    forward level (`jacrev(jacfwd(f))`) the primal; under a wrapped grad level
    (`grad(hessian(f))`) the value one level down. The levels that run on torch's own
    autograd (the outermost `grad`, `vjp`, `jvp`, `hessian`; the `grad` of
    `vmap(grad(f))`) add no wrapper: a plain tensor there comes back as it is.

    Args:
        tensor (torch.Tensor): the value to unwrap. Anything else (a plain tensor, a
            non-tensor) comes back as it is.
        recurse (bool, default True): unwrap all the way down; False: one level.

    Returns:
        torch.Tensor: the unwrapped tensor.

    Raises:
        Nothing: a value that is not wrapped is returned as it is. A tensor that escaped its
            vmap unwraps to its physical value where any other use raises `DeadLevelError`
            ([error catalogue: vmap inside the function](../errors.md#vmap-inside-the-function)).

    Examples:
        >>> import torch, functx
        >>> functx.vmap(lambda t: torch.tensor(functx.debug_unwrap(t).dim()))(torch.ones(3, 4))
        tensor([2, 2, 2])

        In nested vmaps, all levels or one; the batch dim comes first whatever the in_dim:

        >>> def show(t):
        ...     print(tuple(functx.debug_unwrap(t).shape), tuple(functx.debug_unwrap(t, recurse=False).shape))
        ...     return t
        >>> _ = functx.vmap(functx.vmap(show))(torch.ones(2, 3, 4))
        (2, 3, 4) (3, 4)
        >>> _ = functx.vmap(show, in_dims=1)(torch.ones(3, 4))
        (4, 3) (4, 3)

        A plain tensor comes back as it is:

        >>> x = torch.ones(2)
        >>> functx.debug_unwrap(x) is x
        True

    Differences from torch.func:
        `torch.func.debug_unwrap` gives vmap's physical tensor with the batch dim where it
        happens to be (`in_dims=1`: dim 1); functx's puts it first. Under the outermost
        `grad` and `jvp` torch.func's unwraps to a tensor that carries no gradient or
        tangent; functx's returns the tensor the function sees, which carries them.
    """
    while isinstance(tensor, LevelTensor):
        tensor = tensor._value
        if not recurse:
            break
    return tensor


def unwrap_dead(x):
    """Strip the wrappers of finished transforms from `x` (a tensor, list or tuple)."""
    while isinstance(x, LevelTensor) and not x._interp.alive:
        x = x._interp.unwrap_dead(x)
    if type(x) is list or type(x) is tuple:
        return type(x)(unwrap_dead(e) for e in x)
    return x


def _dispatch_with_dead_levels(op, args, kwargs):
    """A level tensor outlived its transform (a `vjp_fn` called after `vjp` returned, a
    tensor stashed away): run the op on what the dead wrappers stand for (vmap: the
    physical tensor with the batch dim; grad: the value one level down), so the highest
    live level, or plain torch, handles it.

    Like every interpreter, this runs one level down with autograd restored, so that live
    grad levels below (and plain autograd) record the op: a late `vjp_fn` runs its
    backward formulas here and an outer `grad` must see them. torch's autograd and view
    tracking still run at the dead wrappers' level and need fresh output objects, so a
    dead grad level re-boxes the outputs (`rebox_dead`); every transform strips such
    boxes from what it returns.
    """
    if op is _detach and isinstance(args[0], LevelTensor) and not args[0]._interp.alive and not is_user_detach():
        # autograd detaches saved outputs of the dead level: its interpreter decides
        return args[0]._interp.detach_dead(args[0])
    if op is _to_layout and kwargs.get("device") == _META:
        # torch's ZeroTensor arithmetic asks for a result's shape on `.to("meta")` copies: the
        # wrapper's metadata answers it. Taken one level down instead, the copy would carry
        # whatever derivatives the value carries (a forward-AD tangent attached to the plain
        # value by a jvp on values, ad/direct_forward.py), and the meta computation would
        # differentiate prims that have no forward formula.
        x = args[0]
        return torch.empty_strided(x.shape, x.stride(), dtype=kwargs.get("dtype") or x.dtype, device=_META)
    dead, with_autograd = None, True
    for a in (*args, *kwargs.values()):
        for t in a if type(a) is list or type(a) is tuple else (a,):
            if isinstance(t, LevelTensor) and not t._interp.alive:
                with_autograd = with_autograd and t._interp.dead_values_with_autograd
                if dead is None or t._interp.level > dead.level:
                    dead = t._interp
    if not with_autograd:  # (functionalize's must be read inside __torch_dispatch__'s state)
        values = tuple(unwrap_dead(a) for a in args)
        kw_values = {k: unwrap_dead(v) for k, v in kwargs.items()}
    with torch._C._RestorePythonTLSSnapshot():
        if with_autograd:
            # what the dead wrappers stand for, taken with autograd restored too: vmap's one
            # element of an expanded input (`value[0]`) keeps its graph to the caller's
            # tensor (taken below autograd it had none: an escaped slice of a parameter the
            # caller tracks lost its derivative, where torch.func's escaped slice keeps it)
            values = tuple(unwrap_dead(a) for a in args)
            kw_values = {k: unwrap_dead(v) for k, v in kwargs.items()}
        # In the forward-AD state of the values, as every level's rule one level down
        # (core/dual_values.py): a `vjp_fn` called with a cotangent of a live level over a jvp
        # on values runs its backward under `at_wrappers` (forward AD off for those wrappers),
        # and its dead formulas' values (the jvp's plain duals) would lose their tangents.
        if op is _VIEW_AS_REAL and values[0].is_conj():
            # a dead wrapper of a lazily conjugated value (wrappers carry no conj bit, so
            # torch's `real` took it for resolved): resolve it here, where the levels below
            # record it (their autograd and forward AD), as the grad level does
            out = call_at_values(view_as_real_resolved, values, kw_values, down_state())
        else:
            out = call_at_values(op, values, kw_values, down_state())
    if dead is None:
        return out
    mutated = mutated_argument(op)
    if mutated is not None:
        return args[mutated]
    if isinstance(out, torch.Tensor):
        return dead.rebox_dead(out)
    if type(out) is tuple or type(out) is list:
        return type(out)(dead.rebox_dead(o) if isinstance(o, torch.Tensor) else o for o in out)
    return out


def replay_inplace_view(op, args, kwargs):
    """After an in-place view op (`squeeze_`, `unsqueeze_`, `transpose_`, `as_strided_`)
    changed a wrapper's inner value, change the wrapper's own sizes and strides to match:
    replay the op on the wrapper's metadata alone (no dispatch, meta kernels), as torch's
    `return_and_correct_aliasing` does."""
    with torch.utils._mode_utils.no_dispatch():
        meta_in_tls = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            op(*args, **kwargs)
        finally:
            torch._C._set_meta_in_tls_dispatch_include(meta_in_tls)


def is_physical(x) -> bool:
    """Whether `x` is a tensor no functx level owns: a plain tensor, or one of torch's own
    tracing tensors (fake, functional, under torch.compile and make_fx), which compute as
    plain tensors do (checking `type(x) is Tensor` instead turned layout rules off when
    staged: compiled per-sample weight gradients came out transposed)."""
    return isinstance(x, torch.Tensor) and not isinstance(x, LevelTensor)


def level_of(x) -> int:
    """Level of a level tensor, 0 for anything else (plain tensors sit below every level)."""
    return x._interp.level if isinstance(x, LevelTensor) else 0


__all__ = ["LevelTensor", "debug_unwrap", "is_physical", "is_user_detach", "level_of", "promote_for_write", "refresh_views", "wrapper_like", "op_name", "replay_inplace_view", "unwrap_dead"]
