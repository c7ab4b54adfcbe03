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

    Its use is to hand a program to a backend or compiler that cannot represent mutation
    or aliasing: trace `functionalize(func)` (with `make_fx`) and the graph holds only
    out-of-place ops (and, with "mutations_and_views", no views).

    How it works and behaves:

    - **At the level of ATen ops.** Every op `func` runs reaches functionalize as an ATen
      operator. A mutating operator is replaced by its out-of-place equivalent
      (`aten.add_` -> `aten.add`), a view operator (with "mutations_and_views") by its
      copying equivalent (`aten.view` -> `aten.view_copy`), while functionalize tracks
      which tensors alias which: after a write through one alias, the others (the base,
      other views of it) read the new value, as they would in `func`.
    - **Inputs written into** are updated once, at the end: the final value is copied into
      the caller's tensor (`copy_`; `resize_` or `as_strided_` first where the function
      changed its size or strides in place). A traced graph shows that copy as its one
      mutation. An output that is an input (`return a` after `a.mul_(2)`) comes back as a
      new tensor holding the final value.
    - **Global state**: tensors `func` did not receive as arguments (globals, closures)
      are not functionalized. Reading them, and views of them, work; writing a constant
      into one runs as written; writing a value computed from the inputs into one raises.
      Pass such a tensor as an argument (its mutation is then copied back), or make it
      inside `func`.
    - **Autograd inside**: `functionalize(grad(f))` differentiates, and so does
      `.backward()` inside `func` (which torch.func refuses).
    - **Limits** (as in torch.func): `resize_()` of a view to a larger size raises;
      `as_strided` views whose elements overlap are not modelled, and a write through
      one gives results that differ from `func`'s.

    Args:
        func (Callable): a function of tensors (pytrees of them, and other values).
        remove (str, default "mutations"): "mutations" replaces in-place and `out=` ops;
            "mutations_and_views" replaces view ops by their `*_copy` ops too.

    Returns:
        Callable: a function of the same arguments returning what `func` returns, with the
        writes into its inputs applied once, at the end.

    Raises:
        RuntimeError: an invalid `remove`; a value computed inside written into a tensor
            captured from outside the function; `resize_()` of a view to a larger size
            ([error catalogue: functionalize](../errors.md#functionalize)).

    Examples:
        Mutations and views on intermediate tensors: the result is `func`'s:

        >>> import torch, functx
        >>> def f(a):
        ...     b = a + 1
        ...     c = b.view(-1)
        ...     c.add_(1)
        ...     return b
        >>> x = torch.zeros(2, 2)
        >>> functx.functionalize(f)(x)
        tensor([[2., 2.],
                [2., 2.]])
        >>> torch.equal(functx.functionalize(f)(x), f(x))
        True

        The traced graphs: `func` as written, without mutations, and without mutations
        and views (`show` prints one line per op, then what the graph returns); a write
        into a view of an intermediate becomes a scatter into its base:

        >>> import torch, functx
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> def show(graph_module):
        ...     for node in graph_module.graph.nodes:
        ...         if node.op == "call_function":
        ...             print(node.name, "=", node.target.overloadpacket.__name__, node.args)
        ...         elif node.op == "output":
        ...             print("return", node.args[0])
        >>> def f(a):
        ...     b = a + 1
        ...     c = b.view(-1)
        ...     c.add_(1)
        ...     return b
        >>> x = torch.zeros(2)
        >>> show(make_fx(f)(x))
        add = add (a_1, 1)
        view = view (add, [-1])
        add_ = add_ (view, 1)
        return add
        >>> show(make_fx(functx.functionalize(f))(x))
        add = add (a_1, 1)
        view = view (add, [-1])
        add_1 = add (view, 1)
        view_1 = view (add_1, [2])
        view_2 = view (view_1, [-1])
        return view_1
        >>> show(make_fx(functx.functionalize(f, remove="mutations_and_views"))(x))
        add = add (a_1, 1)
        view_copy = view_copy (add, [-1])
        add_1 = add (view_copy, 1)
        view_copy_1 = view_copy (add_1, [2])
        view_copy_2 = view_copy (view_copy_1, [-1])
        return view_copy_1
        >>> def h(a):
        ...     b = a * 2
        ...     b[0].add_(10)
        ...     return b
        >>> show(make_fx(functx.functionalize(h))(torch.zeros(2, 2)))
        mul = mul (a_1, 2)
        select = select (mul, 0, 0)
        add = add (select, 10)
        select_scatter = select_scatter (mul, add, 0, 0)
        select_1 = select (select_scatter, 0, 0)
        return select_scatter
        >>> functx.functionalize(h)(torch.ones(2, 2)).tolist()
        [[12.0, 12.0], [2.0, 2.0]]

        A function that writes into its input: the caller's tensor is updated, and the
        traced graph ends with the one `copy_` into it:

        >>> import torch, functx
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> def g(a):
        ...     b = a.view(-1)
        ...     b.add_(1)
        ...     return a
        >>> x = torch.zeros(2)
        >>> out = functx.functionalize(g)(x)
        >>> x.tolist(), out.tolist(), out is x
        ([1.0, 1.0], [1.0, 1.0], False)
        >>> def ops(graph_module):
        ...     return [n.target.overloadpacket.__name__ for n in graph_module.graph.nodes if n.op == "call_function"]
        >>> ops(make_fx(functx.functionalize(g, remove="mutations_and_views"))(torch.zeros(2)))
        ['view_copy', 'add', 'view_copy', 'view_copy', 'copy_']

        Composed with `vmap`: a write of a batched value into a temporary made inside the
        function, which `vmap` alone refuses, is out-of-place under `functionalize`:

        >>> import torch, functx
        >>> def fill(x):
        ...     buffer = torch.zeros(3)
        ...     buffer.copy_(x)
        ...     return buffer * 2
        >>> xs = torch.randn(4, 3)
        >>> torch.allclose(functx.vmap(functx.functionalize(fill))(xs), xs * 2)
        True

        With autograd: `grad` inside, and `.backward()` inside `func`:

        >>> import torch, functx
        >>> x = torch.tensor([1.0, 2.0])
        >>> functx.functionalize(functx.grad(lambda t: t.clone().mul_(t).sum()))(x).tolist()  # 2 t
        [2.0, 4.0]
        >>> def by_backward(x):
        ...     x = x.detach().requires_grad_()
        ...     (x ** 3).sum().backward()
        ...     return x.grad
        >>> functx.functionalize(by_backward)(x).tolist()  # 3 x ** 2
        [3.0, 12.0]

        A captured tensor: a write of a value from the inputs into it raises:

        >>> import torch, functx
        >>> total = torch.zeros(2)
        >>> def accumulate(x):
        ...     total.add_(x)
        ...     return x * 2
        >>> try:
        ...     functx.functionalize(accumulate)(torch.ones(2))
        ... except RuntimeError as error:
        ...     print("captured or global tensor" in str(error))
        True

    Differences from torch.func:
        `.backward()` inside `func` works (torch.func raises). A value computed inside
        written into a captured tensor raises functx's message (torch.func's is an
        internal assert). An input whose strides the function changes in place
        (`as_strided_`) keeps the new strides, as after `func` (torch.func copies the
        values into the old layout). A traced graph can name another overload of the same
        op (`a.add_(1)` becomes `aten.add.Scalar`; torch.func's graph has
        `aten.add.Tensor`); the values are the same.
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
