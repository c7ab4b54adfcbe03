"""One vmap call at a level: inputs batched, the function run, outputs unbatched.

`api.vmap` checks the inputs, chunks the batch and makes the level; `map_at_level` does the
rest, and is what an autograd.Function's generated vmap rule runs its forward with (on a
fresh level of the kind applying it, vmap/custom_function.py), so neither needs the other.
The error messages name the user's function as torch.func's do.

    >>> import torch
    >>> from functx.vmap.interpreter import VmapInterpreter
    >>> leaves, dims, spec = flatten_in_dims(torch.sin, 0, (torch.zeros(4, 2),))
    >>> map_at_level(VmapInterpreter(4, "error"), torch.sin, leaves, dims, spec, 0, {}).shape
    torch.Size([4, 2])
"""

from __future__ import annotations

import functools

import torch

from ..core import pytree
from ..core.interpreter import functx_code, interpreting
from ..core.level_tensor import refresh_views, unwrap_dead
from .batched_tensor import BatchedTensor
from ..core.containers import is_container
from .containers import batch_container, container_leaf, mapped_dim, unbatch_container
from .randomness import RandomnessMode


def name_of(func) -> str:
    if isinstance(func, functools.partial):
        return f"functools.partial({name_of(func.func)}, ...)"
    return getattr(func, "__name__", repr(func))


def describe_leaf(spec, i) -> str:
    """Where the args' leaf `i` is, for an error (paths are not computed otherwise)."""
    path = spec.paths()[i]
    text = f"args[{path[0]}]"
    for key in path[1:]:
        text += f"[{key!r}]"
    return text


def count_hint(dims, tree, what: str) -> str:
    """` (3 entries for 2 inputs)` when both are tuples or lists of different lengths."""
    if isinstance(dims, (tuple, list)) and isinstance(tree, (tuple, list)) and len(dims) != len(tree):
        return f" ({len(dims)} entries for {len(tree)} {what})"
    return ""


def flatten_in_dims(func, in_dims, args):
    """Flat args, their in_dims and the args' structure; errors as torch.func words them."""
    if not isinstance(in_dims, (int, tuple)) or isinstance(in_dims, bool):
        raise ValueError(
            f"vmap({name_of(func)}, in_dims={in_dims}, ...)(<inputs>): expected `in_dims` to "
            f"be int or a (potentially nested) tuple matching the structure of inputs, "
            f"got: {type(in_dims)}."
        )
    if not args:
        raise ValueError(
            f"vmap({name_of(func)})(<inputs>): got no inputs. Maybe you forgot to add inputs, "
            f"or you are trying to vmap over a function with no inputs. The latter is unsupported."
        )
    keep_whole = container_leaf()  # containers with a batch size (vmap/containers.py)
    leaves, spec = pytree.tree_flatten(args, none_is_leaf=True, is_leaf=keep_whole)
    if isinstance(in_dims, int):  # the common case: no prefix to broadcast
        return leaves, [in_dims] * len(leaves), spec
    try:
        flat_dims = pytree.broadcast_prefix(in_dims, args, none_is_leaf=True, is_leaf=keep_whole)
    except ValueError:
        raise ValueError(
            f"vmap({name_of(func)}, in_dims={in_dims}, ...)(<inputs>): in_dims is not "
            f"compatible with the structure of `inputs`: in_dims={pytree.describe(in_dims)} "
            f"against the inputs {pytree.describe(args)}{count_hint(in_dims, args, 'inputs')}. "
            f"in_dims must have the inputs' structure, or a prefix of it (one entry for a "
            f"whole container); an int applies to every input."
        ) from None
    return leaves, flat_dims, spec


def map_at_level(interp, func, leaves, flat_dims, spec, out_dims, kwargs):
    """`func` run once at `interp` (a fresh vmap level) on `leaves` (the args' flat leaves,
    `spec` their structure) batched along `flat_dims`, its outputs unbatched to `out_dims`:
    the whole of one vmap call but checking the inputs and chunking (api.py)."""
    with interpreting(interp):
        with functx_code():
            batched = [
                x if d is None
                else BatchedTensor(x if d == 0 else x.movedim(d, 0), interp) if isinstance(x, torch.Tensor)
                else batch_container(_mapped_dim(func, interp), x, d)  # (in_dims checked: a registered container)
                for x, d in zip(leaves, flat_dims)
            ]
            for b, x, d in zip(batched, leaves, flat_dims):
                if d and type(b) is BatchedTensor:  # for autograd.Function vmap rules, given the in_dim (custom_function.py)
                    b._vmap_input = (d % x.dim(), x, b._value)
        with RandomnessMode(interp):  # user code only
            outputs = func(*pytree.tree_unflatten(spec, batched), **kwargs)
        with functx_code():
            return unbatch_outputs(func, outputs, out_dims, interp)


