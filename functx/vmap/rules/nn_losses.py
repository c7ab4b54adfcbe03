"""Losses: every reduction ("mean", "sum") must reduce each batch element's logical dims
only, never across the vmap batch. So each rule runs the op with reduction="none" (one
batched kernel) and reduces per batch element afterwards.

What reaches vmap (torch 2.x): F.cross_entropy -> _log_softmax + nll_loss_forward
(nll_loss2d_forward for (N, C, H, W); other ranks are viewed to 4-D first; class
probability targets and label smoothing are composite ops); F.mse_loss, smooth_l1_loss,
huber_loss, soft_margin_loss, binary_cross_entropy(_with_logits) arrive as themselves;
F.l1_loss, kl_div, hinge_embedding, margin_ranking, cosine_embedding, poisson/gaussian nll
and triplet losses are composite (pointwise + reductions), so they need no rule here.
F.ctc_loss -> _ctc_loss (+ composite reductions); its rule is at the end.
"""

import math

import torch

from ...core.errors import NeedsPerSampleValues
from ...core.level_tensor import LevelTensor
from ..batched_tensor import VMAP_RULES
from ..fallback import loop_fallback
from ..templates import materialize, pad_to_rank

aten = torch.ops.aten
Tensor = torch.Tensor

NONE, MEAN, SUM = 0, 1, 2  # at::Reduction


# -- shared helpers -------------------------------------------------------------------------
def _per_element(t, reduction):
    """Reduce a physical (B, ...) loss over its logical dims."""
    if reduction == NONE or t.dim() == 1:
        return t
    dims = list(range(1, t.dim()))
    return t.sum(dims) if reduction == SUM else t.mean(dims)


def _per_element_sum(t):
    return t.sum(list(range(1, t.dim()))) if t.dim() > 1 else t


def _rows(t):
    """(B, ...) -> (B, K): one row of indices per batch element (K may be 0)."""
    return t.flatten(1) if t.dim() > 1 else t.unsqueeze(1)


def _gather_rows(interp, weight, index):
    """weight[index] per batch element: weight logical (C,), index physical (B, ...)."""
    w = materialize(interp, weight)
    return w.gather(1, _rows(index)).view(index.shape)


def _common_physical(interp, tensors):
    """Physical values (batch dim in front) of the tensors, broadcast to one shape (views)."""
    rank = max(t.dim() for t in tensors)
    values = [pad_to_rank(materialize(interp, t), t.dim(), rank) for t in tensors]
    shape = torch.broadcast_shapes(*(v.shape for v in values))
    return [v.expand(shape) for v in values]


def _set_reduction(op, args, index, value):
    """Args with the reduction argument (position `index`) set, filling omitted defaults."""
    arguments = op._schema.arguments
    args = list(args)
    while len(args) <= index:
        args.append(arguments[len(args)].default_value)
    old = args[index]
    args[index] = value
    return args, old


def _reduction_index(op):
    return next(i for i, a in enumerate(op._schema.arguments) if a.name == "reduction")


# -- elementwise losses (and their backward ops) ---------------------------------------------
def elementwise_loss_rule(op):
    """loss(self, target, [weight, ...], reduction, [beta]): broadcast every tensor argument
    in physical layout, run with reduction="none", reduce per batch element."""
    index = _reduction_index(op)

    def rule(interp, *args, **kwargs):
        args, reduction = _set_reduction(op, args, index, NONE)
        positions = [i for i, a in enumerate(args) if isinstance(a, Tensor)]
        values = _common_physical(interp, [args[i] for i in positions])
        for i, v in zip(positions, values):
            args[i] = v
        return interp.wrap(_per_element(op(*args, **kwargs), reduction))

    rule.__name__ = f"elementwise_loss_{op.__name__}"
    return rule


