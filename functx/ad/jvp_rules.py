"""Forward-mode rules: how a wrapped jvp level (ad/wrapped_forward.py) computes one op's
result and tangent, resolved once per op in `JVP_RULES`, as vmap's rules are in `VMAP_RULES`.

1. the op's own rule (registered below): matrix products (the product rule with only the
   factors that carry a tangent), the softmaxes, logsumexp, nll_loss, the real 2-norm, det,
   slogdet, eigh and solve (tangents by ops that re-dispatch, where torch's formula writes a
   temporary in place or reuses an output with no derivative, which reverse mode over it
   cannot follow), the normalizations decomposed when another AD level lies below;
2. templates: *linear* (view ops: the same view of the tangent), *zero* (ops whose result
   does not depend on their arguments' values: no tangent), in-place views (the same
   in-place view of primal and tangent);
3. otherwise torch's own formula on duals made for this op only (`WrappedJvpLevel.on_duals`,
   with a one-pass fast path for out-of-place ops, `out_of_place`).

A rule is `rule(level, *args, **kwargs)` and computes one level down under `level.lower()`.
`coverage_table.py` reports how each op of torch's database is handled (`JVP_RULES.how`).

    >>> JVP_RULES.how(torch.ops.aten.mm.default), JVP_RULES.how(torch.ops.aten.unsqueeze.default)
    ('rule', 'template')
    >>> JVP_RULES.how(torch.ops.aten.atan.default)
    'default'
"""

from __future__ import annotations

import torch
import torch._decomp

from ..core.forward_ad_state import user_forward_ad
from ..core.level_tensor import LevelTensor
from ..core.op_facts import is_inplace_view, is_view_of_first, mutated_argument, writes_out
from ..core.rules import RuleTable
from .aliased_writes import out_of_place_twin, read_before_write, reads_its_target
from .dual_tensor import DualTensor, tangent_of

aten = torch.ops.aten

GENERAL = object()  # a fast path declined: the general path (`WrappedJvpLevel.on_duals`)


# Ops whose result does not depend on their arguments' values: no tangent. (torch.autograd.grad
# makes its default cotangent with `ones_like(output)`; under a fake tensor mode, as
# torch.compile traces, running it on a dual decomposes below autograd and fails.)
_VALUE_FREE = frozenset(
    (
        aten.ones_like.default, aten.zeros_like.default, aten.empty_like.default, aten.full_like.default,
        aten.rand_like.default, aten.randn_like.default, aten.new_zeros.default, aten.new_ones.default,
        aten.new_empty.default, aten.new_full.default, aten.new_empty_strided.default,
    )
)


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
    """`(values, tangents)` when every tensor is this level's `DualTensor` or a tensor of a
    level below (a constant here: no tangent); else None. Not over a jvp on values (its
    tangents must stay off this level's calls: core/dual_values.py), nor where the jvp was
    called with forward AD off (what this level computes is then invisible below)."""
    if level.over_dual_values or not level.prev_fwd_grad_mode:
        return None
    values, tangents = [], []
    for t in tensors:
        if type(t) is DualTensor and t._interp is level:
            values.append(t._value)
            tangents.append(t._tangent if t._tangent is not None else tangent_of(t))
        elif isinstance(t, torch.Tensor) and not (isinstance(t, LevelTensor) and t._interp.level > level.level):
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



# -- the table --------------------------------------------------------------------------------
def is_out_of_place(op) -> bool:
    """Writes none of its arguments (in place, through an in-place view op, or `out=`)."""
    return mutated_argument(op) is None and not is_inplace_view(op) and not writes_out(op)


_TAKES_DIMS = frozenset((*_EXPLICIT_JVPS, aten.sum.dim_IntList, aten.mean.dim))


