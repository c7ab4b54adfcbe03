"""The registry of users' batching rules (`functx.library.register_vmap`) and the adapter
that runs one in torch.library's form, `rule(info, in_dims, *args, **kwargs)` ->
`(output, out_dims)`, as a functx batching rule. custom_ops.py finds a rule for an op
outside aten here (or in torch.library's registry); functx's own rules written in that form
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

from ..batched_tensor import VMAP_RULES
from ..custom_function import VmapInfo, in_dims_and_values, wrap_user_outputs

REGISTERED: dict = {}  # OpOverload -> rule, from functx.library.register_vmap


def user_rule(func):
    """A batching rule (functx's form) running a user's rule (torch.library's form)."""

    def rule(interp, *args, **kwargs):
        in_dims, values = in_dims_and_values(interp, args, user_dims=True)
        result = func(VmapInfo(interp.batch_size, interp.randomness), in_dims, *values, **kwargs)
        return wrap_user_outputs(interp, result, args, values, in_dims=in_dims)

    return rule


def register(op, func) -> None:
    """`func` (torch.library's form) as the batching rule of `op`, replacing what
    `VMAP_RULES` had resolved for it."""
    REGISTERED[op] = func
    VMAP_RULES._handlers.pop(op, None)
