"""The jet level's rules (`JET_RULES`), by shape of op, each shape written once.

- `linear_in(positions)`: ops linear in the arguments at `positions` (views, reductions,
  indexing, `add`, `cat`, `where`'s branches, scatters): the k-th coefficient is the op of
  the arguments' k-th coefficients (zero for a tensor there that is not a jet: a constant;
  0 for a number there: `x + 2` shifts the primal only), the other arguments as they are.
- `bilinear`: `mul`, the matrix products, convolution: Cauchy products of the two series.
- `pointwise(function)`: a function of one series from series.py (exp, log, tanh, pow...:
  derivative recurrences).
- `piecewise`: relu, abs, clamp, maximum: each coefficient takes the primal's branch (the
  one-sided Taylor series; at a kink, the branch torch's derivative takes).
- `on_primals`: ops whose result has no coefficients (comparisons, argmax, rounding, `*_like`
  factories, `.item()`).
The rest decompose (core/rules.py: composite kernels, `torch._decomp`) or take the nested
forward-mode fallback (taylor/fallback.py).
"""

from __future__ import annotations

import math

import torch

from . import series as S
from ..ad import torch_nn_rules
from ..core.rules import overloads
from .fallback import nested_forward_fallback
from .level import JET_RULES

aten = torch.ops.aten


def _wrap_out(level, out0, coefficients):
    """The op's result at the level: `out0` (a tensor or a tuple of them) with `coefficients`
    (K entries, each None or shaped like `out0`)."""
    if isinstance(out0, torch.Tensor):
        return level.wrap_series([out0, *coefficients])
    return type(out0)(
        level.wrap_series([o] + [None if c is None else c[i] for c in coefficients]) if isinstance(o, torch.Tensor) else o
        for i, o in enumerate(out0)
    )


def _zero_like(x):
    if isinstance(x, torch.Tensor):
        return torch.zeros_like(x)
    return 0


def _at(level, x, k):
    """`x`'s k-th coefficient as an argument of a linear op: a jet's (zeros where it is
    None), a constant's zero; lists opened one level (`cat`'s tensors). None where no
    element has one."""
    if type(x) is list or type(x) is tuple:
        items = [_at(level, e, k) for e in x]
        if all(i is None for i in items):
            return None
        return [torch.zeros_like(level.series_of(e)[0]) if i is None else i for i, e in zip(items, x)]
    if level.is_jet(x):
        return x._series[k - 1]
    return None


def _primal(level, x):
    if type(x) is list or type(x) is tuple:
        return type(x)(_primal(level, e) for e in x)
    return x._value if level.is_jet(x) else x


def linear_in(op, *positions, names=()):
    """The rule of `op`, linear in its arguments at `positions` (and keywords `names`)."""

    def rule(level, *args, **kwargs):
        primal_args = [_primal(level, a) for a in args]
        primal_kwargs = {key: _primal(level, v) for key, v in kwargs.items()}
        out0 = op(*primal_args, **primal_kwargs)
        coefficients = []
        for k in range(1, level.order + 1):
            at_k = {i: _at(level, args[i], k) for i in positions if i < len(args)}
            at_k_kw = {key: _at(level, kwargs[key], k) for key in names if key in kwargs}
            if all(c is None for c in at_k.values()) and all(c is None for c in at_k_kw.values()):
                coefficients.append(None)
                continue
            call_args = list(primal_args)
            for i, c in at_k.items():
                call_args[i] = _zero_like(primal_args[i]) if c is None else c
            call_kwargs = dict(primal_kwargs)
            for key, c in at_k_kw.items():
                call_kwargs[key] = _zero_like(primal_kwargs[key]) if c is None else c
            coefficients.append(op(*call_args, **call_kwargs))
        return _wrap_out(level, out0, coefficients)

    return rule


def _register_linear(ops, *positions, names=()):
    for op in overloads(*ops):
        JET_RULES.set(op, linear_in(op, *positions, names=names))