def operands(level, op, args, kwargs):
    """`(values, tangents or None, plain)` of an out-of-place op whose tensors of `level` are
    positional arguments (lists only of non-tensors, and only for an op of `_TAKES_DIMS`:
    their dims), in one pass: its arguments one level down, the tangents of `level`'s, and
    whether every value is a plain tensor. `GENERAL` for anything else."""
    values = list(args)
    tangents = None
    plain = True
    for i in range(len(values)):
        a = values[i]
        if type(a) is DualTensor:
            if a._interp is not level:
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
            if op not in _TAKES_DIMS or any(isinstance(e, torch.Tensor) for e in a):
                return GENERAL  # (a rule that takes a list of dims)
        elif plain and isinstance(a, LevelTensor):
            plain = False
    if kwargs:
        for v in kwargs.values():
            if isinstance(v, LevelTensor) or type(v) is list or type(v) is tuple:
                return GENERAL
    return values, tangents, plain


def _without_derivative(level, op, values, kwargs):
    """The op on its values one level down; its results carry no tangent at this level."""
    with level.lower():
        out = op(*values, **kwargs)
    if isinstance(out, torch.Tensor):
        return DualTensor(out, None, level)
    return level.wrap_outputs(out, False)


def _over_operands(op, differentiate):
    """A rule for an out-of-place op: where `operands` takes its arguments and one carries a
    tangent, `differentiate(level, args, kwargs, values, tangents, plain)`; the general path
    where it does not take them; the op one level down where nothing carries a tangent."""

    def rule(level, *args, **kwargs):
        found = operands(level, op, args, kwargs)
        if found is GENERAL:
            return level.on_duals(op, args, kwargs)
        values, tangents, plain = found
        if tangents is None:
            return _without_derivative(level, op, values, kwargs)
        return differentiate(level, args, kwargs, values, tangents, plain)

    return rule


def _by_torch_formula(op):
    """torch's formula on plain duals in one pass where the values are plain (or the level
    lies over plain grad levels only and the op is in `_PLAIN_UNDER_GRAD`), the general path
    otherwise: `differentiate` for `_over_operands`."""
    plain_under_grad = op in _PLAIN_UNDER_GRAD

    def differentiate(level, args, kwargs, values, tangents, plain):
        if not plain or level.nested and not (level.over_plain_grads and plain_under_grad):
            return level.on_duals(op, args, kwargs)
        out = level.on_plain_duals(op, values, tangents, kwargs)
        return level.on_duals(op, args, kwargs) if out is GENERAL else out

    return differentiate


def _out_of_place(op):
    """The default for an out-of-place op: torch's own formula (`_by_torch_formula`)."""
    return _over_operands(op, _by_torch_formula(op))


def _general(op):
    def rule(level, *args, **kwargs):
        return level.on_duals(op, args, kwargs)

    return rule


def _default(op):
    return _out_of_place(op) if is_out_of_place(op) else _general(op)


JVP_RULES = RuleTable("jvp", otherwise=_default)
"""Forward-mode rules of a wrapped jvp level: `@JVP_RULES.register(aten.op.overload)`."""


VIEWS_TAKING_LISTS = frozenset((aten.view.default, aten.permute.default, aten.split_with_sizes.default, aten.squeeze.dims))
"""View ops whose list arguments (a shape, dims, sizes) cannot make a view's elements share
memory: the linear template takes them with their lists (`WrappedJvpLevel.view`)."""


def _linear_template(op):
    """A view op on one tensor of the level: the same view of its tangent (`view`)."""
    otherwise = _out_of_place(op)

    def rule(level, *args, **kwargs):
        out = level.view(op, args, kwargs)
        return otherwise(level, *args, **kwargs) if out is GENERAL else out

    return rule


def _inplace_view_template(op):
    def rule(level, *args, **kwargs):
        level.inplace_view(op, args, kwargs, level.lower)  # (the table fixes the wrapper's metadata)

    return rule


