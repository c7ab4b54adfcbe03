"""The kinds of containers with a batch size functx registers itself (core/containers.py),
and `in_use`, the lookup that registers them once their library is imported: TensorDict's
containers (TensorDict, LazyStackedTensorDict, TensorDictParams, tensorclass instances).

tensordict implements, for torch.func's vmap, how each of its containers takes a batch dim
out and puts it back (`_add_batch_dim(in_dim, vmap_level)`,
`_maybe_remove_batch_dim(funcname, vmap_level, batch_size, out_dim)`): names, locks, lazy
stacks (a stack along the mapped dim is hidden, not densified), nested and non-tensor entries.
Those methods call three functions of torch.func's for each tensor, through names in
tensordict's own modules (`tensordict._td`, `tensordict._lazy`). functx reuses the methods:
its `vmap_level` is the key of the `MappedDim` vmap gives a container's kind (containers.py:
an int, as torch.func's levels, since tensordict caches results of locked containers by
level, and negative, so never one of torch.func's), and the three names are replaced (core/patches.py) by functions that call those for such a level and
torch.func's own otherwise, so torch.func's vmap over TensorDicts works as before.

Registered by `in_use` the first time vmap (or functional_call) runs while `tensordict` is
imported; functx itself never imports tensordict.
"""

from __future__ import annotations

import importlib

import sys

from .containers import any_registered, live_mapped_dim, register_batched_container
from .patches import patch

# tensordict's modules whose names for torch.func's per-tensor functions are replaced
_MODULES = ("tensordict._td", "tensordict._lazy")


def _routing(original, kind):
    """A replacement for one of torch.func's per-tensor functions in tensordict's modules:
    functx's own for the key of a running functx vmap call, torch.func's `original` for any
    other level."""
    if kind == "add":

        def _add_batch_dim(tensor, in_dim, vmap_level):
            mapped = live_mapped_dim(vmap_level)
            if mapped is not None:
                return mapped.batch(tensor, in_dim)
            return original(tensor, in_dim, vmap_level)

        return _add_batch_dim
    if kind == "remove":

        def _remove_batch_dim(tensor, vmap_level, batch_size, out_dim):
            mapped = live_mapped_dim(vmap_level)
            if mapped is not None:
                return mapped.unbatch(tensor, out_dim)
            return original(tensor, vmap_level, batch_size, out_dim)

        return _remove_batch_dim

    def _maybe_remove_batch_dim(name, tensor, vmap_level, batch_size, out_dim):
        mapped = live_mapped_dim(vmap_level)
        if mapped is not None:  # (out_dim None, a non-tensor: vmap's own checks)
            return mapped.unbatch(tensor, out_dim)
        return original(name, tensor, vmap_level, batch_size, out_dim)

    return _maybe_remove_batch_dim


_WHY = (
    "tensordict's containers take out and put back a vmap dim through these names (torch.func's "
    "per-tensor functions); for a functx vmap level they call functx's instead"
)


def _install_routing():
    for module_name in _MODULES:
        module = importlib.import_module(module_name)
        for attribute, kind in (("_add_batch_dim", "add"), ("_remove_batch_dim", "remove"), ("_maybe_remove_batch_dim", "maybe")):
            original = module.__dict__.get(attribute)
            if original is None or getattr(original, "_functx_routing", False):
                continue
            replacement = _routing(original, kind)
            replacement._functx_routing = True
            patch(module, attribute, replacement, _WHY)


def _batch_shape(obj):
    return obj.batch_size


def _add_batch_dim(obj, in_dim, mapped):
    return obj._add_batch_dim(in_dim=in_dim, vmap_level=mapped.key)


def _remove_batch_dim(obj, out_dim, mapped):
    return obj._maybe_remove_batch_dim("the function", vmap_level=mapped.key, batch_size=mapped.size, out_dim=out_dim)


def register_tensordict_kinds():
    """Register TensorDict's containers with functx's vmap (tensordict is imported)."""
    from tensordict import is_tensor_collection

    _install_routing()
    register_batched_container(
        is_tensor_collection,
        batch_shape=_batch_shape,
        add_batch_dim=_add_batch_dim,
        remove_batch_dim=_remove_batch_dim,
        name="tensordict",
    )


_tensordict_registered = False


def in_use() -> bool:
    """Whether vmap must look for containers with a batch size: a kind is registered, or
    tensordict is imported (its kinds are registered then, once)."""
    global _tensordict_registered
    if not _tensordict_registered and "tensordict" in sys.modules:
        _tensordict_registered = True
        register_tensordict_kinds()
    return any_registered()
