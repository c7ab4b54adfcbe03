"""`functx.vmap`: same signature and semantics as `torch.func.vmap`."""

from __future__ import annotations

import functools

import torch

from ..core import pytree
from ..core.interpreter import functx_code, interpreting
from ..core.level_tensor import refresh_views, unwrap_dead
from .batched_tensor import BatchedTensor, VmapInterpreter
from .randomness import RANDOMNESS_MODES, RandomnessMode, check_randomness


def vmap(func, in_dims=0, out_dims=0, randomness="error", *, chunk_size=None):
    """Vectorize `func` over a batch dimension of its inputs.

    `vmap(func)(*args)` runs `func` once on batched inputs and returns what a loop over
    the batch dimension would stack. Args and outputs may be pytrees (tuples, lists,
    dicts, namedtuples, containers registered with `torch.utils._pytree` or optree);
    `in_dims` / `out_dims` are an int, None (not batched) or a prefix of the args /
    outputs structure. Keyword arguments are passed unbatched. `randomness` is
    "error", "different" or "same"; `chunk_size` splits the batch into chunks of at most
    that many elements to bound memory (every chunk sees the same random numbers when
    randomness="same").

    Example:
        >>> import torch, functx
        >>> x, y = torch.randn(4, 3), torch.randn(3)
        >>> functx.vmap(torch.dot, in_dims=(0, None))(x, y).shape
        torch.Size([4])
        >>> functx.vmap(functx.vmap(torch.mul))(torch.ones(2, 3), torch.ones(2, 3)).shape
        torch.Size([2, 3])
    """
    check_randomness(randomness)
    if chunk_size is not None and not (isinstance(chunk_size, int) and chunk_size > 0):
        raise ValueError(f"vmap: chunk_size should be None or greater than 0. (got {chunk_size})")

    @functools.wraps(func)
    def vmapped(*args, **kwargs):
        return _vmap_call(func, in_dims, out_dims, randomness, chunk_size, args, kwargs)

    return vmapped


def _name(func) -> str:
    if isinstance(func, functools.partial):
        return f"functools.partial({_name(func.func)}, ...)"
    return getattr(func, "__name__", repr(func))


def _describe_leaf(spec, i) -> str:
    """Where the args' leaf `i` is, for an error (paths are not computed otherwise)."""
    path = spec.paths()[i]
    text = f"args[{path[0]}]"
    for key in path[1:]:
        text += f"[{key!r}]"
    return text


def _count_hint(dims, tree, what: str) -> str:
    """` (3 entries for 2 inputs)` when both are tuples or lists of different lengths."""
    if isinstance(dims, (tuple, list)) and isinstance(tree, (tuple, list)) and len(dims) != len(tree):
        return f" ({len(dims)} entries for {len(tree)} {what})"
    return ""


def _flatten_in_dims(func, in_dims, args):
    """Flat args, their in_dims and the args' structure; errors as torch.func words them."""
    if not isinstance(in_dims, (int, tuple)) or isinstance(in_dims, bool):
        raise ValueError(
            f"vmap({_name(func)}, in_dims={in_dims}, ...)(<inputs>): expected `in_dims` to "
            f"be int or a (potentially nested) tuple matching the structure of inputs, "
            f"got: {type(in_dims)}."
        )
    if not args:
        raise ValueError(
            f"vmap({_name(func)})(<inputs>): got no inputs. Maybe you forgot to add inputs, "
            f"or you are trying to vmap over a function with no inputs. The latter is unsupported."
        )
    leaves, spec = pytree.tree_flatten(args, none_is_leaf=True)
    if isinstance(in_dims, int):  # the common case: no prefix to broadcast
        return leaves, [in_dims] * len(leaves), spec
    try:
        flat_dims = pytree.broadcast_prefix(in_dims, args, none_is_leaf=True)
    except ValueError:
        raise ValueError(
            f"vmap({_name(func)}, in_dims={in_dims}, ...)(<inputs>): in_dims is not "
            f"compatible with the structure of `inputs`: in_dims={pytree.describe(in_dims)} "
            f"against the inputs {pytree.describe(args)}{_count_hint(in_dims, args, 'inputs')}. "
            f"in_dims must have the inputs' structure, or a prefix of it (one entry for a "
            f"whole container); an int applies to every input."
        ) from None
    return leaves, flat_dims, spec