# -- linear in the first argument: views, copies, reductions, indexing -------------------------
_register_linear(
    (
        aten.view, aten._unsafe_view, aten.reshape, aten.permute, aten.transpose, aten.t, aten.expand,
        aten.unsqueeze, aten.squeeze, aten.select, aten.slice, aten.narrow, aten.diagonal, aten.unfold,
        aten.as_strided, aten.alias, aten.clone, aten._to_copy, aten.lift_fresh, aten.flip, aten.roll,
        aten.repeat, aten.sum, aten.mean, aten.cumsum, aten.trace, aten.tril, aten.triu, aten.diag_embed,
        aten.index_select, aten.gather, aten.index, aten.split, aten.split_with_sizes, aten.unbind,
        aten.chunk, aten.movedim, aten.neg, aten.expand_copy, aten.view_copy, aten.permute_copy,
        aten.unsqueeze_copy, aten.squeeze_copy, aten.t_copy, aten.transpose_copy, aten.select_copy,
        aten.slice_copy, aten.alias_copy, aten.pixel_shuffle, aten.pixel_unshuffle, aten.im2col,
        aten.col2im, aten.avg_pool2d, aten.avg_pool3d, aten._adaptive_avg_pool2d, aten._adaptive_avg_pool3d,
        aten.upsample_nearest2d, aten.real, aten.imag, aten.conj_physical, aten.view_as_real,
        aten.view_as_complex, aten.diagonal_copy, aten.unbind_copy, aten.split_with_sizes_copy,
        aten.reflection_pad1d, aten.reflection_pad2d, aten.replication_pad1d, aten.replication_pad2d,
    ),
    0,
)
# linear in the first argument, a number beside it shifting the primal only or scaling
_register_linear([aten.mul.Scalar, aten.div.Scalar, aten.true_divide.Scalar], 0)
_register_linear([aten.add.Scalar, aten.sub.Scalar, aten.rsub.Scalar], 0, 1)
_register_linear([aten.constant_pad_nd.default], 0, 2, names=("value",))
_register_linear([aten.masked_fill.Scalar, aten.masked_fill.Tensor], 0, 2)
# jointly linear
_register_linear([aten.rsub.Tensor], 0, 1)


def _sum_rule(sign):
    """add.Tensor / sub.Tensor: `a_k + sign * alpha * b_k`, a coefficient that only one side
    has passing through as it is (broadcast to the result), without adding zeros to it."""

    def rule(level, a, b, *, alpha=1):
        sa, sb = level.series_of(a), level.series_of(b)
        out0 = torch.add(sa[0], sb[0], alpha=sign * alpha)
        coefficients = []
        for ca, cb in zip(sa[1:], sb[1:]):
            if cb is None:
                c = None if ca is None else ca
            elif ca is None:
                c = cb * (sign * alpha) if sign * alpha != 1 else cb
            else:
                c = torch.add(ca, cb, alpha=sign * alpha)
            if c is not None and (c.shape != out0.shape or c.dtype != out0.dtype):
                c = c.to(out0.dtype).expand(out0.shape)
            coefficients.append(c)
        return level.wrap_series([out0, *coefficients])

    return rule


JET_RULES.set(aten.add.Tensor, _sum_rule(1))
JET_RULES.set(aten.sub.Tensor, _sum_rule(-1))
_register_linear((aten.cat, aten.stack, aten.hstack, aten.vstack), 0)
_register_linear((aten.where,), 1, 2)
_register_linear([aten.copy.default], 1)
_register_linear((aten.index_put,), 0, 2)
_register_linear([aten.scatter.src, aten.scatter.value, aten.scatter_add.default, aten.index_add.default,
                  aten.index_copy.default], 0, 3)
_register_linear([aten.masked_scatter.default], 0, 2)
_register_linear((aten.select_scatter, aten.slice_scatter, aten.diagonal_scatter, aten.as_strided_scatter), 0, 1)


# -- bilinear: Cauchy products --------------------------------------------------------------------
def _bilinear(level, a, b, product):
    sa, sb = level.series_of(a), level.series_of(b)
    return S.product(sa, sb, product)


def _product_rule(product):
    """`product(a, b)`, bilinear (mul, mm, bmm, mv, dot, outer): the Cauchy product."""

    def rule(level, a, b):
        return level.wrap_series(_bilinear(level, a, b, product))

    return rule


for _op in (aten.mul.Tensor, aten.mm.default, aten.bmm.default, aten.mv.default, aten.dot.default,
            aten.vdot.default, aten.outer.default):
    JET_RULES.set(_op, _product_rule(_op))


def _biased_product_rule(product):
    """`beta * bias + alpha * product(a, b)` (addmm, baddbmm, addmv, addbmm)."""

    def rule(level, bias, a, b, *, beta=1, alpha=1):
        result = _bilinear(level, a, b, product)
        if alpha != 1:
            result = [S.scaled(r, alpha) for r in result]
        if isinstance(beta, (int, float)) and beta == 0:  # torch ignores the bias then (NaN too)
            return level.wrap_series(result)
        sb = level.series_of(bias)
        return level.wrap_series([S.add_terms([r, t if beta == 1 else S.scaled(t, beta)]) for r, t in zip(result, sb)])

    return rule


