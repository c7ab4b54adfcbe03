"""`FunctionalizedTensor` (functionalize's level tensor) and `FunctionalizeInterpreter`.

A FunctionalizedTensor's `_value` is one of torch's C++ functional tensors
(`torch._to_functional_tensor`) over the value one level down. torch's Functionalize kernels
do the real work: an in-place op on a functional tensor becomes its out-of-place op on the
value inside, whose result replaces that value; a view records how to replay itself (as a
view op, or as a `*_copy` op with `remove="mutations_and_views"`), so that a write through
a view reaches its base (through `*_scatter` ops) the next time the base is read.

The interpreter calls those kernels *directly* (`op.redispatch` with the Functionalize key
on top), past the autograd keys of the functional tensors: the kernels call the op again,
out of place, on the values inside with the dispatch state of outside restored, so a grad
level below records it on its own tensors (going through torch's autograd kernel for the
functional tensors would switch autograd off for everything below them). Nothing ever
records autograd on a functional tensor itself. A few ops whose functionalization is wrong
when a level below differentiates have rules (rules.py).
"""

from __future__ import annotations

import contextlib

import torch
import torch.utils._mode_utils

from ..core.errors import op_name
from ..core.interpreter import Interpreter, top_interpreter
from ..core.level_tensor import LevelTensor, replay_inplace_view, wrapper_like
from ..core.rules import resolved_once
from .rules import rule_for
from .scalars import has_numbers, rewrite_numbers
from ..core.op_facts import is_inplace_view, is_view, writes_of

_restore_outside = torch._C._RestorePythonTLSSnapshot
_to_functional = torch._to_functional_tensor
_from_functional = torch._from_functional_tensor
_is_functional = torch._is_functional_tensor
_set_reapply_views = torch._functionalize_enable_reapply_views
_dispatch_keys = torch._C._dispatch_keys
_Key = torch._C.DispatchKey
# The keys torch's kernels for a functional tensor may take, from Functionalize down: not
# autograd (see the module docstring), not the conjugate/negative bits (the value inside
# carries them, and resolving them on the functional tensor would call the op afresh).
_BELOW_AUTOGRAD = (
    torch._C._after_ADInplaceOrView_keyset.remove(_Key.Conjugate).remove(_Key.Negative).remove(_Key.ZeroTensor)
)
_AS_STRIDED = torch.ops.aten.as_strided.default
_make_wrapper = torch.Tensor._make_wrapper_subclass


@contextlib.contextmanager
def reapplying_views(reapply: bool):
    """Set torch's thread-local choice between view ops and `*_copy` ops for the
    Functionalize kernels that run in the block (syncs regenerate views with it too)."""
    previous = _set_reapply_views(reapply)
    try:
        yield
    finally:
        _set_reapply_views(previous)


class FunctionalizedTensor(LevelTensor):
    """A tensor inside `functx.functionalize`: a C++ functional tensor over the value one
    level down, laid out as that functional tensor is (or, for a view, as the view would be).
    A view's `_root` is the tensor of the level it is (a view of a view of ...) a view of."""

    _root = None
    _relaid = False  # laid out unlike its value (see FunctionalizeInterpreter._wrap_views)

    @staticmethod
    def __new__(cls, functional: torch.Tensor, interp: "FunctionalizeInterpreter"):
        return wrapper_like(cls, functional, interp)

    def current(self) -> torch.Tensor:
        """The value one level down that this tensor holds now (pending writes applied)."""
        return self._interp.current(self._value)

    def tolist(self):
        return self.current().tolist()

    def __repr__(self):
        return f"FunctionalizedTensor(level={self._interp.level}, value={self.current()!r})"

    __str__ = __repr__


