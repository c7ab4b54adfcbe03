"""`functx.functionalize`: same signature and semantics as `torch.func.functionalize`."""

from __future__ import annotations

import functools

import torch

from ..core import pytree
from ..core.type_aliases import Function
from ..core.errors import user_facing
from ..core.interpreter import functx_code, interpreting
from .level import FunctionalizeInterpreter, FunctionalizedTensor

REMOVE_OPTIONS = ("mutations", "mutations_and_views")


def functionalize(func: Function, *, remove: str = "mutations") -> Function:
    """Run `func` with its mutations (and, optionally, its views) replaced by out-of-place ops.

    `functionalize(func)(*args)` returns what `func(*args)` returns, but every in-place
    op (`y.add_(1)`), `out=` op and write through a view runs as its out-of-place
    equivalent (`y = y.add(1)`; a write into a view becomes a `*_scatter` into its base).
    With `remove="mutations_and_views"` view ops also run as their `*_copy` ops, so no
    tensor of the function aliases another. Inputs the function writes into are written
    once, at the end (`input.copy_(final_value)`), so callers see the same inputs as after
    `func`. It is a transform like the others: it composes with `vmap`, `grad`, `jvp` ...
    both ways, and `make_fx(functionalize(f))` traces a graph without mutations (but the
    final copies into mutated inputs). Writes into tensors from outside the function (a
    captured global) cannot be removed; writing a value computed inside into one is an error.

    Args:
        func (Callable): a function of tensors (pytrees of them, and other values).
        remove (str, default "mutations"): "mutations" replaces in-place and `out=` ops;
            "mutations_and_views" replaces view ops by their `*_copy` ops too.

    Returns:
        Callable: a function of the same arguments returning what `func` returns, with the
        writes into its inputs applied once, at the end.

    Raises:
        RuntimeError: an invalid `remove`; a value computed inside written into a tensor
            captured from outside the function
            ([error catalogue: functionalize](../errors.md#functionalize)).

    Examples:
        >>> import torch, functx
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> def f(a):
        ...     b = a + 1
        ...     c = b.view(-1)
        ...     c.add_(1)
        ...     return b
        >>> x = torch.zeros(2, 2)
        >>> functx.functionalize(f)(x)
        tensor([[2., 2.],
                [2., 2.]])
        >>> def ops(graph):
        ...     return [n.target.overloadpacket.__name__ for n in graph.nodes if n.op == "call_function"]
        >>> ops(make_fx(functx.functionalize(f, remove="mutations_and_views"))(x).graph)
        ['add', 'view_copy', 'add', 'view_copy', 'view_copy']
        >>> def g(a):  # mutates its input: one copy_ into it at the end
        ...     a.mul_(2)
        ...     return a.sum()
        >>> ops(make_fx(functx.functionalize(g))(torch.ones(3)).graph)
        ['mul', 'sum', 'copy_']

    Differences from torch.func:
        functionalize is an interpreter level like the other transforms, so
        `functionalize(vmap(f))` and `vmap(functionalize(f))` both work, and under vmap it
        makes writes of batched values into unbatched temporaries out-of-place (which
        `vmap` alone refuses).
    """
    if remove not in REMOVE_OPTIONS:
        raise RuntimeError(
            f"functionalize(f, remove='mutations'): received invalid argument for remove={remove}. "
            f"Valid options are:\n"
            f"     remove='mutations': all inplace and out= operators will be removed from the program, "
            f"and replaced with their out-of-place equivalents.\n"
            f"     remove='mutations_and_views': In addition to the above, all aliasing operators {{view}} "
            f"will be replaced with their non-aliasing counterparts, {{view}}_copy.\n"
        )
    reapply_views = remove == "mutations"

    @user_facing
    @functools.wraps(func)
    def functionalized(*args, **kwargs):
        return _functionalize_call(func, reapply_views, args, kwargs)

    return functionalized


def _functionalize_call(func, reapply_views, args, kwargs):
    interp = FunctionalizeInterpreter(reapply_views)
    with interpreting(interp):
        with functx_code():
            leaves, spec = pytree.tree_flatten((args, kwargs))
            inputs = [interp.wrap(x) if isinstance(x, torch.Tensor) else x for x in leaves]
            call_args, call_kwargs = pytree.tree_unflatten(spec, inputs)
        outputs = func(*call_args, **call_kwargs)
        with functx_code():
            outputs = pytree.tree_map(lambda out: _unwrap_output(interp, out), outputs)
            for original, wrapped in zip(leaves, inputs):
                if isinstance(original, torch.Tensor):
                    _copy_back(interp, original, wrapped)
    return outputs


def _unwrap_output(interp, out):
    """An output as it leaves the level: what it holds now, one level down."""
    if type(out) is FunctionalizedTensor and out._interp is interp:
        return out.current()
    return out


def _copy_back(interp, original, wrapped):
    """Write what an input holds at the end of the function into the caller's tensor, if the
    function wrote into it (its functional tensor then holds a new value): as torch.func does,
    a changed size by `resize_`, changed sizes/strides (`transpose_`) by `as_strided_`, then
    the data by `copy_`. When the final value is a view of the caller's tensor itself (only
    its metadata changed: `transpose_`, `as_strided_`), the `as_strided_` is all it takes
    (torch.func copies it onto itself as well, and fails where that copy overlaps)."""
    final = wrapped.current()
    if final is original:  # never written (views of it are views of the caller's tensor)
        return
    if torch._C._is_alias_of(original, final):
        original.as_strided_(final.shape, final.stride(), final.storage_offset())
        return
    if original.nbytes != final.nbytes:
        original.resize_(final.shape)
    if original.shape != final.shape:
        original.as_strided_(final.shape, final.stride())
    original.copy_(final)


__all__ = ["functionalize", "REMOVE_OPTIONS"]
