"""Module state as data: helpers that let transforms work with `torch.nn.Module`s."""

from .batch_norm import replace_all_batch_norm_modules_
from .functional_call import functional_call
from .make_functional import (
    FunctionalModule,
    FunctionalModuleWithBuffers,
    combine_state_for_ensemble,
    make_functional,
    make_functional_with_buffers,
)
from .stack import stack_module_state
from .ensemble import Ensemble, vmap_init

__all__ = [
    "replace_all_batch_norm_modules_",
    "functional_call",
    "stack_module_state",
    "make_functional",
    "make_functional_with_buffers",
    "combine_state_for_ensemble",
    "FunctionalModule",
    "FunctionalModuleWithBuffers",
    "Ensemble",
    "vmap_init",
]