class FunctionalizeInterpreter(Interpreter):
    """One `functionalize` level. `reapply_views` False: views become `*_copy` ops too
    (`remove="mutations_and_views"`)."""

    __slots__ = ("reapply_views", "_lifting")
    dead_values_with_autograd = False  # its values are read through torch's functional state

    def __init__(self, reapply_views: bool):
        super().__init__()
        self.reapply_views = reapply_views
        # Inside a jvp level on values, torch's forward AD stays on at this level's wrappers
        # (core/dual_values.py): the Functionalize kernels run below autograd on the C++
        # functional tensors, so the wrappers' own tangents are the only ones they get.
        self.over_dual_values = False
        self.refresh()

    def pushed(self):
        from .lifting import FactoryLifting

        self._lifting = FactoryLifting(self)
        self._lifting.__enter__()

    def popped(self):
        self._lifting.__exit__(None, None, None)

    # -- values in and out ----------------------------------------------------------------
    def wrap(self, value: torch.Tensor) -> FunctionalizedTensor:
        """`value` (one level down) as a tensor of this level: an input, or a tensor the
        function made."""
        return FunctionalizedTensor(_to_functional(value), self)

    def current(self, functional: torch.Tensor) -> torch.Tensor:
        """The value one level down that a functional tensor of this level holds now: pending
        writes through its views are applied first, with this level's choice of view ops
        (ops one level down: inside `process`, call it with the dispatch state of outside
        restored, or the levels below do not record them)."""
        with reapplying_views(self.reapply_views):
            torch._sync(functional)
        return _from_functional(functional)

    def values_below(self, x):
        """This level's tensors in `x` (a tensor, list or tuple) as the values one level down
        they hold now; anything else as it is."""
        if type(x) is FunctionalizedTensor and x._interp is self:
            return self.current(x._value)
        if type(x) is list or type(x) is tuple:
            return type(x)(self.values_below(e) for e in x)
        return x

    def install(self, functional: torch.Tensor, value: torch.Tensor) -> None:
        """Make `value` (one level down) the new value of a functional tensor of this level,
        as torch's Functionalize kernels do after an in-place op: its views see it."""
        torch._functionalize_replace(functional, value)
        torch._functionalize_commit_update(functional)
        with reapplying_views(self.reapply_views):
            torch._functionalize_sync(functional)

    def owns(self, x) -> bool:
        return type(x) is FunctionalizedTensor and x._interp is self

    def _unwrap(self, x):
        if type(x) is FunctionalizedTensor and x._interp is self:
            return x._value
        if type(x) is list or type(x) is tuple:
            return type(x)(self._unwrap(e) for e in x)
        return x

    # -- one op: `handler_of(op)`, `_handler` at the end ----------------------------------
    def refresh(self):
        """`handler_of`: each op's handler (`_handler`); the state one level down is entered
        in `kernel` (outside's state and this level's choice of view ops)."""
        super().refresh()
        self.handler_of = _HANDLERS

    def kernel(self, op, writes, args, kwargs):
        """The op's Functionalize kernel on this level's functional tensors (see the module
        docstring); in-place and out= ops (`writes`) return the wrappers they wrote into."""
        if op is _AS_STRIDED and type(args[0]) is FunctionalizedTensor and args[0]._root is not None:
            # as_strided counts from the storage, not from its input: take it of the view's
            # root, so that it starts a chain of views instead of extending one (torch's
            # functionalization refuses writes through views of as_strided views)
            args = (args[0]._root, *args[1:])
        values = [self._unwrap(a) for a in args]
        kw_values = {k: self._unwrap(v) for k, v in kwargs.items()} if kwargs else {}
        keys = _keyset(values, kw_values)
        call = op
        if has_numbers(op, values, kw_values):
            call, values, kw_values = rewrite_numbers(op, values, kw_values)
        with _restore_outside():
            previous = _set_reapply_views(self.reapply_views)  # (not `reapplying_views`: hot path)
            try:
                out = call.redispatch(keys, *values, **kw_values)
            finally:
                _set_reapply_views(previous)
        if writes is None:
            if is_view(op) and type(args[0]) is FunctionalizedTensor:
                return self._wrap_views(op, args, kwargs, out)
            if _relaid_in(args, kwargs):
                return self._wrap_laid_out(out, _on_meta(op, args, kwargs))
            return self._wrap_all(out)
        if is_inplace_view(op):  # transpose_, squeeze_, as_strided_ ...: the wrapper's own shape changes
            replay_inplace_view(op, args, kwargs)
        for target in writes.targets(args, kwargs):
            _check_layout(target)
        if len(writes.returns) == 1:
            where = writes.returns[0]
            return self._wrap_all(out) if where is None else writes.argument(where, args, kwargs)
        return type(out)(
            self._wrap_all(o) if where is None else writes.argument(where, args, kwargs)
            for o, where in zip(out, writes.returns)
        )

    def _wrap_all(self, out):
        if isinstance(out, torch.Tensor):
            return FunctionalizedTensor(out if _is_functional(out) else _to_functional(out), self)
        if type(out) is tuple or type(out) is list:
            return type(out)(self._wrap_all(o) for o in out)
        return out

    def _wrap_views(self, op, args, kwargs, out):
        """Outputs of a view op: they remember their root (see `process`), and are laid out as
        real views would be. With `remove="mutations_and_views"` the values are `*_copy`
        results (contiguous, offset 0), but levels above compute with the layout of views
        (a jvp level finds a view's tangent in its base's tangent by strides and offset), and
        code decides by layout (`reshape` views or copies, `is_contiguous()`), so the wrappers
        get the layout the op gives on meta tensors laid out like the inputs; so do results
        of other ops on such tensors (`_relaid_in`), as a transposed view's `* 2` keeps its
        strides in plain torch (torch.func reports the copies' layouts instead)."""
        root = args[0] if args[0]._root is None else args[0]._root
        as_values = self.reapply_views and not _laid_unlike_value(args[0])
        wrapped = self._wrap_laid_out(out, None if as_values else _on_meta(op, args, kwargs))
        for w in wrapped if type(wrapped) is tuple or type(wrapped) is list else (wrapped,):
            if type(w) is FunctionalizedTensor:
                w._root = root
        return wrapped

    def _wrap_laid_out(self, out, layouts):
        """Outputs wrapped with the sizes, strides and offsets of `layouts` (the op on meta
        tensors; None: the values' own)."""
        single = not (type(out) is tuple or type(out) is list)
        outs = (out,) if single else out
        layouts = outs if layouts is None else (layouts,) if single else layouts
        wrapped = []
        for o, like in zip(outs, layouts):
            if not isinstance(o, torch.Tensor):
                wrapped.append(o)
                continue
            o = o if _is_functional(o) else _to_functional(o)
            if not isinstance(like, torch.Tensor) or like.shape != o.shape:
                like = o
            w = _make_wrapper(
                FunctionalizedTensor, like.shape, like.stride(), like.storage_offset(),
                dtype=o.dtype, device=o.device, layout=o.layout,
            )  # fmt: skip
            w._value, w._interp = o, self
            if like is not o and (like.stride() != o.stride() or like.storage_offset() != o.storage_offset()):
                w._relaid = True
            wrapped.append(w)
        return wrapped[0] if single else type(out)(wrapped)

    def _write_into_foreign(self, op, writes, args, kwargs):
        """An op writes into a tensor that is not this level's (made outside the function).
        From the function itself that is an error, as in torch.func: functionalization cannot
        remove that write. From a rule of a transform above (a buffer it made for itself),
        the write happens one level down, with this level's values as they are now."""
        if top_interpreter() is self:
            raise RuntimeError(
                f"functionalize: {op_name(op)} writes in place into a tensor that was not made inside "
                f"the functionalized function (a captured or global tensor), and the value it writes "
                f"comes from inside. functionalize cannot remove that write (torch.func refuses it "
                f"too: 'mutating a non-functional tensor with a functional tensor is not allowed'). "
                f"Pass the tensor to the function as an input (its mutation is then copied back at "
                f"the end), or clone it inside the function."
            )
        with _restore_outside():
            op(*self.values_below(list(args)), **{k: self.values_below(v) for k, v in kwargs.items()})
        results = [writes.argument(w, args, kwargs) for w in writes.returns if w is not None]
        return results[0] if len(writes.returns) == 1 else tuple(results)

    # -- after the transform returned -------------------------------------------------------
    def unwrap_dead(self, x):
        """A tensor that escaped the function (stored away): the value it holds now. (Called
        from inside `__torch_dispatch__`.)"""
        with _restore_outside():
            return self.current(x._value)

    def detach_dead(self, x):
        return self.unwrap_dead(x).detach()


