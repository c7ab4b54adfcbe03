"""Normalization: batch norm, layer norm, group norm (instance norm is batch norm).

What reaches vmap (torch 2.x, CPU): F.batch_norm -> aten.native_batch_norm;
F.layer_norm -> aten.native_layer_norm; F.group_norm -> aten.native_group_norm;
F.instance_norm views (N, C, ...) as (1, N*C, ...) and runs native_batch_norm in
training mode, so it needs no rule of its own. The `_native_batch_norm_legit*` and
`_batch_norm_{with,no}_update` forms (used by tracing) share the batch-norm rule; on CUDA
`cudnn_batch_norm` decomposes into native_batch_norm.

Two ways to fold the vmap batch B into one kernel call:
- into the sample dim N, when every batch element normalizes with the same statistics
  and parameters (layer/group norm always; batch norm in eval mode with unbatched
  running stats);
- into the channel dim C, when the statistics are per (batch element, channel): batch
  norm in training mode computes them over the logical (N, *spatial) of each element,
  so (B, N, C, ...) runs as (N, B*C, ...) with parameters and running stats of size B*C.
Batched affine parameters (model ensembles) are applied afterwards with broadcasting,
after one normalization call without them. Batch norm of an unbatched input in training
mode normalizes once too, whatever the running stats: its statistics are the same for
every element (`_batch_norm_unbatched_input`).
"""

import torch
import torch._decomp

from ..batched_tensor import UNDER_DIRECT_GRAD, UNDER_DIRECT_JVP, VMAP_RULES
from ..templates import materialize, pad_to_rank

aten = torch.ops.aten
Tensor = torch.Tensor


# -- shared helpers -------------------------------------------------------------------------
def _any_batched(interp, *tensors) -> bool:
    return any(interp.is_batched(t) for t in tensors if t is not None)


def _feature_view(interp, t, trailing: int, out_rank: int):
    """Physical value of a per-feature tensor (weight/bias) that broadcasts against a
    physical output whose batch dim is in front and whose logical rank is `out_rank`;
    `trailing` size-1 dims go after the feature dims (channel-at-dim-1 parameters)."""
    if interp.is_batched(t):
        value = t._value.reshape(*t._value.shape, *((1,) * trailing))
        return pad_to_rank(value, t.dim() + trailing, out_rank)
    return t.reshape(*t.shape, *((1,) * trailing))


def _apply_affine(interp, out, out_rank: int, weight, bias, trailing: int):
    """out * weight + bias, weight/bias batched or not, out a physical value or a plain
    (unbatched) tensor; the result is physical, with the batch dim in front."""
    if weight is not None:
        out = out * _feature_view(interp, weight, trailing, out_rank)
    if bias is not None:
        out = out + _feature_view(interp, bias, trailing, out_rank)
    return out


def _batched_stat(interp, t, batched_source: bool):
    """A statistic output (mean/rstd): batched as is, or expanded when it was computed
    from unbatched values (it is the same for every batch element)."""
    return interp.wrap(t if batched_source else t.expand(interp.batch_size, *t.shape))


# -- layer norm -----------------------------------------------------------------------------
@VMAP_RULES.register(aten.native_layer_norm.default)
def _native_layer_norm(interp, input, normalized_shape, weight=None, bias=None, eps=1e-5):
    """Normalized dims are the trailing ones, so the batch dim in front is just one more
    leading dim: one call. Batched weight/bias are applied after an affine-free call."""
    x_batched = interp.is_batched(input)
    x = input._value if x_batched else input
    if not _any_batched(interp, weight, bias):
        return interp.wrap_all(aten.native_layer_norm.default(x, normalized_shape, weight, bias, eps))
    out, mean, rstd = aten.native_layer_norm.default(x, normalized_shape, None, None, eps)
    out = _apply_affine(interp, out, input.dim(), weight, bias, trailing=0)
    return interp.wrap(out), _batched_stat(interp, mean, x_batched), _batched_stat(interp, rstd, x_batched)


_layer_norm_backward_decomposition = torch._decomp.decomposition_table[aten.native_layer_norm_backward.default]


