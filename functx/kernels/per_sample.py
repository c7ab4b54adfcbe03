"""Per-sample gradients of one layer, kept implicit.

For a layer called on a batch, the gradient of sample b's loss with respect to the layer's
parameters is a function of what the layer saw for that sample: its input `a_b` and the
gradient `g_b` of the loss with respect to its output. A `LayerGradients` holds the batch of
both and answers, without materialising B copies of every parameter gradient:

- `norms_sq()`: ‖∂ℓ_b/∂θ‖² summed over the layer's parameters, per sample;
- `weighted_sum(c)`: Σ_b c_b ∂ℓ_b/∂θ per parameter (the clipped sum of DP-SGD);
- `per_sample()`: the per-sample gradients themselves (for a parameter the layer shares);
- `release()`: after the norms, drop what the sum will not read (functx.dp calls it in the
  backward, so a layer's output gradient does not outlive its turn).

Per layer type:
- Linear, 2-D input: the weight gradient is the outer product g_b a_bᵀ, so its norm is
  ‖g_b‖·‖a_b‖. On sequences (B, T, d): ‖Σ_t g_bt a_btᵀ‖² = ⟨A_b A_bᵀ, G_b G_bᵀ⟩ (the "ghost
  norm"), in row blocks so the T×T products are never held whole. The sum is one GEMM:
  (c ⊙ G)ᵀ A, so A and G are kept until the weights c are known, unless the per-sample
  gradients are no larger (d_in·d_out <= T·(d_in + d_out): long sequences): then they are
  made at once (one batched GEMM), give the norms and the sum, and A and G are freed
  (`release`). Where A and G are kept, 2T² < d_in·d_out follows: the ghost norm pays.
- Embedding: sample b's gradient has a row per distinct id, the sum of its tokens' output
  gradients; the rows are summed by (sample, id) keys, never as a dense (B, V, D).
- Conv1d / Conv2d (one group, zero padding), where 2L² < C·k·O (few output positions, a
  large weight: deep layers): the Linear case over the unfolded input, one row per output
  position (ghost norm); other zero-padded convolutions (Conv3d, groups): materialised by
  one grouped convolution backward (the batch folded into the groups).
- LayerNorm / GroupNorm affine parameters: the per-sample gradients are small (B × C),
  computed directly from the normalised input.
- Any other layer: materialised, functx's `vmap` of `grad` of ⟨output, output gradient⟩
  (the layer's vjp; correct for any layer that treats dim 0 as the batch), unless a kernel
  is registered for its type (`register_layer_gradients`, open to users' layer types).

    >>> import torch, functx
    >>> from functx.kernels import layer_gradients
    >>> layer = torch.nn.Linear(3, 2)
    >>> a, g = torch.randn(4, 3), torch.randn(4, 2)
    >>> ghost = layer_gradients(layer, (a,), g).norms_sq()
    >>> full = (g[:, :, None] * a[:, None, :]).flatten(1).pow(2).sum(1) + g.pow(2).sum(1)
    >>> torch.allclose(ghost, full)
    True
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch import Tensor

from . import ops


class LayerGradients:
    """Per-sample gradients of `module`'s trainable parameters (its submodules' too) from
    one call: its positional inputs `args` (batch first), keyword inputs `kwargs` (the same
    for every sample), and `grad_output`, the gradient of the summed per-sample losses with
    respect to its output (a tuple, with None for non-tensor items, where the output is).

    Example:
        >>> import torch
        >>> from functx.kernels import LayerGradients, layer_gradients
        >>> a, g = torch.randn(4, 3), torch.randn(4, 2)  # the layer's input, its output's gradient
        >>> grads = layer_gradients(torch.nn.Linear(3, 2), (a,), g)
        >>> isinstance(grads, LayerGradients)
        True
        >>> per_sample = grads.per_sample()
        >>> per_sample["weight"].shape, per_sample["bias"].shape
        (torch.Size([4, 2, 3]), torch.Size([4, 2]))
        >>> full = sum(p.flatten(1).pow(2).sum(1) for p in per_sample.values())
        >>> torch.allclose(grads.norms_sq(), full)
        True
    """

    def __init__(self, module: nn.Module, args: tuple, grad_output, kwargs: dict | None = None):
        self.module = module
        self.args = args
        self.kwargs = kwargs or {}
        self.grad_output = grad_output
        self.names = [n for n, p in module.named_parameters() if p.requires_grad]
        first = grad_output if isinstance(grad_output, Tensor) else next(g for g in grad_output if g is not None)
        self.batch = first.shape[0]

    def per_sample(self) -> dict[str, Tensor]:
        """name -> (B, *param.shape): each sample's gradient (made once: the norms and the
        sum of a layer without a kernel of its own both read them)."""
        grads = self.__dict__.get("_per_sample_grads")
        if grads is None:
            grads = self._per_sample_grads = self._per_sample()
        return grads

    def _per_sample(self) -> dict[str, Tensor]:
        raise NotImplementedError

    def norms_sq(self) -> Tensor:
        """(B,): each sample's squared gradient norm over this layer's parameters."""
        grads = self.per_sample()
        return sum(g.reshape(g.shape[0], -1).pow(2).sum(1) for g in grads.values())

    def weighted_sum(self, weights: Tensor) -> dict[str, Tensor]:
        """name -> Σ_b weights[b] · (sample b's gradient)."""
        return {n: torch.tensordot(weights.to(g.dtype), g, dims=1) for n, g in self.per_sample().items()}

    def release(self) -> None:
        """Keep only what `weighted_sum` reads, once the norms are taken (DP-SGD's weights
        come after every layer's norms). Here that is the per-sample gradients: the inputs
        and the output gradient are dropped (a convolution's output gradient is often larger
        than its per-sample weight gradients)."""
        self.per_sample()
        self.args = self.kwargs = self.grad_output = None


def _rows(a: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """(B, *, d) -> (B, T, d): the positions between batch and features as one dim."""
    return a.reshape(a.shape[0], -1, a.shape[-1]), g.reshape(g.shape[0], -1, g.shape[-1])


class LinearGradients(LayerGradients):
    @functools.cached_property
    def _parts(self):
        """(a, g) as (B, T, d): the norms and the sum both read them (an unfolded
        convolution's are made once)."""
        return self._rows()

    def _rows(self):
        a, g = _rows(self.args[0], self.grad_output)
        return a.to(g.dtype), g

    def _per_sample(self):
        a, g = self._parts
        out = {}
        if "weight" in self.names:
            out["weight"] = torch.bmm(g.mT, a).reshape(self.batch, *self.module.weight.shape)  # (B, d_out, d_in)
        if "bias" in self.names:
            out["bias"] = g.sum(1)
        return out

    @functools.cached_property
    def _materialised(self) -> bool:
        """Whether the per-sample gradients (B·(d_out·d_in + d_out) numbers) take no more
        memory than the inputs and output gradient the sum otherwise keeps until every
        layer's norm is known (B·T·(d_in + d_out)): on long sequences they do. Made once (one
        batched GEMM, as many flops as the sum's), they give the norms and the sum, and the
        inputs and output gradient are freed in the backward (LayerGradients.release)."""
        a, g = self._parts
        weight = "weight" in self.names
        per_sample = (a.shape[2] * g.shape[2] if weight else 0) + ("bias" in self.names) * g.shape[2]
        return per_sample <= a.shape[1] * ((a.shape[2] if weight else 0) + g.shape[2])

    def norms_sq(self):
        if self._materialised:
            return super().norms_sq()
        a, g = self._parts
        total = torch.zeros(self.batch, dtype=g.dtype, device=g.device)
        if "bias" in self.names:
            total = total + g.sum(1).pow(2).sum(1)
        if "weight" not in self.names:
            return total
        return total + ops.linear_weight_norms_sq(a, g)  # outer product, ghost norm or materialised

    def release(self):
        """Materialised: the base's (keep the per-sample gradients only). Otherwise the sum is
        one GEMM of the inputs and the output gradient: both kept."""
        if self._materialised:
            super().release()
            del self._parts

    def weighted_sum(self, weights):
        if self._materialised:
            return super().weighted_sum(weights)
        a, g = self._parts
        out = {}
        if "weight" in self.names:
            out["weight"] = ops.linear_weight_weighted_sum(a, g, weights).reshape(self.module.weight.shape)
        if "bias" in self.names:
            out["bias"] = torch.tensordot(weights.to(g.dtype), g.sum(1), dims=1)
        return out


class ConvGradients(LinearGradients):
    """Conv1d/Conv2d (one group, zero padding): a linear layer over the unfolded input,
    one row per output position: (B, L, C·k) against the output gradient's (B, L, O)."""

    def _rows(self):
        module, x, g = self.module, self.args[0].to(self.grad_output.dtype), self.grad_output
        if isinstance(module, nn.Conv1d):  # as a 2-D convolution of height 1
            x = x.unsqueeze(-2)
            kernel, dilation, stride = ((1, v[0]) for v in (module.kernel_size, module.dilation, module.stride))
            padding = (0, module.padding[0])
        else:
            kernel, dilation, padding, stride = module.kernel_size, module.dilation, module.padding, module.stride
        columns = torch.nn.functional.unfold(x, kernel, dilation=dilation, padding=padding, stride=stride)
        # row-major (B, L, C·k): the sum's GEMM reads it as (B·L, C·k) without another copy
        return columns.mT.contiguous(), g.reshape(g.shape[0], g.shape[1], -1).mT


class GroupedConvGradients(LayerGradients):
    """A convolution's per-sample weight gradients materialised by `ops.conv_per_sample_weight_grads`:
    one grouped convolution backward (the batch folded into the channels and the groups, as
    torch.func's vmap does), or unfold + one batched GEMM where that costs less (wide inputs
    on small maps)."""

    def _per_sample(self):
        conv, x, g = self.module, self.args[0].to(self.grad_output.dtype), self.grad_output
        out = {}
        if "weight" in self.names:
            out["weight"] = ops.conv_per_sample_weight_grads(
                x, g, list(conv.weight.shape), list(conv.stride), list(conv.padding), list(conv.dilation), conv.groups
            )
        if "bias" in self.names:
            out["bias"] = g.sum(tuple(range(2, g.dim())))
        return out


class EmbeddingGradients(LayerGradients):
    def _tokens(self):
        ids = self.args[0].reshape(self.batch, -1)
        return ids, self.grad_output.reshape(self.batch, ids.shape[1], -1)

    def _per_sample(self):
        """The dense (B, V, D) gradients (only for a table a layer shares): each token's
        row added at its (sample, id) key."""
        ids, g = self._tokens()
        module = self.module
        keys, keep = ops.token_keys(ids, module.num_embeddings, module.padding_idx)
        rows = g.reshape(-1, g.shape[-1])
        if keep is not None:
            keys, rows = keys[keep], rows[keep]
        out = rows.new_zeros(self.batch * module.num_embeddings, rows.shape[1]).index_add_(0, keys, rows)
        return {"weight": out.view(self.batch, *module.weight.shape)}

    def norms_sq(self):
        ids, g = self._tokens()
        return ops.embedding_norms_sq(ids, g, self.module.num_embeddings, self.module.padding_idx)

    def release(self):
        """The sum reads the ids and the output gradient: both kept."""

    def weighted_sum(self, weights):
        ids, g = self._tokens()
        module = self.module
        return {"weight": ops.embedding_weighted_sum(ids, g, weights, module.num_embeddings, module.padding_idx)}


class NormAffineGradients(LayerGradients):
    """LayerNorm and GroupNorm: weight_b = Σ g ⊙ x̂, bias_b = Σ g over the positions each
    affine parameter applies to (x̂ the normalised input, recomputed)."""

    def _per_sample(self):
        x, g, module = self.args[0], self.grad_output, self.module
        if isinstance(module, nn.LayerNorm):
            weight, bias = ops.layer_norm_affine_grads(x, g, len(module.normalized_shape), module.eps)
        else:  # GroupNorm: (B, C, *s), statistics per (sample, group)
            weight, bias = ops.group_norm_affine_grads(x, g, module.num_groups, module.eps)
        out = {"weight": weight, "bias": bias}
        return {name: out[name] for name in self.names}


class MaterializedGradients(LayerGradients):
    """Any layer: each sample's gradient as functx's vmap of the gradient of ⟨output, output
    gradient⟩, the layer called on one sample at a time (as a batch of one)."""

    def _per_sample(self):
        from ..ad import grad
        from ..nn import functional_call
        from ..vmap import vmap

        module, kwargs = self.module, self.kwargs
        params = {n: p.detach() for n, p in module.named_parameters() if n in self.names}
        tensors = [i for i, a in enumerate(self.args) if isinstance(a, Tensor)]
        several = not isinstance(self.grad_output, Tensor)

        def one(g_b, *batched):
            args = list(self.args)
            for i, a_b in zip(tensors, batched):
                args[i] = a_b.unsqueeze(0)

            def paired(params):
                """⟨output, its gradient⟩: its gradient is the vjp with that cotangent (as grad,
                which composes with vmap where vjp does not: an LSTM's zero initial state)."""
                out = functional_call(module, params, tuple(args), kwargs)
                if not several:
                    return (out * g_b.unsqueeze(0)).sum()
                return sum((o * g.unsqueeze(0)).sum() for o, g in zip(out, g_b) if g is not None)

            return grad(paired)(params)

        grad_output = (
            tuple(None if g is None else g.detach() for g in self.grad_output) if several else self.grad_output.detach()
        )
        in_dims = (tuple(None if g is None else 0 for g in grad_output) if several else 0, *(0,) * len(tensors))
        with torch.enable_grad():
            return vmap(one, in_dims=in_dims)(grad_output, *(self.args[i].detach() for i in tensors))


_KERNELS: dict = {}  # layer type -> kernel(module, args, grad_output, kwargs) -> LayerGradients | None


def register_layer_gradients(layer_type: type, kernel=None):
    """Make `kernel` the per-sample gradients of layers of exactly `layer_type` (the habit of
    Opacus's `register_grad_sampler`): `kernel(module, args, grad_output, kwargs)` returns a
    `LayerGradients`, or None where it does not apply to this call (then the layer's
    gradients are materialised). A `LayerGradients` subclass is a kernel itself. Replaces
    what was registered for the type before (functx's own kernels too). As a decorator:
    `@register_layer_gradients(MyLayer)`.

    Example:
        >>> import torch
        >>> from functx.kernels import LayerGradients, layer_gradients, register_layer_gradients
        >>> class Scale(torch.nn.Module):  # y = w * x, elementwise
        ...     def __init__(self, n):
        ...         super().__init__()
        ...         self.weight = torch.nn.Parameter(torch.ones(n))
        ...     def forward(self, x):
        ...         return self.weight * x
        >>> @register_layer_gradients(Scale)
        ... class ScaleGradients(LayerGradients):
        ...     def _per_sample(self):  # sample b's gradient: g_b * x_b
        ...         return {"weight": self.grad_output * self.args[0]}
        >>> x, g = torch.randn(4, 3), torch.randn(4, 3)
        >>> grads = layer_gradients(Scale(3), (x,), g)
        >>> type(grads).__name__, torch.allclose(grads.norms_sq(), (g * x).pow(2).sum(1))
        ('ScaleGradients', True)
    """
    if not isinstance(layer_type, type):
        raise TypeError(f"register_layer_gradients: expected a layer type (a class), got {layer_type!r}")

    def register(kernel):
        if not callable(kernel):
            raise TypeError(f"register_layer_gradients({layer_type.__name__}): the kernel must be callable, got {kernel!r}")
        _KERNELS[layer_type] = kernel
        return kernel

    return register if kernel is None else register(kernel)


def layer_gradients(module: nn.Module, args: tuple, grad_output, kwargs: dict | None = None) -> LayerGradients:
    """The per-sample gradients of `module`'s trainable parameters in one call (positional
    inputs `args`, batch first; keyword inputs `kwargs`, shared; `grad_output` the gradient
    of the summed per-sample losses with respect to the call's output), by the kernel
    registered for the layer's type (`register_layer_gradients`), or materialised for a
    layer without one.

    Example:
        >>> import torch
        >>> from functx.kernels import layer_gradients
        >>> a, g = torch.randn(5, 3), torch.randn(5, 2)  # the layer's input, its output's gradient
        >>> grads = layer_gradients(torch.nn.Linear(3, 2), (a,), g)
        >>> grads.norms_sq().shape  # each sample's squared gradient norm
        torch.Size([5])
        >>> total = grads.weighted_sum(torch.ones(5))  # the sum of the per-sample gradients
        >>> torch.allclose(total["weight"], g.T @ a), torch.allclose(total["bias"], g.sum(0))
        (True, True)
    """
    kernel = _KERNELS.get(type(module))
    if kernel is not None:
        grads = kernel(module, args, grad_output, kwargs)
        if grads is not None:
            return grads
    return MaterializedGradients(module, args, grad_output, kwargs)


# -- functx's own kernels: one call's input and output gradient only (no keyword inputs) ------
def _plain(args, grad_output, kwargs) -> bool:
    return isinstance(grad_output, Tensor) and not kwargs and len(args) == 1


@register_layer_gradients(nn.Linear)
def _linear(module, args, grad_output, kwargs):
    return LinearGradients(module, args, grad_output) if _plain(args, grad_output, kwargs) else None


@register_layer_gradients(nn.Embedding)
def _embedding(module, args, grad_output, kwargs):
    if _plain(args, grad_output, kwargs) and not module.scale_grad_by_freq and module.max_norm is None:
        return EmbeddingGradients(module, args, grad_output)
    return None


def _convolution(module, args, grad_output, kwargs):
    if not (_plain(args, grad_output, kwargs) and _zero_padded(module)):
        return None
    positions = grad_output[0, 0].numel()
    if type(module) is not nn.Conv3d and module.groups == 1 and 2 * positions * positions < module.weight.numel():
        return ConvGradients(module, args, grad_output)  # the ghost norm is cheaper
    # materialised (grouped convolution or unfold, by the operator's measured rule)
    return GroupedConvGradients(module, args, grad_output)


def _norm_affine(module, args, grad_output, kwargs):
    return NormAffineGradients(module, args, grad_output) if _plain(args, grad_output, kwargs) else None


for _conv in (nn.Conv1d, nn.Conv2d, nn.Conv3d):
    register_layer_gradients(_conv, _convolution)
for _norm in (nn.LayerNorm, nn.GroupNorm):
    register_layer_gradients(_norm, _norm_affine)


def _zero_padded(conv) -> bool:
    """Zero padding given as numbers: the module's forward is one convolution of its input."""
    return conv.padding_mode == "zeros" and not isinstance(conv.padding, str)
