"""Torch calls a vmap level takes whole, before they decompose (`WHOLE_CALL_RULES`,
consulted by the level's call handler, vmap/randomness.py, for the user's torch calls and
those the levels inside make).

`torch.matmul` and `F.linear` are CompositeImplicitAutograd: of a 1-d operand, matmul reaches
the level as unsqueeze, mm and an in-place squeeze, three dispatches, and the level's rules
then make the same three at every level below (a Hessian by `jacfwd(jacfwd(f))` of a small
MLP spent ~30 of its ~72 dispatches there). When the operands' batch dims line up with
torch's own broadcasting, the call on the physical values is the batched call: one call
here, which the levels below again take whole. Only where nothing else rides on the level
(no AD level over its physical tensors, whose overrides lay out products, vmap/batched_tensor.py
`UNDER_DIRECT_GRAD`; no views to refresh; real operands; no graph on its wrappers) and the
shapes agree (a mismatch decomposes and gets the usual error); otherwise NotImplemented.

    >>> import torch, functx
    >>> w = torch.randn(4, 3)
    >>> functx.vmap(lambda x: x @ w)(torch.randn(5, 4)).shape
    torch.Size([5, 3])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...core.level_tensor import LevelTensor
from ..batched_tensor import BatchedTensor, WHOLE_CALL_RULES, wrapper_requires_grad


def _operands(interp, tensors):
    """The physical values of `tensors` and which are batched here, or None where the call
    is not this level's to take whole: a tensor of a level inside this one (that level comes
    first), a complex or conjugate-viewed operand, or a wrapper torch's autograd records on."""
    values, batched = [], []
    level = interp.level
    for t in tensors:
        if type(t) is BatchedTensor and t._interp is interp:
            if wrapper_requires_grad(t) or t._conj_view:
                return None
            values.append(t._value)
            batched.append(True)
        elif isinstance(t, LevelTensor) and t._interp.level > level:
            return None
        else:
            values.append(t)
            batched.append(False)
        if t.is_complex():
            return None
    return values, batched


def _matmul_lines_up(a, b, a_batched, b_batched) -> bool:
    """Whether matmul of the physical values (batch dim first) is the batched matmul of
    logical `a` and `b`: torch's broadcasting then aligns the batch dims."""
    ra, rb = a.dim(), b.dim()
    inner_a = a.shape[-1]
    inner_b = b.shape[0] if rb == 1 else b.shape[-2]
    if inner_a != inner_b:
        return False
    if a_batched and b_batched:
        return ra >= 2 and ra == rb
    if a_batched:
        return rb <= 2
    return rb >= 2 and ra <= 2


def _matmul(interp, args, kwargs):
    if kwargs or len(args) != 2:
        return NotImplemented
    operands = _operands(interp, args)
    if operands is None or not any(operands[1]):
        return NotImplemented
    (a, b), (a_batched, b_batched) = operands
    if not _matmul_lines_up(args[0], args[1], a_batched, b_batched):
        return NotImplemented
    return BatchedTensor(torch.matmul(a, b), interp)


def _linear_arguments(input, weight, bias=None):
    return input, weight, bias


def _linear(interp, args, kwargs):
    """F.linear of a batched input with shared weight and bias: the input's batch dim is
    one more leading dim."""
    try:
        input, weight, bias = _linear_arguments(*args, **kwargs)
    except TypeError:
        return NotImplemented
    operands = _operands(interp, (input, weight) if bias is None else (input, weight, bias))
    if operands is None or not operands[1][0] or any(operands[1][1:]):
        return NotImplemented
    if input.dim() == 0 or weight.dim() != 2 or input.shape[-1] != weight.shape[1]:
        return NotImplemented
    return BatchedTensor(F.linear(*operands[0]), interp)


for _func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__):
    WHOLE_CALL_RULES[_func] = _matmul
WHOLE_CALL_RULES[F.linear] = _linear
