"""functx: JAX-style composable function transforms for PyTorch.

The public API mirrors `torch.func`: replacing `torch.func` by `functx` in working code
keeps it working.
"""

from .core import PerformanceWarning, debug_unwrap, set_vmap_fallback, vmap_fallback
from .core.containers import register_batched_container
from . import library, nn
from .nn import (
    combine_state_for_ensemble,
    functional_call,
    make_functional,
    make_functional_with_buffers,
    replace_all_batch_norm_modules_,
    stack_module_state,
    Ensemble,
    vmap_init,
)
from .vmap import vmap
from .ad import grad, grad_and_value, hessian, jacfwd, jacrev, jvp, linearize, vjp
from .ad.selective_checkpoint import checkpoint, checkpoint_name, checkpoint_policies
from .functionalize import functionalize
from .einops import rearrange
from .staging import watch_for_dynamo as _watch_for_dynamo
from .staging.jit import jit
from .explain import explain
from .taylor import bilaplacian, jet, laplacian, weighted_laplacian

_watch_for_dynamo()  # torch.compile support, installed when torch._dynamo is imported

__version__ = "0.1.0"

__all__ = ["library", "nn", "replace_all_batch_norm_modules_", "functional_call", "stack_module_state", "make_functional", "make_functional_with_buffers", "combine_state_for_ensemble", "Ensemble", "vmap_init", "vmap", "grad", "grad_and_value", "vjp", "jvp", "linearize", "jacrev", "jacfwd", "hessian", "checkpoint", "checkpoint_policies", "checkpoint_name", "functionalize", "rearrange", "jit", "explain", "jet", "laplacian", "weighted_laplacian", "bilaplacian", "dp", "kernels", "distributed", "PerformanceWarning", "set_vmap_fallback", "vmap_fallback", "debug_unwrap", "register_batched_container"]


def __getattr__(name):
    """`functx.dp`, `functx.kernels` and `functx.distributed` are imported on first use (they
    register operators and batching rules)."""
    if name in ("dp", "kernels", "distributed"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'functx' has no attribute {name!r}")
