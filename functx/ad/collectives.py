"""Forward-mode rules for torch's functional collectives: torch gives them reverse mode only
(its forward AD drops their tangents: zeros). A collective is linear in its tensors, so the
output's tangent is the same collective of every rank's tangent; all_reduce with max/min is
not, and is an error.

Registered through `library_ops` (`register_forward_rule`), once torch's functional
collectives are imported: the first forward transform after that imports this module
(forward.py), as does `functx.distributed`.

Example (one process: a group of one rank):
    >>> import os, torch, torch.distributed as dist, functx
    >>> import torch.distributed._functional_collectives as funcol
    >>> os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29532")  # doctest: +ELLIPSIS
    '...'
    >>> started = not dist.is_initialized() and dist.init_process_group("gloo", rank=0, world_size=1) is None
    >>> f = lambda x: funcol.all_reduce(x.sin(), "sum", dist.group.WORLD)
    >>> x, t = torch.ones(2), torch.ones(2)
    >>> torch.allclose(functx.jvp(f, (x,), (t,))[1], x.cos())
    True
    >>> if started: dist.destroy_process_group()
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives  # noqa: F401  (registers the _c10d_functional ops)
from torch import Tensor

from . import library_ops
from .wrapped_forward import NO_FORWARD_FORMULA

_c10d = torch.ops._c10d_functional
_c10d_autograd = torch.ops._c10d_functional_autograd


def _linear_forward_rule(op, reduce_op_at=None):
    """A collective is linear in its tensors (sum or average over ranks, gathering, scattering,
    exchanging, broadcasting): the output's tangent is the same collective of the tangents,
    so forward mode costs one more collective, as torch's backward does. Every rank must
    differentiate the same collectives (with zero tangents where it has none), as every
    rank calls them."""

    def rule(run, primals, tangents, kwargs):
        if reduce_op_at is not None and str(primals[reduce_op_at]).lower() not in ("sum", "avg"):
            raise NotImplementedError(
                f"{NO_FORWARD_FORMULA} {op} with reduce_op={primals[reduce_op_at]!r}: only a sum or an average over "
                f"ranks is linear (functx.jvp falls back to the double-VJP identity, which needs the backward)"
            )
        args = [_tangent_or_zeros(p, t) for p, t in zip(primals, tangents)]
        # The tangent's collective is waited on at once: attaching it to the output may copy
        # it (a vmap-batched tangent), which must not read the buffer before it is filled.
        tangent = op(*args, **kwargs)
        if isinstance(tangent, list):
            return run(*primals, **kwargs), [_c10d.wait_tensor(t) for t in tangent]
        return run(*primals, **kwargs), _c10d.wait_tensor(tangent)

    return rule


def _wrap_forward_rule(run, primals, tangents, kwargs):
    """`_wrap_tensor_autograd` returns an AsyncCollectiveTensor, whose users read its inner
    tensor (`.elem`), which has no tangent: under forward mode the collective is waited on
    at once instead (as under vmap)."""
    return _c10d.wait_tensor(primals[0]), _c10d.wait_tensor(tangents[0])


def _tangent_or_zeros(primal, tangent):
    if isinstance(primal, Tensor):
        return torch.zeros_like(primal) if tangent is None else tangent
    if isinstance(primal, list) and tangent is not None:
        return [torch.zeros_like(p) if t is None else t for p, t in zip(primal, tangent)]
    return primal


def _register_forward_rules() -> None:
    """Forward mode (jvp, jacfwd, hessian) through the functional collectives: torch gives
    them reverse mode only (functx/ad/library_ops.py)."""
    reduce_op_at = {"all_reduce": 1, "all_reduce_coalesced": 1, "reduce_scatter_tensor": 1, "reduce_scatter_tensor_coalesced": 1}
    namespaces = {
        _c10d: ("all_reduce", "all_reduce_coalesced", "all_gather_into_tensor", "all_gather_into_tensor_coalesced",
                "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "all_to_all_single", "broadcast",
                "wait_tensor"),
        _c10d_autograd: ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"),
    }  # fmt: skip
    for namespace, names in namespaces.items():
        for name in names:
            op = getattr(namespace, name).default
            library_ops.register_forward_rule(op, _linear_forward_rule(op, reduce_op_at.get(name)))
            library_ops.wrap_existing(op)
    library_ops.register_forward_rule(_c10d._wrap_tensor_autograd.default, _wrap_forward_rule)
    library_ops.wrap_existing(_c10d._wrap_tensor_autograd.default)


_register_forward_rules()
