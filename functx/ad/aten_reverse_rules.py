"""Reverse rules for ATen operators whose derivative formula in torch fails at a higher order
under transforms.

`linalg.det`: torch's backward of `_linalg_det` under `create_graph` uses, for tensor
subclasses (every functx level's wrapper, vmap's BatchedTensor; torch.func's too), its SVD
formula for every matrix, where plain tensors get the solve formula and an SVD only for
singular matrices. Differentiated once more, that formula takes the SVD of det's orthogonal
factor U, whose repeated singular values make torch's SVD backward divide by zero gaps:
`vjp(vmap(hessian(det)))`, the caller's gradient through `jacrev(jacrev(det))`, any third
derivative, were NaN (torch.func's are); so were those of a det on plain values whose
backward a transform runs on batched cotangents (jacrev's rows: the subclass path again).
Inside a transform, where autograd records det and every matrix is invertible, functx
computes det as sign · exp(log|det|) through `slogdet` (torch's value to rounding; its
backward solves with A^H at every order); a singular matrix keeps
torch's formula (its first derivative, the adjugate, is right there), as do code outside
transforms and traced (fake) values.

    >>> import torch, functx
    >>> a = torch.tensor([[2.0, 1.0], [1.0, 3.0]], dtype=torch.float64)
    >>> third = functx.jacrev(functx.jacrev(functx.jacrev(torch.linalg.det)))(a)
    >>> bool(torch.isfinite(third).all()), float(third.abs().max()) < 1e-12  # det of 2x2: quadratic
    (True, True)
"""

from __future__ import annotations

import functools

import torch

from ..core.interpreter import FIRST_TRANSFORM_HOOKS, current_stack
from ..core.level_tensor import LevelTensor
from . import library_ops

_linalg_det = torch.ops.aten._linalg_det.default
_forward_ad_off = functools.partial(torch.autograd.forward_ad._set_fwd_grad_enabled, False)


def _plain(x):
    while isinstance(x, LevelTensor):
        x = x._value
    return x


def _invertible_under_a_transform(A) -> bool:
    """Inside a transform, A recorded by autograd (a level's wrapper, or a plain tensor whose
    backward a transform may run on its batched cotangents: jacrev's rows, where torch's
    formula takes its subclass path too), every matrix invertible (checked on the plain
    values: a singular one keeps torch's formula)."""
    if not (A.requires_grad and torch.is_grad_enabled() and current_stack()):
        return False
    values = _plain(A)
    if values.device.type == "meta" or isinstance(values, torch._subclasses.FakeTensor):
        return False
    with torch.no_grad():
        return bool((_linalg_det(values.detach())[0] != 0).all())


def _det_through_slogdet(A):
    """`_linalg_det(A)` as sign · exp(log|det|) (torch's value to rounding), with torch's LU
    and pivots as constants (outputs without derivatives, as the op's own). Every level
    differentiates the one expression: adding torch's value to a zero made with `detach()`
    counted the tangent twice under `jvp(grad)` (forward AD kept the value's tangent)."""
    with torch.no_grad(), _forward_ad_off():
        _, lu, pivots = _linalg_det(A)
    sign, logabsdet = torch.linalg.slogdet(A)
    return sign * torch.exp(logabsdet), lu, pivots


library_ops.register_reverse_decomposition(_linalg_det, _invertible_under_a_transform, _det_through_slogdet)
FIRST_TRANSFORM_HOOKS.append(lambda: library_ops.wrap_existing(_linalg_det))