def _check_and_batch_size(func, in_dims, spec, leaves, flat_dims) -> int:
    sizes = []
    for i, (arg, dim) in enumerate(zip(leaves, flat_dims)):
        if dim is None:
            continue
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise ValueError(
                f"vmap({_name(func)}, in_dims={in_dims}, ...)(<inputs>): Got in_dim={dim} for "
                f"an input but in_dim must be either an integer dimension or None."
            )
        if not isinstance(arg, torch.Tensor):
            raise ValueError(
                f"vmap({_name(func)}, in_dims={in_dims}, ...)(<inputs>): Got in_dim={dim} for "
                f"an input but the input is of type {type(arg)}. We cannot vmap over non-Tensor "
                f"arguments, please use None as the respective in_dim"
            )
        if arg.is_nested or arg.layout is not torch.strided:
            raise NotImplementedError(
                f"vmap({_name(func)}, in_dims={in_dims}, ...)(<inputs>): {_describe_leaf(spec, i)} is a "
                f"{'nested' if arg.is_nested else str(arg.layout)} tensor; functx.vmap maps over "
                f"strided tensors only. For ragged samples, vmap over a padded strided tensor (with "
                f"a mask), or loop over `tensor.unbind()`; sparse inputs: `.to_dense()`."
            )
        if not -arg.dim() <= dim < max(arg.dim(), 1) or arg.dim() == 0:
            raise ValueError(
                f"vmap({_name(func)}, in_dims={in_dims}, ...)(<inputs>): Got in_dim={dim} for "
                f"some input, but that input ({_describe_leaf(spec, i)}) is a Tensor of "
                f"dimensionality {arg.dim()} so expected in_dim to satisfy "
                f"-{arg.dim()} <= in_dim < {arg.dim()}."
            )
        sizes.append((i, arg.size(dim)))
    if not sizes:
        raise ValueError(
            f"vmap({_name(func)}, in_dims={in_dims}, ...)(<inputs>): at least one input must "
            f"be a Tensor with an in_dim that is not None (vmap: Expected at least one Tensor "
            f"to vmap over)."
        )
    batch_size = sizes[0][1]
    if any(size != batch_size for _, size in sizes):
        detail = ", ".join(f"{_describe_leaf(spec, i)} has size {s}" for i, s in sizes)
        raise ValueError(
            f"vmap: Expected all tensors to have the same size in the mapped dimension, got "
            f"sizes {[s for _, s in sizes]} for the mapped dimension ({detail})."
        )
    return batch_size


def _vmap_call(func, in_dims, out_dims, randomness, chunk_size, args, kwargs):
    leaves, flat_dims, spec = _flatten_in_dims(func, in_dims, args)
    batch_size = _check_and_batch_size(func, in_dims, spec, leaves, flat_dims)
    if chunk_size is None or chunk_size >= batch_size:
        return _vmap_once(func, leaves, flat_dims, spec, batch_size, randomness, out_dims, kwargs)
    return _vmap_chunked(func, leaves, flat_dims, spec, batch_size, randomness, out_dims, kwargs, chunk_size)


def _vmap_once(func, leaves, flat_dims, spec, batch_size, randomness, out_dims, kwargs):
    interp = VmapInterpreter(batch_size, randomness)
    with interpreting(interp):
        with functx_code():
            batched = [
                x if d is None else BatchedTensor(x if d == 0 else x.movedim(d, 0), interp)
                for x, d in zip(leaves, flat_dims)
            ]
            for b, x, d in zip(batched, leaves, flat_dims):
                if d:  # for autograd.Function vmap rules, given the in_dim (custom_function.py)
                    b._vmap_input = (d % x.dim(), x, b._value)
        with RandomnessMode(interp):  # user code only
            outputs = func(*pytree.tree_unflatten(spec, batched), **kwargs)
        with functx_code():
            return _unbatch_outputs(func, outputs, out_dims, interp)


