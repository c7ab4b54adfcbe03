"""Pytree helpers for the transforms: optree's, also seeing torch's pytree registrations.

torch.func flattens with `torch.utils._pytree`, where user types, dataclasses
(`register_dataclass`) and libraries register their containers; functx flattens with
optree (C++, fast). Every type registered with torch's pytree and unknown to optree is
registered here, lazily, with optree in functx's own namespace (`NAMESPACE`), through an
adapter that calls torch's flatten / unflatten functions. So the transforms accept
containers registered with either library, and still flatten in one optree call.

The registration is synced when torch's registry changes. The key (`_registry_key`) is its
length and its last entry's `NodeDef` object: torch appends every registration at the end
as a new object (which functx keeps alive, so its identity cannot be reused), and a
deregistration shortens the dict, so no change can keep both (deregistering one type and
registering another keeps the length only). The hot path (one flatten per transform call,
never per op) pays one `len()` and one `reversed()` step (~0.1 µs).

Precedence: a type optree knows (built-in containers, namedtuples, structseqs, types
registered in optree's global namespace or in `NAMESPACE`) is flattened as optree does;
torch's registration is used for the others. To register a type for functx only, with
optree: `optree.register_pytree_node(cls, flatten, unflatten, namespace="functx")`.

Example:
    >>> import torch, torch.utils._pytree as torch_pytree
    >>> from functx.core import pytree
    >>> class Pair:
    ...     def __init__(self, a, b):
    ...         self.a, self.b = a, b
    >>> torch_pytree.register_pytree_node(Pair, lambda p: ([p.a, p.b], None), lambda v, c: Pair(*v))
    >>> leaves, spec = pytree.tree_flatten(Pair(torch.zeros(1), torch.ones(1)))
    >>> [t.item() for t in leaves], type(pytree.tree_unflatten(spec, leaves)).__name__
    ([0.0, 1.0], 'Pair')
"""

from __future__ import annotations

import threading

import optree
import torch
import torch.utils._pytree as _torch_pytree

__all__ = [
    "NAMESPACE",
    "broadcast_prefix",
    "describe",
    "tree_flatten",
    "tree_flatten_with_path",
    "tree_leaves",
    "tree_map",
    "tree_structure",
    "tree_unflatten",
]

NAMESPACE = "functx"

_TORCH_NODES = _torch_pytree.SUPPORTED_NODES  # torch mutates this dict in place
_TORCH_NODE_DEFS = _TORCH_NODES.values()  # a live view
_lock = threading.Lock()
_synced_key: tuple = (-1, None)  # _registry_key() when last synced
_from_torch: dict[type, object] = {}  # types registered here -> torch's NodeDef then


def _known_to_optree(cls) -> bool:
    get = getattr(optree.register_pytree_node, "get", None)
    if get is not None:  # built-ins, namedtuples, structseqs, globally or NAMESPACE-registered types
        return get(cls, namespace=NAMESPACE) is not None
    registry = getattr(optree.registry, "_NODETYPE_REGISTRY", {})  # an older optree
    return (
        cls in registry
        or (NAMESPACE, cls) in registry
        or optree.is_namedtuple_class(cls)
        or optree.is_structseq_class(cls)
    )


def _adapters(cls, node_def):
    """optree's (flatten, unflatten) calling torch's functions for `cls`; looked up when
    called, so a registration torch overwrites is followed."""

    def flatten(node):
        children, context = _TORCH_NODES.get(cls, node_def).flatten_fn(node)
        return children, context

    def unflatten(context, children):
        return _TORCH_NODES.get(cls, node_def).unflatten_fn(list(children), context)

    return flatten, unflatten


def _registry_key() -> tuple:
    """(length, last NodeDef) of torch's registry: changes with every (de)registration."""
    return len(_TORCH_NODES), next(reversed(_TORCH_NODE_DEFS), None)


def _sync() -> None:
    """Register with optree (in NAMESPACE) the types torch's pytree knows and optree does
    not; unregister those torch forgot."""
    global _synced_key
    with _lock:
        key = _registry_key()
        nodes = dict(_TORCH_NODES)
        for cls in [c for c in _from_torch if c not in nodes]:
            optree.unregister_pytree_node(cls, namespace=NAMESPACE)
            del _from_torch[cls]
        for cls, node_def in nodes.items():
            if not isinstance(cls, type) or cls in _from_torch or _known_to_optree(cls):
                continue
            try:
                optree.register_pytree_node(cls, *_adapters(cls, node_def), namespace=NAMESPACE)
            except ValueError:  # optree refuses it (a type it handles itself): its way wins
                continue
            _from_torch[cls] = node_def
        _synced_key = key  # holds the last NodeDef: its identity stays unique


def _namespace() -> str:
    """`NAMESPACE`, synced with torch's registrations first if they changed."""
    length, last = _synced_key
    if len(_TORCH_NODES) != length or next(reversed(_TORCH_NODE_DEFS), None) is not last:
        _sync()
    return NAMESPACE


def tree_flatten(tree, none_is_leaf: bool = False, is_leaf=None):
    """`(leaves, spec)`, as `optree.tree_flatten`, seeing torch's registrations too
    (`is_leaf`: nodes to keep whole, vmap's containers with a batch size)."""
    return optree.tree_flatten(tree, is_leaf, none_is_leaf=none_is_leaf, namespace=_namespace())


def tree_flatten_with_path(tree, none_is_leaf: bool = False):
    """`(paths, leaves, spec)`, as `optree.tree_flatten_with_path`."""
    return optree.tree_flatten_with_path(tree, none_is_leaf=none_is_leaf, namespace=_namespace())


def tree_leaves(tree, none_is_leaf: bool = False):
    return optree.tree_leaves(tree, none_is_leaf=none_is_leaf, namespace=_namespace())


def tree_structure(tree, none_is_leaf: bool = False):
    return optree.tree_structure(tree, none_is_leaf=none_is_leaf, namespace=_namespace())


def tree_map(func, tree, none_is_leaf: bool = False):
    return optree.tree_map(func, tree, none_is_leaf=none_is_leaf, namespace=_namespace())


def broadcast_prefix(prefix, tree, none_is_leaf: bool = False, is_leaf=None) -> list:
    """The leaves of `prefix` (a prefix of `tree`'s structure: in_dims, out_dims) repeated
    over `tree`'s leaves they stand for; ValueError when it is not a prefix."""
    return optree.broadcast_prefix(prefix, tree, is_leaf, none_is_leaf=none_is_leaf, namespace=_namespace())


tree_unflatten = optree.tree_unflatten  # the spec knows its namespace


class _Shown:
    __slots__ = ("text",)

    def __init__(self, text):
        self.text = text

    def __repr__(self):
        return self.text


def describe(tree) -> str:
    """`tree` written as Python, each tensor as `Tensor(<shape>)` (for error messages: the
    user's structure, not a PyTreeSpec).

    Example:
        >>> import torch
        >>> describe(({"w": torch.zeros(2, 3)}, None, 1))
        "({'w': Tensor(2, 3)}, None, 1)"
    """

    def leaf(x):
        if isinstance(x, torch.Tensor):
            return _Shown(f"Tensor({', '.join(map(str, x.shape))})")
        if x is None or isinstance(x, (bool, int, float, str)):
            return _Shown(repr(x))
        return _Shown(type(x).__name__)

    return repr(tree_map(leaf, tree, none_is_leaf=True))
