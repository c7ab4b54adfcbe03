"""`torch.autograd.Function` at a vmap level.

A torch 2.x style Function is batched by
- its `vmap` staticmethod, called with `VmapInfo(batch_size, randomness)`, the in_dims
  and the physical values; it returns `(outputs, out_dims)`, checked as torch.func checks
  them (and for the batch size, which torch.func does not check);
- or, with `generate_vmap_rule = True`, by a generated Function whose `forward`,
  `setup_context`, `backward` and `jvp` are the user's under `vmap` (saved tensors keep
  their batch dims; gradients of unbatched inputs are summed over the batch);
- otherwise it is an error, as in torch.func.
As in torch.func, `in_dims` is a tuple with one entry per positional argument (keywords
bound to forward's parameters), mirroring containers among the arguments (`F.apply([a, b])`
gets `([0, 0],)`), with None for non-tensors and tensors not batched at this level. An
int says where the batch dim of the physical value is. torch.func gives wherever its physical
batch dim happens to be; functx keeps its batch dim first, so it gives 0, except for a tensor
passed to vmap and handed to the Function as is (maybe written in place), where torch.func
gives vmap's in_dim (made non-negative, each vmap level its own; each chunk's with
chunk_size): functx gives that in_dim too, with the tensor passed to vmap (api.py records
it on the input's BatchedTensor as `_vmap_input`). After other ops the two may differ:
torch.func keeps the batch dim where it was through unary pointwise ops (`x.sin()`,
`x.clone()`: still the in_dim) and in-place view ops (`x.t_()`), and for an input of
`vmap(grad(f))` (functx's grad level there differentiates new batched tensors), where functx
gives 0; through binary ops, views and reductions both give 0. A correct `vmap` staticmethod reads the dims it
gets, so it works with both. torch.library custom ops' vmap rules get theirs the same way
(rules/custom_ops.py).

The batched Function is applied one level down, so lower levels (a `grad` around the
`vmap`) see a Function with the user's backward, not its forward's operations.

An old-style Function (`forward(ctx, ...)`) runs once per batch element, one level down,
as vmap's per-sample fallback runs an op without a rule, under the same setting
(`functx.set_vmap_fallback`): one `functx.PerformanceWarning` per Function ("warn"), none
("silent"), or a `NotImplementedError` ("error"; torch.func refuses it always): slow, but
its custom backward still holds. Tensors passed to a Function by keyword (what is left after
binding to a new-style forward's parameters) are refused, as torch.func does; for an
old-style Function, those batched at this level (each sample's call would get the whole
batch).
"""

from __future__ import annotations

import operator
import sys
import threading
import weakref
from typing import NamedTuple

import optree
import torch

from ..core.custom_function import apply_original, cached_on_class, is_new_style, user_backward, with_forward
from .fallback import refuse_if_switched_off, warn_once
from .mapping import flatten_in_dims, map_at_level
from .randomness import lowered

_EXTENDING = "For more details, please see https://pytorch.org/docs/main/notes/extending.func.html"