def _statistics_with_tangents(direct, input, normalized_shape, mean, rstd):
    """`mean` and `rstd` of layer norm recomputed from `input` (differentiable ops, so
    forward AD gives them their tangents); eps, which the backward op is not given, is the
    constant that makes the recomputed rstd the given one, computed from primals without
    the direct jvp level's tangents. Those ride on the plain tensor under every vmap level
    of the direct level: taking them off one level down (the tensor under this level's
    wrapper) worked under one vmap only; under two, eps kept minus the tangent of var,
    which cancelled rstd's tangent (layer-norm HVPs under two vmaps came out wrong)."""
    dims = tuple(range(input.dim() - len(normalized_shape), input.dim()))
    new_mean = input.mean(dims, keepdim=True)
    var = (input - new_mean).pow(2).mean(dims, keepdim=True).view(rstd.shape)
    primal = lambda t: direct.unpack(t)[0]
    eps = primal(rstd).pow(-2) - primal(var)
    return new_mean.view(mean.shape), (var + eps).rsqrt()


@VMAP_RULES.register(aten.native_layer_norm_backward.default)
def _native_layer_norm_backward(interp, grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask):
    """Per-sample gradients of layer norm (vmap of grad): the input gradient is one call on
    the physical tensors (the batch is one more leading dim); the weight and bias
    gradients sum over the logical leading dims only, so they stay per batch element.
    A batched weight or bias (ensembles) goes through torch's decomposition."""
    if _any_batched(interp, weight, bias):
        return _layer_norm_backward_decomposition(
            grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask
        )
    # The kernel reads mean/rstd (and the input) as dense rows: expanded unbatched values
    # (stride 0 along the batch) must be made real first.
    go, x = materialize(interp, grad_out), materialize(interp, input).contiguous()
    mu, r = materialize(interp, mean).contiguous(), materialize(interp, rstd).contiguous()
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        grad_input = interp.wrap(
            aten.native_layer_norm_backward.default(go, x, normalized_shape, mu, r, weight, bias, [True, False, False])[0]
        )
    leading = tuple(range(1, go.dim() - len(normalized_shape)))
    if output_mask[1] and weight is not None:
        grad_weight = interp.wrap(((go * (x - mu) * r).sum(leading) if leading else go * (x - mu) * r))
    if output_mask[2] and bias is not None:
        grad_bias = interp.wrap(go.sum(leading) if leading else go)
    return grad_input, grad_weight, grad_bias


@UNDER_DIRECT_JVP.register(aten.native_layer_norm_backward.default)
def _layer_norm_backward_with_tangents(
    direct, interp, grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask
):
    """Under a direct jvp level (forward AD on the physical tensors: forward-over-reverse
    Hessian-vector products of batched primals, `vmap(jvp(grad(f)))`), `mean` and `rstd`
    carry no tangent (torch's forward AD gives the statistics none), so every formula that
    reads them would miss their dependence on the input: they are recomputed from the
    input (same values, their tangents now right) and torch's decomposition runs on them."""
    mean, rstd = _statistics_with_tangents(direct, input, normalized_shape, mean, rstd)
    return _layer_norm_backward_decomposition(grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask)


# -- group norm -----------------------------------------------------------------------------
@VMAP_RULES.register(aten.native_group_norm.default)
def _native_group_norm(interp, input, weight, bias, N, C, HxW, group, eps):
    """Groups are per sample, so B folds into N: (B, N, C, ...) runs as (B*N, C, ...)."""
    rank = input.dim()
    affine_batched = _any_batched(interp, weight, bias)
    if not interp.is_batched(input):  # only weight/bias are batched
        out, mean, rstd = aten.native_group_norm.default(input, None, None, N, C, HxW, group, eps)
        out = _apply_affine(interp, out, rank, weight, bias, trailing=rank - 2)
        return interp.wrap(out), _batched_stat(interp, mean, False), _batched_stat(interp, rstd, False)
    batch = interp.batch_size
    x = input._value.flatten(0, 1).contiguous()  # the kernel requires it, as F.group_norm ensures
    w, b = (None, None) if affine_batched else (weight, bias)
    out, mean, rstd = aten.native_group_norm.default(x, w, b, batch * N, C, HxW, group, eps)
    out = out.unflatten(0, (batch, N))
    if affine_batched:
        out = _apply_affine(interp, out, rank, weight, bias, trailing=rank - 2)
    return interp.wrap(out), interp.wrap(mean.unflatten(0, (batch, N))), interp.wrap(rstd.unflatten(0, (batch, N)))


