"""functx's registrations for user-defined operators.

`register_vmap(op, func)` gives functx.vmap a batching rule for an operator of your own
(a `torch.library.custom_op`, or an op defined with `torch.library.Library`), in the form
`torch.library.register_vmap` uses: `func(info, in_dims, *args, **kwargs)` returns
`(output, out_dims)`. Rules registered with `torch.library.register_vmap` on a
`torch.library.custom_op` are read too, so code written for torch.func works unchanged.
Without a rule, functx.vmap runs the op once per batch element (with a
`functx.PerformanceWarning`).

Example:
    >>> import torch, functx
    >>> @torch.library.custom_op("functx_doc::scale", mutates_args=())
    ... def scale(x: torch.Tensor, k: float) -> torch.Tensor:
    ...     return x * k
    >>> @functx.library.register_vmap("functx_doc::scale")
    ... def scale_vmap(info, in_dims, x, k):
    ...     return scale(x, k), in_dims[0]
    >>> functx.vmap(lambda x: scale(x, 2.0))(torch.ones(3, 2)).tolist()
    [[2.0, 2.0], [2.0, 2.0], [2.0, 2.0]]
"""

from __future__ import annotations

import torch

from .vmap.custom_function import VmapInfo
from .vmap.rules import user_rules


def _overloads(op):
    """The OpOverloads named by `op`: an OpOverload, a packet, a custom op, or "ns::name"."""
    if isinstance(op, torch._ops.OpOverload):
        return [op]
    if hasattr(op, "_opoverload"):  # torch.library.custom_op's CustomOpDef
        return [op._opoverload]
    if isinstance(op, str):
        namespace, _, rest = op.partition("::")
        name, _, overload = rest.partition(".")
        if not namespace or not name:
            raise ValueError(f"functx.library.register_vmap: expected an op name like 'mylib::op', got {op!r}")
        op = getattr(getattr(torch.ops, namespace), name)
        if overload:
            return [getattr(op, overload)]
    if isinstance(op, torch._ops.OpOverloadPacket):
        return [getattr(op, name) for name in op.overloads()]
    raise TypeError(
        f"functx.library.register_vmap: expected an operator (OpOverload, custom op or 'ns::name'), got {type(op)}"
    )


