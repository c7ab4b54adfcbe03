"""Forward mode, wrapped strategy: `DualTensor`s that hold a primal and a tangent.

A `DualTensor` of a jvp level holds its primal (`_value`) and its tangent (`_tangent`, None
for zero), both one level down. For each op, "one level down" means: make torch dual
tensors of the primals and tangents *for this op only* (`torch._make_dual` at torch's
single forward-AD level), run the op on them, and take the primal and tangent of each
result apart again (`_unpack_dual`). torch's own forward formulas (and an
`autograd.Function`'s `jvp`) compute the tangents, on values one level down, so their ops
dispatch through the lower levels like any other.

Where the op's values one level down (its primals and other arguments, not the tangents)
are not all plain tensors (a batched value under `vmap(jvp)`, another jvp level's value),
the duals are made of fresh DualTensors of this level ("carriers") instead, so that
torch's formulas run on this level's objects and only this level's process unwraps them:
otherwise the op would reach that lower level's rule with a dual among its arguments, and
the rule, running the op on its own values with autograd on, would propagate this level's
tangent there too. Tangents may be anything (`jacfwd`: plain primals, batched tangents):
torch's formulas see them only beside primal views, which carry no tangent. Carriers are
used too when another AD level lies below (`nested`): torch's formulas take faster
in-place paths on plain tensors (`logsumexp_jvp`: `exp_p *= self_t`) that write into
tensors a reverse level below saved, and out-of-place paths on tensor subclasses.

Why transient duals: torch has one dual level, and a tangent that stays attached to a
tensor is seen by every op that tensor meets, at every functx level. If an inner jvp's
op met an outer jvp's value carrying its tangent, torch would mix the outer tangent into
the inner one (perturbation confusion), and the outer level could no longer see how the
inner tangent depends on its own input (the mixed partial, dropped). Here a tangent is
attached only while one op of its own level runs, to objects made for that op; the outer
level's tangents live inside its own DualTensors, which the inner op's formulas meet as
ordinary values, so the outer level differentiates the inner tangent too. Forward mode
therefore nests by construction: `jvp(jvp(f))`, `jacfwd(jacfwd(f))`, `jvp` of a `vmap`.

An op with no forward formula in torch falls back, for that op only, to the double-VJP
identity (`op_jvp_without_formula`, installed by forward.py).

    >>> import torch
    >>> from functx.core.interpreter import interpreting
    >>> from functx.ad.level import dual_level
    >>> with dual_level(), interpreting(WrappedJvpLevel()) as level:
    ...     x = level.dual(torch.tensor(0.0), torch.tensor(2.0))
    ...     primal, tangent = level.unpack(torch.exp(x))
    >>> primal.item(), tangent.item()
    (1.0, 2.0)
"""

from __future__ import annotations

import contextlib

import torch
import torch._decomp
from torch.autograd.forward_ad import _set_fwd_grad_enabled

from ..core.dual_values import one_level_down_over_dual_values
from ..core.forward_ad_state import user_forward_ad
from ..core.interpreter import EnteredTogether, current_stack
from ..core.level_tensor import (
    LevelTensor,
    mutated_argument,
    promote_for_write,
    refresh_views,
    replay_inplace_view,
)
from .custom_function import apply_at_jvp_level
from .dual_tensor import (
    LIST_MARK,
    DualList,
    DualTensor,
    as_outside,
    levels_of,
    load_forward_decompositions,
    make_duals,
    overlaps,
    tangent_like,
    tangent_of,
    view_like,
    views_tracked,
)
from .level import AT_THIS_LEVEL, ADLevel, WrappedLevel
from .lifting import raise_captured_write

_restore_autograd = torch._C._RestorePythonTLSSnapshot
_make_dual = torch._make_dual
_unpack_dual = torch._VF._unpack_dual
_DUAL_LEVEL = 0  # torch has exactly one forward-AD level

# Ops whose result does not depend on their arguments' values: no tangent. (torch.autograd.grad
# makes its default cotangent with `ones_like(output)`; under a fake tensor mode, as
# torch.compile traces, running it on a dual decomposes below autograd and fails.)
_aten = torch.ops.aten
_VALUE_FREE = frozenset(
    (
        _aten.ones_like.default, _aten.zeros_like.default, _aten.empty_like.default, _aten.full_like.default,
        _aten.rand_like.default, _aten.randn_like.default, _aten.new_zeros.default, _aten.new_ones.default,
        _aten.new_empty.default, _aten.new_full.default, _aten.new_empty_strided.default,
    )
)
_ADInplaceOrView = torch._C.DispatchKey.ADInplaceOrView
_tls_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded
NO_FORWARD_FORMULA = "Trying to use forward AD with"  # torch's error for an op without one
_SPARSE_PRIMAL = "Cannot access storage of SparseTensorImpl"  # `_make_dual` needs a strided primal
_no_context = contextlib.nullcontext()
_view_as_real = torch.ops.aten.view_as_real.default
aten = torch.ops.aten

