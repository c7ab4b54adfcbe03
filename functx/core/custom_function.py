"""How functx sees `torch.autograd.Function.apply`.

An autograd.Function is not an ATen op: its `apply` never reaches `__torch_dispatch__`,
and a TorchFunctionMode does not see it either. So importing functx replaces
`Function.apply` by `_apply`, which hands the call to the highest level among the
arguments (`Interpreter.apply_function`); that level transforms the Function once and
applies the result one level down, where the next level does the same, until plain torch
runs it. It has to be in place for good, not only while a transform runs: code binds
`F.apply` early (`vmap(F.apply)`, `op = F.apply` at import time). On a thread with no
transform running, `_apply` calls torch's own `apply` at once: one thread-local check
(measured: +0.2 µs on the 12 µs of torch's own `apply` for a trivial Function), and
torch behaves exactly as before for everyone else.

    >>> import torch, functx
    >>> class Cube(torch.autograd.Function):
    ...     @staticmethod
    ...     def forward(x):
    ...         return x ** 3
    ...     @staticmethod
    ...     def setup_context(ctx, inputs, output):
    ...         ctx.save_for_backward(inputs[0])
    ...     @staticmethod
    ...     def backward(ctx, g):
    ...         (x,) = ctx.saved_tensors
    ...         return 3 * x ** 2 * g
    >>> functx.grad(lambda x: Cube.apply(x))(torch.tensor(2.0)).item()
    12.0
    >>> Cube.apply(torch.tensor(2.0)).item()  # no transform: torch's own apply
    8.0
"""

from __future__ import annotations

import inspect
import threading

import optree
import torch
from torch.autograd.function import _is_setup_context_defined

from . import interpreter as _interpreter  # (imports this module first: use at call time)
from .forward_ad_state import applying_at_torch_level, applying_function
from .level_tensor import LevelTensor, unwrap_dead
from .patches import patch
from .recompute import contexts_to_restore

_ORIGINAL_APPLY = torch.autograd.Function.__dict__["apply"]  # the classmethod object
_original_apply_function = _ORIGINAL_APPLY.__func__


def apply_original(function, *args, **kwargs):
    """Run `function` (an autograd.Function subclass) with torch's own `apply`."""
    return _original_apply_function(function, *args, **kwargs)


_REPLACED: dict = {}  # Function class -> what runs instead of its apply under a transform


_function_body = threading.local()  # `depth`: Functions being applied on plain values


class function_body:
    """While a Function is applied (its forward, jvp, vmap staticmethods run): what they do
    is the Function's, not the user's program. `jvp` may update a tangent in place, as
    NumpyExp_ does with mark_dirty, which the captured-write check (ad/lifting.CapturedWrites)
    lets be; torch runs `forward` with grad mode off, which the double-VJP fallback's watch
    for no_grad regions (ad/forward.py) does not count."""

    __slots__ = ()

    def __enter__(self):
        _function_body.depth = getattr(_function_body, "depth", 0) + 1

    def __exit__(self, *exc):
        _function_body.depth -= 1


def in_function_body() -> bool:
    return getattr(_function_body, "depth", 0) > 0


def replace_under_transforms(function, replacement) -> None:
    """Under any functx transform, and where a recomputation would have to enter a context
    again (core/recompute.py: inside `functional_call`), `function.apply(*args, **kwargs)`
    calls `replacement(*args, **kwargs)` instead (torch's reentrant checkpoint, whose
    backward recomputes outside both: ad/checkpointing.py)."""
    _REPLACED[function] = replacement


def cached_on_class(function, key, make):
    """`make(function)`, made once per Function class and kept on the class itself.

    Not in a module-level dict: that would keep every Function class alive for good, and
    classes defined inside a function called in a loop would pile up. What is cached here
    (generated Functions) refers back to the class, so a `WeakKeyDictionary` would not free
    it either; on the class, the two form a cycle that `gc` collects with the class. Read
    from the class's own `__dict__`: a subclass must not find its parent's entries.
    """
    cache = function.__dict__.get("_functx_cache")
    if cache is None:
        cache = {}
        setattr(function, "_functx_cache", cache)
    try:
        return cache[key]
    except KeyError:
        value = cache[key] = make(function)
        return value


