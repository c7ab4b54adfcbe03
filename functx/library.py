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
    """Register `func(info, in_dims, *args, **kwargs) -> (output, out_dims)` as functx.vmap's
    batching rule for `op` (usable as a decorator). See the module docstring.

    Example:
        >>> import torch, functx
        >>> @torch.library.custom_op("functx_doc::double_it", mutates_args=())
        ... def double_it(x: torch.Tensor) -> torch.Tensor:
        ...     return 2 * x
        >>> def double_it_vmap(info, in_dims, x):
        ...     return double_it(x), in_dims[0]  # elementwise: the batch dim stays where it is
        >>> _ = functx.library.register_vmap(double_it, double_it_vmap)
        >>> functx.vmap(double_it, in_dims=1)(torch.ones(2, 3)).shape
        torch.Size([3, 2])
    """

    def register(func):
        for overload in _overloads(op):
            user_rules.register(overload, func)
        return func

    return register if func is None else register(func)


__all__ = ["VmapInfo", "register_vmap"]
