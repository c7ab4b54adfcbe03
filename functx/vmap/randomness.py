"""Random ops under vmap: the `randomness` policy ("error", "different", "same").

Random ops that touch a BatchedTensor reach the batching rules in `rules/random.py`.
Random ops on values that are not batched at this level — factories such as
`torch.randn(3)` that take no tensor at all, or `torch.rand_like(w)` of a captured `w` —
never reach the dispatcher through a BatchedTensor, so a handler of torch calls (core/torch_function.py), live for
the duration of each vmap call, intercepts them. It costs two dictionary lookups for
every other torch call. The same handler also routes two non-random calls: indexing with
batched 0-dim integer tensors, and `torch.autograd.grad` / `.backward()` (autograd_calls.py).

Torch functions written in Python (`torch.svd_lowrank`, `F.gumbel_softmax`,
`torch.nn.init.normal_`) reach the handler as one call; their bodies run with the handler on, so
the draws inside follow the policy too. Code that runs below a vmap level while its handler is
live (an autograd.Function's `vmap` staticmethod and the forward it applies one
level down) runs with that level's handler, and those above it, lowered (`lowered`).
"""

from __future__ import annotations

import threading
from types import FunctionType

import torch
import torch.nn.functional as F
from torch.overrides import redispatch_function

from ..core.errors import ISSUES
from ..core.factories import FACTORIES
from ..core.forward_ad_state import in_level_rule
from ..core.interpreter import current_stack
from ..core.torch_function import CallHandler, call_outer, seen_by_outer, seen_here_and_outer
from ..core.level_tensor import LevelTensor, call_at_values, level_of
from .autograd_calls import route_autograd_grad, route_backward
from .chain import peel

RANDOMNESS_MODES = ("error", "different", "same")


def check_randomness(randomness):
    if randomness not in RANDOMNESS_MODES:
        raise RuntimeError(
            f"Only allowed values for randomness are 'error', 'different', or 'same'. Got {randomness}"
        )


def random_op_error():
    return RuntimeError(
        "vmap: called random operation while in randomness error mode. Please either use the "
        "'same' or 'different' randomness flags on vmap or perform the randomness operation "
        "out of vmap"
    )


def inplace_different_error():
    return RuntimeError(
        "vmap: Cannot ask for different inplace randomness on an unbatched tensor. This will "
        "appear like same randomness. If this is necessary for your usage, please file an issue "
        f"at {ISSUES}."
    )


def _size_of_factory(func, args, kwargs):
    """Split a random factory call into (size, rebuild) where rebuild(new_size) calls it again."""
    if func in (torch.rand, torch.randn):
        if "size" in kwargs:
            size = tuple(kwargs["size"])
            return size, lambda new: func(*args, **{**kwargs, "size": new})
        size = tuple(args[0]) if len(args) == 1 and not isinstance(args[0], int) else tuple(args)
        return size, lambda new: func(new, **kwargs)
    # randint(high, size) / randint(low, high, size); normal(mean, std, size)
    if "size" in kwargs:
        size = tuple(kwargs["size"])
        return size, lambda new: func(*args, **{**kwargs, "size": new})
    size = tuple(args[-1])
    return size, lambda new: func(*args[:-1], new, **kwargs)


def _is_factory_call(func, args, kwargs):
    if func is torch.normal:  # normal(float, float, size) is a factory; normal(Tensor, ...) is not
        return not any(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values()))
    return True


def _dropout_is_active(func, args, kwargs):
    """Dropout draws random numbers only in training mode and with p > 0."""
    p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
    if func in (torch.dropout, torch.dropout_, torch.feature_dropout, torch.alpha_dropout, torch.native_dropout):
        training = args[2] if len(args) > 2 else kwargs.get("train", True)
    else:
        training = args[2] if len(args) > 2 else kwargs.get("training", True)
    return bool(training) and p != 0


class _Lowered(threading.local):
    # the vmap levels whose handlers let calls through untouched (`lowered`), each mapped to
    # None, or to the old-style Function it runs once per batch element
    interps: dict = {}


_lowered = _Lowered()


class lowered:
    """While code of the levels below runs on the physical values of vmap level `level` (an
    autograd.Function's `vmap` staticmethod, and the Function it applies one level down,
    whose `forward` torch runs on plain tensors), the handlers of `level` and of the vmap
    levels above it let every call through untouched, as torch.func's `interpreter.lower()`
    does: that code is not the vmapped function's (an inner vmap's handler would batch a draw
    of code that runs below it). Otherwise a tensor such a `forward` made
    (`torch.as_tensor(ndarray)`, `torch.tensor(list)`) was lifted into a batched copy when
    a direct grad level had batched an input (`_lift_buffer`), and the forward handed a
    BatchedTensor to torch's autograd: `vmap(grad(f), in_dims=(0, None))` gave garbage
    per-sample gradients.

    `per_sample`: the old-style Function `level` runs once per element (its forward is the
    vmapped function's code for one element): its random calls draw per element, which is
    `randomness="different"`; under "error" they raise and under "same" they are refused
    (`_check_per_sample_draw`)."""

    __slots__ = ("_below", "_previous")

    def __init__(self, level, per_sample=None):
        self._below = {v: None for v in current_stack() if type(v) is type(level) and v.level > level.level}
        self._below[level] = per_sample

    def __enter__(self):
        self._previous = _lowered.interps
        _lowered.interps = {**self._previous, **self._below}

    def __exit__(self, *exc):
        _lowered.interps = self._previous