class VmapInfo(NamedTuple):
    """What a batching rule is told about the vmap it runs in: the first argument of an
    autograd.Function's `vmap` staticmethod and of a rule given to
    `functx.library.register_vmap`. A NamedTuple, built by functx; build one yourself to
    call a rule directly (in a unit test).

    Args:
        batch_size (int): the size of the mapped dim at this vmap level (of the chunk, with
            `vmap(..., chunk_size=...)`).
        randomness (str): the vmap's `randomness`: "error", "different" or "same".

    Raises:
        TypeError: a field missing or one too many, as for any NamedTuple; the values are
            not checked. The errors of a rule's return value are in the error catalogue
            ([autograd.Function](../errors.md#torchautogradfunction-under-transforms)).

    Examples:
        What a Function's `vmap` staticmethod gets:

        >>> import torch, functx
        >>> class Triple(torch.autograd.Function):
        ...     @staticmethod
        ...     def forward(x):
        ...         return 3 * x
        ...     @staticmethod
        ...     def setup_context(ctx, inputs, output):
        ...         pass
        ...     @staticmethod
        ...     def backward(ctx, grad):
        ...         return 3 * grad
        ...     @staticmethod
        ...     def vmap(info, in_dims, x):
        ...         print(info)
        ...         return 3 * x, in_dims[0]
        >>> functx.vmap(Triple.apply, randomness="same")(torch.ones(4, 2)).shape
        VmapInfo(batch_size=4, randomness='same')
        torch.Size([4, 2])

        Calling the rule directly, with a `VmapInfo` of one's own:

        >>> info = functx.library.VmapInfo(batch_size=4, randomness="error")
        >>> out, out_dim = Triple.vmap(info, (0,), torch.ones(4, 2))
        VmapInfo(batch_size=4, randomness='error')
        >>> out.shape, out_dim, info == functx.library.VmapInfo(4, "error")
        (torch.Size([4, 2]), 0, True)

    Differences from torch.func:
        torch.func's is `torch._functorch.autograd_function.VmapInfo`, a NamedTuple with
        the same two fields (not exported under a public name); the two compare equal for
        equal values, but are different classes (`isinstance` tells them apart).
    """

    batch_size: int
    randomness: str


def apply_at_vmap_level(level, function, args, kwargs):
    """`function.apply(*args)` where `level` (a vmap level) is the highest level."""
    if level.ad_above and is_new_style(function) and not getattr(_recording_above, "active", False):
        return _apply_recorded_above(level, function, args, kwargs)
    return _apply_batched(level, function, args, kwargs)


_recording_above = threading.local()


def _apply_recorded_above(level, function, args, kwargs):
    """With a direct AD level on values above this one (`VmapInterpreter.ad_above`), torch's
    autograd records on this level's BatchedTensors: the Function is applied there with
    torch's own apply, as a Function whose forward batches the user's (below, as without AD)
    and whose setup_context, backward and jvp are the user's, run on BatchedTensors."""
    generated = cached_on_class(function, "recorded_above", _recorded_above_function)
    previous = getattr(_recording_above, "call", None)
    _recording_above.call = (level, function, kwargs)
    try:
        return apply_original(generated, *args)
    finally:
        _recording_above.call = previous


def _recorded_above_function(function):
    def forward(*args):
        level, _, kwargs = _recording_above.call
        _recording_above.active = True
        try:
            return _apply_batched(level, function, args, kwargs)
        finally:
            _recording_above.active = False

    return with_forward(function, forward, "AboveVmap")


def _apply_batched(level, function, args, kwargs):
    # the user's vmap rule (or forward, one level down) runs on the physical values: the
    # modes of this vmap level and those above let its calls through (randomness.lowered)
    with lowered(level, None if is_new_style(function) else function):
        return _apply_batched_lowered(level, function, args, kwargs)


def _apply_batched_lowered(level, function, args, kwargs):
    name = function.__name__
    # A new-style Function's keywords bound to forward's parameters are in `args` already:
    # tensors left in `kwargs` are refused, as torch.func does. An old-style Function's are
    # passed as given, to each sample's call: one batched at this level would be the whole
    # batch there (unbatched ones are fine).
    new_style = is_new_style(function)
    kept = (lambda v: isinstance(v, torch.Tensor)) if new_style else level.is_batched
    if kwargs and any(kept(v) for v in optree.tree_leaves(kwargs, none_is_leaf=True)):
        raise NotImplementedError(
            f"Run vmap on autograd.Function with kwarg-only Tensor args. Please do not pass "
            f"kwarg-only Tensors to autograd.Function. Got: {kwargs}"
        )
    if not new_style:
        return _per_sample(level, function, args, kwargs)
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
    in_dims, values = in_dims_and_values(level, args, user_dims=True)
    result = function.vmap(VmapInfo(level.batch_size, level.randomness), in_dims, *values, **kwargs)
    return wrap_user_outputs(level, result, args, values, f"the vmap staticmethod of {name}", in_dims)


