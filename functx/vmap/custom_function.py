"""`torch.autograd.Function` at a vmap level.

A torch 2.x style Function is batched by
- its `vmap` staticmethod, called with `VmapInfo(batch_size, randomness)`, the in_dims
  (0 for this level's batched arguments, None otherwise) and the physical values; it
  returns `(outputs, out_dims)`;
- or, with `generate_vmap_rule = True`, by a generated Function whose `forward`,
  `setup_context`, `backward` and `jvp` are the user's under `vmap` (saved tensors keep
  their batch dims; gradients of unbatched inputs are summed over the batch);
- otherwise it is an error, as in torch.func.
The batched Function is applied one level down, so lower levels (a `grad` around the
`vmap`) see a Function with the user's backward, not its forward's operations.

An old-style Function (`forward(ctx, ...)`) runs once per batch element, one level down,
with one `functx.PerformanceWarning` per Function (torch.func refuses it): slow, but its
custom backward still holds.
"""

from __future__ import annotations

import threading
import warnings
from typing import NamedTuple

import optree
import torch

from ..core.custom_function import is_new_style, register_level_rule, user_backward
from ..core.errors import PerformanceWarning
from .batched_tensor import VmapInterpreter

_EXTENDING = "For more details, please see https://pytorch.org/docs/main/notes/extending.func.html"


class VmapInfo(NamedTuple):
    """What an autograd.Function's `vmap` staticmethod is told about the vmap."""

    batch_size: int
    randomness: str


def apply_at_vmap_level(level, function, args, kwargs):
    """`function.apply(*args)` where `level` (a vmap level) is the highest level."""
    name = function.__name__
    if not is_new_style(function):
        return _per_sample(level, function, args, kwargs)
    if any(isinstance(v, torch.Tensor) for v in kwargs.values()):
        raise NotImplementedError(
            f"Run vmap on autograd.Function with kwarg-only Tensor args. Please do not pass "
            f"kwarg-only Tensors to autograd.Function. Got: {kwargs}"
        )
    overridden = function.vmap is not torch.autograd.Function.vmap
    if getattr(function, "generate_vmap_rule", False):
        if overridden:
            raise RuntimeError(
                f"You tried to vmap over {name}, but it has both generate_vmap_rule=True and an "
                f"overridden vmap staticmethod. Please set generate_vmap_rule=False or delete the "
                f"overridden vmap staticmethod to avoid ambiguity. {_EXTENDING}"
            )
        return _apply_generated_rule(level, function, args, kwargs)
    if not overridden:
        raise RuntimeError(
            f"You tried to vmap over {name}, but it does not have vmap support. Please override "
            f"and implement the vmap staticmethod or set generate_vmap_rule=True. {_EXTENDING}"
        )
    in_dims = tuple(0 if level.is_batched(a) else None for a in args)
    values = tuple(level.unwrap(a) for a in args)
    result = function.vmap(VmapInfo(level.batch_size, level.randomness), in_dims, *values, **kwargs)
    return wrap_user_outputs(level, result, args, values)


def wrap_user_outputs(level, result, args, values):
    """Batched results of a user's vmap rule: `result` is its `(outputs, out_dims)`."""
    base = (
        "Expected the vmap staticmethod to have two returns, an output and out_dims with "
        "pytree structure compatible with the output. "
    )
    if not isinstance(result, tuple):
        raise RuntimeError(base + f"Got a {type(result)} instead")
    if len(result) != 2:
        raise RuntimeError(base + f"Got {len(result)} returns instead")
    outputs, out_dims = result
    flat, spec = optree.tree_flatten(outputs)
    if isinstance(out_dims, int) or out_dims is None:
        flat_dims = [out_dims] * len(flat)
    else:
        flat_dims = optree.tree_flatten(out_dims, none_is_leaf=True)[0]
        if len(flat_dims) != len(flat):
            raise RuntimeError(
                f"The autograd.Function's vmap staticmethod returned an incompatible (output, "
                f"out_dims) tuple. Expected out_dims={out_dims} to be compatible with the "
                f"structure of `output`. {_EXTENDING}"
            )
    wrapped = []
    for out, dim in zip(flat, flat_dims):
        if not isinstance(out, torch.Tensor) or dim is None:
            wrapped.append(out)
            continue
        original = next((a for a, v in zip(args, values) if v is out), None)
        wrapped.append(original if original is not None and dim == 0 else level.wrap(out.movedim(dim, 0)))
    return optree.tree_unflatten(spec, wrapped)


# -- old-style Functions: one call per batch element ----------------------------------
_warned: set = set()


def _per_sample(level, function, args, kwargs):
    if function not in _warned:
        _warned.add(function)
        warnings.warn(
            f"functx.vmap: {function.__name__} is an old-style autograd.Function (forward(ctx, ...) "
            f"without setup_context), so vmap runs it once per batch element, which is slow. Give "
            f"it a setup_context staticmethod (and a vmap staticmethod or generate_vmap_rule=True) "
            f"to batch it.",
            PerformanceWarning,
            stacklevel=4,
        )
    results = []
    for b in range(level.batch_size):
        sample = tuple(a._value[b] if level.is_batched(a) else a for a in args)
        results.append(function.apply(*sample, **kwargs))  # one level down
    first = results[0]
    if isinstance(first, torch.Tensor):
        return level.wrap(torch.stack(results))
    if type(first) is tuple or type(first) is list:
        return type(first)(
            level.wrap(torch.stack([r[i] for r in results])) if isinstance(o, torch.Tensor) else o
            for i, o in enumerate(first)
        )
    return first


