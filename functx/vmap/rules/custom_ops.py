"""Batching rules written by users for their own operators (`torch.library.custom_op` or
any op outside aten/prims), in torch.library's form: `rule(info, in_dims, *args, **kwargs)`
returns `(output, out_dims)`, where `info` is a `VmapInfo(batch_size, randomness)` and
`in_dims` holds 0 for each argument batched at this level, None otherwise. They come from
`functx.library.register_vmap` or, for custom ops, from `torch.library.register_vmap`.
"""

from __future__ import annotations

import torch

from ..batched_tensor import VMAP_RULES
from ..custom_function import VmapInfo, wrap_user_outputs

REGISTERED: dict = {}  # OpOverload -> rule, from functx.library.register_vmap


def user_rule(func):
    """A batching rule (functx's form) running a user's rule (torch.library's form)."""

    def rule(interp, *args, **kwargs):
        in_dims = tuple(0 if interp.is_batched(a) else None for a in args)
        values = tuple(interp.unwrap(a) for a in args)
        result = func(VmapInfo(interp.batch_size, interp.randomness), in_dims, *values, **kwargs)
        return wrap_user_outputs(interp, result, args, values)

    return rule


def _torch_registered_rule(op):
    """The rule given to `torch.library.register_vmap` for a `torch.library.custom_op`."""
    opdefs = getattr(getattr(torch._library, "custom_ops", None), "OPDEFS", {})
    namespace, _, name = op._schema.name.partition("::")
    opdef = opdefs.get(f"{namespace}::{name}")
    return getattr(opdef, "_vmap_fn", None) if opdef is not None else None


def rule_for(op):
    """The user's batching rule for `op` (functx's registry first), or None."""
    if op.namespace in ("aten", "prims"):
        return None
    func = REGISTERED.get(op) or _torch_registered_rule(op)
    return user_rule(func) if func is not None else None


VMAP_RULES.add_template(lambda op: rule_for(op) is not None, rule_for)


def register(op, func) -> None:
    REGISTERED[op] = func
    VMAP_RULES._handlers.pop(op, None)