def in_dims_and_values(level, args, user_dims=False):
    """torch.func's in_dims for `args` (through containers: None for anything not batched at
    this level) and the physical values. The batch dim of a value is first (in_dim 0), or,
    with `user_dims`, where vmap's caller had it for a tensor passed to vmap as is."""
    leaves, spec = optree.tree_flatten(args, none_is_leaf=True)
    in_dims, values = [], []
    for a in leaves:
        if not level.is_batched(a):
            in_dims.append(None)
            values.append(a)
        elif user_dims and hasattr(a, "_vmap_input"):
            value, dim = _as_passed_to_vmap(a)
            values.append(value)
            in_dims.append(dim)
        else:
            values.append(a._value)
            in_dims.append(0)
    return optree.tree_unflatten(spec, in_dims), optree.tree_unflatten(spec, values)


def _as_passed_to_vmap(a):
    """`(physical value, in_dim)` of `a`, a vmap input (api.py set `a._vmap_input = (in_dim
    made non-negative, the tensor passed to vmap, the physical value made from it)` for an
    in_dim given other than 0): that tensor
    itself and its in_dim, as torch.func gives them (which keeps the identity of an outer
    level's input, so that level gives its in_dim too); the current physical value with its
    batch dim moved there if an inner AD level replaced it (lifted: the same layout); the
    physical value and 0 after in-place view ops (`a.t_()`) changed its layout."""
    dim, passed, physical = a._vmap_input
    value = a._value
    shape, stride = list(passed.shape), list(passed.stride())
    shape.insert(0, shape.pop(dim))
    stride.insert(0, stride.pop(dim))
    if list(value.shape) != shape or list(value.stride()) != stride:
        return value, 0
    return (passed if value is physical else value.movedim(0, dim)), dim


def wrap_user_outputs(level, result, args, values, rule="the vmap rule", in_dims=None):
    """Batched results of a user's vmap rule (`rule` names it in errors), given `in_dims`
    (None: 0 for every batched argument) and `values`: `result` is its `(outputs, out_dims)`.
    out_dims is checked as torch.func checks it (a prefix of the outputs' structure; ints or
    None; in range), plus the size of the batch dim, which torch.func does not check (a
    wrong size silently gives garbage there)."""
    base = (
        f"functx.vmap: expected {rule} to have two returns, an output and out_dims with "
        f"pytree structure compatible with the output. "
    )
    if not isinstance(result, tuple):
        raise RuntimeError(base + f"Got a {type(result)} instead")
    if len(result) != 2:
        raise RuntimeError(base + f"Got {len(result)} returns instead")
    outputs, out_dims = result
    # None is a leaf of both trees, as in torch's pytree: out_dims=(0, None) for (x, None)
    flat, spec = optree.tree_flatten(outputs, none_is_leaf=True)
    try:
        dims_tree = optree.tree_broadcast_prefix(out_dims, outputs, none_is_leaf=True)
    except ValueError:
        raise RuntimeError(
            f"functx.vmap: {rule} returned an incompatible (output, out_dims) tuple. Expected "
            f"out_dims={out_dims} to be compatible with the structure of `output`. out_dims has "
            f"structure {optree.tree_structure(out_dims, none_is_leaf=True)} but output has "
            f"structure {spec}. {_EXTENDING}"
        ) from None
    flat_dims = optree.tree_leaves(dims_tree, none_is_leaf=True)
    leaves = zip(optree.tree_leaves(args, none_is_leaf=True), optree.tree_leaves(values, none_is_leaf=True))
    # an input returned with its own in_dim as out_dim: the input itself, as in torch.func
    dims = optree.tree_leaves(in_dims, none_is_leaf=True) if in_dims is not None else None
    originals = {
        id(v): (a, 0 if dims is None else dims[i])
        for i, (a, v) in enumerate(leaves)
        if level.is_batched(a)
    }
    wrapped = []
    for i, (out, dim) in enumerate(zip(flat, flat_dims)):
        if not isinstance(out, torch.Tensor) or dim is None:  # None: the same for every sample
            wrapped.append(out)
            continue
        dim = _check_out_dim(level, rule, out_dims, i, out, dim)
        original, in_dim = originals.get(id(out), (None, None))
        wrapped.append(original if dim == in_dim else level.wrap(out.movedim(dim, 0)))
    return optree.tree_unflatten(spec, wrapped)


