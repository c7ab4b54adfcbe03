"""Convolution: every F.conv{1,2,3}d / F.conv_transpose{1,2,3}d arrives as
`aten.convolution` (the composite conv ops add and remove the N dim of an unbatched
input, and turn padding="same"/"valid" into ints, before it), and its gradient as
`aten.convolution_backward`.

One kernel call per op, whichever arguments are batched; the vmap batch B goes into:
- N, when only the input is batched (the weight is shared);
- the output channels, when only the weight is batched (a model ensemble on one input);
- the groups, when both are (functorch's and JAX's trick): input (B, N, C, ...) becomes
  (N, B*C, ...), weight (B, O, C/g, ...) becomes (B*O, C/g, ...), groups g becomes B*g,
  so each batch element's channels only ever meet its own weights.
"""

import torch

from ...core.custom_function import apply_original
from ..batched_tensor import UNDER_DIRECT_GRAD, VMAP_RULES
from ..templates import materialize
from .linalg import records_products

aten = torch.ops.aten


# -- layout helpers ----------------------------------------------------------------------
def _batch_into_groups(value):
    """(B, N, C, *s) -> (N, B*C, *s): the channels of batch element b form block b."""
    return value.movedim(0, 1).flatten(1, 2)


def _groups_to_batch(out, batch):
    """(N, B*C, *s) -> (B, N, C, *s), the inverse of `_batch_into_groups`."""
    return out.unflatten(1, (batch, -1)).movedim(1, 0)


def _group_major(value, groups):
    """(B, O, ...) -> (B*O, ...) with the channels ordered (group, batch, channel in group).

    torch gives group i the i-th contiguous block of output channels, so when the weight's
    batch is folded into its output channels, each group's block must hold the channels
    of that group for all B batch elements. Used for a batched weight (B, O, C/g, *k) and
    its bias (B, O)."""
    return value.unflatten(1, (groups, -1)).transpose(0, 1).flatten(0, 2)


def _transposed_group_major(weight):
    """A batched transposed weight (B, C, O/g, *k) -> (C, B*O/g, *k): its output channels
    (dim 1) are already per group, so B goes inside each group's block."""
    return weight.movedim(0, 1).flatten(1, 2)


def _from_group_major(out, batch, groups):
    """(N, g*B*O/g, *s) ordered (group, batch, channel) -> (B, N, O, *s)."""
    out = out.unflatten(1, (groups, batch, -1)).movedim(2, 0)
    return out.flatten(2, 3)


def _check_input_rank(input, weight):
    if input.dim() != weight.dim():
        raise RuntimeError(
            f"Expected {weight.dim()}-dimensional input for {weight.dim()}-dimensional weight "
            f"{list(weight.shape)}, but got {input.dim()}-dimensional input of size "
            f"{list(input.shape)} instead"
        )


# -- per-sample weight gradients by unfolding -------------------------------------------------
def unfolding_pays(input, grad_output, groups, transposed=False) -> bool:
    """Per-sample weight gradients of (B, N, C, *s) inputs and (B, N, O, *s') output gradients:
    whether unfold + one batched GEMM beats the grouped convolution backward. On CPU,
    oneDNN's grouped backward slows down with wide groups: measured at 1 thread (k = 3 and
    1), unfolding took 0.38-0.9x its time where the input channels are at least twice the
    output positions per sample (C=128-512 on 4x4-14x14 maps), 1.07-4.6x elsewhere (a 28x28
    CNN: 1.0-2.4x)."""
    positions = 1
    for size in (grad_output.shape[1], *grad_output.shape[3:]):
        positions *= size
    return (
        not transposed and groups == 1 and input.device.type == "cpu" and input.dim() in (4, 5)
        and input.shape[2] >= 2 * max(positions, 1)
    )  # fmt: skip


def unfolded_weight_grads(input, grad_output, weight_shape, stride, padding, dilation):
    """(B, N, C, *s), (B, N, O, *s') -> (B, *weight_shape): Σ_n g_bn ⊗ unfold(x_bn) per sample,
    for 1-d and 2-d convolutions of one group (1-d as 2-d of height 1)."""
    batch, n = input.shape[:2]
    x, go = input.flatten(0, 1), grad_output.flatten(0, 1)
    if x.dim() == 3:
        x, go = x.unsqueeze(-2), go.unsqueeze(-2)
        stride, padding, dilation = (1, stride[0]), (0, padding[0]), (1, dilation[0])
        kernel = (1, weight_shape[-1])
    else:
        kernel = tuple(weight_shape[-2:])
    columns = torch.nn.functional.unfold(x, kernel, dilation=dilation, padding=padding, stride=stride)
    columns = columns.unflatten(0, (batch, n)).movedim(1, 2).flatten(2)  # (B, C·k, N·L)
    go = go.flatten(2).unflatten(0, (batch, n)).movedim(1, 2).flatten(2)  # (B, O, N·L)
    return torch.bmm(go, columns.mT).view(batch, *weight_shape)