# -- generate_vmap_rule = True ---------------------------------------------------------
class _Spec(NamedTuple):
    in_dims: tuple
    batch_size: int
    randomness: str


_pending = threading.local()  # the spec of the generated Function being applied
_generated: dict = {}


class _CtxProxy:
    """Stands for the real ctx: attributes it does not define itself go to the real one."""

    def __init__(self, ctx):
        object.__setattr__(self, "_ctx", ctx)

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    def __setattr__(self, name, value):
        setattr(self._ctx, name, value)


class _BatchedSaveCtx(_CtxProxy):
    """The ctx a user's `setup_context` sees under vmap: saved tensors are stored physical,
    with their batch dims."""

    def __init__(self, ctx, level):
        super().__init__(ctx)
        object.__setattr__(self, "_level", level)

    def _physical(self, tensors):
        level = self._level
        dims = tuple(0 if level.is_batched(t) else None for t in tensors)
        return tuple(level.unwrap(t) for t in tensors), dims

    def save_for_backward(self, *tensors):
        physical, dims = self._physical(tensors)
        self._ctx._functx_saved_dims = dims
        self._ctx.save_for_backward(*physical)

    def save_for_forward(self, *tensors):
        physical, dims = self._physical(tensors)
        self._ctx._functx_saved_forward_dims = dims
        self._ctx.save_for_forward(*physical)

    def mark_non_differentiable(self, *tensors):
        self._ctx.mark_non_differentiable(*self._physical(tensors)[0])

    def mark_dirty(self, *tensors):
        self._ctx.mark_dirty(*self._physical(tensors)[0])


class _SavedCtx(_CtxProxy):
    """The ctx a user's `backward`/`jvp` sees under vmap: per-sample saved tensors."""

    def __init__(self, ctx, saved):
        super().__init__(ctx)
        object.__setattr__(self, "saved_tensors", saved)


def _generated_rule_function(function):
    """A Function that is `function` under vmap (cached per Function class); the in_dims
    and batch size of the current application come in `_pending.spec`."""
    try:
        return _generated[function]
    except KeyError:
        pass
    from .api import vmap

    def forward(*values):
        spec = _pending.spec
        return vmap(function.forward, in_dims=spec.in_dims, randomness=spec.randomness)(*values)

    def setup_context(ctx, inputs, output):
        spec = _pending.spec
        ctx._functx_spec = spec
        ctx._functx_saved_dims = ()
        ctx._functx_saved_forward_dims = ()

        def inner(inputs, output):
            from ..core.interpreter import top_interpreter

            function.setup_context(_BatchedSaveCtx(ctx, top_interpreter()), inputs, output)
            return torch.zeros(())

        vmap(inner, in_dims=(spec.in_dims, 0), out_dims=None, randomness=spec.randomness)(tuple(inputs), output)

    def backward(ctx, *grads):
        spec = ctx._functx_spec
        grad_dims = tuple(None if g is None else 0 for g in grads)

        def inner(saved, grads):
            return user_backward(function)(_SavedCtx(ctx, saved), *grads)

        per_input = vmap(inner, in_dims=(ctx._functx_saved_dims, grad_dims), randomness=spec.randomness)(
            tuple(ctx.saved_tensors), grads
        )
        if not isinstance(per_input, tuple):
            per_input = (per_input,)
        # an unbatched input's gradient is the sum of its per-sample gradients
        return tuple(
            g.sum(0) if isinstance(g, torch.Tensor) and dim is None else g
            for g, dim in zip(per_input, spec.in_dims)
        )

    def jvp(ctx, *tangents):
        spec = ctx._functx_spec
        tangent_dims = tuple(None if t is None else d for t, d in zip(tangents, spec.in_dims))

        def inner(saved, tangents):
            return function.jvp(_SavedCtx(ctx, saved), *tangents)

        return vmap(inner, in_dims=(ctx._functx_saved_forward_dims or ctx._functx_saved_dims, tangent_dims), randomness=spec.randomness)(
            tuple(ctx.saved_tensors), tangents
        )

    name = f"{function.__name__}Vmapped"
    members = {
        "forward": staticmethod(forward),
        "setup_context": staticmethod(setup_context),
        "backward": staticmethod(backward),
        "jvp": staticmethod(jvp),
        "generate_vmap_rule": True,
        "__qualname__": name,
    }
    generated = type(name, (torch.autograd.Function,), members)
    _generated[function] = generated
    return generated


def _apply_generated_rule(level, function, args, kwargs):
    in_dims = tuple(0 if level.is_batched(a) else None for a in args)
    values = tuple(level.unwrap(a) for a in args)
    generated = _generated_rule_function(function)
    previous = getattr(_pending, "spec", None)
    _pending.spec = _Spec(in_dims, level.batch_size, level.randomness)
    try:
        outputs = generated.apply(*values, **kwargs)  # one level down (maybe another transform)
    finally:
        _pending.spec = previous
    return wrap_user_outputs(level, (outputs, 0), args, values)


register_level_rule(VmapInterpreter, apply_at_vmap_level)
