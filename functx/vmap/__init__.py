"""vmap: the batching transform. Importing it registers every batching rule."""

from . import rules  # noqa: F401  (fills VMAP_RULES)
from .api import vmap
from .batched_tensor import VMAP_RULES, BatchedTensor
from .interpreter import VmapInterpreter

__all__ = ["vmap", "BatchedTensor", "VmapInterpreter", "VMAP_RULES"]
