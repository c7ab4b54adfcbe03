"""functionalize: the transform that replaces mutations (and optionally views) by
out-of-place ops, as a level of functx's interpreter stack."""

from .api import functionalize
from .level import FunctionalizedTensor, FunctionalizeInterpreter

__all__ = ["functionalize", "FunctionalizedTensor", "FunctionalizeInterpreter"]
