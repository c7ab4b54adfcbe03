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
(copy_, clone, views; the matrix products' conjugate bit) keep torch's handling: their
kernels read it; the matrix products get functx's kernel at the keys they have none for
(`PRODUCTS`: a negative view, `z.conj().imag`).

Efficient zeros (`torch._efficientzerotensor`, the tangents torch's forward AD formulas
leave where a tangent is structurally zero) are a lazy bit too. torch's ZeroTensor kernels
for `mul`, `div`, `linalg_cross`, `dot` and `vdot` answer from the result's shape alone,
with a *plain* tensor, even beside a level tensor: autograd, which has recorded the op on
the level's wrapper (saving it), then hands that plain tensor on into the graphs of the
levels below, and the caller's backward after the transform unpacked the dead wrapper
(jacrev(jvp(jacrev)) under the caller's grad). functx's kernels at the ZeroTensor key
answer the same value through the level (`new_full` of the level tensor) there, and what
torch's kernel answers elsewhere.

    >>> import torch, functx
    >>> w = torch.tensor([1 + 2j, 3 - 1j], requires_grad=True)
    >>> b = torch.randn(4, 2, dtype=torch.complex64)
    >>> y = functx.vmap(lambda row: row * w.conj())(b)
    >>> got = torch.autograd.grad(y.abs().sum(), w)[0]
    >>> torch.allclose(got, torch.autograd.grad((b * w.conj()).abs().sum(), w)[0])
    True
"""

from __future__ import annotations

import warnings

import torch

from .interpreter import FIRST_TRANSFORM_HOOKS
from .level_tensor import LevelTensor
from .patches import kernels

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

# Matrix products: their kernels read a conjugate bit (most of them), but a negative view
# (`z.conj().imag`) goes to torch's materializing fallback, which lost the view's path under
# jacrev(jacrev) (the second derivative of `m.mT @ m` came out zero). functx's kernel goes
# at each key where torch has none of its own (`_register`).
PRODUCTS = (
    aten.mm.default,
    aten.bmm.default,
    aten.mv.default,
    aten.dot.default,
    aten.vdot.default,
    aten.addmm.default,
    aten.addmv.default,
    aten.addbmm.default,
    aten.baddbmm.default,
    aten.addr.default,
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


# Ops of two tensors whose ZeroTensor kernel answers from the result's shape alone.
ZERO_OPS = (aten.mul.Tensor, aten.div.Tensor, aten.linalg_cross.default, aten.dot.default, aten.vdot.default)


def _is_zero(x) -> bool:
    return isinstance(x, torch.Tensor) and x._is_zerotensor()


def _zero_fill(op, a, b):
    """What torch's ZeroTensor kernel of `op` fills its result with (None: an efficient
    zero). div's: 0 / 0 is NaN, x / 0 is inf (whatever x is), 0 / x is zero."""
    if op is aten.div.Tensor:
        if _is_zero(a):
            return float("nan") if _is_zero(b) else None
        return float("inf")
    return None


def _device(x):
    return x.device if isinstance(x, torch.Tensor) else torch.device("cpu")  # a Python number


def _meta(x):
    return x.to("meta") if isinstance(x, torch.Tensor) else x


def _zero_kernel(op):
    def answer_from_the_shape(keyset, a, b, *rest, **kwargs):
        # the result's shape and dtype from the operands' metadata (a level tensor's own; a
        # Python number, which comes here unwrapped, promotes as the binding wraps it)
        meta = op(_meta(a), _meta(b), *rest, **kwargs)
        fill = _zero_fill(op, a, b)
        level = a if isinstance(a, LevelTensor) else b if isinstance(b, LevelTensor) else None
        if level is not None:  # through the level: its wrapper, not a plain tensor
            return level.new_full(meta.shape, 0.0 if fill is None else fill, dtype=meta.dtype)
        device = _device(b) if _device(a).type == "cpu" else _device(a)  # torch's correct_out_device
        if fill is None:
            return torch._efficientzerotensor(meta.shape, dtype=meta.dtype, device=device)
        return torch.full(meta.shape, fill, dtype=meta.dtype, device=device)

    return answer_from_the_shape


def _register():
    library = torch.library.Library("aten", "IMPL")
    for op in OPS:
        for key in ("Conjugate", "Negative"):
            library.impl(_schema_name(op), _kernel(op), key, with_keyset=True)
    for op in PRODUCTS:
        for key in (_CONJUGATE, _NEGATIVE):
            if not op.has_kernel_for_dispatch_key(key):  # torch's fallback would materialize
                library.impl(_schema_name(op), _kernel(op), key.name, with_keyset=True)
    with warnings.catch_warnings():  # torch warns that these replace its ZeroTensor kernels
        warnings.filterwarnings("ignore", "Warning only once for all operators")
        for op in ZERO_OPS:
            library.impl(_schema_name(op), _zero_kernel(op), "ZeroTensor", with_keyset=True)
    return library


def install():
    """Register the kernels (once, core/patches.py; at the first transform,
    `FIRST_TRANSFORM_HOOKS`: until then plain torch keeps its own fallback, which is ~6 µs
    faster per call than this one)."""
    kernels(
        "lazy conjugate, negative and zero bits beside level tensors",
        _register,
        "torch resolves a conj/neg view below autograd without a graph, and answers an efficient "
        "zero's product with a plain tensor: beside a level tensor both lost or escaped a level's graph",
        reset=lambda: None,
    )


FIRST_TRANSFORM_HOOKS.append(install)
