"""vmap over nested tensors (`torch.nested`, jagged or strided layout): one sample at a time.

A nested tensor at in_dim 0 is a batch of samples whose shapes differ, so no BatchedTensor
can hold it: a level tensor's per-sample shape is one shape, and torch's autograd formulas
read it (a `sum`'s backward expands its gradient to the saved shape). vmap therefore calls
the function once per sample, on the sample itself (a dense tensor; dense inputs sliced at
their in_dim), with one `functx.PerformanceWarning` per call: what a loop over `unbind()`
computes, so every transform inside or around composes as on any Python loop. The
per-sample outputs are joined by `join_samples`: stacked where every sample's output has the
same shape (per-sample gradients, losses, pooled features), a nested tensor otherwise
(jagged where the inputs were and the shapes differ in one dim, strided else).
`randomness` keeps its meaning: "error" raises when a call moved the global random state,
"same" starts every call from one state, "different" lets them draw in turn.

torch.func batches strided nested tensors through a per-op fallback; functx also runs where
that refuses (jagged inputs, `x.shape` inside, nested and dense inputs mapped at different
dims, `vmap(vmap(f))`, Python control flow on a sample's values).

    >>> import torch, functx, warnings
    >>> x = torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3)], layout=torch.jagged)
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore", functx.PerformanceWarning)
    ...     functx.vmap(lambda s: s.sum(0))(x)
    tensor([[2., 2., 2.],
            [4., 4., 4.]])
"""

from __future__ import annotations

import traceback

import torch

from ..core import config, pytree
from ..core.containers import is_container
from ..core.errors import PerformanceWarning, internal_dirs, warn
from .containers import container_leaf
from .mapping import name_of, out_dims_per_leaf
from .randomness import random_op_error

__all__ = ["nested_batch_size", "map_per_sample", "join_samples", "per_sample_reason", "raise_written_before_fallback"]

_ONLY_DIM_0 = "Nested tensors can only be vmapped over dim=0"  # torch.func's words, which users' code matches


def nested_batch_size(func_name: str, in_dims, where: str, x: torch.Tensor, dim) -> int:
    """The number of components of nested tensor `x`, checking that `dim` (its in_dim) is 0
    (RuntimeError, as torch.func's)."""
    if dim % x.dim() != 0:
        raise RuntimeError(
            f"vmap({func_name}, in_dims={in_dims}, ...)(<inputs>): {where} is a nested tensor "
            f"with in_dim={dim}. {_ONLY_DIM_0} (its components, whose shapes differ): give it "
            f"in_dim 0, or None to pass it to the function whole."
        )
    return x.size(0)


def map_per_sample(func, leaves, flat_dims, spec, batch_size, randomness, out_dims, kwargs, layout, reason):
    """vmap of `func` over `leaves` (the args' flat leaves, `spec` their structure, mapped at
    `flat_dims`; a nested one at 0) as a loop over the samples, outputs joined by
    `join_samples` into `layout`'s nested tensors where their shapes differ (layout None: an
    error). `reason`: why, for the warning ("": a nested input)."""
    name = name_of(func)
    warn_per_sample(name, batch_size, reason)
    samples = [None if d is None else _samples_of(x, d) for x, d in zip(leaves, flat_dims)]
    state = _random_state() if randomness != "different" else None
    outputs = []
    for b in range(batch_size):
        if randomness == "same":
            torch.set_rng_state(state[0])
        args = pytree.tree_unflatten(spec, [x if s is None else s[b] for x, s in zip(leaves, samples)])
        outputs.append(func(*args, **kwargs))
        if randomness == "error" and not _same_state(state, _random_state()):
            raise random_op_error()
    keep_whole = container_leaf()
    flat = [pytree.tree_flatten(o, none_is_leaf=True, is_leaf=keep_whole) for o in outputs]
    out_spec = flat[0][1]
    for _, other in flat:
        if other != out_spec:
            raise ValueError(
                f"vmap({name}, ...): `{name}` returned outputs of different structures for different "
                f"samples ({out_spec} and {other}); vmap needs one structure."
            )
    flat_out_dims = out_dims_per_leaf(func, out_dims, outputs[0], len(flat[0][0]), keep_whole)
    joined = [join_samples(name, out_dims, i, [f[0][i] for f in flat], d, layout) for i, d in enumerate(flat_out_dims)]
    return pytree.tree_unflatten(out_spec, joined)


def raise_written_before_fallback(func, error):
    """The batched attempt wrote into an input before an op needed a sample's value: running
    the function again per sample would write twice, so refuse (a wrong number otherwise)."""
    name = name_of(func)
    raise RuntimeError(
        f"vmap({name}, ...): {per_sample_reason(error)}, so vmap would run {name} once per sample, "
        f"but {name} had already written in place into one of its inputs, and running it again "
        f"would write a second time. Write into a copy (x = x.clone()) or after the value is read, "
        f"or compute both branches and select with torch.where."
    ) from error