class SharedWeightConvolution(torch.autograd.Function):
    """A convolution of a batch (B, N, C, *s) with one weight that a direct grad level gave
    the batch dim as an expand ((B, O, C/g, *k), stride 0: `vmap(grad(loss))` of a conv net),
    for torch's autograd to record. The grouped convolution (the batch in the groups) would
    convolve B copies of the weight; here the forward is one convolution of the B·N inputs
    against the weight itself, and the backward gives the input's gradient likewise and each
    element's weight gradient grouped or unfolded, whichever `unfolding_pays`. Only where the
    gradient is not built with create_graph=True (`records_products`): the backward reads
    the weight through element 0, which would differentiate as element 0 alone."""

    # forward(ctx, ...) without setup_context: torch binds a setup_context Function's
    # arguments with inspect.signature on every apply (~20 µs)
    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups):
        ctx.save_for_backward(x, weight)
        ctx.settings = (stride, padding, dilation, groups)
        ctx.has_bias = bias is not None
        batch, n = x.shape[:2]
        spatial = x.dim() - 3
        shared_bias = bias[0] if bias is not None and bias.stride(0) == 0 else None
        out = aten.convolution.default(
            x.flatten(0, 1), weight[0], shared_bias, stride, padding, dilation, False, [0] * spatial, groups
        ).unflatten(0, (batch, n))
        if bias is not None and shared_bias is None:  # per-element biases (B, O)
            out = out + bias.view(batch, 1, bias.shape[1], *(1,) * spatial)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.settings
        batch, n = x.shape[:2]
        spatial = x.dim() - 3
        grad_x = grad_weight = grad_bias = None

        def backward(go, inp, w, g, mask):
            return aten.convolution_backward.default(go, inp, w, None, stride, padding, dilation, False, [0] * spatial, g, mask)

        if ctx.needs_input_grad[0]:
            grad_x = backward(grad.flatten(0, 1), x.flatten(0, 1), weight[0], groups, [True, False, False])[0]
            grad_x = grad_x.unflatten(0, (batch, n))
        if ctx.needs_input_grad[1]:
            if unfolding_pays(x, grad, groups):
                grad_weight = unfolded_weight_grads(x, grad, list(weight.shape[1:]), stride, padding, dilation)
            else:  # the grouped backward, its weight read only for its shape
                dummy = weight.new_zeros(()).expand(batch * weight.shape[1], *weight.shape[2:])
                grouped = backward(_batch_into_groups(grad), _batch_into_groups(x), dummy, batch * groups, [False, True, False])
                grad_weight = grouped[1].unflatten(0, (batch, -1))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum((1, *range(3, grad.dim())))
        return grad_x, grad_weight, grad_bias, None, None, None, None