def user_backward(function):
    """The user's backward: `backward`, or its alias `vjp` where that is the one overridden."""
    if function.vjp is not torch.autograd.Function.vjp:
        return function.vjp
    return function.backward


def with_forward(function, forward, suffix, jvp=None):
    """A Function class running `forward` and the user's `setup_context`, `backward` and
    (unless `jvp` is given) `jvp`: how a level applies a user's Function its own way while
    torch's autograd records it as the user's."""

    def setup_context(ctx, inputs, output):
        return function.setup_context(ctx, inputs, output)

    def backward(ctx, *grads):
        return user_backward(function)(ctx, *grads)

    def user_jvp(ctx, *tangents):
        return function.jvp(ctx, *tangents)

    name = f"{function.__name__}{suffix}"
    members = {
        "forward": staticmethod(forward),
        "setup_context": staticmethod(setup_context),
        "backward": staticmethod(backward),
        "jvp": staticmethod(jvp or user_jvp),
        "__qualname__": name,
    }
    return type(name, (torch.autograd.Function,), members)


def is_new_style(function) -> bool:
    """torch 2.x style: `forward` without ctx plus a `setup_context` staticmethod."""
    return _is_setup_context_defined(function.setup_context)


def _apply(cls, *args, **kwargs):
    replacement = _REPLACED.get(cls)
    if replacement is not None and (_interpreter._stack.interpreters or contexts_to_restore()):
        return replacement(*args, **kwargs)
    if not _interpreter._stack.interpreters:  # no transform running on this thread
        return _original_apply_function(cls, *args, **kwargs)
    if is_new_style(cls):  # torch binds keywords and defaults to forward's positions too
        signature = cached_on_class(cls, "signature", _forward_signature)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        args, kwargs = bound.args, bound.kwargs
    # Tensors inside containers count too (`F.apply([a, b])`): torch.func looks through
    # pytrees, and a level must see them to unwrap them before applying one level down.
    leaves, spec = optree.tree_flatten(args, none_is_leaf=True)
    if any(isinstance(a, LevelTensor) and not a._interp.alive for a in leaves):
        leaves = [unwrap_dead(a) for a in leaves]
        args = optree.tree_unflatten(spec, leaves)
    top = None
    for a in leaves:
        if isinstance(a, LevelTensor) and (top is None or a._interp.level > top.level):
            top = a._interp
    if top is None:
        for interp in reversed(_interpreter._stack.interpreters or contexts_to_restore()):
            if interp.functions_on_plain_values:
                out = interp.apply_function(cls, args, kwargs)
                if out is not NotImplemented:
                    return out
                break
        if torch._C._is_fwd_grad_enabled():  # torch's forward AD calls its jvp for its own level
            with function_body(), applying_at_torch_level():
                return _original_apply_function(cls, *args, **kwargs)
        with function_body():
            return _original_apply_function(cls, *args, **kwargs)
    with applying_function(), function_body():  # torch's forward AD off in its forward and jvp is not the user's
        out = top.apply_function(cls, args, kwargs)
    if out is NotImplemented:
        raise NotImplementedError(f"functx: {type(top).__name__} levels do not support torch.autograd.Function")
    return out


def _forward_signature(function):
    return inspect.signature(function.forward)


# what users see in error messages and reprs (`vmap(apply, ...)`), as with torch's own
_apply.__name__, _apply.__qualname__ = "apply", "Function.apply"
patch(
    torch.autograd.Function,
    "apply",
    classmethod(_apply),
    "a Function applied while a transform runs goes to the highest level among its arguments",
)