def register_vmap(op, func=None):
    """Register `func` as functx.vmap's batching rule for `op`, an operator of your own, in
    the form `torch.library.register_vmap` takes (usable as a decorator).

    The rule is used for an operator outside `aten` and `prims` that has no
    `CompositeImplicitAutograd` kernel and no `torch._decomp` decomposition (those are
    batched through what they decompose into, and the registration goes unused). Without a
    rule, functx reads one given to `torch.library.register_vmap` for a
    `torch.library.custom_op`, and otherwise runs the op once per batch element (with a
    `functx.PerformanceWarning`).

    Args:
        op (OpOverload | OpOverloadPacket | CustomOpDef | str): the operator: a
            `torch.library.custom_op`, an `OpOverload` (`torch.ops.mylib.op.default`), a
            packet (`torch.ops.mylib.op`: all its overloads), or a name, `"mylib::op"` (all
            overloads) or `"mylib::op.overload"`.
        func (Callable | None, default None): the rule, `func(info, in_dims, *args,
            **kwargs) -> (output, out_dims)`. `info` is a `functx.library.VmapInfo` (batch
            size, randomness); `in_dims` has one entry per positional argument: None for an
            argument not batched at this vmap level (or not a tensor), else the dim of the
            batch in that argument; `args` and `kwargs` are the op's arguments with their
            batch dims in. `out_dims` mirrors `output`: where each output's batch dim is
            (None: not batched). None: return a decorator.

    Registering a rule again for the same op replaces the one before, from the op's next
    call on (also inside a vmap that already ran the op), as with
    `torch.library.register_vmap`.

    Returns:
        Callable: `func`; without `func`, a decorator that registers the function it is
        applied to and returns that function.

    Raises:
        ValueError: a name without a namespace (not `"mylib::op"`).
        TypeError: `op` is not an operator (a Python function such as `torch.sin`, an int),
            or `func` is not callable (raised by the decorator when `func` is None)
            ([error catalogue: configuration](../errors.md#configuration-and-extension)).
        NotImplementedError: the op (one of its overloads, for a packet or a name without
            an overload) has keyword-only tensor arguments, which `in_dims` has no entry
            for; nothing is registered (torch.library.register_vmap's error).
        AttributeError: no operator or overload of that name (`torch.ops`'s lookup).
        RuntimeError, IndexError, TypeError: at vmap time, a rule that does not return
            `(output, out_dims)` or returns `out_dims` that do not fit its outputs
            ([error catalogue: autograd.Function](../errors.md#torchautogradfunction-under-transforms)).

    Examples:
        A `torch.library.custom_op`, its rule given as an argument:

        >>> import torch, functx
        >>> @torch.library.custom_op("functx_doc::double_it", mutates_args=())
        ... def double_it(x: torch.Tensor) -> torch.Tensor:
        ...     return 2 * x
        >>> def double_it_vmap(info, in_dims, x):
        ...     return double_it(x), in_dims[0]  # elementwise: the batch dim stays where it is
        >>> functx.library.register_vmap(double_it, double_it_vmap) is double_it_vmap
        True
        >>> functx.vmap(double_it, in_dims=1)(torch.ones(2, 3)).shape
        torch.Size([3, 2])

        An op defined with `torch.library.define`, its rule registered by name with the
        decorator; the rule moves each batch dim to the front (an unbatched argument gets
        one by `expand`):

        >>> torch.library.define("functx_doc::scaled_add", "(Tensor x, Tensor y, float k) -> Tensor")
        >>> @torch.library.impl("functx_doc::scaled_add", "CompositeExplicitAutograd")
        ... def scaled_add(x, y, k):
        ...     return x + k * y
        >>> @functx.library.register_vmap("functx_doc::scaled_add")
        ... def scaled_add_vmap(info, in_dims, x, y, k):
        ...     front = lambda t, d: t.movedim(d, 0) if d is not None else t.expand(info.batch_size, *t.shape)
        ...     return torch.ops.functx_doc.scaled_add(front(x, in_dims[0]), front(y, in_dims[1]), k), 0
        >>> x, y = torch.ones(4, 3), torch.arange(3.0)
        >>> out = functx.vmap(torch.ops.functx_doc.scaled_add, in_dims=(0, None, None))(x, y, 2.0)
        >>> out.shape, torch.allclose(out, x + 2.0 * y)
        (torch.Size([4, 3]), True)

    Differences from torch.func:
        `torch.library.register_vmap` registers a rule for torch.func's vmap; functx reads
        those of `torch.library.custom_op`s too, so code written for torch.func needs no
        change (rules given to it for ops defined with `torch.library.define` or a
        `Library` are not read: torch keeps those only inside a kernel it registers in the
        dispatcher, reachable only through torch._functorch). functx's returns the rule
        (torch's returns None, also from its decorator), takes no `lib` argument, accepts an
        `OpOverloadPacket` (torch raises `ValueError`), and refuses a rule that is not
        callable (torch's accepts it and fails at vmap time). Both refuse an op with
        keyword-only tensor arguments (`NotImplementedError`).

        >>> torch.library.define("functx_doc::kw_only", "(Tensor x, *, Tensor y) -> Tensor")
        >>> try:
        ...     functx.library.register_vmap("functx_doc::kw_only", lambda info, in_dims, x, y: (x + y, 0))
        ... except NotImplementedError as error:
        ...     print(str(error)[:60])
        functx.library.register_vmap with kwarg-only Tensor args: th
    """

    overloads = _overloads(op)
    for overload in overloads:  # all checked before any is registered
        if _has_kwarg_only_tensors(overload._schema):
            raise NotImplementedError(
                f"functx.library.register_vmap with kwarg-only Tensor args: the rule's in_dims "
                f"has entries for positional arguments only, so it could not say where the batch "
                f"dim of such an argument is. In the original definition of the op, please make "
                f"your tensors not kwarg-only. Got: {overload._schema}"
            )

    def register(func):
        if not callable(func):
            raise TypeError(
                f"functx.library.register_vmap: the rule must be callable, "
                f"rule(info, in_dims, *args, **kwargs) -> (output, out_dims); got {type(func).__name__}"
            )
        for overload in overloads:
            user_rules.register(overload, func)
        return func

    return register if func is None else register(func)


def _has_kwarg_only_tensors(schema) -> bool:
    """Whether `schema` has a keyword-only argument that may hold tensors (a Tensor, an
    optional one, a list of them), as torch.library.register_vmap checks."""
    utils = torch._library.utils
    return any(
        a.kwarg_only and (utils.is_tensor_like_type(a.type) or utils.is_tensorlist_like_type(a.type))
        for a in schema.arguments
    )


__all__ = ["VmapInfo", "register_vmap"]