def elementwise_loss_backward_rule(op):
    """loss_backward(grad_output, self, target, ..., reduction, ...): a "mean"/"sum" grad is
    one number per batch element; spread it over the elements (divided by their count for
    "mean") and run the reduction="none" backward once. The grad may also come shaped like
    `self` (the double backward's `mse_loss_backward(grad, self, target, reduction)` for
    grad_output's gradient, which autograd then sums): it broadcasts as it is."""
    index = _reduction_index(op)

    def rule(interp, grad_output, *args, **kwargs):
        args, reduction = _set_reduction(op, (grad_output, *args), index, NONE)
        positions = [i for i, a in enumerate(args) if isinstance(a, Tensor)]
        values = _common_physical(interp, [args[i] for i in positions[1:]])
        grad = materialize(interp, grad_output)
        if reduction != NONE:
            numel = math.prod(values[0].shape[1:])
            grad = grad / numel if reduction == MEAN else grad
        grad = pad_to_rank(grad, grad_output.dim(), values[0].dim() - 1)
        args[0] = grad.expand(values[0].shape)
        for i, v in zip(positions[1:], values):
            args[i] = v
        return interp.wrap(op(*args, **kwargs))

    rule.__name__ = f"elementwise_loss_backward_{op.__name__}"
    return rule


for _op in (
    aten.mse_loss.default,
    aten.l1_loss.default,
    aten.smooth_l1_loss.default,
    aten.huber_loss.default,
    aten.soft_margin_loss.default,
    aten.binary_cross_entropy.default,
    aten.binary_cross_entropy_with_logits.default,
):
    VMAP_RULES.set(_op, elementwise_loss_rule(_op))

for _op in (
    aten.mse_loss_backward.default,
    aten.smooth_l1_loss_backward.default,
    aten.huber_loss_backward.default,
    aten.soft_margin_loss_backward.default,
    aten.binary_cross_entropy_backward.default,
):
    VMAP_RULES.set(_op, elementwise_loss_backward_rule(_op))