# Ops whose forward derivative in torch cannot itself be differentiated right, so under
# another AD level (forward or reverse over forward: jacfwd(jacfwd), jacrev(jacfwd),
# vjp(jvp)) they decompose (torch._decomp) into ops whose derivatives can:
# - the normalizations' formulas use their mean/rstd outputs, which torch marks
#   non-differentiable: the outer level misses their dependence on the input (the Hessian
#   of layer_norm came out wrong by up to 0.5, torch.func's too; finite differences agree
#   with the decomposition);
_DECOMPOSED_WHEN_NESTED = {
    op: torch._decomp.decomposition_table[op]
    for op in (
        aten.native_layer_norm.default, aten.native_group_norm.default, aten.native_batch_norm.default,
        aten._native_batch_norm_legit.default, aten._native_batch_norm_legit_no_training.default,
    )
}


def op_jvp_without_formula(op, primals, tangents, kwargs, error):
    """`(output, output tangents)` of one op torch has no forward formula for. The transforms
    above the levels install it (forward.jvp_by_double_vjp: the double-VJP identity, which
    needs `vjp` and `grad`)."""
    raise error


def _forward_ad_on():
    """torch's forward AD switched on (the jvp transform switches it on for the function;
    torch switches it off inside an autograd.Function's forward and jvp)."""
    return _no_context if torch._C._is_fwd_grad_enabled() else _set_fwd_grad_enabled(True)


class _RestoredForwardOff(EnteredTogether):
    """The outside dispatch state with torch's forward AD off (`_one_level_down`)."""

    __slots__ = ()

    def guards(self):
        return _restore_autograd(), _set_fwd_grad_enabled(False)


def _inplace_view(op) -> bool:
    return torch.Tag.inplace_view in op.tags


def _writes_out_argument(op) -> bool:
    return any(a.kwarg_only and a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments)


_op_kind_cache: dict = {}


_OUT_OF_PLACE = (None, False, False)
_VIEW = (None, False, False, "view")  # a view op: tangent of the view = the same view of the tangent
_GENERAL = object()  # `_out_of_place` declined: the general path of `process`


# -- matrix products: their tangent, summed over the factors that carry one ------------------
# torch's forward formulas for these give every factor without a tangent a ZeroTensor and
# multiply it through; ZeroTensor's kernels find the result's shape with Python meta
# functions (torch._refs): measured ~150 µs per addmm under plain torch forward AD, half of
# a 16-32-8 MLP's jvp (616 -> 305 µs per call without them; torch.func ~450 µs). The
# product rule with only the defined terms is exact and costs one product per tangent.
def _product_tangent(product, a, b, a_t, b_t):
    tangent = None if a_t is None else product(a_t, b)
    if b_t is not None:
        term = product(a, b_t)
        tangent = term if tangent is None else tangent + term
    return tangent


def _mm_jvp(product):
    def jvp(out, values, tangents, kwargs):
        a, b = values
        return _product_tangent(product, a, b, tangents[0], tangents[1])

    return jvp


def _added_product_jvp(product):
    """addmm / addmv (c, a, b, beta, alpha) = beta c + alpha product(a, b)."""

    def jvp(out, values, tangents, kwargs):
        c, a, b = values[:3]
        beta = kwargs.get("beta", values[3] if len(values) > 3 else 1)
        alpha = kwargs.get("alpha", values[4] if len(values) > 4 else 1)
        tangent = _product_tangent(product, a, b, tangents[1], tangents[2])
        if tangent is not None and alpha != 1:
            tangent = tangent * alpha
        c_t = tangents[0]
        if c_t is not None and beta != 0:  # beta = 0 ignores `c` (even its nans)
            c_t = c_t if beta == 1 else c_t * beta
            tangent = c_t.expand_as(out).clone() if tangent is None else tangent + c_t
        return tangent

    return jvp


def _plain_operands(level, tensors):
    """`(values, tangents)` when every tensor is this level's `DualTensor` over a plain value
    or a plain tensor, and no AD level lies below; else None."""
    if level.nested:
        return None
    values, tangents = [], []
    for t in tensors:
        if type(t) is DualTensor and t._interp is level and not isinstance(t._value, LevelTensor):
            values.append(t._value)
            tangents.append(t._tangent if t._tangent is not None else tangent_of(t))
        elif isinstance(t, torch.Tensor) and not isinstance(t, LevelTensor):
            values.append(t)
            tangents.append(None)
        else:
            return None
    return values, tangents


def _matmul_rule(level, args, kwargs):
    """`torch.matmul` of plain operands in one step: 1-d operands decompose into unsqueeze,
    mm and an in-place squeeze, three dispatches at this level (~45 µs) for one product."""
    if kwargs or len(args) != 2:
        return NotImplemented
    operands = _plain_operands(level, args) if user_forward_ad() else None
    if operands is None:
        return NotImplemented
    (a, b), (a_t, b_t) = operands
    if a_t is None and b_t is None:
        return NotImplemented
    return DualTensor(torch.matmul(a, b), _product_tangent(torch.matmul, a, b, a_t, b_t), level)


def _linear_arguments(input, weight, bias=None):
    return input, weight, bias