JET_RULES.set(aten.addmm.default, _biased_product_rule(aten.mm.default))
JET_RULES.set(aten.baddbmm.default, _biased_product_rule(aten.bmm.default))
JET_RULES.set(aten.addmv.default, _biased_product_rule(aten.mv.default))
JET_RULES.set(aten.addbmm.default, _biased_product_rule(lambda a, b: aten.bmm.default(a, b).sum(0)))


@JET_RULES.register(aten.convolution.default)
def _convolution(level, input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    def conv(x, w):
        return aten.convolution.default(x, w, None, stride, padding, dilation, transposed, output_padding, groups)

    result = _bilinear(level, input, weight, conv)
    if bias is not None:
        sb = level.series_of(bias)
        shape = (1, -1) + (1,) * (result[0].dim() - 2)
        result = [S.add_terms([r, None if t is None else t.reshape(shape)]) for r, t in zip(result, sb)]
    return level.wrap_series(result)


# -- division and powers --------------------------------------------------------------------------
@JET_RULES.register(aten.div.Tensor)
def _div(level, a, b):
    if not (isinstance(b, torch.Tensor) and level.is_jet(b)):
        sa = level.series_of(a)
        b0 = _primal(level, b)
        return level.wrap_series([torch.div(sa[0], b0)] + [None if c is None else torch.div(c, b0) for c in sa[1:]])
    return level.wrap_series(S.quotient(level.series_of(a), level.series_of(b)))


def _on_primals(op):
    """The rule of an op whose result has no coefficients: the op of the primals."""

    def rule(level, *args, **kwargs):
        return op(*[_primal(level, a) for a in args], **{k: _primal(level, v) for k, v in kwargs.items()})

    rule.on_jets = True  # (reads no coefficient: a collapsed level runs it once)
    return rule


for _op in overloads(
    aten.eq, aten.ne, aten.lt, aten.le, aten.gt, aten.ge, aten.argmax, aten.argmin, aten.isnan, aten.isinf,
    aten.isfinite, aten.isneginf, aten.isposinf, aten.logical_not, aten.logical_and, aten.logical_or,
    aten.logical_xor, aten.sign, aten.sgn, aten.floor, aten.ceil, aten.round, aten.trunc, aten.heaviside,
    aten.signbit, aten.nonzero, aten.zeros_like, aten.ones_like, aten.empty_like, aten.full_like, aten.rand_like,
    aten.randn_like, aten.randint_like, aten.new_zeros, aten.new_ones, aten.new_empty, aten.new_full,
    aten.new_empty_strided, aten.empty_strided, aten._local_scalar_dense, aten.bernoulli, aten.is_nonzero,
    aten.equal, aten.allclose, aten.isclose, aten.any, aten.all, aten.count_nonzero, aten.bucketize,
    aten.searchsorted, aten.floor_divide, aten.argsort, aten.sym_size, aten.sym_stride, aten.sym_numel,
    aten.sym_storage_offset, aten.is_same_size, aten._has_compatible_shallow_copy_type,
):
    JET_RULES.set(_op, _on_primals(_op))
for _op in (aten.div.Tensor_mode, aten.div.Scalar_mode):
    # a rounded quotient: piecewise constant (remainder and fmod are not: x - q b, decomposed)
    JET_RULES.set(_op, _on_primals(_op))


@JET_RULES.register(aten.pow.Tensor_Scalar)
def _pow_scalar(level, x, exponent):
    sx = level.series_of(x)
    if float(exponent).is_integer() and exponent >= 0:  # exact where x0 = 0 too (x ** 2 at 0)
        out = S.integer_power(sx, int(exponent))
        out[0] = torch.pow(sx[0], exponent)
        return level.wrap_series(out)
    return level.wrap_series(S.power(sx, exponent))


@JET_RULES.register(aten.pow.Tensor_Tensor)
def _pow_tensor(level, x, exponent):
    if not level.is_jet(exponent):
        return level.wrap_series(S.power(level.series_of(x), exponent))
    sx, se = level.series_of(x), level.series_of(exponent)
    out = S.exp(S.product(se, S.log(sx)))
    out[0] = torch.pow(sx[0], se[0])
    return level.wrap_series(out)


@JET_RULES.register(aten.pow.Scalar)
def _pow_base_scalar(level, base, exponent):
    se = level.series_of(exponent)
    out = S.exp(S.affine(se, math.log(base)))
    out[0] = torch.pow(base, se[0])
    return level.wrap_series(out)


# -- pointwise functions through their recurrences ------------------------------------------------
def _square(u):
    return S.integer_power(u, 2)


_POINTWISE = {
    aten.exp.default: S.exp,
    aten.expm1.default: S.expm1,
    aten.exp2.default: lambda x: _with_primal(S.exp(S.affine(x, math.log(2.0))), torch.exp2(x[0])),
    aten.log.default: S.log,
    aten.log2.default: lambda x: _with_primal([S.scaled(c, 1 / math.log(2.0)) for c in S.log(x)], torch.log2(x[0])),
    aten.log10.default: lambda x: _with_primal([S.scaled(c, 1 / math.log(10.0)) for c in S.log(x)], torch.log10(x[0])),
    aten.log1p.default: lambda x: S.integral(torch.log1p(x[0]), x, S.reciprocal(S.affine(x, 1.0, 1.0))),
    aten.sin.default: lambda x: S.sin_cos(x)[0],
    aten.cos.default: lambda x: S.sin_cos(x)[1],
    aten.sinh.default: lambda x: S.sinh_cosh(x)[0],
    aten.cosh.default: lambda x: S.sinh_cosh(x)[1],
    aten.tan.default: S.tan,
    aten.tanh.default: S.tanh,
    aten.sigmoid.default: S.sigmoid,
    aten.sqrt.default: lambda x: S.power(x, 0.5),
    aten.rsqrt.default: lambda x: S.power(x, -0.5),
    aten.reciprocal.default: S.reciprocal,
    aten.erf.default: S.erf,
    aten.erfc.default: lambda x: _with_primal([S.scaled(c, -1) for c in S.erf(x)], torch.erfc(x[0])),
    aten.atan.default: lambda x: S.chain(torch.atan(x[0]), x, lambda u: S.reciprocal(S.affine(_square(u), 1.0, 1.0))),
    aten.asin.default: lambda x: S.chain(torch.asin(x[0]), x, lambda u: S.power(S.affine(_square(u), -1.0, 1.0), -0.5)),
    aten.acos.default: lambda x: S.chain(
        torch.acos(x[0]), x, lambda u: [S.scaled(c, -1) for c in S.power(S.affine(_square(u), -1.0, 1.0), -0.5)]
    ),
    aten.asinh.default: lambda x: S.chain(torch.asinh(x[0]), x, lambda u: S.power(S.affine(_square(u), 1.0, 1.0), -0.5)),
    aten.acosh.default: lambda x: S.chain(torch.acosh(x[0]), x, lambda u: S.power(S.affine(_square(u), 1.0, -1.0), -0.5)),
    aten.atanh.default: lambda x: S.chain(torch.atanh(x[0]), x, lambda u: S.reciprocal(S.affine(_square(u), -1.0, 1.0))),
}


def _with_primal(series_, primal):
    return [primal] + list(series_[1:])


def _pointwise(function):
    def rule(level, x):
        if level.collapse is not None:  # coefficients per direction: compose (series.composed)
            out = level.wrap_series(S.composed(level.series_of(x), function, level.collapse.summed))
            out._top_summed = True  # (taylor/level.py: not summed again)
            return out
        return level.wrap_series(function(level.series_of(x)))

    return rule


for _op, _function in _POINTWISE.items():
    JET_RULES.set(_op, _pointwise(_function))


# -- piecewise: each coefficient takes the primal's branch ----------------------------------------
def _masked(level, x, mask, out0):
    sx = level.series_of(x)
    return level.wrap_series([out0] + [None if c is None else c * mask for c in sx[1:]])


@JET_RULES.register(aten.relu.default)
def _relu(level, x):
    x0 = _primal(level, x)
    return _masked(level, x, x0 > 0, torch.relu(x0))


@JET_RULES.register(aten.abs.default)
def _abs(level, x):
    x0 = _primal(level, x)
    return _masked(level, x, torch.sgn(x0), torch.abs(x0))


@JET_RULES.register(aten.clamp.default)
def _clamp(level, x, min=None, max=None):
    x0 = _primal(level, x)
    inside = torch.ones_like(x0, dtype=torch.bool)
    if min is not None:
        inside = inside & (x0 >= min)
    if max is not None:
        inside = inside & (x0 <= max)
    return _masked(level, x, inside, torch.clamp(x0, min, max))


@JET_RULES.register(aten.clamp_min.default)
def _clamp_min(level, x, min):
    return _clamp(level, x, min, None)


@JET_RULES.register(aten.clamp_max.default)
def _clamp_max(level, x, max):
    return _clamp(level, x, None, max)


@JET_RULES.register(aten.hardtanh.default)
def _hardtanh(level, x, min_val=-1.0, max_val=1.0):
    return _clamp(level, x, min_val, max_val)


@JET_RULES.register(aten.threshold.default)
def _threshold(level, x, threshold, value):
    x0 = _primal(level, x)
    return _masked(level, x, x0 > threshold, torch.threshold(x0, threshold, value))


def _extremum_of(op, take_first):
    def rule(level, a, b):
        sa, sb = level.series_of(a), level.series_of(b)
        out0 = op(sa[0], sb[0])
        first = take_first(sa[0], sb[0])
        coefficients = []
        for ca, cb in zip(sa[1:], sb[1:]):
            if ca is None and cb is None:
                coefficients.append(None)
                continue
            ca = torch.zeros_like(sa[0]) if ca is None else ca
            cb = torch.zeros_like(sb[0]) if cb is None else cb
            coefficients.append(torch.where(first, ca, cb))
        return level.wrap_series([out0, *coefficients])

    return rule


JET_RULES.set(aten.maximum.default, _extremum_of(torch.maximum, lambda a, b: a >= b))
JET_RULES.set(aten.minimum.default, _extremum_of(torch.minimum, lambda a, b: a <= b))
JET_RULES.set(aten.fmax.default, _extremum_of(torch.fmax, lambda a, b: (a >= b) | torch.isnan(b)))
JET_RULES.set(aten.fmin.default, _extremum_of(torch.fmin, lambda a, b: (a <= b) | torch.isnan(b)))


# -- selections: the coefficients of the selected elements ----------------------------------------
def _selected(level, x, out0, indices, dim, keepdim):
    sx = level.series_of(x)
    index = indices if keepdim else indices.unsqueeze(dim)
    coefficients = []
    for c in sx[1:]:
        if c is None:
            coefficients.append(None)
            continue
        picked = torch.gather(c, dim, index)
        coefficients.append(picked if keepdim else picked.squeeze(dim))
    return [out0, *coefficients]


def _values_and_indices(op):
    """max.dim, min.dim, kthvalue, median.dim, mode: the coefficients of the selected elements."""

    def rule(level, x, *args, **kwargs):
        values, indices = op(_primal(level, x), *args, **kwargs)
        if op is aten.kthvalue.default:
            dim = kwargs.get("dim", args[1] if len(args) > 1 else -1)
        else:
            dim = kwargs.get("dim", args[0] if args else -1)
        keepdim = values.dim() == x.dim()
        index = indices if keepdim else indices.unsqueeze(dim)
        coefficients = []
        for c in level.series_of(x)[1:]:
            picked = None if c is None else torch.gather(c, dim, index)
            coefficients.append(picked if keepdim or picked is None else picked.squeeze(dim))
        return level.wrap_series([values, *coefficients]), indices

    return rule


for _op in (aten.max.dim, aten.min.dim, aten.kthvalue.default, aten.median.dim, aten.mode.default):
    JET_RULES.set(_op, _values_and_indices(_op))


@JET_RULES.register(aten.sort.default)
def _sort(level, x, dim=-1, descending=False):
    values, indices = aten.sort.default(_primal(level, x), dim, descending)
    coefficients = [None if c is None else torch.gather(c, dim, indices) for c in level.series_of(x)[1:]]
    return level.wrap_series([values, *coefficients]), indices


@JET_RULES.register(aten.topk.default)
def _topk(level, x, k, dim=-1, largest=True, sorted=True):
    values, indices = aten.topk.default(_primal(level, x), k, dim, largest, sorted)
    coefficients = [None if c is None else torch.gather(c, dim, indices) for c in level.series_of(x)[1:]]
    return level.wrap_series([values, *coefficients]), indices


def _extreme_reduction(op, largest):
    """amax/amin and the full max()/min(): the coefficients averaged over tied extremes, as
    torch's gradient shares them."""

    def rule(level, x, dim=(), keepdim=False):
        x0 = _primal(level, x)
        full = op in (aten.max.default, aten.min.default)
        dims = list(range(x0.dim())) if full or dim in ((), []) else ([dim] if isinstance(dim, int) else list(dim))
        out0 = op(x0) if full else op(x0, dim, keepdim)
        extreme = x0.amax(dims, keepdim=True) if largest else x0.amin(dims, keepdim=True)
        mask = (x0 == extreme).to(x0.dtype)
        count = mask.sum(dims, keepdim=keepdim and not full)
        coefficients = [
            None if c is None else (c * mask).sum(dims, keepdim=keepdim and not full) / count for c in level.series_of(x)[1:]
        ]
        return level.wrap_series([out0, *coefficients])

    return rule


JET_RULES.set(aten.amax.default, _extreme_reduction(aten.amax.default, True))
JET_RULES.set(aten.amin.default, _extreme_reduction(aten.amin.default, False))
JET_RULES.set(aten.max.default, _extreme_reduction(aten.max.default, True))
JET_RULES.set(aten.min.default, _extreme_reduction(aten.min.default, False))


@JET_RULES.register(aten._local_scalar_dense.default)
def _item(level, x):
    """`.item()`: the primal's value (the path at t = 0), as JAX's jet concretizes."""
    return _primal(level, x).item()


_item.on_jets = True


# -- composites torch decomposes into prims (no autograd there): written on the level's tensors --
def _reduced_dims(x, dim):
    if dim is None or dim == [] or dim == ():
        return list(range(x.dim()))
    return [dim] if isinstance(dim, int) else list(dim)


@JET_RULES.register(aten.var.correction)
def _var(level, x, dim=None, *, correction=None, keepdim=False):
    """The variance as `sum((x - mean)^2) / (n - correction)`, on the level's tensors (each op
    dispatched to its rule)."""
    dims = _reduced_dims(x, dim)
    count = math.prod(x.shape[d] for d in dims)
    centered = x - x.mean(dims, keepdim=True)
    return (centered * centered).sum(dims, keepdim=keepdim) / (count - (1 if correction is None else correction))


@JET_RULES.register(aten.std.correction)
def _std(level, x, dim=None, *, correction=None, keepdim=False):
    return torch.sqrt(_var(level, x, dim, correction=correction, keepdim=keepdim))


@JET_RULES.register(aten.var_mean.correction)
def _var_mean(level, x, dim=None, *, correction=None, keepdim=False):
    return _var(level, x, dim, correction=correction, keepdim=keepdim), x.mean(_reduced_dims(x, dim), keepdim=keepdim)


@JET_RULES.register(aten.std_mean.correction)
def _std_mean(level, x, dim=None, *, correction=None, keepdim=False):
    var, mean = _var_mean(level, x, dim, correction=correction, keepdim=keepdim)
    return torch.sqrt(var), mean


# Ops whose torch._decomp decomposition ends in prims (which have no derivatives), with no
# recurrence here: their coefficients by nested forward mode on the ATen op itself.
for _op in (
    aten.lgamma.default, aten.digamma.default, aten.polygamma.default, aten.erfinv.default, aten.atan2.default,
    aten.hypot.default, aten.prod.default, aten.prod.dim_int, aten.cumprod.default, aten.i0.default,
    aten.special_i0e.default, aten.special_i1.default, aten.special_i1e.default, aten.special_ndtri.default,
    aten.special_erfcx.default, aten.mvlgamma.default, aten.logaddexp.default, aten.logaddexp2.default,
    aten.nextafter.default, aten.remainder.Tensor, aten.remainder.Scalar, aten.remainder.Scalar_Tensor,
    aten.fmod.Tensor, aten.fmod.Scalar, aten.copysign.Tensor, aten.copysign.Scalar, aten.frexp.Tensor,
    aten.scatter_reduce.two, aten.index_reduce.default, aten.linalg_householder_product.default,
):
    JET_RULES.set(_op, nested_forward_fallback(_op))


# torch.nn's chunked cross-entropy operators: their reverse-only autograd has no series; the
# loss as cross_entropy(linear(x)) on the jets (ad/torch_nn_rules.py)
def _chunked_cross_entropy(level, *args):
    return torch_nn_rules._cross_entropy_of_linear(*args)


def _chunked_cross_entropy_per_sample(level, *args):
    return torch_nn_rules._cross_entropy_of_linear_per_sample(*args)


if torch_nn_rules._CHUNKED is not None:
    JET_RULES.set(torch_nn_rules._CHUNKED, _chunked_cross_entropy)
    JET_RULES.set(torch_nn_rules._CHUNKED_PER_SAMPLE, _chunked_cross_entropy_per_sample)


for _rule in (_var, _std, _var_mean, _std_mean, _chunked_cross_entropy, _chunked_cross_entropy_per_sample):
    _rule.on_jets = True  # written with ops on the level's tensors