@UNDER_DIRECT_GRAD.register(aten.convolution.default)
def _shared_weight_convolution(direct, interp, input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """A convolution of batched inputs against a weight the direct grad level `direct` gave
    the batch dim as an expand, as a `SharedWeightConvolution` where the level has torch's
    autograd record it (`records_products`; see the Function's docstring)."""
    if transposed or not (interp.is_batched(input) and interp.is_batched(weight)):
        return NotImplemented
    _check_input_rank(input, weight)
    x, w = materialize(interp, input), materialize(interp, weight)
    if w.stride(0) != 0 or not w.shape[0] or not records_products(direct, x, w):
        return NotImplemented
    b = None if bias is None else materialize(interp, bias)
    return interp.wrap(apply_original(SharedWeightConvolution, x, w, b, stride, padding, dilation, groups))


# -- aten.convolution -----------------------------------------------------------------------
def _convolution_rule(op):
    """Rule for `convolution` and `_convolution` (the latter has four trailing flags)."""

    def rule(interp, input, weight, bias, stride, padding, dilation, transposed, output_padding, groups, *flags):
        def conv(x, w, b, g):
            return op(x, w, b, stride, padding, dilation, transposed, output_padding, g, *flags)

        _check_input_rank(input, weight)
        batch = interp.batch_size
        input_batched, weight_batched = interp.is_batched(input), interp.is_batched(weight)
        if weight_batched:
            bias_value = None if bias is None else materialize(interp, bias)
            if input_batched:  # B into the groups
                w = weight._value.flatten(0, 1)
                b = None if bias_value is None else bias_value.flatten(0, 1)
                out = conv(_batch_into_groups(input._value), w, b, groups * batch)
                return interp.wrap(_groups_to_batch(out, batch))
            # B into the output channels
            w = _transposed_group_major(weight._value) if transposed else _group_major(weight._value, groups)
            b = None if bias_value is None else _group_major(bias_value, groups)
            return interp.wrap(_from_group_major(conv(input, w, b, groups), batch, groups))

        bias_batched = interp.is_batched(bias)
        shared_bias = None if bias_batched else bias
        if input_batched:  # B into N
            out = conv(input._value.flatten(0, 1), weight, shared_bias, groups).unflatten(0, (batch, input.shape[0]))
        else:  # only the bias is batched
            out = conv(input, weight, None, groups)
        if bias_batched:  # (B, O) added along the channel dim of (B, N, O, *s)
            spatial = weight.dim() - 2
            out = out + bias._value.view(batch, 1, bias.shape[0], *(1,) * spatial)
        return interp.wrap(out)

    rule.__name__ = f"batch_{op.__name__}"
    return rule


VMAP_RULES.set(aten.convolution.default, _convolution_rule(aten.convolution.default))
VMAP_RULES.set(aten._convolution.default, _convolution_rule(aten._convolution.default))


# -- aten.convolution_backward -----------------------------------------------------------------
@VMAP_RULES.register(aten.convolution_backward.default)
def _convolution_backward(
    interp,
    grad_output,
    input,
    weight,
    bias_sizes,
    stride,
    padding,
    dilation,
    transposed,
    output_padding,
    groups,
    output_mask,
):
    """Gradients of a convolution, as `vmap(grad(...))` asks for them (per-sample weight
    gradients being the common case). grad_input depends on (grad_output, weight),
    grad_weight on (grad_output, input), grad_bias on grad_output; each result is
    computed batched only when what it depends on is, in at most three kernel calls:
    - grad_input with a shared weight: B folded into N;
    - everything else batched: B folded into the groups (per-sample grad_weight);
    - unbatched results: one plain call, expanded over the batch.
    """
    batch = interp.batch_size
    go_b, x_b, w_b = (interp.is_batched(t) for t in (grad_output, input, weight))
    _check_input_rank(input, weight)

    def backward(go, x, w, sizes, g, mask):
        return aten.convolution_backward.default(
            go, x, w, sizes, stride, padding, dilation, transposed, output_padding, g, mask
        )

    grouped, folded, plain = [False] * 3, [False] * 3, [False] * 3
    if output_mask[0]:
        (grouped if w_b else folded if go_b else plain)[0] = True
    if output_mask[1]:
        (grouped if go_b or x_b else plain)[1] = True
    if output_mask[2]:
        (grouped if go_b else plain)[2] = True

    results = [None, None, None]
    if grouped[1] and x_b and go_b and unfolding_pays(input._value, grad_output._value, groups, transposed):
        grouped[1] = False  # the per-sample weight gradients by unfold + one batched GEMM
        results[1] = unfolded_weight_grads(input._value, grad_output._value, list(weight.shape), stride, padding, dilation)
    if any(grouped):
        go, x, w = (materialize(interp, t) for t in (grad_output, input, weight))
        sizes = None if bias_sizes is None else [batch * bias_sizes[0]]
        out = backward(_batch_into_groups(go), _batch_into_groups(x), w.flatten(0, 1), sizes, batch * groups, grouped)
        if grouped[0]:
            results[0] = _groups_to_batch(out[0], batch)
        for i in (1, 2):
            if grouped[i]:
                results[i] = out[i].unflatten(0, (batch, -1))
    if any(folded):  # grad_input only: grad_output batched, weight shared
        go = grad_output._value.flatten(0, 1)
        x = materialize(interp, input).flatten(0, 1)  # only its shape matters
        results[0] = backward(go, x, weight, None, groups, folded)[0].unflatten(0, (batch, input.shape[0]))
    if any(plain):  # results whose inputs are all unbatched; the batched ones give only shapes
        go, x, w = (t._value.select(0, 0) if interp.is_batched(t) else t for t in (grad_output, input, weight))
        out = backward(go, x, w, bias_sizes, groups, plain)
        for i in range(3):
            if plain[i]:
                results[i] = out[i].expand(batch, *out[i].shape)
    return tuple(None if r is None else interp.wrap(r) for r in results)