def _linear_rule(level, args, kwargs):
    """`F.linear(x, w, b)` = x w^T + b of plain operands in one step (see `_matmul_rule`)."""
    try:
        x, w, bias = _linear_arguments(*args, **kwargs)
    except TypeError:
        return NotImplemented
    operands = _plain_operands(level, (x, w) if bias is None else (x, w, bias)) if user_forward_ad() else None
    if operands is None or all(t is None for t in operands[1]):
        return NotImplemented
    values, tangents = operands
    out = torch.nn.functional.linear(*values)
    tangent = _product_tangent(torch.nn.functional.linear, values[0], values[1], tangents[0], tangents[1])
    if bias is not None and tangents[2] is not None:
        tangent = tangents[2].expand_as(out).clone() if tangent is None else tangent + tangents[2]
    return DualTensor(out, tangent, level)


_TORCH_FUNCTION_RULES = {
    torch.matmul: _matmul_rule,
    torch.Tensor.matmul: _matmul_rule,
    torch.Tensor.__matmul__: _matmul_rule,
    torch.nn.functional.linear: _linear_rule,
}


_MATMUL_JVPS = {
    torch.ops.aten.mm.default: _mm_jvp(torch.mm),
    torch.ops.aten.bmm.default: _mm_jvp(torch.bmm),
    torch.ops.aten.mv.default: _mm_jvp(torch.mv),
    torch.ops.aten.addmm.default: _added_product_jvp(torch.mm),
    torch.ops.aten.addmv.default: _added_product_jvp(torch.mv),
}


# Elementwise ops whose forward formulas torch's reverse mode differentiates right when they
# run on plain duals (the formulas are out-of-place expressions of the primals, results and
# tangents): a wrapped jvp level over plain grad levels runs them without carriers (each
# carrier costs ~4 Python dispatches per op: its `_make_dual` and torch's layout checks).
# Not here: ops whose formulas write into temporaries in place for plain tensors (softmax,
# log_softmax, logsumexp: `logsumexp_jvp`), or give statistics no tangent (the norms).
_PLAIN_UNDER_GRAD = frozenset(
    getattr(aten, name).default if "." not in name else getattr(getattr(aten, name.split(".")[0]), name.split(".")[1])
    for name in (
        "tanh", "sigmoid", "exp", "log", "sin", "cos", "relu", "neg", "sqrt", "rsqrt", "reciprocal",
        "gelu", "silu", "softplus", "elu", "leaky_relu", "threshold", "tanh_backward", "sigmoid_backward",
        "threshold_backward", "add.Tensor", "sub.Tensor", "mul.Tensor", "div.Tensor", "add.Scalar",
        "sub.Scalar", "mul.Scalar", "div.Scalar", "pow.Tensor_Scalar", "square",
    )
)  # fmt: skip


# -- softmax, log_softmax, nll_loss: their tangents by ops that re-dispatch ------------------
# (the tail of every cross-entropy). torch's formula for the softmaxes (`logsumexp_jvp`)
# multiplies a temporary in place when the tensors are plain, which breaks reverse mode over
# it, so under another AD level they needed carriers (~14 Python dispatches per op); these
# are exact, out of place, and need none. Only the first argument may carry a tangent.
def _log_softmax_jvp(out, values, t, kwargs):
    dim = values[1]
    return t - (out.exp() * t).sum(dim, keepdim=True)


def _softmax_jvp(out, values, t, kwargs):
    dim = values[1]
    return out * (t - (out * t).sum(dim, keepdim=True))


def _logsumexp_jvp(out, values, t, kwargs):
    """Σ softmax(x) t over the reduced dims: torch's `logsumexp_jvp` writes into the exp it
    saved, which a reverse level below (the caller's autograd, a grad outside) then finds
    modified ("modified by an inplace operation"; plain torch fails the same way)."""
    x = values[0]
    dims = values[1] if len(values) > 1 else kwargs.get("dim")
    keepdim = values[2] if len(values) > 2 else kwargs.get("keepdim", False)
    if x.dim() == 0:
        return t
    dims = [d % x.dim() for d in dims] if dims else list(range(x.dim()))
    weights = torch.exp(x - (out if keepdim else out.reshape([1 if i in dims else n for i, n in enumerate(x.shape)])))
    return (weights * t).sum(dims, keepdim=keepdim)


def _nll_loss_forward_jvp(out, values, t, kwargs):
    # linear in `self`: the loss of the tangent; `total_weight` does not depend on `self`
    return aten.nll_loss_forward.default(t, *values[1:], **kwargs)[0], None


_SOFTMAXES = (aten._log_softmax.default, aten._softmax.default)
def _vector_norm_jvp(out, values, t, kwargs):
    """The 2-norm's tangent, out of place: torch's `norm_jvp` divides and masks a temporary
    in place, and under a reverse level below (grad(jvp(jvp(norm))), F.normalize under
    grad(jacfwd(jacfwd))) the outer grad had saved it: "modified by an inplace operation"
    (torch.func fails the same way)."""
    x = values[0]
    dim = values[2] if len(values) > 2 else kwargs.get("dim")
    keepdim = values[3] if len(values) > 3 else kwargs.get("keepdim", False)
    dims = list(range(x.dim())) if dim is None else dim
    total = (x * t).sum(dims, keepdim=keepdim) if x.dim() else x * t
    return torch.where(out == 0, torch.zeros_like(total), total / out)


