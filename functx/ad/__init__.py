"""Automatic differentiation: reverse mode (grad levels over torch autograd) and forward
mode, plus the Jacobian/Hessian transforms built from them."""

from . import aten_forward_rules  # noqa: F401  (ATen forward formulas torch gets wrong)
from . import aten_reverse_rules  # noqa: F401  (ATen reverse formulas that fail at higher orders)
from . import checkpointing  # noqa: F401  (torch.utils.checkpoint under transforms)
from . import library_ops  # noqa: F401  (torch.library operators keep their tangents)
from . import norms_in_ops  # noqa: F401  (layer/batch/instance norm differentiated three times)
from . import torch_nn_rules  # noqa: F401  (torch.nn's first-order-only library operators, at every order)
from . import user_backward  # noqa: F401  (.backward() inside a transform: a clear error)
from .forward import hessian, jacfwd, jvp, linearize
from .reverse import grad, grad_and_value, jacrev, vjp

__all__ = ["grad", "grad_and_value", "hessian", "jacfwd", "jacrev", "jvp", "linearize", "vjp"]