def _check_per_sample_draw(interp, function, func, args, kwargs):
    kind = _RANDOM_FUNCS[func]
    if kind not in ("factory", "tensor", "dropout", "inplace") or interp.randomness == "different":
        return
    if kind == "dropout" and not _dropout_is_active(func, args, kwargs):
        return
    if interp.randomness == "error":
        raise random_op_error()
    raise RuntimeError(
        f"vmap: randomness='same' cannot hold inside the old-style autograd.Function "
        f"{function.__name__}: vmap runs it once per batch element, so every element draws its "
        f"own numbers. Use randomness='different', or give {function.__name__} a setup_context "
        f"staticmethod and a vmap staticmethod (or generate_vmap_rule=True)."
    )


class RandomnessMode(CallHandler):
    """Applies one vmap level's randomness policy to random calls on unbatched values."""

    def __init__(self, interp):
        self.interp = interp

    def torch_function(self, func, types, args, kwargs):
        # Paid by every torch call of the vmapped function: the common case (not random, not
        # written in Python, nothing to lift) answers after two lookups.
        kind = _RANDOM_FUNCS.get(func)
        interp = self.interp
        if kind is None:
            whole = interp.whole_calls.get(func)
            if whole is not None and interp.lifted_bases is None and not (_lowered.interps and interp in _lowered.interps):
                out = whole(interp, args, kwargs)
                if out is not NotImplemented:
                    return out
            python_body = _written_in_python(func)
            direct = interp.direct_ad
            lifts = direct is not None and func in FACTORIES and direct.lifts_buffers
            if not (python_body or lifts or interp.over_dual_values):
                return NotImplemented
        below = _lowered.interps
        if below and interp in below:  # code running below this level (`lowered`)
            if below[interp] is not None and kind is not None:
                _check_per_sample_draw(interp, below[interp], func, args, kwargs)
            return NotImplemented
        if kind is None:
            if python_body and not in_level_rule():
                # Its body would run with this level's handler off (we are inside it): the
                # `torch.randn` inside svd_lowrank was neither refused ("error") nor drawn
                # per element ("different"), and its buffers were not lifted. Run the body
                # with the handler on, skipping the one hop of torch function that brought
                # the call here, so each of its torch calls is handled as the user's own.
                with seen_here_and_outer():
                    return redispatch_function(func, types, args, kwargs)
            if interp.over_dual_values and not in_level_rule():  # core/dual_values.py
                out = call_at_values(lambda *a, **k: call_outer(func, types, a, k), args, kwargs)
            elif lifts:
                out = call_outer(func, types, args, kwargs)
            else:
                return NotImplemented
            if lifts:
                with seen_by_outer():
                    return _lift_buffer(interp, direct, out)
            return out
        if kind == "index":
            return _index_with_tensor_scalars(func, args, kwargs)
        with seen_by_outer():  # (their draws and what they make: an outer level's too)
            if kind == "autograd":
                return route_autograd_grad(interp, func, args, kwargs)
            if kind == "backward":
                return route_backward(interp, func, args, kwargs)
            return _handle_random(interp, func, kind, args, kwargs)


def _written_in_python(func) -> bool:
    """Whether `func` is a torch function written in Python (torch.svd_lowrank,
    torch.pca_lowrank, F.gumbel_softmax, torch.nn.init.*, any library function with a
    `has_torch_function` guard), which reaches the handlers as one call when it meets a wrapper.
    Not the Tensor methods written in Python (`unflatten`, `split`, `__rsub__`; none draws):
    the `super().unflatten(...)` in their body reaches the handlers as the Python method again,
    and running that body with the handler on would recurse."""
    return type(func) is FunctionType and getattr(torch.Tensor, func.__name__, None) is not func


def _lift_buffer(interp, direct, out):
    """A buffer the function made under a direct grad level that batched some input of its
    own (ad/direct_reverse.py `lift_buffer`): batched at that level's vmap levels, by the
    innermost one only (the handlers of the others see the result already lifted)."""
    if (
        interp is direct.vmap_levels[-1]
        and type(out) is torch.Tensor
        and (out.is_floating_point() or out.is_complex())
    ):
        lifted = direct.lift_buffer(out)
        physical = peel(direct.vmap_levels, lifted)
        # while unwritten, it still stands for `out` (batched_tensor._unlifted_fresh_constants)
        lifted._fresh_origin = (out, physical, physical._version)
        return lifted
    return out


def _batched_here(interp, args, kwargs):
    """Does a tensor argument hold a value batched at this level, possibly under the
    wrappers of higher levels (a grad level inside this vmap)? Then the op reaches this
    level's batching rules through the dispatcher and needs nothing here."""
    for a in (*args, *kwargs.values()):
        while isinstance(a, LevelTensor):
            if a._interp is interp:
                return True
            a = a._value
    return False


