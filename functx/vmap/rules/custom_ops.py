"""Batching rules written by users for their own operators (`torch.library.custom_op` or
any op outside aten/prims), in torch.library's form: `rule(info, in_dims, *args, **kwargs)`
returns `(output, out_dims)`, where `info` is a `VmapInfo(batch_size, randomness)` and
`in_dims` has one entry per argument, as torch.func gives them: a list for a list of tensors
(`[1, None]`), None for what is not batched at this level, else where the batch dim of the
physical value is: 0, or vmap's in_dim for a tensor passed to vmap as is (as an
autograd.Function's vmap staticmethod gets them: custom_function.py). They come from
`functx.library.register_vmap` or, for custom ops, from `torch.library.register_vmap`.
"""

from __future__ import annotations

import importlib

import torch

from ...core.rules import decomposition_for
from ..batched_tensor import VMAP_RULES
from ..fallback import loop_fallback
from .user_rules import REGISTERED, user_rule


def _torch_registered_rule(op):
    """The rule given to `torch.library.register_vmap` for a `torch.library.custom_op`."""
    opdefs = getattr(getattr(torch._library, "custom_ops", None), "OPDEFS", {})
    namespace, _, name = op._schema.name.partition("::")
    opdef = opdefs.get(f"{namespace}::{name}")
    return getattr(opdef, "_vmap_fn", None) if opdef is not None else None


def _is_user_op(op) -> bool:
    """An operator outside aten/prims that nothing else (its own composite kernel, a
    torch._decomp decomposition) batches."""
    return (
        op.namespace not in ("aten", "prims")
        and not op.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd)
        and decomposition_for(op) is None
    )


# Namespaces whose rules live in a functx module imported on first use (it would cost every
# `import functx` an import of torch.distributed): the module registers them on import.
_RULES_IMPORTED_ON_USE = {
    "_c10d_functional": f"{__package__}.collectives",
    "_c10d_functional_autograd": f"{__package__}.collectives",
}


def _user_op_rule(op):
    """The user's rule for `op`, looked up again on every call until there is one (rules
    may be registered after the op's first vmap), else the per-sample loop."""
    loop = loop_fallback(op)

    def rule(interp, *args, **kwargs):
        if op not in REGISTERED and op.namespace in _RULES_IMPORTED_ON_USE:
            importlib.import_module(_RULES_IMPORTED_ON_USE[op.namespace])
        func = REGISTERED.get(op) or _torch_registered_rule(op)
        if func is None:
            return loop(interp, *args, **kwargs)
        found = user_rule(func)
        VMAP_RULES.set(op, found)
        return found(interp, *args, **kwargs)

    return rule


VMAP_RULES.add_template(_is_user_op, _user_op_rule)