def _samples_of(x, dim: int):
    """`x`'s samples along `dim`: a nested tensor's components, a tensor's or container's
    slices (the dim removed)."""
    if isinstance(x, torch.Tensor):
        return x.unbind(0 if x.is_nested else dim)
    unbind = getattr(x, "unbind", None)
    if unbind is None:
        raise NotImplementedError(
            f"vmap over a nested tensor calls the function once per sample, so it slices the other "
            f"inputs: a {type(x).__name__} has no `unbind(dim)` method to slice it with; give it one."
        )
    return unbind(dim)


def _random_state():
    """The global random state a random op moves: the CPU generator's, and CUDA's where used."""
    cpu = torch.get_rng_state()
    return (cpu, torch.cuda.get_rng_state_all()) if torch.cuda.is_initialized() else (cpu,)


def _same_state(a, b) -> bool:
    return len(a) == len(b) and torch.equal(a[0], b[0]) and all(
        torch.equal(x, y) for xs, ys in zip(a[1:], b[1:]) for x, y in zip(xs, ys)
    )


def warn_per_sample(func_name: str, batch_size: int, reason: str):
    if config.fallback == "silent":
        return
    if reason:
        text = (
            f"vmap({func_name}) runs {func_name} once per sample ({batch_size} samples): {reason}. "
            f"To vectorize, compute both branches and select with torch.where, or use a "
            f"fixed-shape op; functx.set_vmap_fallback('error') makes this an error."
        )
    else:
        text = (
            f"vmap({func_name}) over a nested tensor runs {func_name} once per sample ({batch_size} "
            f"samples): nested tensors' samples have different shapes, which one batched call cannot "
            f"hold. To vectorize, pad the samples to one length (with a mask) and vmap over the "
            f"padded tensor."
        )
    warn(text, PerformanceWarning)


def per_sample_reason(error) -> str:
    """What a `NeedsPerSampleValues` says, in short, with the user's line that raised it (the
    innermost frame of its traceback outside functx and torch)."""
    where, internal = None, internal_dirs()
    for frame in traceback.extract_tb(error.__traceback__):
        if not frame.filename.startswith(internal):
            where = frame
    if where is None:
        return error.what
    return f"{error.what}, at {where.filename}:{where.lineno} (`{(where.line or '').strip()}`)"


def join_samples(func_name: str, out_dims, index: int, outputs: list, out_dim, layout):
    """Output `index` of the per-sample calls (`outputs`, one per sample) as vmap returns it at
    `out_dim`: stacked where their shapes agree, else a nested tensor of `layout`
    (torch.jagged, or torch.strided) that holds each sample's output."""
    first = outputs[0]
    if out_dim is None:  # must not depend on the sample
        if all(o is first or _equal(o, first) for o in outputs):
            return first
        raise ValueError(
            f"vmap({func_name}, ...): `{func_name}` returned output {index} that differs between "
            f"samples with out_dim None (it depends on the batched inputs; give it an int out_dim)."
        )
    if not all(isinstance(o, torch.Tensor) for o in outputs):
        if all(is_container(o) for o in outputs):
            return torch.stack(outputs, dim=out_dim)  # the container's own stack (refuses ragged ones)
        bad = next(o for o in outputs if not isinstance(o, torch.Tensor))
        raise ValueError(
            f"vmap({func_name}, ...): `{func_name}` must only return Tensors, got type {type(bad)}. "
            f"Did you mean to set out_dims= to None for output?"
        )
    rank = first.dim() + 1
    if all(o.shape == first.shape for o in outputs):
        if not -rank <= out_dim < rank:
            raise IndexError(
                f"vmap({func_name}, ..., out_dims={out_dim}): out_dim {out_dim} is out of range "
                f"for an output of {rank - 1} dimensions (expected -{rank} <= out_dim < {rank})."
            )
        return torch.stack(outputs, dim=out_dim)
    distinct = list(dict.fromkeys(tuple(o.shape) for o in outputs))
    shapes = ", ".join(str(shape) for shape in distinct[:3]) + (", ..." if len(distinct) > 3 else "")
    if layout is None:
        raise RuntimeError(
            f"vmap({func_name}, ...): output {index} has different shapes per sample ({shapes}) "
            f"under vmap's per-sample fallback, and vmap stacks outputs of one shape: return a "
            f"fixed shape (pad it), or get a nested tensor: functx.set_vmap_fallback(mode, "
            f"ragged='nested') (or map over a nested tensor)."
        )
    if out_dim % rank != 0:
        raise RuntimeError(
            f"vmap({func_name}, ..., out_dims={out_dims}): output {index} has different shapes per "
            f"sample ({shapes}), so it comes back as a nested tensor, and {_ONLY_DIM_0}: give it "
            f"out_dim 0."
        )
    if any(o.dim() != first.dim() for o in outputs):
        raise ValueError(
            f"vmap({func_name}, ...): output {index} has a different number of dims per sample "
            f"({shapes}); a nested tensor needs components of one rank."
        )
    if layout is torch.jagged and first.dim() > 0:
        try:
            return torch.nested.as_nested_tensor(outputs, layout=torch.jagged)
        except (RuntimeError, ValueError):  # ragged in more than one dim: jagged holds one
            pass
    return torch.nested.as_nested_tensor(outputs, layout=torch.strided)


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    try:
        return bool(a == b)
    except Exception:  # an == that is not a truth value
        return False
