"""The registry of users' batching rules (`functx.library.register_vmap`) and the adapter
that runs one in torch.library's form, `rule(info, in_dims, *args, **kwargs)` ->
`(output, out_dims)`, as a functx batching rule. custom_ops.py finds a rule for an op
outside aten here (or in torch.library's registry) at every call, so a rule registered
again replaces the one before at once; functx's own rules written in that form
(collectives.py) register here too.

    >>> import torch, functx
    >>> from functx.vmap.rules.user_rules import REGISTERED
    >>> @torch.library.custom_op("functx_doc::halve", mutates_args=())
    ... def halve(x: torch.Tensor) -> torch.Tensor:
    ...     return x / 2
    >>> _ = functx.library.register_vmap(halve, lambda info, in_dims, x: (halve(x), in_dims[0]))
    >>> halve._opoverload in REGISTERED
    True
"""

from __future__ import annotations

import optree

from ...core.errors import op_name
from ..custom_function import VmapInfo, in_dims_and_values, wrap_user_outputs

REGISTERED: dict = {}  # OpOverload -> rule, from functx.library.register_vmap


def run_user_rule(op, func, interp, args, kwargs):
    """`func`, a user's rule for `op` (torch.library's form), run as a functx batching rule.
    `in_dims` has entries for the positional arguments only (as torch.func's): a tensor
    batched at this level among the keyword(-only) arguments is refused, never handed to the
    rule without its batch dim (functx.library.register_vmap refuses such ops' rules)."""
    if kwargs and any(interp.is_batched(v) for v in optree.tree_leaves(kwargs, none_is_leaf=True)):
        raise NotImplementedError(
            f"functx.vmap: the vmap rule of {op_name(op)} got a batched tensor in a keyword-only "
            f"argument, which has no entry in in_dims (vmap rules with kwarg-only Tensor args are "
            f"not supported, as in torch.library.register_vmap). In the original definition of "
            f"the op, please make your tensors not kwarg-only. Got: {op._schema}"
        )
    in_dims, values = in_dims_and_values(interp, args, user_dims=True)
    result = func(VmapInfo(interp.batch_size, interp.randomness), in_dims, *values, **kwargs)
    return wrap_user_outputs(interp, result, args, values, in_dims=in_dims)


def register(op, func) -> None:
    """`func` (torch.library's form) as the batching rule of `op`, replacing any rule given
    before (found at the op's next call: rules/custom_ops.py looks it up at every call)."""
    REGISTERED[op] = func