def _solve_jvp(out, values, tangents, kwargs):
    """`_linalg_solve_ex(A, B, left)`'s tangent: A^-1 (dB - dA X) (left) or (dB - X dA) A^-1,
    by `linalg.solve`, whose derivatives are right to every order. torch's own formula
    reuses the LU factorization the op returns, which has no derivative, so reverse mode over
    it (vjp(jvp(solve)), grad(jvp(jvp(solve)))) came out wrong, in torch.func too. Takes the
    tangents of both A and B (a jvp of a jvp gives the inner tangent's solve one of B's)."""
    a, b = values[0], values[1]
    a_t, b_t = tangents[0], tangents[1]
    left = values[2] if len(values) > 2 else kwargs.get("left", True)
    x = out[0]
    rhs = b_t
    if a_t is not None:
        if left:
            vector = b.dim() == 1 or (b.dim() == a.dim() - 1 and b.shape == a.shape[:-1])
            product = (a_t @ x.unsqueeze(-1)).squeeze(-1) if vector else a_t @ x
        else:
            product = x @ a_t
        rhs = -product if rhs is None else rhs - product
    return (torch.linalg.solve(a, rhs, left=left), None, None, None)


def _trace_of_solve(a, t):
    """tr(A^-1 dA), from an LU factorization of A made here, where the levels below see it:
    torch's formulas for det and slogdet solve with the LU the op returns, which has no
    derivative ("we never differentiate over forward AD"), so reverse mode over them
    (vjp(jvp(det))) came out wrong, in torch.func too. A singular A is nudged as torch nudges
    it (an exact zero pivot becomes eps): the tangent stays finite there."""
    lu, pivots, _ = torch.linalg.lu_factor_ex(a)
    pivot = lu.diagonal(0, -2, -1)
    eps = torch.finfo(pivot.real.dtype if pivot.is_complex() else pivot.dtype).eps
    lu = lu + torch.diag_embed(torch.where(pivot == 0, eps, 0.0).to(lu.dtype))
    return torch.linalg.lu_solve(lu, pivots, t).diagonal(0, -2, -1).sum(-1)


def _det_jvp(out, values, t, kwargs):
    """`_linalg_det(A)`'s tangent: det(A) tr(A^-1 dA)."""
    return (_trace_of_solve(values[0], t) * out[0], None, None)


def _slogdet_jvp(out, values, t, kwargs):
    """`_linalg_slogdet(A)`'s tangents: with τ = tr(A^-1 dA), d log|det| = Re τ and
    d sign = sign · i Im τ (zero for real A)."""
    trace = _trace_of_solve(values[0], t)
    sign = out[0]
    if not trace.is_complex():
        return (None, trace, None, None)
    return (sign * (1j * trace.imag), trace.real, None, None)


def _eigh_jvp(out, values, t, kwargs):
    """`_linalg_eigh(A)`'s tangents (real A, eigenvectors computed): with S = V^T dA V,
    dL = diag(S) and dV = V (S ∘ F), F_ij = 1 / (L_j - L_i) off the diagonal, 0 on it.
    torch's formula divides by L_j - L_i with the diagonal's zeros in it and masks the
    result, so reverse mode over it (vjp(jvp(grad(eigvalsh)))) met 0 / 0: NaN, in torch.func
    too. Here the diagonal is replaced before dividing: no NaN to mask."""
    eigenvalues, eigenvectors = out
    s = eigenvectors.mT @ t @ eigenvectors
    gaps = eigenvalues.unsqueeze(-2) - eigenvalues.unsqueeze(-1)
    diagonal = torch.eye(gaps.shape[-1], dtype=torch.bool, device=gaps.device)
    inverse_gaps = torch.where(diagonal, 0.0, 1.0 / torch.where(diagonal, 1.0, gaps))
    return s.diagonal(0, -2, -1), eigenvectors @ (s * inverse_gaps)


def _is_real_eigh_with_vectors(values, kwargs) -> bool:
    compute_v = values[2] if len(values) > 2 else kwargs.get("compute_v", True)
    return compute_v and not values[0].is_complex()


def _is_real_two_norm(op, values, kwargs) -> bool:
    if op is not aten.linalg_vector_norm.default:
        return True
    order = values[1] if len(values) > 1 else kwargs.get("ord", 2)
    return order == 2 and not values[0].is_complex() and kwargs.get("dtype") is None


_EXPLICIT_JVPS = {
    aten._log_softmax.default: _log_softmax_jvp,
    aten._softmax.default: _softmax_jvp,
    aten.nll_loss_forward.default: _nll_loss_forward_jvp,
    aten.logsumexp.default: _logsumexp_jvp,
    aten.linalg_vector_norm.default: _vector_norm_jvp,
    aten._linalg_det.default: _det_jvp,
    aten._linalg_slogdet.default: _slogdet_jvp,
    aten._linalg_eigh.default: _eigh_jvp,
}


def _is_view_op(op) -> bool:
    """One tensor (or one list of tensors: `split`, `unbind`) returned, aliases of the first
    argument that it does not write."""
    if op is aten.detach.default:  # aliases, but drops the tangent
        return False
    schema = op._schema
    if len(schema.returns) != 1 or not schema.arguments:
        return False
    out, first = schema.returns[0].alias_info, schema.arguments[0].alias_info
    return out is not None and not out.is_write and first is not None and not first.is_write


