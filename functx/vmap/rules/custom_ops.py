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

from ...core.errors import op_name
from ...core.rules import decomposition_for
from ..batched_tensor import VMAP_RULES
from ..fallback import loop_fallback
from .user_rules import REGISTERED, run_user_rule


def _torch_registered_rule(op):
    """The rule given to `torch.library.register_vmap` for a `torch.library.custom_op`."""
    opdefs = getattr(getattr(torch._library, "custom_ops", None), "OPDEFS", {})
    opdef = opdefs.get(op._schema.name)  # "namespace::name", as OPDEFS keys them
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
    """The user's rule for `op`, else the per-sample loop. Looked up at every call, not
    kept: a rule may be registered after the op's first vmap, or registered again (with
    `functx.library.register_vmap` or `torch.library.register_vmap`) to replace the one
    before, and every level's resolved handler of `op` (core/rules.py `lookup`, under a
    direct AD level's overrides too) is this function."""
    loop = loop_fallback(op)
    imported_on_use = _RULES_IMPORTED_ON_USE.get(op.namespace)

    def rule(interp, *args, **kwargs):
        func = REGISTERED.get(op)
        if func is None and imported_on_use is not None:
            importlib.import_module(imported_on_use)
            func = REGISTERED.get(op)
        if func is None:
            func = _torch_registered_rule(op)
            if func is None:
                return loop(interp, *args, **kwargs)
            if not callable(func):  # torch.library.register_vmap does not check
                raise TypeError(
                    f"functx.vmap: the vmap rule given to torch.library.register_vmap for "
                    f"{op_name(op)} is not callable: got {type(func).__name__}. Register a function "
                    f"rule(info, in_dims, *args, **kwargs) -> (output, out_dims)."
                )
        return run_user_rule(op, func, interp, args, kwargs)

    return rule


VMAP_RULES.add_template(_is_user_op, _user_op_rule)
