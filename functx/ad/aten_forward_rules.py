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
first forward transform: a plain program pays nothing before one) with a rule that sums only
the tangents present; without a tangent the operator's own kernel runs.

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


def _sum_defined(terms):
    """The sum of the terms that are not None (None when none is)."""
    total = None
    for term in terms:
        if term is not None:
            total = term if total is None else total + term
    return total


def _mse_loss_backward_rule(run, primals, tangents, kwargs):
    """mse_loss_backward(g, x, t, reduction) = norm (x - t) g, norm = 2 (/ numel for mean)."""
    grad, input, target, reduction = primals
    grad_t, input_t, target_t = tangents[:3]
    out = run(*primals, **kwargs)
    norm = 2.0 / input.numel() if reduction == _MEAN else 2.0
    difference_t = _sum_defined([input_t, None if target_t is None else -target_t])
    tangent = _sum_defined(
        [
            None if difference_t is None else difference_t * grad,
            None if grad_t is None else (input - target) * grad_t,
        ]
    )
    tangent = tangent * norm
    if tangent.shape != out.shape:  # a tangent of a broadcast target or gradient alone
        tangent = tangent.expand(out.shape).clone()
    return out, tangent


for _op, _rule in ((torch.ops.aten.mse_loss_backward.default, _mse_loss_backward_rule),):
    library_ops.register_forward_rule(_op, _rule)
    library_ops.wrap_at_first_forward(_op)