def _pointwise_write_template(op):
    """An in-place pointwise op: torch's formula on duals, but where an operand shares the
    target's memory (`v.mul_(v)`), the op out of place and copied in, through this level's
    rules again (ad/aliased_writes.py: torch's formula would read the operand after the write)."""
    twin, general = out_of_place_twin(op), _general(op)

    def rule(level, *args, **kwargs):
        target = args[0]
        if reads_its_target(target, (*args[1:], *kwargs.values())):
            before, kw_before = read_before_write(args, kwargs)
            out = twin(*before, **kw_before)
            if out.shape == target.shape:
                return aten.copy_.default(target, out)
        return general(level, *args, **kwargs)

    return rule


JVP_RULES.add_template(lambda op: is_out_of_place(op) and is_view_of_first(op), _linear_template)
JVP_RULES.add_template(is_inplace_view, _inplace_view_template)
JVP_RULES.add_template(lambda op: out_of_place_twin(op) is not None, _pointwise_write_template)


def _zero(op):
    """No tangent: the op on the primals one level down."""

    def rule(level, *args, **kwargs):
        values = [level.primals_of(a) for a in args]
        kw_values = {k: level.primals_of(v) for k, v in kwargs.items()} if kwargs else kwargs
        return _without_derivative(level, op, values, kw_values)

    return rule


def _own(op, jvp, accepts=None):
    """A rule from `jvp(out, values, tangents, kwargs)`, the result's tangent(s) by ops on the
    values one level down (right whatever lies below: they re-dispatch), for the operands
    `operands` takes and `accepts(values, tangents, kwargs)` (when given) accepts; torch's
    formula for the rest."""
    by_torch = _by_torch_formula(op)

    def differentiate(level, args, kwargs, values, tangents, plain):
        if accepts is not None and not accepts(values, tangents, kwargs):
            return by_torch(level, args, kwargs, values, tangents, plain)
        with level.lower():
            out = op(*values, **kwargs)
            out_tangent = jvp(out, values, tangents, kwargs)
        if type(out) is tuple:
            return tuple(DualTensor(o, t, level) for o, t in zip(out, out_tangent))
        return DualTensor(out, out_tangent, level)

    return _over_operands(op, differentiate)


def _first_tangent_only(jvp):
    """An explicit jvp `jvp(out, values, t, kwargs)` of the first argument's tangent `t`."""
    return lambda out, values, tangents, kwargs: jvp(out, values, tangents[0], kwargs)


def _accepts_explicit(op):
    """Only the first argument carries a tangent, and the op's own conditions hold."""

    def accepts(values, tangents, kwargs):
        return (
            tangents[0] is not None
            and all(t is None for t in tangents[1:])
            and not (op in _SOFTMAXES and values[2])  # half_to_float: leave the dtype handling to torch
            and _is_real_two_norm(op, values, kwargs)
            and (op is not aten._linalg_eigh.default or _is_real_eigh_with_vectors(values, kwargs))
        )

    return accepts


def _recorded_by_the_caller(level, args) -> bool:
    """Whether the caller's autograd records this op (a tensor it tracks among the arguments'
    values), and so may differentiate the tangent made here: a second AD level as well."""
    if not torch.is_grad_enabled():
        return False
    return any(isinstance(a, torch.Tensor) and (a._value if type(a) is DualTensor else a).requires_grad for a in args)


def _decomposed_when_nested(op, decomposition):
    """Under another AD level, or where the caller's autograd records the op (it
    differentiates the tangent: `torch.autograd.grad` of a jvp's output), the op's
    decomposition (its ops come back here); the default otherwise, and where nothing carries
    a tangent."""
    otherwise = _out_of_place(op)

    def rule(level, *args, **kwargs):
        if (level.nested or _recorded_by_the_caller(level, args)) and level.has_tangents(args, kwargs):
            with level.lower():
                return decomposition(*args, **kwargs)
        return otherwise(level, *args, **kwargs)

    return rule