def _flat_out_dims(func, out_dims, outputs, n_leaves):
    """One out_dim per output leaf (`n_leaves` of them): `out_dims` is an int/None or a
    prefix of the outputs."""
    if out_dims is None or (isinstance(out_dims, int) and not isinstance(out_dims, bool)):
        return [out_dims] * n_leaves
    dim_leaves = pytree.tree_leaves(out_dims, none_is_leaf=True)
    if not dim_leaves or any(d is not None and (not isinstance(d, int) or isinstance(d, bool)) for d in dim_leaves):
        raise ValueError(
            f"vmap({_name(func)}, ..., out_dims={out_dims}): `out_dims` must be an int, None or "
            f"a python collection of ints representing where in the outputs the vmapped "
            f"dimension should appear."
        )
    if isinstance(out_dims, tuple) and len(out_dims) == 1 and not isinstance(outputs, tuple):
        out_dims = out_dims[0]  # torch.func accepts out_dims=(d,) for a single output
    try:
        return pytree.broadcast_prefix(out_dims, outputs, none_is_leaf=True)
    except ValueError:
        raise ValueError(
            f"vmap({_name(func)}, ..., out_dims={out_dims})(<inputs>): out_dims is not "
            f"compatible with the structure of `outputs`: out_dims={pytree.describe(out_dims)} "
            f"against the outputs {pytree.describe(outputs)}{_count_hint(out_dims, outputs, 'outputs')}. "
            f"out_dims must have the outputs' structure, or a prefix of it (one entry for a "
            f"whole container); an int applies to every output."
        ) from None


def _unbatch_outputs(func, outputs, out_dims, interp):
    # None is an output like any other (torch.func: it needs out_dim None)
    flat_out, out_spec = pytree.tree_flatten(outputs, none_is_leaf=True)
    flat_out_dims = _flat_out_dims(func, out_dims, outputs, len(flat_out))
    unbatched = [_unbatch(func, out, dim, interp) for out, dim in zip(flat_out, flat_out_dims)]
    return pytree.tree_unflatten(out_spec, unbatched)


def _unbatch(func, out, out_dim, interp):
    if out_dim is None:
        if interp.is_batched(out):
            raise ValueError(
                f"vmap({_name(func)}, ...): `{_name(func)}` can not return a BatchedTensor when "
                f"out_dim is None (the output depends on the batched inputs; give it an int out_dim)."
            )
        return out
    if not isinstance(out, torch.Tensor):
        raise ValueError(
            f"vmap({_name(func)}, ...): `{_name(func)}` must only return Tensors, got type "
            f"{type(out)}. Did you mean to set out_dims= to None for output?"
        )
    if interp.is_batched(out):
        if interp.lifted_bases is not None:
            refresh_views(interp, (out,))
        value = unwrap_dead(out._value)
    else:  # does not depend on the batch: every element is the same
        value = out.unsqueeze(0).expand(interp.batch_size, *out.shape)
    rank = value.dim()
    if not -rank <= out_dim < rank:
        raise IndexError(
            f"vmap({_name(func)}, ..., out_dims={out_dim}): out_dim {out_dim} is out of range "
            f"for an output of {rank - 1} dimensions (expected -{rank} <= out_dim < {rank})."
        )
    return value if out_dim in (0, -rank) else value.movedim(0, out_dim)


def _vmap_chunked(func, leaves, flat_dims, spec, batch_size, randomness, out_dims, kwargs, chunk_size):
    split = [None if d is None else x.split(chunk_size, dim=d) for x, d in zip(leaves, flat_dims)]
    n_chunks = (batch_size + chunk_size - 1) // chunk_size
    rng_state = torch.get_rng_state() if randomness == "same" else None
    chunk_outputs = []
    for c in range(n_chunks):
        if rng_state is not None:
            torch.set_rng_state(rng_state)
        chunk_leaves = [x if s is None else s[c] for x, s in zip(leaves, split)]
        size = next(s[c].size(d) for s, d in zip(split, flat_dims) if s is not None)
        chunk_outputs.append(_vmap_once(func, chunk_leaves, flat_dims, spec, size, randomness, out_dims, kwargs))
    flat_chunks = [pytree.tree_flatten(o, none_is_leaf=True) for o in chunk_outputs]
    out_spec = flat_chunks[0][1]
    flat_out_dims = _flat_out_dims(func, out_dims, chunk_outputs[0], len(flat_chunks[0][0]))
    merged = [
        flat_chunks[0][0][i] if d is None else torch.cat([fc[0][i] for fc in flat_chunks], dim=d)
        for i, d in enumerate(flat_out_dims)
    ]
    return pytree.tree_unflatten(out_spec, merged)


__all__ = ["vmap", "RANDOMNESS_MODES"]
