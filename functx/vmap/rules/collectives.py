"""Batching rules for torch's functional collectives (`torch.distributed._functional_collectives`).

Code written for one sample that calls `all_reduce`, `all_gather_tensor` /
`all_gather_single`, `reduce_scatter_tensor` / `reduce_scatter_single`,
`all_to_all_single`, `broadcast`, their coalesced forms and `wait_tensor` works under
`functx.vmap`: each collective runs ONCE on the physical (batched) tensor, with the batch
dim moved where the collective leaves it alone (all-reduce and broadcast are elementwise:
anywhere; gathers, scatters and all-to-all work on dim 0 of the sample: the batch goes to
dim 1). An `AsyncCollectiveTensor` is waited on at once; the in-place and `out=` forms and
the point-to-point ops are refused with an error naming what to use instead.

Imported on first use (`custom_ops._RULES_IMPORTED_ON_USE`: it costs an import of
torch.distributed, which `import functx` does not pay) and by `functx.distributed`. The
rules are written in the form of `functx.library.register_vmap` (`info, in_dims, *args`).

Example (one process: a group of one rank):
    >>> import os, torch, torch.distributed as dist, functx
    >>> import torch.distributed._functional_collectives as funcol
    >>> os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29531")  # doctest: +ELLIPSIS
    '...'
    >>> started = not dist.is_initialized() and dist.init_process_group("gloo", rank=0, world_size=1) is None
    >>> functx.vmap(lambda x: funcol.all_reduce(x, "sum", dist.group.WORLD) * 2)(torch.ones(3, 2)).tolist()
    [[2.0, 2.0], [2.0, 2.0], [2.0, 2.0]]
    >>> if started: dist.destroy_process_group()
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives  # noqa: F401  (registers the _c10d_functional ops)
from torch import Tensor

from .user_rules import register

_c10d = torch.ops._c10d_functional
_c10d_autograd = torch.ops._c10d_functional_autograd


def _elementwise_rule(op):
    """all_reduce, broadcast, wait_tensor: the collective acts elementwise across ranks, so
    it runs on the physical tensor as it is (batch dim anywhere)."""

    def rule(info, in_dims, x, *rest):
        return op(x, *rest), in_dims[0]

    return rule


def _dim0_rule(op):
    """all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single: they gather, scatter
    or exchange along dim 0 of the sample, so the batch dim goes to dim 1 and the output
    keeps it there (`(n, B, ...)` -> `(W·n, B, ...)` for a gather)."""

    def rule(info, in_dims, x, *rest):
        _check_has_dim0(op, x)
        return op(x.movedim(in_dims[0], 1).contiguous(), *rest), 1

    return rule


def _check_has_dim0(op, physical: Tensor) -> None:
    if physical.dim() < 2:
        raise RuntimeError(
            f"functx.vmap: {op._schema.name} of a 0-dim sample: the collective works along dim 0 of each "
            f"sample, which a 0-dim tensor does not have; give the sample one (x.unsqueeze(0))"
        )


def _coalesced_rule(op, dim0: bool):
    """The coalesced forms: one collective for a list of tensors, each moved as its single
    form moves it; unbatched ones go as they are."""

    def rule(info, in_dims, xs, *rest):
        dims = in_dims[0]
        if dim0:
            for x, d in zip(xs, dims):
                if d is not None:
                    _check_has_dim0(op, x)
        moved = [x if d is None else (x.movedim(d, 1).contiguous() if dim0 else x) for x, d in zip(xs, dims)]
        out_dims = [None if d is None else (1 if dim0 else d) for d in dims]
        return op(moved, *rest), out_dims

    return rule


def _wait_rule(info, in_dims, x):
    """`_wrap_tensor_autograd` (what the Python wrappers call to return an
    `AsyncCollectiveTensor`, which waits on first use): under vmap, wait now."""
    return _c10d.wait_tensor(x), in_dims[0]


def _refusing_rule(op, instead: str):
    def rule(info, in_dims, *args, **kwargs):
        raise NotImplementedError(
            f"functx.vmap: {op._schema.name} has no batching rule (run once per sample, its outputs would be "
            f"read before the collective finished); {instead}"
        )

    return rule


def _register_rules() -> None:
    for op in (_c10d.all_reduce, _c10d.broadcast, _c10d.wait_tensor):
        register(op.default, _elementwise_rule(op.default))
    for op in (
        _c10d.all_gather_into_tensor,
        _c10d.reduce_scatter_tensor,
        _c10d.all_to_all_single,
        _c10d_autograd.all_gather_into_tensor,
        _c10d_autograd.reduce_scatter_tensor,
        _c10d_autograd.all_to_all_single,
    ):
        register(op.default, _dim0_rule(op.default))
    register(_c10d.all_reduce_coalesced.default, _coalesced_rule(_c10d.all_reduce_coalesced.default, False))
    for op in (_c10d.all_gather_into_tensor_coalesced, _c10d.reduce_scatter_tensor_coalesced):
        register(op.default, _coalesced_rule(op.default, True))
    register(_c10d._wrap_tensor_autograd.default, _wait_rule)
    out_of_place = "use the out-of-place form (torch.distributed._functional_collectives.all_reduce, ...)"
    for name in ("all_reduce_", "all_reduce_coalesced_", "broadcast_", "all_gather_into_tensor_out", "reduce_scatter_tensor_out"):
        op = getattr(_c10d, name).default
        register(op, _refusing_rule(op, out_of_place))
    for name in ("isend", "irecv", "batch_p2p_ops"):
        op = getattr(_c10d, name).default
        register(op, _refusing_rule(op, "send and receive the batch outside vmap"))


_register_rules()