# -- negative log likelihood ------------------------------------------------------------------
@VMAP_RULES.register(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def _nll_loss_forward(interp, self, target, weight, reduction, ignore_index):
    """-self[target] (times weight[target]) by one gather over the class dim, as the
    native kernel computes it; returns (output, total_weight) per batch element."""
    batch = interp.batch_size
    class_dim = 2 if self.dim() >= 2 else 1  # physical
    x = materialize(interp, self)
    t = materialize(interp, target)
    valid = t != ignore_index
    safe = torch.where(valid, t, 0)
    picked = x.gather(class_dim, safe.unsqueeze(class_dim)).squeeze(class_dim)
    if weight is None:
        picked_weight = valid.to(x.dtype)
        loss = torch.where(valid, -picked, 0)
    else:
        picked_weight = torch.where(valid, _gather_rows(interp, weight, safe), 0)
        loss = torch.where(valid, -picked * picked_weight, 0)
    if reduction == NONE:
        # torch returns total_weight 0 for a batch of samples, the sample's weight for one.
        total = x.new_zeros(batch) if self.dim() >= 2 else picked_weight
        return interp.wrap(loss), interp.wrap(total)
    total = _per_element_sum(picked_weight)
    loss = _per_element_sum(loss)
    return interp.wrap(loss if reduction == SUM else loss / total), interp.wrap(total)


# -- margin losses over classes ------------------------------------------------------------
# A sample is (C,) (or a 0-dim input, one class) with a target () or (1,) (multi-label: a
# target like the input); a logical (N, C) input is a batch of samples. Either way the
# kernels see rows: B is folded into N, or B plays N.
def _rows_of(interp, self, t, keep_cols):
    """Physical value of a per-sample tensor laid out as kernel rows (B*N or B first)."""
    value = materialize(interp, t)
    if self.dim() == 2:
        return value.flatten(0, 1)
    return value.reshape(interp.batch_size, math.prod(t.shape)) if keep_cols else value.reshape(interp.batch_size)


def _unrow(interp, self, t, shape):
    """Kernel rows back to a physical (B, *shape), shape a logical per-element shape."""
    if self.dim() == 2:
        return t.unflatten(0, (interp.batch_size, self.shape[0]))
    return t.reshape(interp.batch_size, *shape)


def _none_grad(interp, grad_output, self, reduction, none_shape):
    """The grad that reduction="none" would receive, physical (B, *none_shape)."""
    grad = materialize(interp, grad_output)
    if reduction == NONE:
        return grad
    count = math.prod(none_shape)
    grad = grad / count if reduction == MEAN else grad
    return grad.reshape(grad.shape[0], *((1,) * len(none_shape))).expand(grad.shape[0], *none_shape)


def _multi_margin_none_shape(self, target):
    return (self.shape[0],) if self.dim() == 2 else tuple(target.shape)


@VMAP_RULES.register(aten.multi_margin_loss.default)
def _multi_margin_loss(interp, self, target, p=1, margin=1, weight=None, reduction=MEAN):
    """A batched class weight scales each sample's loss by weight[target]: run without it."""
    weight_batched = weight is not None and interp.is_batched(weight)
    x, t = _rows_of(interp, self, self, True), _rows_of(interp, self, target, False)
    loss = aten.multi_margin_loss.default(x, t, p, margin, None if weight_batched else weight, NONE)
    loss = _unrow(interp, self, loss, target.shape)
    if weight_batched:
        loss = loss * _gather_rows(interp, weight, materialize(interp, target))
    return interp.wrap(_per_element(loss, reduction))


@VMAP_RULES.register(aten.multi_margin_loss_backward.default)
def _multi_margin_loss_backward(interp, grad_output, self, target, p, margin, weight=None, reduction=MEAN):
    weight_batched = weight is not None and interp.is_batched(weight)
    grad = _none_grad(interp, grad_output, self, reduction, _multi_margin_none_shape(self, target))
    if weight_batched:
        grad = grad * _gather_rows(interp, weight, materialize(interp, target))
    grad = grad.flatten(0, 1) if self.dim() == 2 else grad.reshape(interp.batch_size)
    x, t = _rows_of(interp, self, self, True), _rows_of(interp, self, target, False)
    out = aten.multi_margin_loss_backward.default(grad, x, t, p, margin, None if weight_batched else weight, NONE)
    return interp.wrap(_unrow(interp, self, out, self.shape))


@VMAP_RULES.register(aten.multilabel_margin_loss_forward.default)
def _multilabel_margin_loss_forward(interp, self, target, reduction):
    x, t = _rows_of(interp, self, self, True), _rows_of(interp, self, target, True)
    loss, is_target = aten.multilabel_margin_loss_forward.default(x, t, NONE)
    loss = _unrow(interp, self, loss, ())
    return interp.wrap(_per_element(loss, reduction)), interp.wrap(_unrow(interp, self, is_target, target.shape))


@VMAP_RULES.register(aten.multilabel_margin_loss_backward.default)
def _multilabel_margin_loss_backward(interp, grad_output, self, target, reduction, is_target):
    none_shape = (self.shape[0],) if self.dim() == 2 else ()
    grad = _none_grad(interp, grad_output, self, reduction, none_shape)
    grad = grad.flatten(0, 1) if self.dim() == 2 else grad
    x, t, is_t = (_rows_of(interp, self, v, True) for v in (self, target, is_target))
    out = aten.multilabel_margin_loss_backward.default(grad, x, t, NONE, is_t)
    return interp.wrap(_unrow(interp, self, out, self.shape))


# -- connectionist temporal classification -------------------------------------------------
# aten._ctc_loss(log_probs (T, N, C), targets, input_lengths, target_lengths, blank,
# zero_infinity) -> (neg_log_likelihood (N,), log_alpha (N, T, 2 * max(target_lengths) + 1)),
# with targets padded (N, S) or concatenated (sum(target_lengths),); F.ctc_loss reduces
# outside (composite ops). The N sequences are independent, so B folds into N. Folding
# gives every element the log_alpha width of the longest target in the whole batch: that is
# each element's own width only when the longest target is as long in every element
# (always with unbatched lengths); otherwise the elements' log_alphas differ in shape.
def _ctc_widths_agree(interp, target_lengths):
    """Is the longest target as long in every batch element? True or False, read from batched
    plain lengths (the kernel reads them too); None for the values of a level below (a
    nested vmap), which cannot be read here."""
    if not interp.is_batched(target_lengths) or target_lengths.numel() == 0 or interp.batch_size == 0:
        return True
    value = target_lengths._value
    if isinstance(value, LevelTensor):
        return None
    longest = value.reshape(interp.batch_size, -1).amax(1)
    return bool((longest == longest[0]).all())


def _ctc_fold(interp, log_probs, targets, input_lengths, target_lengths):
    """The kernel's arguments with the B*N sequences as one batch: log_probs (T, B*N, C),
    targets (B*N, S) or (B*L,) (each element's concatenation in turn, so the offsets from the
    folded lengths stay right), lengths (B*N,) (int lists repeated)."""
    batch = interp.batch_size
    lp = materialize(interp, log_probs).movedim(0, 1).flatten(1, 2)
    tg = materialize(interp, targets).flatten(0, 1)
    il, tl = (
        list(n) * batch if isinstance(n, (list, tuple)) else materialize(interp, n).reshape(-1)
        for n in (input_lengths, target_lengths)
    )
    return lp, tg, il, tl


def _ctc_rule(op, fold):
    """Fold when the widths agree; raise when they differ; run the per-sample loop (which
    stacks equal shapes, or raises) when the lengths cannot be read at this level."""
    name = op._schema.name
    per_sample = loop_fallback(
        op,
        warning=(
            f"functx.vmap: {name} with target lengths batched at an outer vmap level runs once "
            f"per batch element (slow): its log_alpha is as wide as the longest target."
        ),
    )

    def rule(interp, *args, **kwargs):
        agree = _ctc_widths_agree(interp, args[4 if op in _CTC_BACKWARD else 3])
        if agree is None:
            return per_sample(interp, *args, **kwargs)
        if not agree:
            raise NeedsPerSampleValues(
                f"vmap: {name} with a longest target that differs between batch elements: "
                f"log_alpha's shape depends on the values of target_lengths, (N, T, 2 * "
                f"max(target_lengths) + 1), so the per-sample shapes differ and cannot be stacked. "
                f"Pass target_lengths unbatched, or give every batch element the same longest target.",
                interp,
                f"{name}'s log_alpha is as wide as each sample's longest target, which differs between samples",
            )
        return fold(op, interp, *args, **kwargs)

    return rule


def _ctc_loss_folded(op, interp, log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    batch, n = interp.batch_size, log_probs.shape[1]
    nll, log_alpha = op(*_ctc_fold(interp, log_probs, targets, input_lengths, target_lengths), blank, zero_infinity)
    return interp.wrap(nll.unflatten(0, (batch, n))), interp.wrap(log_alpha.unflatten(0, (batch, n)))


def _ctc_loss_backward_folded(
    op, interp, grad, log_probs, targets, input_lengths, target_lengths, nll, log_alpha, blank, zero_infinity=False
):
    lp, tg, il, tl = _ctc_fold(interp, log_probs, targets, input_lengths, target_lengths)
    grad, nll, log_alpha = (materialize(interp, t).flatten(0, 1) for t in (grad, nll, log_alpha))
    out = op(grad, lp, tg, il, tl, nll, log_alpha, blank, zero_infinity)  # (T, B*N, C)
    return interp.wrap(out.unflatten(1, (interp.batch_size, log_probs.shape[1])).movedim(1, 0))


_CTC_BACKWARD = (aten._ctc_loss_backward.default, aten._ctc_loss_backward.Tensor)
for _op in (aten._ctc_loss.default, aten._ctc_loss.Tensor):
    VMAP_RULES.set(_op, _ctc_rule(_op, _ctc_loss_folded))
for _op in _CTC_BACKWARD:
    VMAP_RULES.set(_op, _ctc_rule(_op, _ctc_loss_backward_folded))