def out_dims_per_leaf(func, out_dims, outputs, n_leaves, is_leaf=None):
    """One out_dim per output leaf (`n_leaves` of them): `out_dims` is an int/None or a
    prefix of the outputs."""
    if out_dims is None or (isinstance(out_dims, int) and not isinstance(out_dims, bool)):
        return [out_dims] * n_leaves
    dim_leaves = pytree.tree_leaves(out_dims, none_is_leaf=True)
    if not dim_leaves or any(d is not None and (not isinstance(d, int) or isinstance(d, bool)) for d in dim_leaves):
        raise ValueError(
            f"vmap({name_of(func)}, ..., out_dims={out_dims}): `out_dims` must be an int, None or "
            f"a python collection of ints representing where in the outputs the vmapped "
            f"dimension should appear."
        )
    if isinstance(out_dims, tuple) and len(out_dims) == 1 and not isinstance(outputs, tuple):
        out_dims = out_dims[0]  # torch.func accepts out_dims=(d,) for a single output
    try:
        return pytree.broadcast_prefix(out_dims, outputs, none_is_leaf=True, is_leaf=is_leaf)
    except ValueError:
        raise ValueError(
            f"vmap({name_of(func)}, ..., out_dims={out_dims})(<inputs>): out_dims is not "
            f"compatible with the structure of `outputs`: out_dims={pytree.describe(out_dims)} "
            f"against the outputs {pytree.describe(outputs)}{count_hint(out_dims, outputs, 'outputs')}. "
            f"out_dims must have the outputs' structure, or a prefix of it (one entry for a "
            f"whole container); an int applies to every output."
        ) from None


def unbatch_outputs(func, outputs, out_dims, interp):
    # None is an output like any other (torch.func: it needs out_dim None)
    keep_whole = container_leaf()
    flat_out, out_spec = pytree.tree_flatten(outputs, none_is_leaf=True, is_leaf=keep_whole)
    flat_out_dims = out_dims_per_leaf(func, out_dims, outputs, len(flat_out), keep_whole)
    if keep_whole is None:
        unbatched = [_unbatch(func, out, dim, interp) for out, dim in zip(flat_out, flat_out_dims)]
    else:
        unbatched = [_unbatch_any(func, out, dim, interp) for out, dim in zip(flat_out, flat_out_dims)]
    return pytree.tree_unflatten(out_spec, unbatched)


def _unbatch_any(func, out, out_dim, interp):
    """`_unbatch`, or for a registered container (vmap/containers.py) its kind's rebuilding
    around its unbatched tensors. With out_dim None a container is returned as it is, after
    `_unbatch`'s check on each of its tensors (the pytree leaves it has: a batched one raises)."""
    if not is_container(out):
        return _unbatch(func, out, out_dim, interp)
    if out_dim is None:
        for leaf in pytree.tree_leaves(out):
            _unbatch(func, leaf, None, interp)
        return out
    return unbatch_container(name_of(func), out, out_dim, _mapped_dim(func, interp))


def _mapped_dim(func, interp):
    """What a container's kind gets from the level (vmap/containers.mapped_dim), one for the
    whole call (a container may unbatch while the function runs)."""
    if interp.mapped_dim is None:

        def unbatch(tensor, dim):
            return _unbatch(func, tensor, dim, interp)

        interp.mapped_dim = mapped_dim(interp, unbatch)
    return interp.mapped_dim


def _unbatch(func, out, out_dim, interp):
    if out_dim is None:
        if interp.is_batched(out):
            raise ValueError(
                f"vmap({name_of(func)}, ...): `{name_of(func)}` can not return a BatchedTensor when "
                f"out_dim is None (the output depends on the batched inputs; give it an int out_dim)."
            )
        return out
    if not isinstance(out, torch.Tensor):
        raise ValueError(
            f"vmap({name_of(func)}, ...): `{name_of(func)}` must only return Tensors, got type "
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
            f"vmap({name_of(func)}, ..., out_dims={out_dim}): out_dim {out_dim} is out of range "
            f"for an output of {rank - 1} dimensions (expected -{rank} <= out_dim < {rank})."
        )
    return value if out_dim in (0, -rank) else value.movedim(0, out_dim)
