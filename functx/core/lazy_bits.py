"""Lazy conjugate and negative views of plain tensors meeting functx's level tensors.

`x.conj()` of a complex tensor is a lazy view: the data stays, a bit says "conjugate me".
Most ops cannot read the bit, and torch resolves it in its Conjugate (and Negative)
fallback, which runs below autograd: it copies the operand, and the copy has no graph. For
a plain operation that is harmless, autograd having recorded the op above with the view
itself. Beside a functx level tensor it is not: the levels below record their graphs inside
the level's rule, on the values one level down, and there the copy stands for the view,
so what the view's graph carried is lost. A backward formula makes such views all the time
(mul's is `grad * other.conj()`): under jacrev's rows, or the caller's autograd through a
Jacobian, the path through the conjugate was dropped silently (half the Hessian of |z|^2).

So for the out-of-place ops below (those whose Conjugate/Negative dispatch is torch's
fallback, not a pass-through to a kernel that reads the bit), functx registers its own
kernel at those keys, from the first transform on (`install`): beside a level tensor it
lets the view through unresolved to the level, whose rule calls the op on the values below
in the state they are differentiated in; there (no level tensor among the operands) it does
what torch's fallback does for an out-of-place op, resolving below the autograd and forward
AD that have already recorded the op with the view itself. Ops that pass the bit through
(mm, bmm, dot, copy_, clone, views) keep torch's handling: their kernels read it.

    >>> import torch, functx
    >>> w = torch.tensor([1 + 2j, 3 - 1j], requires_grad=True)
    >>> b = torch.randn(4, 2, dtype=torch.complex64)
    >>> y = functx.vmap(lambda row: row * w.conj())(b)
    >>> got = torch.autograd.grad(y.abs().sum(), w)[0]
    >>> torch.allclose(got, torch.autograd.grad((b * w.conj()).abs().sum(), w)[0])
    True
"""

from __future__ import annotations

import torch

from .interpreter import FIRST_TRANSFORM_HOOKS
from .level_tensor import LevelTensor

aten = torch.ops.aten
_CONJUGATE, _NEGATIVE = torch._C.DispatchKey.Conjugate, torch._C.DispatchKey.Negative

# Out-of-place ops of two or more tensors (what a backward formula combines a cotangent
# with) whose Conjugate and Negative dispatch is torch's materializing fallback.
OPS = (
    aten.mul.Tensor,
    aten.div.Tensor,
    aten.div.Tensor_mode,
    aten.add.Tensor,
    aten.sub.Tensor,
    aten.rsub.Tensor,
    aten.where.self,
    aten.addcmul.default,
    aten.addcdiv.default,
    aten.lerp.Tensor,
    aten.lerp.Scalar,
    aten.cat.default,
    aten.stack.default,
)


def _resolved(x):
    if type(x) is list or type(x) is tuple:
        return type(x)(_resolved(e) for e in x)
    if isinstance(x, torch.Tensor) and not isinstance(x, LevelTensor) and (x.is_conj() or x.is_neg()):
        return x.resolve_conj().resolve_neg()
    return x


def _has_level_tensor(args) -> bool:
    for a in args:
        if isinstance(a, LevelTensor):
            return True
        if (type(a) is list or type(a) is tuple) and any(isinstance(e, LevelTensor) for e in a):
            return True
    return False


def _kernel(op):
    def resolve_then_go_on(keyset, *args, **kwargs):
        if not _has_level_tensor(args):
            # torch's fallback for an out-of-place op: the operands resolved, the op called
            # again (a Python number comes here unwrapped, which `redispatch` would refuse)
            return op(*_resolved(args), **kwargs)
        # on to the level with the view as it is: its rule calls the op on the values below
        # in the state they are differentiated in, where this kernel resolves the view under
        # their autograd and forward AD (resolved here, a forward level on values lost the
        # view's tangent: its state at the wrappers has forward AD off)
        return op.redispatch(keyset.remove(_CONJUGATE).remove(_NEGATIVE), *args, **kwargs)

    return resolve_then_go_on


def _schema_name(op) -> str:
    name = op._schema.name.split("::")[1]
    return f"{name}.{op._schema.overload_name}" if op._schema.overload_name else name


_library = None


def install():
    """Register the kernels (once; at the first transform, `FIRST_TRANSFORM_HOOKS`: until
    then plain torch keeps its own fallback, which is ~6 µs faster per call than this one)."""
    global _library
    if _library is not None:
        return
    library = torch.library.Library("aten", "IMPL")
    for op in OPS:
        for key in ("Conjugate", "Negative"):
            library.impl(_schema_name(op), _kernel(op), key, with_keyset=True)
    _library = library


FIRST_TRANSFORM_HOOKS.append(install)
