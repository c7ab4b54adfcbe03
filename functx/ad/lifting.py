"""Tensors made inside a wrapped AD level's function belong to that level.

A wrapped level (wrapped_reverse.py, wrapped_forward.py) sees only ops on its own wrapper
tensors. A buffer the function makes itself (`h = torch.zeros(3)`) is a plain tensor, and
an in-place write of a differentiated value into it (`h[0] = a`, `h.copy_(a)`) would make
the one plain object carry two levels' derivatives: torch's autograd records this level's
history on it, and the level below records its own on the same object, overwriting one
with the other (second derivatives come out 0; torch raises an internal assert for
`h[0] = a`). So while the function runs, factory results are lifted into the level as
constants (`level.lift`), as functorch's dynamic layers do for factory ops: the buffer is
then a wrapper of this level over a plain tensor, one object per level.

A TorchFunctionMode sees the factories (they have no tensor argument for dispatch to
find); it costs ~1 µs per torch call of the function, paid only at wrapped levels (never
by per-sample gradients, MAML's inner steps or the outermost `grad`, which are direct).
Inside `__torch_dispatch__` and functx's own code (`functx_code`) torch functions are off,
so rules and bookkeeping never see it. A write into a tensor from outside the function
(a captured tensor) cannot be lifted: it raises `raise_captured_write`'s error, as
torch.func does.

    >>> import torch, functx
    >>> def f(a):
    ...     h = torch.zeros(3)
    ...     h[0] = a
    ...     return torch.sin(h).sum()
    >>> functx.grad(functx.grad(f))(torch.tensor(0.5))  # -sin(0.5)
    tensor(-0.4794)
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from ..core.dual_values import call_at_values, in_level_rule
from ..core.errors import op_name
from ..core.factories import FACTORIES
from ..core.level_tensor import level_of


class FactoryLifting(TorchFunctionMode):
    """While a wrapped AD level's function runs: floating-point tensors that factories make
    (or `clone` makes of values from outside) become constants of the level. Since the mode
    sees every torch call of the function anyway, a level may also take whole composite ops
    here, before they decompose (`level.torch_function_rules`)."""

    def __init__(self, level):
        super().__init__()
        self.level = level

    def __torch_function__(self, func, types, args=(), kwargs=None):
        rule = self.level.torch_function_rules.get(func)
        if rule is not None:  # a whole composite op at once (wrapped_forward.py: matmul)
            out = rule(self.level, args, kwargs or {})
            if out is not NotImplemented:
                return out
        if self.level.over_dual_values and not in_level_rule():  # core/dual_values.py
            out = call_at_values(func, args, kwargs or {})
        else:
            out = func(*args, **(kwargs or {}))
        if (
            func in FACTORIES
            and isinstance(out, torch.Tensor)
            and (out.is_floating_point() or out.is_complex())
            and level_of(out) < self.level.level  # plain or from below (a level above made it its own)
            and self.level.alive
        ):
            return self.level.lift(out)
        return out


def raise_captured_write(op, transform: str):
    """An in-place op would write a differentiated value of a wrapped AD level into a tensor
    that is not the level's (made outside the function): torch.func refuses it too."""
    raise RuntimeError(
        f"functx.{transform}: {op_name(op)} writes in place into a tensor that was not made inside "
        f"the transformed function (a captured tensor), but the value it writes depends on the "
        f"inputs being differentiated. Make the tensor inside the function (e.g. `buf = "
        f"torch.zeros(...)` there, or `buf = captured.clone()`), or use the out-of-place op."
    )