# -- batch norm -----------------------------------------------------------------------------
def _unbatched_running_stats_error():
    return RuntimeError(
        "vmap: batch norm in training mode got a tensor batched at this vmap level (its input, "
        "or one of its running stats) while its running_mean/running_var, which it updates in "
        "place, are not (all) batched (Batch norm got a batched tensor as input while the "
        "running_mean or running_var were not batched): every batch element would need its own "
        "running statistics. Fixes: call "
        "functx.nn.replace_all_batch_norm_modules_(model) to stop tracking running stats; or build "
        "the BatchNorm modules with track_running_stats=False; or run the model in eval mode "
        "(model.eval()), which only reads the running stats; or pass running_mean/running_var "
        "batched (one buffer per batch element, e.g. stacked with stack_module_state)."
    )


def _empty_like_save(interp, t):
    """Eval mode returns empty save_mean/save_invstd; give them a batch dim."""
    return interp.wrap(t.expand(interp.batch_size, *t.shape))


def _batch_norm_fold_n(interp, input, weight, bias, running_mean, running_var, momentum, eps):
    """Eval mode, unbatched running stats: every element uses the same statistics, so
    (B, N, C, ...) runs as (B*N, C, ...); batched weight/bias are applied afterwards."""
    batch = interp.batch_size
    value = input._value
    affine_batched = _any_batched(interp, weight, bias)
    w, b = (None, None) if affine_batched else (weight, bias)
    out, save_mean, save_invstd = aten.native_batch_norm.default(
        value.flatten(0, 1), w, b, running_mean, running_var, False, momentum, eps
    )
    out = out.unflatten(0, (batch, value.shape[1]))
    if affine_batched:
        out = _apply_affine(interp, out, input.dim(), weight, bias, trailing=input.dim() - 2)
    return interp.wrap(out), _empty_like_save(interp, save_mean), _empty_like_save(interp, save_invstd)


def _flat_channels(interp, t):
    """(B, C) physical value of a per-channel tensor flattened to B*C (None stays None)."""
    return None if t is None else materialize(interp, t).reshape(-1)


def _batch_norm_fold_channels(interp, input, weight, bias, running_mean, running_var, training, momentum, eps):
    """(B, N, C, ...) runs as (N, B*C, ...): statistics per (batch element, channel) over
    the logical (N, *spatial), exactly as each element alone would compute them."""
    batch = interp.batch_size
    x = materialize(interp, input)
    channels = x.shape[2]
    folded = x.movedim(0, 1).flatten(1, 2)
    # Running stats are updated in place by the kernel: flatten them as views where the
    # layout allows (then nothing to write back), copy otherwise and write the update
    # back. A write-back onto the same memory would still bump the version counter of a
    # tensor autograd saved, breaking a later backward. An unbatched running stat in
    # training mode (`_batch_norm`'s `lifted`) takes its update only once every
    # element's update is checked equal: then every stat is a copy, so that nothing is
    # written before the check.
    shared_update = training and not all(interp.is_batched(s) for s in (running_mean, running_var) if s is not None)
    stats, copied = [], []
    for s in (running_mean, running_var):
        value = None if s is None else materialize(interp, s)
        viewable = value is None or (value.is_contiguous() and not shared_update)
        if value is not None and not viewable:
            value = value.clone(memory_format=torch.contiguous_format)  # its own memory
        stats.append(None if value is None else value.view(-1))
        copied.append(not viewable)
    out, save_mean, save_invstd = aten.native_batch_norm.default(
        folded, _flat_channels(interp, weight), _flat_channels(interp, bias), *stats, training, momentum, eps
    )
    if training:
        originals = (running_mean, running_var)
        updates = [None if flat is None else flat.view(batch, *s.shape) for s, flat in zip(originals, stats)]
        for original, update in zip(originals, updates):
            if update is not None and not interp.is_batched(original):
                # one value for the whole batch: every element must have written the same
                # (plain values only: under an outer vmap the check would be per element)
                same = type(update) is torch.Tensor and torch.equal(update, update[:1].expand_as(update))
                if not same:
                    raise _unbatched_running_stats_error()
        for original, update, is_copy in zip(originals, updates, copied):
            if is_copy and interp.is_batched(original):
                original._value.copy_(update)
            elif is_copy:
                original.copy_(update[0])
    out = out.unflatten(1, (batch, channels)).movedim(1, 0)
    if save_mean.numel() == batch * channels:  # training: per (element, channel) statistics
        stats = (interp.wrap(t.view(batch, channels)) for t in (save_mean, save_invstd))
    else:  # eval: empty tensors
        stats = (_empty_like_save(interp, t) for t in (save_mean, save_invstd))
    return (interp.wrap(out), *stats)