def _keyset(values, kw_values):
    """The dispatch keys to call the Functionalize kernel with: those of the functional tensors
    among the values, from Functionalize down."""
    for group in (values, kw_values.values()):
        for v in group:
            if type(v) is list or type(v) is tuple:
                for e in v:
                    if isinstance(e, torch.Tensor) and _is_functional(e):
                        return _dispatch_keys(e) & _BELOW_AUTOGRAD
            elif isinstance(v, torch.Tensor) and _is_functional(v):
                return _dispatch_keys(v) & _BELOW_AUTOGRAD
    raise AssertionError("functionalize: an op of this level without a tensor of it")  # pragma: no cover


def _relaid_in(args, kwargs) -> bool:
    """Whether a tensor among the arguments is laid out unlike its value (`_wrap_views`)."""
    for group in (args, kwargs.values()):
        for a in group:
            if type(a) is FunctionalizedTensor and _laid_unlike_value(a):
                return True
            if type(a) is list or type(a) is tuple:
                if any(type(e) is FunctionalizedTensor and _laid_unlike_value(e) for e in a):
                    return True
    return False


def _laid_unlike_value(x) -> bool:
    """Whether `x` is laid out unlike its value: relaid views (`_wrap_views`), or a tensor
    whose value torch's functionalization regenerated with another layout after a write
    through a view (under vmap the regenerated base of a buffer written with batched values
    is batched, and was laid out as the view written through: a later transpose of it
    reported itself contiguous)."""
    return x._relaid or x.stride() != x._value.stride() or x.storage_offset() != x._value.storage_offset()


