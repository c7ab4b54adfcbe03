"""torch.autograd.Function subclasses used by the tests of every transform: written the
way users write them (no functx import), covering the features torch documents."""

import numpy as np
import torch
from torch.autograd.function import once_differentiable


class Cube(torch.autograd.Function):
    """x ** 3 * k with its true derivatives; a non-tensor input; generate_vmap_rule."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, k):
        return x**3 * k

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, k = inputs
        ctx.save_for_backward(x)
        ctx.save_for_forward(x)
        ctx.k = k

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * ctx.k * grad, None

    @staticmethod
    def jvp(ctx, tangent, _):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * ctx.k * tangent


class SignSTE(torch.autograd.Function):
    """sign(x) with a straight-through estimator: the custom derivative is 1 (clipped to
    |x| <= 2), the true one 0. A transform that differentiates the forward gets zeros."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return torch.sign(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.save_for_forward(inputs[0])

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * (x.abs() <= 2).to(grad.dtype)

    @staticmethod
    def jvp(ctx, tangent):
        (x,) = ctx.saved_tensors
        return tangent * (x.abs() <= 2).to(tangent.dtype)


class NumpyTanh(torch.autograd.Function):
    """A forward that leaves torch (numpy); a vmap staticmethod that applies the Function
    to the batch (numpy's tanh is elementwise); backward/jvp from the saved output."""

    @staticmethod
    def forward(x):
        return torch.from_numpy(np.tanh(x.detach().cpu().numpy())).to(x.device)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)
        ctx.save_for_forward(output)

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * (1 - y**2)

    @staticmethod
    def jvp(ctx, tangent):
        (y,) = ctx.saved_tensors
        return tangent * (1 - y**2)

    @staticmethod
    def vmap(info, in_dims, x):
        NumpyTanh.vmap_calls.append((info.batch_size, info.randomness, in_dims))
        return NumpyTanh.apply(x), in_dims[0]

    vmap_calls: list = []


class SortWithIndices(torch.autograd.Function):
    """Two outputs, one marked non-differentiable (its gradient arrives as None); a
    non-tensor input; a vmap staticmethod that moves the batch dim and calls apply."""

    @staticmethod
    def forward(x, descending):
        values, indices = torch.sort(x, dim=-1, descending=descending)
        return values, indices

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(output[1])
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, grad_values, grad_indices):
        assert grad_indices is None  # non-differentiable output, grads not materialized
        (indices,) = ctx.saved_tensors
        if grad_values is None:
            return None, None
        return torch.zeros_like(grad_values).scatter(-1, indices, grad_values), None

    @staticmethod
    def vmap(info, in_dims, x, descending):
        x = x.movedim(in_dims[0], 0)
        return SortWithIndices.apply(x, descending), (0, 0)


class ScaleByMax(torch.autograd.Function):
    """forward reads Python numbers out of its input (`.item()`, `.tolist()`); the custom
    backward treats the scale as a constant. vmap by applying it per sample."""

    @staticmethod
    def forward(x):
        scale = 1.0 / max(abs(v) for v in x.reshape(-1).tolist())
        assert scale == 1.0 / x.abs().max().item()
        return x * scale

    @staticmethod
    def setup_context(ctx, inputs, output):
        ScaleByMax.needs_input_grad_seen.append(ctx.needs_input_grad)
        ctx.save_for_backward(inputs[0], output)

    @staticmethod
    def backward(ctx, grad):
        x, y = ctx.saved_tensors
        # y = x * scale, with the scale held constant
        return grad * (y / x)

    @staticmethod
    def vmap(info, in_dims, x):
        x = x.movedim(in_dims[0], 0)
        return torch.stack([ScaleByMax.apply(sample) for sample in x.unbind(0)]), 0

    needs_input_grad_seen: list = []


class OnceDifferentiableExp(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return torch.exp(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * y


class NoVmapSupport(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return x * 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class BothVmapRules(NoVmapSupport):
    generate_vmap_rule = True

    @staticmethod
    def vmap(info, in_dims, x):
        return x * 2, in_dims[0]


class OldStyleSTE(torch.autograd.Function):
    """An old-style Function (forward(ctx, ...), no setup_context): a clipped
    straight-through estimator of round()."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * (x.abs() <= 2).to(grad.dtype)


class Mul(torch.autograd.Function):
    """x * y with generate_vmap_rule: under vmap one input may be unbatched, and its
    gradient is then summed over the batch."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, y):
        return x * y

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)
        ctx.save_for_forward(*inputs)

    @staticmethod
    def backward(ctx, grad):
        x, y = ctx.saved_tensors
        return grad * y, grad * x

    @staticmethod
    def jvp(ctx, tx, ty):  # a tangent is None where its input has none
        x, y = ctx.saved_tensors
        return (0 if tx is None else tx * y) + (0 if ty is None else x * ty)


class KwargOnly(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x, *, scale):
        return x * scale

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad


class BadVmapReturn(NoVmapSupport):
    @staticmethod
    def vmap(info, in_dims, x):
        return x * 2  # should be (output, out_dims)


class AddOneInPlace(torch.autograd.Function):
    """An in-place Function: modifies its input and marks it dirty."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        x.add_(1)
        return x

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_dirty(inputs[0])

    @staticmethod
    def backward(ctx, grad):
        return grad * 2  # deliberately not the true derivative


class WithPythonOutput(torch.autograd.Function):
    """Returns a Python number next to the tensor; custom derivative 5 (true one 2)."""

    @staticmethod
    def forward(x):
        return x * 2, 7

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad, _):
        return grad * 5

    @staticmethod
    def vmap(info, in_dims, x):
        return WithPythonOutput.apply(x), (in_dims[0], None)
