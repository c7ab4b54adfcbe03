"""Containers that carry a batch size (TensorDict, tensorclass, users' own types) under vmap.

Such a container holds tensors whose leading dims are its *batch shape*. vmap addresses it as
a whole, never leaf by leaf: an `in_dims` entry for it is one int, a dim of its batch shape
(negative: counted from the end of the batch shape, not of each leaf's shape), and inside the
function it is rebuilt with that dim taken out of its batch shape and out of every leaf; a
container the function returns comes back with the vmapped dim put at its `out_dims` entry,
in its batch shape and every leaf. `randomness` applies to the leaves as to any input, and
`chunk_size` chunks the container along its mapped batch dim (with its `split(size, dim)`
method, and joins the results with `torch.cat`, which such containers support).

A kind of container is registered once, with four functions:

- `batch_shape(obj)`: its batch shape (a `torch.Size`);
- `add_batch_dim(obj, in_dim, mapped)`: the container as the function sees it, where
  `mapped.batch(tensor, dim)` turns one of its tensors (or of its sub-containers, along the
  same dim) into the tensor the function sees (`in_dim` is normalized: 0 <= in_dim < its
  rank);
- `remove_batch_dim(obj, out_dim, mapped)`: a container the function returned, with the
  mapped dim (`mapped.size` elements) put back at `out_dim` of its batch shape, where
  `mapped.unbatch(tensor, dim)` turns one of its tensors back (a tensor that does not depend
  on the mapped inputs comes back expanded, as vmap's outputs do; a container may also
  unbatch while the function runs, e.g. to store a value in a part it keeps unbatched);
- `types`: the classes it covers (subclasses too), or a predicate on the class.

See `register_batched_container` for an example.

Lookup is by type, once per vmap call: vmap asks `kind_of` for the classes of its arguments
and outputs only while some kind is registered (`container_kinds.in_use`). functx registers
TensorDict's kinds itself (core/container_kinds.py) the first time it meets arguments while
the `tensordict` module is imported: it never imports tensordict.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from typing import Any, Callable

import torch


class MappedDim:
    """What vmap gives a container's kind: the mapped dim's `size`, `batch(tensor, dim)` (a
    tensor of the container as the function sees it, `dim` taken out) and `unbatch(tensor,
    dim)` (a tensor the function holds, with the mapped dim put back at `dim`). One per vmap
    call; `key` is an int no other call has (negative: never one of torch.func's levels),
    for libraries that take a level number (`live_mapped_dim(key)` finds it while the call
    runs)."""

    __slots__ = ("size", "batch", "unbatch", "key", "__weakref__")

    def __init__(self, size: int, batch: Callable, unbatch: Callable):
        self.size, self.batch, self.unbatch = size, batch, unbatch
        self.key = -next(_keys)
        _LIVE[self.key] = self

    def __repr__(self):
        return f"MappedDim(size={self.size})"


_keys = itertools.count(1)
_LIVE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def live_mapped_dim(key) -> MappedDim | None:
    """The `MappedDim` of a running vmap call with this `key`, or None."""
    return _LIVE.get(key) if type(key) is int and key < 0 else None


@dataclasses.dataclass(frozen=True, eq=False)
class ContainerKind:
    """One registered kind of container with a batch size (see the module docstring)."""

    name: str
    covers: Callable[[type], bool] = dataclasses.field(repr=False)
    batch_shape: Callable[[Any], torch.Size] = dataclasses.field(repr=False)
    add_batch_dim: Callable[[Any, int, MappedDim], Any] = dataclasses.field(repr=False)
    remove_batch_dim: Callable[[Any, int, MappedDim], Any] = dataclasses.field(repr=False)


_KINDS: list[ContainerKind] = []
_KIND_OF_TYPE: dict[type, ContainerKind | None] = {}


def register_batched_container(
    types,
    *,
    batch_shape: Callable[[Any], torch.Size],
    add_batch_dim: Callable[[Any, int, MappedDim], Any],
    remove_batch_dim: Callable[[Any, int, MappedDim], Any],
    name: str | None = None,
) -> ContainerKind:
    """Register a kind of container that carries a batch size (its leaves share leading
    dims, its *batch shape*), so that `functx.vmap` maps over a dim of that batch shape
    with the container as one argument or output: its `in_dims` / `out_dims` entry is one
    int, a dim of the batch shape (negative: counted from the end of the batch shape).
    The protocol is in `functx.core.containers`. A later registration of the same classes
    wins. `vmap(..., chunk_size=...)` also needs the container's `split(size, dim)`
    method, and its outputs joined by `torch.cat`.

    Args:
        types (type | tuple[type, ...] | Callable[[type], bool]): the classes of the
            containers (subclasses included), or a predicate on a class.
        batch_shape (Callable[[Any], torch.Size]): `batch_shape(obj)`, the container's
            batch shape.
        add_batch_dim (Callable[[Any, int, MappedDim], Any]): `add_batch_dim(obj, in_dim,
            mapped)`, the container as the function sees it: `mapped.batch(tensor, dim)`
            takes the mapped dim out of each of its tensors; `in_dim` is normalized
            (`0 <= in_dim <` the batch shape's length).
        remove_batch_dim (Callable[[Any, int, MappedDim], Any]): `remove_batch_dim(obj,
            out_dim, mapped)`, a container the function returned with the mapped dim
            (`mapped.size` elements) put back at `out_dim` of its batch shape:
            `mapped.unbatch(tensor, dim)` puts it back into each of its tensors (one that
            does not depend on the mapped inputs comes back expanded).
        name (str | None, default None): the kind's name in messages; None: the classes'
            names (the predicate's `__name__`).

    Returns:
        ContainerKind: the registered kind (`functx.core.containers.ContainerKind`).

    Raises:
        TypeError: `types` is not a class, a non-empty tuple of classes or a callable, or
            one of the three functions is not callable
            ([error catalogue: configuration](../errors.md#configuration-and-extension)).

    Examples:
        A user's container, a dict of tensors with a batch shape, mapped over its last
        batch dim:

        >>> import torch, functx
        >>> from functx.core.containers import forget  # undoes a registration (internal)
        >>> class Batch:
        ...     def __init__(self, data, shape):
        ...         self.data, self.shape = data, torch.Size(shape)
        >>> def add_batch_dim(b, dim, mapped):
        ...     shape = b.shape[:dim] + b.shape[dim + 1:]
        ...     return Batch({k: mapped.batch(v, dim) for k, v in b.data.items()}, shape)
        >>> def remove_batch_dim(b, dim, mapped):
        ...     shape = b.shape[:dim] + (mapped.size,) + b.shape[dim:]
        ...     return Batch({k: mapped.unbatch(v, dim) for k, v in b.data.items()}, shape)
        >>> kind = functx.register_batched_container(
        ...     Batch, batch_shape=lambda b: b.shape, add_batch_dim=add_batch_dim, remove_batch_dim=remove_batch_dim)
        >>> b = Batch({"x": torch.ones(2, 5, 3)}, (2, 5))
        >>> out = functx.vmap(lambda b: Batch({"y": b.data["x"].sum(-1)}, b.shape), in_dims=-1)(b)
        >>> out.shape, out.data["y"].shape
        (torch.Size([5, 2]), torch.Size([5, 2]))
        >>> forget(kind)

        Registered by a predicate, with a name; the container returned at `out_dims=1`:

        >>> kind = functx.register_batched_container(
        ...     lambda cls: issubclass(cls, Batch), name="batches", batch_shape=lambda b: b.shape,
        ...     add_batch_dim=add_batch_dim, remove_batch_dim=remove_batch_dim)
        >>> kind
        ContainerKind(name='batches')
        >>> out = functx.vmap(lambda b: Batch({"x": 2 * b.data["x"]}, b.shape), out_dims=1)(b)
        >>> out.shape, out.data["x"].shape
        (torch.Size([5, 2]), torch.Size([5, 2, 3]))
        >>> forget(kind)

    Differences from torch.func:
        torch.func has none: its vmap maps over the tensors of pytrees
        (`torch.utils._pytree.register_pytree_node` for one's own class), each at the same
        in_dim, with no batch shape of the container's own. tensordict makes its
        containers work with torch.func's vmap by replacing functions of torch's vmap
        implementation (`torch._functorch.vmap`); functx registers TensorDict's kinds
        itself once `tensordict` is imported.
    """
    if isinstance(types, type):
        types = (types,)
    if isinstance(types, tuple):
        if not types or not all(isinstance(t, type) for t in types):
            raise TypeError(
                f"functx.register_batched_container: expected a class, a tuple of classes or a "
                f"predicate on a class, got {types!r}."
            )
        classes = types

        def covers(cls):
            return issubclass(cls, classes)

    elif callable(types):
        covers = types
    else:
        raise TypeError(
            f"functx.register_batched_container: expected a class, a tuple of classes or a "
            f"predicate on a class, got {type(types).__name__}."
        )
    for what, fn in (("batch_shape", batch_shape), ("add_batch_dim", add_batch_dim), ("remove_batch_dim", remove_batch_dim)):
        if not callable(fn):
            raise TypeError(f"functx.register_batched_container: `{what}` must be callable, got {type(fn).__name__}.")
    if name is None:
        name = ", ".join(t.__name__ for t in types) if isinstance(types, tuple) else getattr(types, "__name__", repr(types))
    kind = ContainerKind(name, covers, batch_shape, add_batch_dim, remove_batch_dim)
    _KINDS.insert(0, kind)  # the newest first
    _KIND_OF_TYPE.clear()
    return kind


def forget(kind: ContainerKind) -> None:
    """Undo `register_batched_container` (tests register kinds for a while)."""
    _KINDS.remove(kind)
    _KIND_OF_TYPE.clear()


def kind_of(cls: type) -> ContainerKind | None:
    """The registered kind covering objects of class `cls`, or None (cached per class)."""
    try:
        return _KIND_OF_TYPE[cls]
    except KeyError:
        pass
    kind = next((k for k in _KINDS if k.covers(cls)), None)
    _KIND_OF_TYPE[cls] = kind
    return kind


def is_container(x) -> bool:
    """Whether `x` is an object of a registered kind (a pytree leaf for vmap)."""
    return kind_of(type(x)) is not None


def any_registered() -> bool:
    """Whether some kind is registered (core/container_kinds.py `in_use` also registers the
    kinds of libraries imported since)."""
    return bool(_KINDS)