# -- elementwise ops: tangents by ops that re-dispatch ---------------------------------------
# torch's formula on transient duals costs, per op, a dual per tangent (`_make_dual`, whose
# layout checks dispatch to the tangent's levels: two per tangent batched by jacfwd) and,
# under another AD level, a carrier per argument whose own ops come back to this level (a
# tanh under jvp(jvp) was six dispatches here). These are torch's own forward formulas
# (derivatives.yaml), written with ops that re-dispatch, so every level below sees them as
# it sees any op; real floating operands only (complex ones conjugate: torch's), tangents
# of their primal's dtype. A tangent is never an argument's own object (an in-place write
# into the result's tangent would reach it).
def _tangents_like_values(values, tangents, kwargs) -> bool:
    """Every tensor operand real floating, every tangent of its primal's dtype, no kwargs but
    a Scalar `alpha` (add/sub)."""
    for v, t in zip(values, tangents):
        if isinstance(v, torch.Tensor):
            if not v.is_floating_point() or t is not None and t.dtype != v.dtype:
                return False
        elif isinstance(v, complex):
            return False
    return not kwargs or kwargs.keys() == {"alpha"} and not isinstance(kwargs["alpha"], complex)


def _same_shape_and_dtype(values, tangents, kwargs) -> bool:
    """`_tangents_like_values`, and every tensor operand of one shape and dtype (no
    broadcasting, no promotion: the sum of the tangents is laid out as the result)."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    first = tensors[0]
    return _tangents_like_values(values, tangents, kwargs) and all(
        v.shape == first.shape and v.dtype == first.dtype for v in tensors[1:]
    )


def _unary(formula):
    """`formula(t, x, out)`, the tangent of a one-argument op."""
    return lambda out, values, tangents, kwargs: formula(tangents[0], values[0], out)


def _sum_of_terms(*terms):
    """The tangent Σ term_i(t_i, values, out) over the arguments that carry one."""

    def jvp(out, values, tangents, kwargs):
        tangent = None
        for term, t in zip(terms, tangents):
            if t is not None:
                part = term(t, values, out, kwargs)
                tangent = part if tangent is None else tangent + part
        return tangent

    return jvp


_LINEAR = object()  # (in `_ELEMENTWISE`: the op is linear in its first argument)


def _linear_in_first(op):
    """The tangent of an op linear in its first argument: the op of the tangent."""
    return lambda out, values, tangents, kwargs: op(tangents[0], *values[1:], **kwargs)


def _scaled(t, alpha):
    return t * alpha if alpha != 1 else t.clone()


_ELEMENTWISE = {
    aten.tanh.default: (_unary(lambda t, x, out: aten.tanh_backward(t, out)), _tangents_like_values),
    aten.sigmoid.default: (_unary(lambda t, x, out: aten.sigmoid_backward(t, out)), _tangents_like_values),
    aten.exp.default: (_unary(lambda t, x, out: t * out), _tangents_like_values),
    aten.log.default: (_unary(lambda t, x, out: t / x), _tangents_like_values),
    aten.sin.default: (_unary(lambda t, x, out: t * x.cos()), _tangents_like_values),
    aten.cos.default: (_unary(lambda t, x, out: t * -x.sin()), _tangents_like_values),
    aten.neg.default: (_unary(lambda t, x, out: -t), _tangents_like_values),
    aten.relu.default: (_unary(lambda t, x, out: aten.threshold_backward(t, out, 0)), _tangents_like_values),
    aten.sqrt.default: (_unary(lambda t, x, out: t / (2 * out)), _tangents_like_values),
    aten.rsqrt.default: (_unary(lambda t, x, out: -0.5 * t * out.pow(3)), _tangents_like_values),
    aten.reciprocal.default: (_unary(lambda t, x, out: -t * out * out), _tangents_like_values),
    # (grad_output, output): d = tanh_backward(dg, y) - 2 g y dy
    aten.tanh_backward.default: (
        _sum_of_terms(
            lambda t, v, out, kw: aten.tanh_backward(t, v[1]),
            lambda t, v, out, kw: t * (-2 * v[1] * v[0]),
        ),
        _tangents_like_values,
    ),
    # (grad_output, output): d = sigmoid_backward(dg, y) + dy g (1 - 2 y)
    aten.sigmoid_backward.default: (
        _sum_of_terms(
            lambda t, v, out, kw: aten.sigmoid_backward(t, v[1]),
            lambda t, v, out, kw: t * v[0] * (1 - 2 * v[1]),
        ),
        _tangents_like_values,
    ),
    # (grad_output, self, threshold): the mask does not move
    aten.threshold_backward.default: (
        _sum_of_terms(lambda t, v, out, kw: aten.threshold_backward(t, v[1], v[2])),
        _tangents_like_values,
    ),
    aten.mul.Tensor: (
        _sum_of_terms(lambda t, v, out, kw: t * v[1], lambda t, v, out, kw: v[0] * t),
        _tangents_like_values,
    ),
    aten.div.Tensor: (
        _sum_of_terms(lambda t, v, out, kw: t / v[1], lambda t, v, out, kw: -t * out / v[1]),
        _tangents_like_values,
    ),
    aten.add.Tensor: (
        _sum_of_terms(lambda t, v, out, kw: t.clone(), lambda t, v, out, kw: _scaled(t, kw.get("alpha", 1))),
        _same_shape_and_dtype,
    ),
    aten.sub.Tensor: (
        _sum_of_terms(lambda t, v, out, kw: t.clone(), lambda t, v, out, kw: _scaled(t, -kw.get("alpha", 1))),
        _same_shape_and_dtype,
    ),
    # (self, exponent): torch's pow_backward, for a real nonzero exponent (0: torch's zeros)
    aten.pow.Tensor_Scalar: (
        _sum_of_terms(lambda t, v, out, kw: t * (v[1] * v[0].pow(v[1] - 1))),
        lambda values, tangents, kwargs: _tangents_like_values(values, tangents, kwargs)
        and type(values[1]) in (int, float)
        and values[1] != 0,
    ),
    # linear: the same reduction of the tangent (no `dtype=`: torch's dtype handling)
    aten.sum.default: (_LINEAR, _tangents_like_values),
    aten.sum.dim_IntList: (_LINEAR, _tangents_like_values),
    aten.mean.default: (_LINEAR, _tangents_like_values),
    aten.mean.dim: (_LINEAR, _tangents_like_values),
    aten.mul.Scalar: (_sum_of_terms(lambda t, v, out, kw: t * v[1]), _tangents_like_values),
    aten.div.Scalar: (_sum_of_terms(lambda t, v, out, kw: t / v[1]), _tangents_like_values),
}
"""op -> (jvp(out, values, tangents, kwargs), accepts(values, tangents, kwargs))."""


for _op in _VALUE_FREE:
    JVP_RULES.set(_op, _zero(_op))
for _op, (_jvp, _accepts) in _ELEMENTWISE.items():
    JVP_RULES.set(_op, _own(_op, _linear_in_first(_op) if _jvp is _LINEAR else _jvp, _accepts))
for _op, _jvp in _MATMUL_JVPS.items():
    JVP_RULES.set(_op, _own(_op, _jvp))
JVP_RULES.set(aten._linalg_solve_ex.default, _own(aten._linalg_solve_ex.default, _solve_jvp))  # both tangents
for _op, _jvp in _EXPLICIT_JVPS.items():
    JVP_RULES.set(_op, _own(_op, _first_tangent_only(_jvp), _accepts_explicit(_op)))
for _op, _decomposition in _DECOMPOSED_WHEN_NESTED.items():
    JVP_RULES.set(_op, _decomposed_when_nested(_op, _decomposition))

TORCH_FUNCTION_RULES = _TORCH_FUNCTION_RULES
"""torch function -> rule(level, args, kwargs), tried before the function decomposes (matmul,
linear of plain operands in one step); NotImplemented for arguments a rule does not take."""