def _handle_random(interp, func, kind, args, kwargs):
    if kind == "dropout" and not _dropout_is_active(func, args, kwargs):
        return NotImplemented
    if kind == "factory" and not _is_factory_call(func, args, kwargs):
        kind = "tensor"  # torch.normal(mean_tensor, std): a random function of tensors
    if kind != "factory" and _batched_here(interp, args, kwargs):
        return NotImplemented  # the batching rules see it
    randomness = interp.randomness
    if randomness == "error":
        raise random_op_error()
    if randomness == "same":
        return NotImplemented
    # randomness == "different": draw one sample per batch element
    if kind == "inplace":
        raise inplace_different_error()
    batch = interp.batch_size
    if kind == "factory":
        if func is torch.randperm:
            return interp.wrap(torch.stack([func(*args, **kwargs) for _ in range(batch)]))
        size, rebuild = _size_of_factory(func, args, kwargs)
        return interp.wrap(rebuild((batch, *size)))
    # A random function of tensors that are not batched here: batch them (every element
    # holds the same value), then call it again, so that the batching rules draw per element.
    # Calling it on the expanded plain values instead would be wrong for ops that read the
    # rank: dropout2d/3d would draw one mask per (element, sample) pair instead of per
    # channel, or repeat it; multinomial refuses 3-D probabilities.
    if kind == "dropout" and (kwargs.get("inplace") or (len(args) > 3 and args[3])):
        raise inplace_different_error()
    lifted = [_batch_here(interp, a) if isinstance(a, torch.Tensor) else a for a in args]
    lifted_kw = {k: _batch_here(interp, v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    return func(*lifted, **lifted_kw)


def _batch_here(interp, t):
    """`t`, not batched at this level, as a BatchedTensor of this level with the same value
    for every element. A higher level's wrapper (a grad level inside this vmap) must stay
    above the batch dim, so the batch enters through an op that dispatches through it (a
    product with ones, exact for every value)."""
    batch = interp.batch_size
    if level_of(t) < interp.level and not interp.ad_above:
        # (with AD above this level, torch's autograd records on this level's tensors: the
        # batch must enter through an op it records, the product below)
        return interp.wrap(t.expand(batch, *t.shape))
    ones = interp.wrap(torch.ones((), dtype=t.dtype, device=t.device).expand(batch))
    return t * ones


def _is_batched_integer_scalar(index) -> bool:
    return (
        isinstance(index, LevelTensor)
        and index.dim() == 0
        and not index.is_floating_point()
        and not index.is_complex()
        and index.dtype is not torch.bool
    )


def _index_with_tensor_scalars(func, args, kwargs):
    """`x[i]` / `x[i, j] = v` with 0-dim integer tensors that are batched: Python indexing
    would turn them into ints with `.item()`, which vmap cannot do; as advanced indices
    they select the same elements (one per batch element)."""
    index = args[1]
    parts = index if type(index) is tuple else (index,)
    if not parts or not all(_is_batched_integer_scalar(p) for p in parts):
        return NotImplemented
    if func is torch.Tensor.__getitem__:
        return torch.ops.aten.index.Tensor(args[0], list(parts))
    with seen_by_outer():  # (the value made here is a factory's, for the outer levels too)
        torch.ops.aten.index_put_.default(args[0], list(parts), torch.as_tensor(args[2], dtype=args[0].dtype))
    return None


# Not random, but also seen here: indexing by batched 0-dim integer tensors (above), and
# `torch.autograd.grad` / `.backward()` inside `vmap(grad(f))` (autograd_calls.py).
_RANDOM_FUNCS = {
    torch.Tensor.__getitem__: "index",
    torch.Tensor.__setitem__: "index",
    torch.autograd.grad: "autograd",
    torch.Tensor.backward: "backward",
}
for _f in (torch.rand, torch.randn, torch.randint, torch.randperm, torch.normal):
    _RANDOM_FUNCS[_f] = "factory"
for _f in (
    torch.rand_like, torch.randn_like, torch.randint_like, torch.bernoulli, torch.Tensor.bernoulli,
    torch.multinomial, torch.Tensor.multinomial, torch.poisson, torch.rrelu, F.rrelu,
    # what torch.distributions samples with (Binomial, Gamma/Beta/Chi2, Dirichlet)
    torch.binomial, torch._standard_gamma, torch._sample_dirichlet,
):
    _RANDOM_FUNCS[_f] = "tensor"
for _f in (
    F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
    torch.dropout, torch.feature_dropout, torch.alpha_dropout, torch.native_dropout,
):
    _RANDOM_FUNCS[_f] = "dropout"
for _f in (
    torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.random_, torch.Tensor.exponential_,
    torch.Tensor.geometric_, torch.Tensor.cauchy_, torch.Tensor.log_normal_, torch.Tensor.bernoulli_,
    torch.rrelu_,
):
    _RANDOM_FUNCS[_f] = "inplace"
