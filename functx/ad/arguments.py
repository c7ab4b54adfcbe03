"""Argument handling shared by the AD transforms: argnums, pytrees of tensors, levels.

Pytrees are flattened with `core.pytree` (optree, seeing torch's pytree registrations too),
once per transform call; levels are handed flat lists of leaves."""

from __future__ import annotations

import torch

from ..core import pytree


def check_argnums(argnums, num_args: int, api: str):
    """Validate `argnums` (int or non-empty tuple of unique ints) against `num_args`;
    return it with negative entries wrapped. Errors as torch.func words them."""

    def wrap(argnum):
        if not isinstance(argnum, int) or isinstance(argnum, bool):
            raise RuntimeError(f"{api}: argnum must be int, got: {type(argnum)}")
        if -num_args <= argnum < num_args:
            return argnum % num_args
        raise RuntimeError(f"{api}: Got argnum={argnum}, but only {num_args} positional inputs")

    if isinstance(argnums, int) and not isinstance(argnums, bool):
        return wrap(argnums)
    if isinstance(argnums, tuple):
        if len(argnums) == 0:
            raise RuntimeError(f"{api}: argnums must be non-empty")
        wrapped = tuple(wrap(a) for a in argnums)
        if len(set(wrapped)) != len(wrapped):
            raise RuntimeError(f"{api}: argnums elements must be unique, got {argnums}")
        return wrapped
    raise RuntimeError(f"{api}: argnums must be int or Tuple[int, ...], got: {type(argnums)}")


def select_argnums(args, argnums):
    """The differentiated arguments: one pytree for an int argnums, a tuple for a tuple."""
    if isinstance(argnums, int):
        return args[argnums]
    return tuple(args[i] for i in argnums)


def replace_argnums(args, argnums, new):
    args = list(args)
    if isinstance(argnums, int):
        args[argnums] = new
    else:
        for i, value in zip(argnums, new):
            args[i] = value
    return tuple(args)


def own_arguments(level, args, argnums):
    """`args` as the function at `level` sees them: the tensors of every argument outside
    `argnums` (an int or a tuple) are the function's own (`level.own`)."""
    differentiated = (argnums,) if isinstance(argnums, int) else argnums

    def own(x):
        return level.own(x) if isinstance(x, torch.Tensor) else x

    return tuple(a if i in differentiated else pytree.tree_map(own, a) for i, a in enumerate(args))


def make_differentiable(flat, level, api: str) -> list:
    """Every tensor of `flat` (the differentiated arguments' leaves) as an input `level`
    differentiates with respect to."""

    def leaf(x):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{api}: Thing passed to transform API must be Tensor, got {type(x)}")
        if not (x.is_floating_point() or x.is_complex()):
            raise RuntimeError(
                f"{api}: only floating-point or complex tensors can be differentiated, got a "
                f"Tensor with dtype {x.dtype}. Convert it (x.float()) or leave it out of argnums."
            )
        return level.leaf(x)

    return [leaf(x) for x in flat]


def check_outputs(flat_out, output, api: str) -> None:
    """The differentiated function returned at least one tensor, and only tensors."""
    if not flat_out:
        raise RuntimeError(f"{api}: Expected f to be a function that has non-empty output (got output = {output})")
    for out in flat_out:
        if not isinstance(out, torch.Tensor):
            raise RuntimeError(f"{api}: expected f(*primals) to return only tensors, got unsupported type {type(out)}")


def check_aux(aux, api: str) -> None:
    """`aux` (what a has_aux function returns beside its output) holds only tensors, in any
    containers: torch.func refuses every other leaf, None and python numbers included. The
    error names the transform and where in aux the leaf is; it keeps torch.func's words."""
    paths, leaves, _ = pytree.tree_flatten_with_path(aux, none_is_leaf=True)
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            where = "aux" + "".join(f"[{k!r}]" for k in path)
            raise RuntimeError(
                f"{api} with has_aux=True: aux must be tensors or pytrees of tensors (got "
                f"{type(leaf).__name__} {leaf!r:.40} at {where}). Return it as a tensor "
                f"(torch.tensor(...)) or keep it out of aux (a closure, a list filled by f). "
                f"Expected tensors, got unsupported type {type(leaf)}"
            )


def identity_rows(flat, start, stop):
    """Rows start..stop of the identity matrix over the flattened tensors `flat`, split
    and shaped like them: the basis vectors whose VJPs (JVPs) are the Jacobian's rows
    (columns). Built per chunk, so chunking bounds the memory of the basis too."""
    sizes = [t.numel() for t in flat]
    n = stop - start
    device = flat[0].device  # out of place: no write into a buffer in graphs traced under functionalize
    rows = (torch.arange(start, stop, device=device)[:, None] == torch.arange(sum(sizes), device=device)).to(flat[0].dtype)
    return [piece.to(t.dtype).view(n, *t.shape) for piece, t in zip(rows.split(sizes, dim=1), flat)]


def export(level, tree):
    """`level.export` of a pytree (aux values): the levels see flat lists of leaves."""
    flat, spec = pytree.tree_flatten(tree, none_is_leaf=True)
    return pytree.tree_unflatten(spec, level.export(flat))
