"""vmap: the batching transform. Importing it registers every batching rule."""

from . import custom_function, rules  # noqa: F401  (autograd.Function at vmap levels; fills VMAP_RULES)
from .api import vmap
from .batched_tensor import VMAP_RULES, BatchedTensor, VmapInterpreter

__all__ = ["vmap", "BatchedTensor", "VmapInterpreter", "VMAP_RULES"]
