"""Forward rules for ATen operators whose forward formula in torch fails on valid programs.

torch computes an operator's tangent in its autograd kernel, from the formula in
derivatives.yaml. A formula that writes in place into a product with a tangent that is
absent fails: an absent tangent is an immutable ZeroTensor there. `mse_loss_backward` with
`reduction="mean"` is one: its formula divides `2 * target_t * grad_output` in place, so
any forward-over-reverse product through an MSE loss whose target carries no tangent (every
regression loss: `jvp(grad(loss))`, `jvp(jacrev(loss))`, `vmap(jvp(jacrev(loss)))` Hessian
and GGN products, curvlinops' pattern) raised "ZeroTensors are immutable" (torch.func's
jvp(grad) does too).

functx shadows the autograd kernel of each operator here (library_ops.wrap_existing, at the
first forward transform: a plain program pays nothing before one): where an input carries a
tangent, the operator runs as a decomposition into ops whose formulas are right, on the dual
inputs themselves, so its tangent and the reverse graph of both (differentiated again by
`vjp(grad)` under `jvp`) are theirs. (A rule giving the tangent beside the operator's own
kernel on the primals was right to first order, but the reverse graph it recorded saved
primals without tangents: jvp(vjp(grad)) through an MSE loss came out wrong, found by a
10,000-example fuzz run.) Without a tangent the operator's own kernel runs.

    >>> import torch, functx
    >>> import torch.nn.functional as F
    >>> X, y = torch.eye(2), torch.zeros(2)
    >>> loss = lambda w: F.mse_loss(X @ w, y)  # the mean of w², Hessian = I
    >>> functx.jvp(functx.grad(loss), (torch.ones(2),), (torch.tensor([1.0, 2.0]),))[1]
    tensor([1., 2.])
"""

from __future__ import annotations

import torch

from . import library_ops

_MEAN = 1  # torch's Reduction::Mean


def _mse_loss_backward(grad, input, target, reduction):
    """mse_loss_backward(g, x, t, reduction) = norm (x - t) g, norm = 2 (/ numel for mean):
    ATen's kernel's arithmetic, in its order (so the values are the kernel's)."""
    norm = 2.0 / input.numel() if reduction == _MEAN else 2.0
    return (input - target) * norm * grad


library_ops.register_forward_decomposition(torch.ops.aten.mse_loss_backward.default, _mse_loss_backward)
library_ops.wrap_at_first_forward(torch.ops.aten.mse_loss_backward.default)