def _check_out_dim(level, rule, out_dims, i, out, dim) -> int:
    """`dim` (the out_dim of output `i`, a tensor) as a non-negative int, or a clear error."""
    what = f"functx.vmap: {rule} returned out_dims={out_dims!r}:"
    try:
        dim = operator.index(dim)  # ints, bools and integer tensors, as torch.func takes them
    except TypeError:
        raise TypeError(
            f"{what} out_dim {dim!r} for output {i} is a {type(dim).__name__}; expected an int "
            f"(where the output's batch dim is) or None (not batched). {_EXTENDING}"
        ) from None
    rank = out.dim()
    if not -rank <= dim < rank:
        raise IndexError(
            f"{what} out_dim {dim} for output {i} is out of range for a tensor of "
            f"{rank} dimensions (expected {-rank} <= out_dim < {rank}). {_EXTENDING}"
        )
    dim %= rank
    if out.shape[dim] != level.batch_size:
        raise RuntimeError(
            f"{what} output {i} has size {out.shape[dim]} in its out_dim {dim}, but the batch "
            f"size is {level.batch_size}. {_EXTENDING}"
        )
    return dim


# -- old-style Functions: one call per batch element ----------------------------------
_warned = weakref.WeakSet()  # the Functions warned about (not kept alive by it)


def _per_sample(level, function, args, kwargs):
    # the per-sample fallback's setting (functx.set_vmap_fallback) holds here too
    name = function.__name__
    refuse_if_switched_off(
        f"functx.vmap: {name} is an old-style autograd.Function (forward(ctx, ...) without "
        f"setup_context), which vmap can only run once per batch element, and the per-sample "
        f"fallback is switched off (functx.set_vmap_fallback('error')). Give it a setup_context "
        f"staticmethod (and a vmap staticmethod or generate_vmap_rule=True) to batch it."
    )
    warn_once(
        function,
        _warned,
        f"functx.vmap: {name} is an old-style autograd.Function (forward(ctx, ...) "
        f"without setup_context), so vmap runs it once per batch element, which is slow. Give "
        f"it a setup_context staticmethod (and a vmap staticmethod or generate_vmap_rule=True) "
        f"to batch it.",
    )
    results = []
    for b in range(level.batch_size):
        sample = optree.tree_map(lambda a: a._value[b] if level.is_batched(a) else a, args, none_is_leaf=True)
        results.append(_settled(function.apply(*sample, **kwargs)))  # one level down
    first = results[0]
    if isinstance(first, torch.Tensor):
        return level.wrap(torch.stack(results))
    if type(first) is tuple or type(first) is list:
        return type(first)(
            level.wrap(torch.stack([r[i] for r in results])) if isinstance(o, torch.Tensor) else o
            for i, o in enumerate(first)
        )
    return first


def _settled(out):
    """`out` with any collective behind it finished: torch's functional collectives return
    their output before it is filled (their Functions, e.g. the double backward of
    all_reduce, run here per sample), and stacking reads it at once."""
    if "torch.distributed._functional_collectives" not in sys.modules:
        return out
    wait = torch.ops._c10d_functional.wait_tensor
    return optree.tree_map(lambda o: wait(o) if isinstance(o, torch.Tensor) else o, out, none_is_leaf=True)