def _channel_vector(interp, t):
    """weight/bias as the (C,) vectors the kernel reads: native_batch_norm takes any shape
    with C elements (a (C, 1) weight works in plain PyTorch), while the folds below
    broadcast weight/bias as vectors of channels."""
    if t is None or t.dim() == 1:
        return t
    if interp.is_batched(t):
        return interp.wrap(t._value.view(interp.batch_size, -1) if t._value.is_contiguous() else t._value.flatten(1))
    return t.view(-1) if t.is_contiguous() else t.flatten()


def _batch_norm_unbatched_input(interp, input, weight, bias, running_mean, running_var, training, momentum, eps):
    """An unbatched input whose normalization is the same for every batch element: training
    mode (the statistics come from the input alone) or eval mode with unbatched running
    stats. One kernel call without weight/bias (batched ones, a model ensemble, are applied
    afterwards). In training mode every element makes the same update
    `stat <- (1 - momentum) * stat + momentum * batch_stat`: an unbatched running stat
    takes it once (as per element), a batched one per element. For a batched stat the kernel
    gets a zero buffer, so it holds `momentum * batch_stat` (the kernel's own rounding,
    unbiased variance included), and each element's buffer is blended with it here."""
    kernel_stats, blends = [], []
    for s in (running_mean, running_var):
        if s is not None and interp.is_batched(s):
            # Only training mode gets here with a batched stat (eval with one folds channels).
            zeros = s._value.new_zeros(s._value.shape[1:])
            kernel_stats.append(zeros)
            blends.append((s._value, zeros))
        else:
            kernel_stats.append(s)
    out, save_mean, save_invstd = aten.native_batch_norm.default(
        input, None, None, *kernel_stats, training, momentum, eps
    )
    for value, update in blends:
        value.mul_(1 - momentum).add_(update)
    out = _apply_affine(interp, out, input.dim(), weight, bias, trailing=input.dim() - 2)
    if not _any_batched(interp, weight, bias):
        # Only running stats are batched: the output is the same for every element. A copy
        # per element, not an expanded view, so that the caller may write into it in place.
        out = out.expand(interp.batch_size, *out.shape).clone()
    return interp.wrap(out), _batched_stat(interp, save_mean, False), _batched_stat(interp, save_invstd, False)


def _batch_norm(interp, input, weight, bias, running_mean, running_var, training, momentum, eps, lifted=False):
    """native_batch_norm's batching rule: (out, save_mean, save_invstd). `lifted`: a direct AD
    level right inside this vmap gave an unbatched differentiated input a batch dim
    (`vmap(grad(f), in_dims=(None, ...))`, README "grad, jacrev and jvp inside vmap"). Then a
    batched input may hold the same value for every element (where torch.func, whose grad
    level keeps such inputs unbatched, sees it unbatched), and training mode with an
    unbatched running stat is a per-sample program when every element makes the same update
    to it: `_batch_norm_fold_channels` checks that on the values and raises the usual error
    otherwise."""
    if not training and (running_mean is None or running_var is None):
        raise RuntimeError("batch_norm: running_mean and running_var must be defined in evaluation mode")
    weight, bias = _channel_vector(interp, weight), _channel_vector(interp, bias)
    x_batched = interp.is_batched(input)
    stats = [s for s in (running_mean, running_var) if s is not None]
    stats_batched = [interp.is_batched(s) for s in stats]
    if not x_batched and (training or not any(stats_batched)):
        return _batch_norm_unbatched_input(interp, input, weight, bias, running_mean, running_var, training, momentum, eps)
    if training and not all(stats_batched) and not lifted:
        raise _unbatched_running_stats_error()
    if not training and not any(stats_batched):
        return _batch_norm_fold_n(interp, input, weight, bias, running_mean, running_var, momentum, eps)
    return _batch_norm_fold_channels(interp, input, weight, bias, running_mean, running_var, training, momentum, eps)