def _op_kind(op):
    """(index of the argument an in-place op writes or None, in-place view op?, out= op?),
    and `_OUT_OF_PLACE` / `_VIEW` for the two common kinds."""
    kind = _op_kind_cache.get(op)
    if kind is None:
        kind = (mutated_argument(op), _inplace_view(op), _writes_out_argument(op))
        if kind == _OUT_OF_PLACE:
            kind = _VIEW if _is_view_op(op) else _OUT_OF_PLACE
        _op_kind_cache[op] = kind
    return kind


class WrappedJvpLevel(WrappedLevel):
    """One `jvp` level over wrapper tensors (see the module docstring)."""

    __slots__ = ("nested", "over_plain_grads", "prev_fwd_grad_mode")
    torch_function_rules = _TORCH_FUNCTION_RULES
    forward_mode = True

    def __init__(self):
        super().__init__()
        load_forward_decompositions()
        # forward AD as the user's code had it where the jvp was called: off, everything this
        # level computes is invisible to the forward levels below (as `prev_grad_mode` for
        # an outer `no_grad()`, torch.func's rule for both)
        self.prev_fwd_grad_mode = user_forward_ad()
        stack = current_stack()
        # another AD level below differentiates what this one computes: carriers for every op
        # (see the module docstring), and _DECOMPOSED_WHEN_NESTED
        self.nested = any(isinstance(level, ADLevel) for level in stack)
        # `over_dual_values` (a jvp level on values below, direct_forward.py, k = 0): its
        # tangents sit on plain tensors at torch's one dual level, which torch would take
        # for this level's. Then every tensor argument of an op goes in as a carrier, so only
        # this level's tangents are attached where the op's formulas see them; the outer
        # tangents flow one level down (core/dual_values.py), when the carriers are unwrapped.
        # only grad levels on plain values below (reverse over forward: grad(jvp(f)), a
        # Hessian-vector product): torch's autograd differentiates the formulas of the ops in
        # `_PLAIN_UNDER_GRAD` right on plain duals, so those need no carriers
        self.over_plain_grads = bool(stack) and all(
            getattr(level, "vmap_levels", None) == () and not level.forward_mode for level in stack
        )

    def _one_level_down(self):
        """The dispatch state for running an op one level down: outside's (autograd on), and
        forward AD as the user's code has it for the op (`user_forward_ad`: their
        `_set_fwd_grad_enabled(False)` holds at every forward level; torch's own switching
        inside an autograd.Function's `jvp`, which this level runs on its carriers, does not:
        the tangents of the levels below must flow through what that computes), off if
        this jvp was called with it off (`prev_fwd_grad_mode`)."""
        state = self.prev_fwd_grad_mode and user_forward_ad()
        if self.over_dual_values:
            return one_level_down_over_dual_values(state)
        if state or not torch._C._is_fwd_grad_enabled():
            return _restore_autograd()  # forward AD as it is (forward levels below decide)
        return _RestoredForwardOff()

    def apply_function(self, function, args, kwargs):
        """An autograd.Function whose arguments hold this level's tensors: applied one level
        down to duals of their primals and tangents, so torch calls its `jvp` there
        (ad/custom_function.py)."""
        return apply_at_jvp_level(self, function, args, kwargs)

    # -- the AD level protocol (level.py) ------------------------------------------------------
    def dual(self, primal: torch.Tensor, tangent: torch.Tensor) -> DualTensor:
        """The function's input for `primal` with `tangent`. Tangents are kept laid out like
        their primals (torch's rule for forward gradients), so views of them line up."""
        if primal.is_inference() or overlaps(primal):  # cannot carry a (per-element) tangent
            primal = primal.clone()
        if tangent.is_inference():
            tangent = tangent.clone()
        if tangent.layout == torch.strided and (
            tangent.stride() != primal.stride() or not levels_of(primal) <= levels_of(tangent)
        ):
            # laid out like the primal, and a tensor of the levels the primal lives at: torch's
            # formulas write into tangents in place (`sin_`), with values of those levels
            tangent = tangent_like(tangent, primal, tangent)
        return DualTensor(primal, tangent, self)

    def unpack(self, x):
        """`(primal, tangent or None)` of a result, both one level down."""
        if type(x) is DualTensor and x._interp is self:
            if self.lifted_bases is not None:
                refresh_views(self, (x,))
            return x._value, tangent_of(x)
        return x, None

    def depends(self, output) -> bool:
        return self.unpack(output)[1] is not None

    def lift(self, value: torch.Tensor) -> DualTensor:
        """A tensor made inside the function (a factory's result): a constant of this level."""
        return DualTensor(value, None, self)

    wrap = lift  # autograd.Function outputs on this level's carriers (custom_function.py)

    def cut(self, x: DualTensor) -> DualTensor:
        """A new DualTensor with the same primal and tangent (an alias torch's autograd uses)."""
        return DualTensor(x._value, tangent_of(x), self)

    # -- one op ------------------------------------------------------------------------------
    def process(self, op, args, kwargs):
        """One level down: torch duals of the primals and tangents, for this op only (of the
        values, or of carriers), the op on them with torch's forward AD on, and its results
        taken apart into this level's DualTensors."""
        here = AT_THIS_LEVEL.get(op)
        if here is not None:
            out = here(self, args, kwargs)
            if out is not None:
                return out
        if self.lifted_bases is not None:
            refresh_views(self, (*args, *kwargs.values()))
        kind = _op_kind_cache.get(op)
        if kind is None:
            kind = _op_kind(op)
        if not user_forward_ad():
            return self._without_tangents(op, args, kwargs, kind)
        if kind is _VIEW:
            out = self._view(op, args, kwargs)
            if out is not _GENERAL:
                return out
            kind = _OUT_OF_PLACE
        if kind is _OUT_OF_PLACE:
            out = self._out_of_place(op, args, kwargs)
            if out is not _GENERAL:
                return out
        mutated, inplace_view, writes_out = kind
        if inplace_view:
            return self._inplace_view(op, args, kwargs)
        if mutated is not None and type(args[mutated]) is DualTensor and args[mutated]._interp is self:
            promote_for_write(args[mutated], args)
        primals, tangents = self.split(args)
        kw_primals, kw_tangents = self.split(kwargs.values()) if kwargs else ((), ())
        if mutated is not None and not (type(args[mutated]) is DualTensor and args[mutated]._interp is self):
            if any(t is not None for t in (*tangents, *kw_tangents)):
                raise_captured_write(op, "jvp")
            mutated = None
        if (all(t is None for t in tangents) and all(t is None for t in kw_tangents)) or op in _VALUE_FREE:
            with self._one_level_down():  # nothing to differentiate here: the op one level down
                out = op(*primals, **dict(zip(kwargs, kw_primals)))
            return args[mutated] if mutated is not None else self.wrap_outputs(out, False)
        if self.nested and op in _DECOMPOSED_WHEN_NESTED:
            with self._one_level_down():
                return _DECOMPOSED_WHEN_NESTED[op](*args, **kwargs)  # its ops come back here
        if writes_out:
            raise NotImplementedError(
                f"functx.jvp: {op} writes into an `out=` tensor, which forward-mode AD does not "
                f"support; use the out-of-place form."
            )
        if mutated is not None:
            written = _written_tangents(primals, tangents, kw_primals, kw_tangents, mutated)
            tangents[mutated] = self._tangent_for_write(args[mutated], tangents[mutated], written)
        carrier = None if not self.nested and _all_plain(primals, kw_primals) else self
        try:
            with _restore_autograd(), views_tracked(), _forward_ad_on():
                every = self.over_dual_values
                duals = make_duals(primals, tangents, carrier, every)
                kw_duals = dict(zip(kwargs, make_duals(kw_primals, kw_tangents, carrier, every)))
                out = op(*duals, **kw_duals)
                if mutated is not None:
                    return self._write_back(args[mutated], tangents[mutated], duals[mutated])
                return self.wrap_outputs(out, True)
        except NotImplementedError as error:
            if _SPARSE_PRIMAL in str(error):
                raise NotImplementedError(
                    f"functx.jvp: {op} on a sparse tensor that carries a tangent: torch cannot attach "
                    f"a tangent to a sparse tensor (`_make_dual`). Keep the tangent-carrying values "
                    f"dense (`.to_dense()`), or use reverse mode (vjp, jacrev)."
                ) from error
            simple = mutated is None and not kwargs and all(t is not LIST_MARK for t in tangents)
            if NO_FORWARD_FORMULA not in str(error) or not simple:
                raise
            with self._one_level_down():
                out, out_tangent = op_jvp_without_formula(op, primals, tangents, {}, error)
            return self._wrap_pairs(out, out_tangent)

    def _without_tangents(self, op, args, kwargs, kind):
        """The op under the user's `_set_fwd_grad_enabled(False)`: its results get no tangent
        here, and one level down forward AD stays off, so no forward level below gives them
        one either (torch.func's rule: the mode holds while an op goes down through its
        levels). An in-place (or `out=`) op leaves its target's tangent as it was, as torch
        does."""
        mutated, inplace_view, writes_out = kind[0], kind[1], kind[2]
        if inplace_view:
            return self._inplace_view(op, args, kwargs)
        own_target = mutated is not None and type(args[mutated]) is DualTensor and args[mutated]._interp is self
        if own_target:
            promote_for_write(args[mutated], args)
        values = [self._unwrap(a) for a in args]
        kw_values = {k: self._unwrap(v) for k, v in kwargs.items()} if kwargs else kwargs
        with self._one_level_down():
            out = op(*values, **kw_values)
        if own_target:
            return args[mutated]
        target = kwargs.get("out") if writes_out else None
        if type(target) is DualTensor and target._interp is self:
            return target
        return self.wrap_outputs(out, False)

    def _unwrap(self, a):
        """This level's primals in an op argument (lists opened), anything else as it is."""
        if type(a) is DualTensor and a._interp is self:
            return a._value
        if type(a) is list or type(a) is tuple:
            return type(a)(self._unwrap(e) for e in a)
        return a

    def _view(self, op, args, kwargs):
        """A view op on one tensor of this level (`unsqueeze`, `select`, `transpose`...): views
        are linear, so the result's tangent is the same view of the tangent (torch's formula
        for every view op), made directly, no duals; both stay views of what they view."""
        x = args[0]
        if type(x) is not DualTensor or x._interp is not self:
            return _GENERAL
        for a in args[1:]:
            # Any list argument (a view's shape too) takes the general path: there a view's
            # tangent is laid out for in-place writes through it (an `expand`ed tangent shared
            # by a clone that is then written into cannot take the write: fuzzer regression).
            if isinstance(a, torch.Tensor) or type(a) is list or type(a) is tuple:
                return _GENERAL
        tangent = x._tangent
        if tangent is None:
            tangent = tangent_of(x)
        value = x._value
        with self._one_level_down():
            if op is _view_as_real and value.is_conj():
                # The wrapper of a lazily conjugated value does not carry the conj bit itself,
                # so torch's `real`/`imag` took it for resolved (`x.conj().real`): resolve the
                # value, and the tangent laid out like it, here (as the grad level does)
                value = value.resolve_conj()
                tangent = None if tangent is None else tangent.resolve_conj()
            primal = op(value, *args[1:], **kwargs)
            out_tangent = None if tangent is None else op(tangent, *args[1:], **kwargs)
        if type(primal) is list or type(primal) is tuple:  # `split`, `unbind`: one per piece
            if out_tangent is None:
                return type(primal)(DualTensor(p, None, self) for p in primal)
            return type(primal)(DualTensor(p, t, self) for p, t in zip(primal, out_tangent))
        return DualTensor(primal, out_tangent, self)

    def _out_of_place(self, op, args, kwargs):
        """`process` for the common case, in one pass: an out-of-place op whose tensors of
        this level are positional arguments (not in lists). `_GENERAL` for anything else."""
        values = list(args)
        tangents = None
        plain = True
        for i in range(len(values)):
            a = values[i]
            if type(a) is DualTensor:
                if a._interp is not self:
                    plain = False  # another jvp level's value
                    continue
                value = values[i] = a._value
                tangent = a._tangent
                if tangent is None:
                    tangent = tangent_of(a)
                if tangent is not None:
                    if tangents is None:
                        tangents = [None] * len(values)
                    tangents[i] = tangent
                if plain and isinstance(value, LevelTensor):
                    plain = False
            elif type(a) is list or type(a) is tuple:
                if op not in _EXPLICIT_JVPS or any(isinstance(e, torch.Tensor) for e in a):
                    return _GENERAL  # (an explicit jvp takes a list of dims)
            elif plain and isinstance(a, LevelTensor):
                plain = False
        if kwargs:
            for v in kwargs.values():
                if isinstance(v, LevelTensor) or type(v) is list or type(v) is tuple:
                    return _GENERAL
        if tangents is None or op in _VALUE_FREE:
            with self._one_level_down():  # nothing to differentiate here: the op one level down
                out = op(*values, **kwargs)
            if isinstance(out, torch.Tensor):
                return DualTensor(out, None, self)
            return self.wrap_outputs(out, False)
        matmul_jvp = _MATMUL_JVPS.get(op)
        if matmul_jvp is not None:  # ops that re-dispatch: right whatever lies below
            with self._one_level_down():
                out = op(*values, **kwargs)
                return DualTensor(out, matmul_jvp(out, values, tangents, kwargs), self)
        if op is aten._linalg_solve_ex.default:  # (see _solve_jvp: both tangents)
            with self._one_level_down():
                out = op(*values, **kwargs)
                out_tangent = _solve_jvp(out, values, tangents, kwargs)
            return tuple(DualTensor(o, t, self) for o, t in zip(out, out_tangent))
        explicit = _EXPLICIT_JVPS.get(op)
        if (
            explicit is not None
            and tangents[0] is not None
            and all(t is None for t in tangents[1:])
            and not (op in _SOFTMAXES and values[2])  # half_to_float: leave the dtype handling to torch
            and _is_real_two_norm(op, values, kwargs)
            and (op is not aten._linalg_eigh.default or _is_real_eigh_with_vectors(values, kwargs))
        ):
            with self._one_level_down():  # the same: tangents by ops on the values one level down
                out = op(*values, **kwargs)
                out_tangent = explicit(out, values, tangents[0], kwargs)
            if type(out) is tuple:
                return tuple(DualTensor(o, t, self) for o, t in zip(out, out_tangent))
            return DualTensor(out, out_tangent, self)
        if not plain or self.nested and not (self.over_plain_grads and op in _PLAIN_UNDER_GRAD):
            return _GENERAL
        try:
            with _restore_autograd(), _forward_ad_on():
                if _tls_excluded(_ADInplaceOrView):  # rare (see views_tracked); the guard costs
                    with views_tracked():
                        return self._on_plain_duals(op, values, tangents, kwargs)
                return self._on_plain_duals(op, values, tangents, kwargs)
        except NotImplementedError:
            return _GENERAL  # the general path raises or falls back

    def _on_plain_duals(self, op, values, tangents, kwargs):
        for i, tangent in enumerate(tangents):
            if tangent is not None:
                value = values[i]
                if 0 in value.stride() and overlaps(value):
                    # an expanded primal: where torch finds its tangent laid out otherwise
                    # (other strides, or another storage size: a reduction's 0-dim result
                    # expanded) it copies the tangent into the primal's layout, where elements
                    # share memory, and raises. The op reads the primal only: a copy of it,
                    # as `dual` makes for the function's inputs
                    value = value.clone()
                values[i] = _make_dual(value, tangent, _DUAL_LEVEL)
        out = op(*values, **kwargs)
        if isinstance(out, torch.Tensor):
            primal, tangent = _unpack_dual(out, _DUAL_LEVEL)
            return DualTensor(primal, tangent, self)
        return self.wrap_outputs(out, True)

    def split(self, values):
        """Primals and tangents (None where zero or not this level's) of op arguments."""
        primals, tangents = [], []
        for a in values:
            if type(a) is DualTensor and a._interp is self:
                primals.append(a._value)
                tangents.append(tangent_of(a))
            elif (type(a) is list or type(a) is tuple) and any(type(e) is DualTensor and e._interp is self for e in a):
                # a list argument (cat, stack, index): a dual per element
                inner_p, inner_t = self.split(a)
                if all(t is None for t in inner_t):
                    primals.append(type(a)(inner_p))
                    tangents.append(None)
                else:
                    primals.append(DualList(type(a), inner_p, inner_t))
                    tangents.append(LIST_MARK)
            else:
                primals.append(a)
                tangents.append(None)
        return primals, tangents

    def wrap_outputs(self, out, with_tangents: bool):
        """This level's DualTensors for an op's results (taken apart from torch duals when
        `with_tangents`; tangent-less otherwise); non-tensors as they are."""
        if isinstance(out, torch.Tensor):
            if not with_tangents:
                return DualTensor(out, None, self)
            primal, tangent = _unpack_dual(out, _DUAL_LEVEL)
            return DualTensor(self._inner(primal), self._inner(tangent), self)
        if type(out) is tuple or type(out) is list:
            return type(out)(self.wrap_outputs(o, with_tangents) for o in out)
        return out

    def _inner(self, x):
        """What a carrier (or any tensor of this level without a tangent) holds."""
        return x._value if type(x) is DualTensor and x._interp is self else x

    def _wrap_pairs(self, out, out_tangent):
        if isinstance(out, torch.Tensor):
            return DualTensor(out, out_tangent, self)
        return type(out)(self._wrap_pairs(o, t) for o, t in zip(out, out_tangent))

    def _tangent_for_write(self, target: DualTensor, tangent, written):
        """The tangent an in-place op on `target` writes into: its own, if it lives at every
        level the primal lives at and every level of the tangents `written` into it (the op
        writes values of those levels into it: a tangent batched at fewer vmap levels than
        its primal or than the tangent copied in, or plain under a grad level, could not
        take them); otherwise zeros of those levels (plus the old tangent). The written
        tangents count on their own: under `jacfwd`, a clone's tangent can be plain below
        the vmap while the tangent written into it is batched there (the primals of both
        plain), so the primal's levels alone do not say it. For a view, that happens to its
        base (the write lands in the base's tangent, as the value lands in the base), and
        the view's tangent is its part of the base's."""
        needed = levels_of(target._value)
        for t in written:
            needed |= levels_of(t)
        if tangent is not None and needed <= levels_of(tangent):
            return tangent
        # tangents laid out like this one's primal, through the levels each of them lives at
        likes = [t for t in (tangent, *written) if t is not None]
        base = target._base if target._is_view() else None
        with as_outside():
            if type(base) is DualTensor and base._interp is self:
                base._tangent = tangent_like(likes, base._value, tangent_of(base))
                target._tangent = view_like(base._tangent, base, target)
            else:
                target._tangent = tangent_like(likes, target._value, tangent)
        return target._tangent

    def _write_back(self, target: DualTensor, tangent, dual):
        """After an in-place op on `dual` (a dual of `target`'s primal, whose memory it wrote):
        the new tangent goes into `target`'s tangent in place, so its views and base see it."""
        new_tangent = self._inner(_unpack_dual(dual, _DUAL_LEVEL)[1])
        if new_tangent is not None and new_tangent is not tangent:
            tangent.copy_(new_tangent)
        return target

    def _inplace_view(self, op, args, kwargs):
        """`squeeze_`, `transpose_`, `as_strided_`...: change the primal's and the tangent's
        metadata in place, then the wrapper's."""
        x = args[0]
        rest = [a._value if type(a) is DualTensor and a._interp is self else a for a in args[1:]]
        tangent = tangent_of(x)
        with self._one_level_down():
            op(x._value, *rest, **kwargs)
            if tangent is not None:
                op(tangent, *rest, **kwargs)
        replay_inplace_view(op, args, kwargs)
        return x


def _written_tangents(primals, tangents, kw_primals, kw_tangents, mutated):
    """The tangents an in-place op writes into its target's tangent: those of every argument
    but the target (list elements included)."""
    written = []
    for values, marks in ((primals, tangents), (kw_primals, kw_tangents)):
        for i, (p, t) in enumerate(zip(values, marks)):
            if t is LIST_MARK:
                written.extend(e for e in p.tangents if e is not None)
            elif t is not None and not (values is primals and i == mutated):
                written.append(t)
    return written


def _plain(x) -> bool:
    if type(x) is DualList:
        return all(_plain(e) for e in x.primals)
    if type(x) is list or type(x) is tuple:
        return all(_plain(e) for e in x)
    return not isinstance(x, LevelTensor)


def _all_plain(*groups) -> bool:
    """Whether every value of an op one level down is plain (or not a tensor)."""
    return all(_plain(x) for group in groups for x in group)