# -- generate_vmap_rule = True ---------------------------------------------------------
class _Spec:
    """How one application of a generated Function is batched. It is passed to the generated
    Function as its first argument (a plain object: levels and vmap see one non-tensor
    argument) rather than through a thread-local: under nested vmaps each level applies its
    own generated Function one level down before any forward runs, so a thread-local held
    the innermost application's spec when the outer forward ran, and the inner forward read
    the outer's in_dims (`vmap(vmap(F.apply, (0, 0)), (0, None))` broadcast wrongly)."""

    __slots__ = ("in_dims", "batch_size", "randomness", "kind")

    def __init__(self, in_dims, level):
        self.in_dims, self.batch_size, self.randomness, self.kind = in_dims, level.batch_size, level.randomness, type(level)

    def vmap(self, func, in_dims, out_dims=0):
        """`vmap(func, in_dims, out_dims, randomness)` over this application's batch: each call
        at a fresh level of the kind applying the Function (its class is not imported here:
        vmap/interpreter.py imports this module)."""

        def mapped(*args):
            leaves, flat_dims, tree = flatten_in_dims(func, in_dims, args)
            level = self.kind(self.batch_size, self.randomness)
            return map_at_level(level, func, leaves, flat_dims, tree, out_dims, {})

        return mapped


class _State:
    """What one generated Function keeps on the ctx: its spec and where the batch dims of
    the tensors saved through it are. Keyed on the ctx by the batched Function: under nested
    vmaps one ctx is shared by the generated Functions of every level (each one's
    `setup_context` runs the next one's on a proxy of the same ctx), and one set of
    attributes was overwritten by the inner levels."""

    __slots__ = ("spec", "saved_dims", "saved_forward_dims", "sample_shapes")

    def __init__(self, spec):
        self.spec, self.saved_dims, self.saved_forward_dims = spec, (), ()
        self.sample_shapes = ()  # per input: one sample's shape (None: not a tensor)


def _sample_shape(x, dim):
    if not isinstance(x, torch.Tensor):
        return None
    if dim is None:
        return x.shape
    dim %= x.dim()
    return x.shape[:dim] + x.shape[dim + 1 :]


def _state(ctx, function) -> _State:
    return ctx._functx_generated[function]


class _CtxProxy:
    """Stands for the real ctx: attributes it does not define itself go to the real one.
    `needs_input_grad` drops the generated Function's first input (its spec)."""

    def __init__(self, ctx):
        object.__setattr__(self, "_ctx", ctx)

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    def __setattr__(self, name, value):
        setattr(self._ctx, name, value)

    @property
    def needs_input_grad(self):
        return self._ctx.needs_input_grad[1:]