def _with_reserve(interp, input, outputs):
    """The `_batch_norm_*_update` ops also return an empty uint8 `reserve` buffer."""
    reserve = interp.unwrap(input).new_empty((interp.batch_size, 0), dtype=torch.uint8)
    return (*outputs, interp.wrap(reserve))


def _same(i, w, b, rm, rv, t, m, e):
    return i, w, b, rm, rv, t, m, e


# Each batch-norm op's arguments as (input, weight, bias, running_mean, running_var,
# training, momentum, eps), and whether it also returns the `reserve` buffer.
_BATCH_NORM_FORMS = {
    aten.native_batch_norm.default: (_same, False),
    aten._native_batch_norm_legit.default: (_same, False),
    aten._native_batch_norm_legit.no_stats: (lambda i, w, b, t, m, e: (i, w, b, None, None, t, m, e), False),
    aten._native_batch_norm_legit_no_training.default: (lambda i, w, b, rm, rv, m, e: (i, w, b, rm, rv, False, m, e), False),
    aten._batch_norm_with_update.default: (lambda i, w, b, rm, rv, m, e: (i, w, b, rm, rv, True, m, e), True),
    aten._batch_norm_no_update.default: (lambda i, w, b, rm, rv, m, e: (i, w, b, rm, rv, False, m, e), True),
}


def _batch_norm_rule(form, reserve, lifted):
    def rule(interp, *args):
        arguments = form(*args)
        outputs = _batch_norm(interp, *arguments, lifted=lifted)
        return _with_reserve(interp, arguments[0], outputs) if reserve else outputs

    return rule


def _batch_norm_override(form, reserve):
    """Under a direct AD level that lifted buffers (`_batch_norm`'s `lifted`)."""
    rule = _batch_norm_rule(form, reserve, lifted=True)

    def override(direct, interp, *args):
        return rule(interp, *args) if direct.lifts_buffers else NotImplemented

    return override


for _op, (_form, _reserve) in _BATCH_NORM_FORMS.items():
    VMAP_RULES.set(_op, _batch_norm_rule(_form, _reserve, lifted=False))
    UNDER_DIRECT_GRAD.set(_op, _batch_norm_override(_form, _reserve))
    UNDER_DIRECT_JVP.set(_op, _batch_norm_override(_form, _reserve))


_batch_norm_backward_decomposition = torch._decomp.decomposition_table[aten.native_batch_norm_backward.default]


def _statistics(input, eps):
    """Training mode's saved mean and inverse standard deviation, recomputed from the input
    (the same values, with the input's derivatives)."""
    dims = [0, *range(2, input.dim())]
    save_mean = input.mean(dims)
    centered = input - save_mean.view(1, -1, *((1,) * (input.dim() - 2)))
    return save_mean, (centered.pow(2).mean(dims) + eps).rsqrt()


@VMAP_RULES.register(aten.native_batch_norm_backward.default)
def _native_batch_norm_backward(
    interp, grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps, output_mask
):
    """torch's decomposition, on this level's tensors. Where autograd may record it (grad mode
    on: a second derivative, `grad(jacrev(f))`, `vmap(hessian(f))`), training mode's saved
    statistics are recomputed from the input first: to autograd they are constants (torch's
    own derivative of this backward knows they depend on the input; the decomposition's ops
    do not), and second derivatives through batch and instance norm were off by ~0.6-3."""
    if train and save_mean is not None and torch.is_grad_enabled():
        save_mean, save_invstd = _statistics(input, eps)
    out = _batch_norm_backward_decomposition(
        grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps, output_mask
    )
    if out is NotImplemented:
        from ..fallback import loop_fallback

        return loop_fallback(aten.native_batch_norm_backward.default)(
            interp, grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps, output_mask
        )
    return out


@UNDER_DIRECT_JVP.register(aten.native_batch_norm_backward.default)
def _batch_norm_backward_with_tangents(
    direct, interp, grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps, output_mask
):
    """Under a direct jvp level (forward AD on the physical tensors, `vmap(jvp(grad(f)))` of
    batched primals) the saved statistics of training mode carry no tangent: they are
    recomputed from the input first (same values, their tangents now right; see
    `_layer_norm_backward_with_tangents`)."""
    if not train or save_mean is None:
        return NotImplemented
    save_mean, save_invstd = _statistics(input, eps)
    return _native_batch_norm_backward(
        interp, grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps, output_mask
    )