def _on_meta(op, args, kwargs):
    """The op's outputs on meta tensors laid out as the tensors in `args` (None where the op
    cannot run on meta tensors: then the values' layouts are used)."""

    def meta(x):
        if type(x) is list or type(x) is tuple:
            return type(x)(meta(e) for e in x)
        if not isinstance(x, torch.Tensor):
            return x
        extent = 1 + sum((n - 1) * st for n, st in zip(x.shape, x.stride()) if n > 0) if x.numel() else 0
        storage = torch.empty(x.storage_offset() + extent, dtype=x.dtype, device="meta")
        return storage.as_strided(x.shape, x.stride(), x.storage_offset())

    with torch.utils._mode_utils.no_dispatch():
        try:
            return op(*[meta(a) for a in args], **{k: meta(v) for k, v in kwargs.items()})
        except Exception:  # noqa: BLE001 - no meta kernel, or data-dependent: keep the values' layouts
            return None


def _check_layout(target):
    """An op wrote into a tensor of this level and changed its shape (an out= argument of the
    wrong size, `resize_`): the wrapper is laid out anew like its value."""
    if not isinstance(target, LevelTensor) or target.shape == target._value.shape:
        return
    value = target._value
    with torch.utils._mode_utils.no_dispatch():
        meta_in_tls = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            torch.ops.aten.resize_.default(target, value.shape)
            torch.ops.aten.as_strided_.default(target, value.shape, value.stride(), value.storage_offset())
        finally:
            torch._C._set_meta_in_tls_dispatch_include(meta_in_tls)


def _handler(op):
    """The whole of `op` at a functionalize level: its Functionalize kernel
    (`FunctionalizeInterpreter.kernel`), after its rule if it has one (rules.py;
    NotImplemented: the kernel after all); a write into a tensor not this level's goes to
    `_write_into_foreign` first."""
    writes = writes_of(op)

    def handle(level, args, kwargs):
        return level.kernel(op, writes, args, kwargs)

    rule = rule_for(op)
    if rule is not None:
        kernel = handle

        def handle(level, args, kwargs):
            out = rule(level, op, args, kwargs)
            return kernel(level, args, kwargs) if out is NotImplemented else out

    if writes is None:
        return handle

    def own_targets_first(level, args, kwargs):
        for target in writes.targets(args, kwargs):
            if not level.owns(target):
                return level._write_into_foreign(op, writes, args, kwargs)
        return handle(level, args, kwargs)

    return own_targets_first


_HANDLERS = resolved_once(_handler)
