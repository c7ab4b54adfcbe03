"""vmap over containers that carry a batch size (core/containers.py: TensorDict, tensorclass,
users' registered types): checking an `in_dims` entry against the container's batch shape,
batching it for the function, unbatching one it returns.

vmap keeps such a container whole while it flattens its arguments and outputs (`is_leaf`,
only while some kind is registered), so `in_dims` / `out_dims` address it with one int, a
dim of its batch shape; the container's own kind rebuilds it around the batched tensors.

    >>> import torch, functx
    >>> from functx.core.containers import register_batched_container
    >>> class Pair:
    ...     def __init__(self, a, b, shape):
    ...         self.a, self.b, self.shape = a, b, torch.Size(shape)
    >>> _ = register_batched_container(
    ...     Pair, batch_shape=lambda p: p.shape,
    ...     add_batch_dim=lambda p, d, m: Pair(m.batch(p.a, d), m.batch(p.b, d), p.shape[:d] + p.shape[d + 1:]),
    ...     remove_batch_dim=lambda p, d, m: Pair(m.unbatch(p.a, d), m.unbatch(p.b, d), p.shape[:d] + (m.size,) + p.shape[d:]))
    >>> p = Pair(torch.ones(4, 2), torch.zeros(4), (4,))
    >>> functx.vmap(lambda p: p.a.sum() + p.b)(p).shape
    torch.Size([4])
"""

from __future__ import annotations

import torch

from ..core.container_kinds import in_use
from ..core.containers import MappedDim, is_container, kind_of

__all__ = ["container_leaf", "mapped_size", "mapped_dim", "batch_container", "unbatch_container", "chunks_of"]


def container_leaf():
    """The `is_leaf` for vmap's flattening of arguments and outputs: the registered
    containers, kept whole; None (every node opened) while none is registered."""
    return is_container if in_use() else None


def mapped_size(func_name: str, in_dims, where: str, obj, dim: int) -> tuple[int, int]:
    """`(normalized in_dim, size of the mapped dim)` of container `obj` at in_dim `dim`, a dim
    of its batch shape; ValueError naming `where` (the argument) if it has no such dim."""
    shape = kind_of(type(obj)).batch_shape(obj)
    rank = len(shape)
    if not -rank <= dim < rank:
        raise ValueError(
            f"vmap({func_name}, in_dims={in_dims}, ...)(<inputs>): Got in_dim={dim} for {where}, a "
            f"{type(obj).__name__} with batch size {list(shape)}: vmap maps over a dim of a "
            f"container's batch size, so expected -{rank} <= in_dim < {rank}"
            + (" (it has no batch dims: give it a batch size, or in_dim None)." if rank == 0 else ".")
        )
    dim %= rank
    return dim, shape[dim]


def mapped_dim(interp, unbatch) -> MappedDim:
    """What the containers' kinds get from vmap level `interp`: its batch size, the batching
    of one tensor (a BatchedTensor of the level), and `unbatch(tensor, dim)` (vmap/mapping.py:
    the level's unbatching of one output, with its checks)."""
    from .batched_tensor import BatchedTensor

    def batch(tensor, dim):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"vmap: a container's kind asked to batch a {type(tensor).__name__}; only tensors can be batched.")
        return BatchedTensor(tensor if dim == 0 else tensor.movedim(dim, 0), interp)

    return MappedDim(interp.batch_size, batch, unbatch)


def batch_container(mapped: MappedDim, obj, dim: int):
    """`obj` (a registered container, `dim` a normalized dim of its batch shape) as the
    function sees it: rebuilt by its kind around the mapped tensors."""
    return kind_of(type(obj)).add_batch_dim(obj, dim, mapped)


def unbatch_container(func_name: str, obj, out_dim: int, mapped: MappedDim):
    """A registered container the function returned, with the mapped dim put back at `out_dim`
    (of the batch shape it has outside: checked, negative counted from its end) by its kind."""
    rank = len(kind_of(type(obj)).batch_shape(obj)) + 1
    if not -rank <= out_dim < rank:
        raise IndexError(
            f"vmap({func_name}, ..., out_dims={out_dim}): out_dim {out_dim} is out of range for a "
            f"{type(obj).__name__} whose batch size has {rank - 1} dims inside the function "
            f"(expected -{rank} <= out_dim < {rank}: a dim of its batch size outside)."
        )
    return kind_of(type(obj)).remove_batch_dim(obj, out_dim % rank, mapped)


def chunks_of(x, chunk_size: int, dim: int):
    """`x` split into chunks of `chunk_size` along `dim` (a tensor, or a container that can
    `split` along a dim of its batch shape, as TensorDict can)."""
    if is_container(x):
        split = getattr(x, "split", None)
        if split is None:
            raise NotImplementedError(
                f"vmap(..., chunk_size=...): a {type(x).__name__} has no `split(size, dim)` method, "
                f"so vmap cannot chunk it; give it one, or call vmap without chunk_size."
            )
        return split(chunk_size, dim)
    return x.split(chunk_size, dim=dim)