class _BatchedSaveCtx(_CtxProxy):
    """The ctx a user's `setup_context` sees under vmap: saved tensors are stored physical,
    with their batch dims (recorded in `state`)."""

    def __init__(self, ctx, level, state):
        super().__init__(ctx)
        object.__setattr__(self, "_level", level)
        object.__setattr__(self, "_state", state)

    def _physical(self, tensors):
        level = self._level
        dims = tuple(0 if level.is_batched(t) else None for t in tensors)
        return tuple(level.unwrap(t) for t in tensors), dims

    def save_for_backward(self, *tensors):
        physical, self._state.saved_dims = self._physical(tensors)
        self._ctx.save_for_backward(*physical)

    def save_for_forward(self, *tensors):
        physical, self._state.saved_forward_dims = self._physical(tensors)
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
    """A Function that is `function` under vmap; the in_dims and batch size of the current
    application come as its first argument, a `_Spec`. Made once per Function class
    (`cached_on_class`)."""

    def forward(spec, *values):
        return spec.vmap(function.forward, spec.in_dims)(*values)

    def setup_context(ctx, inputs, output):
        spec, inputs = inputs[0], inputs[1:]
        states = getattr(ctx, "_functx_generated", None)
        if states is None:
            states = ctx._functx_generated = {}
        state = states[function] = _State(spec)
        state.sample_shapes = tuple(_sample_shape(x, d) for x, d in zip(inputs, spec.in_dims))

        def inner(inputs, output):
            from ..core.interpreter import top_interpreter

            function.setup_context(_BatchedSaveCtx(ctx, top_interpreter(), state), inputs, output)
            return torch.zeros(())

        spec.vmap(inner, (spec.in_dims, 0), out_dims=None)(tuple(inputs), output)

    def backward(ctx, *grads):
        state = _state(ctx, function)
        spec = state.spec
        grad_dims = tuple(None if g is None else 0 for g in grads)

        is_none = []  # per input: whether the user's backward gave None (vmap needs tensors)

        def inner(saved, grads):
            per_input = user_backward(function)(_SavedCtx(ctx, saved), *grads)
            per_input = per_input if isinstance(per_input, tuple) else (per_input,)
            is_none[:] = [g is None for g in per_input]
            # A gradient of a broadcast input may come back unreduced (torch's engine sums
            # it to the input's shape): reduce it per sample here, where the shapes are one
            # sample's; the engine would sum the physical batch dim too (MulGenVmap under
            # vjp(vmap) was off by up to 5.8 where the batch size equals the broadcast size).
            return tuple(
                g if shape is None or g.shape == shape else g.sum_to_size(shape)
                for g, shape in zip(per_input, state.sample_shapes)
                if g is not None
            )

        tensors = iter(
            spec.vmap(inner, (state.saved_dims, grad_dims))(tuple(ctx.saved_tensors), grads)
        )
        per_input = tuple(None if none else next(tensors) for none in is_none)
        # an unbatched input's gradient is the sum of its per-sample gradients; none for the spec
        return (None,) + tuple(
            g.sum(0) if isinstance(g, torch.Tensor) and dim is None else g
            for g, dim in zip(per_input, spec.in_dims)
        )

    def jvp(ctx, *tangents):
        state = _state(ctx, function)
        spec = state.spec
        tangents = tangents[1:]  # (the spec has none)
        tangent_dims = tuple(None if t is None else d for t, d in zip(tangents, spec.in_dims))

        # A jvp may return None for an output with no tangent (SortGenVmap's indices): vmap
        # takes the tensors only, and the Nones go back in their places.
        none_at = []

        def inner(saved, tangents):
            out = function.jvp(_SavedCtx(ctx, saved), *tangents)
            if type(out) is tuple:
                none_at[:] = [o is None for o in out]
                return tuple(o for o in out if o is not None)
            return out

        out = spec.vmap(inner, (state.saved_forward_dims or state.saved_dims, tangent_dims))(
            tuple(ctx.saved_tensors), tangents
        )
        if not any(none_at):
            return out
        tensors = iter(out)
        return tuple(None if none else next(tensors) for none in none_at)

    name = f"{function.__name__}Vmapped"
    members = {
        "forward": staticmethod(forward),
        "setup_context": staticmethod(setup_context),
        "backward": staticmethod(backward),
        "jvp": staticmethod(jvp),
        "generate_vmap_rule": True,
        "__qualname__": name,
    }
    if function.jvp is torch.autograd.Function.jvp:  # none to vmap: torch's own error, which the
        del members["jvp"]  # forward transforms answer by the double-VJP identity (ad/forward.py)
    return type(name, (torch.autograd.Function,), members)


def _apply_generated_rule(level, function, args, kwargs):
    # batch dims first: these in_dims stay inside (the user's code runs under vmap), and
    # the generated backward gives each input's gradient with its batch dim first
    in_dims, values = in_dims_and_values(level, args)
    generated = cached_on_class(function, "vmap", _generated_rule_function)
    spec = _Spec(in_dims, level)
    outputs = generated.apply(spec, *values, **kwargs)  # one level down (maybe another transform)
    return wrap_user_outputs(level, (outputs, 0), args, values, f"the generated vmap rule of {function.__name__}")

