"""The dispatcher: interpreter stack, level tensors, rule tables. Imports no transform."""

from . import custom_function  # noqa: F401  (installs functx's Function.apply)
from . import lazy_bits  # noqa: F401  (its kernels, installed at the first transform)
from . import control_flow  # noqa: F401  (torch's control-flow operators inside transforms)
from .config import set_vmap_fallback, vmap_fallback
from .errors import PerformanceWarning
from .interpreter import Interpreter, current_stack, interpreting, top_interpreter
from .level_tensor import LevelTensor, debug_unwrap
from .rules import RuleTable

__all__ = [
    "Interpreter",
    "LevelTensor",
    "PerformanceWarning",
    "RuleTable",
    "current_stack",
    "debug_unwrap",
    "interpreting",
    "set_vmap_fallback",
    "top_interpreter",
    "vmap_fallback",
]
