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
import torch.utils._pytree as pytree
from torch import Tensor

from . import ops


class LayerGradients:
    """Per-sample gradients of `module`'s trainable parameters (its submodules' too) from
    one call, kept implicit: from the call's inputs and its output's gradient, the
    per-sample squared norms (`norms_sq`), weighted sums (`weighted_sum`) and, when asked,
    the per-sample gradients themselves (`per_sample`).

    `layer_gradients` returns one (a subclass with a kernel for the layer's type, or one
    that materialises the gradients by `vmap`); construct one yourself to write a kernel.
    A subclass defines `_per_sample()` -> `{name: (B, *param.shape) tensor}` for the names
    in `self.names` (the base's `norms_sq`, `weighted_sum` and `release` read them), or
    overrides those methods to avoid materialising. It reads `self.module`, `self.args`,
    `self.kwargs`, `self.grad_output`, `self.names` (the trainable parameters' names, as
    `module.named_parameters()` gives them) and `self.batch` (B, from `grad_output`'s
    first tensor; where every entry is None, from the inputs' first tensor). Construction
    computes nothing: it checks `grad_output`'s types and that its tensors have the batch
    first, not their shapes against the layer's output (`layer_gradients` checks those).
    Without trainable parameters `norms_sq` gives zeros of shape (B,).

    Args:
        module (torch.nn.Module): the layer that was called.
        args (tuple | Any): its positional inputs, batch first; anything but a tuple is one
            input (as `functional_call`'s `args`).
        grad_output (Tensor | tuple): the gradient of the summed per-sample losses with
            respect to the call's output: a tensor, or a tuple with one entry per output
            item (None for items without a gradient).
        kwargs (dict | None, default None): its keyword inputs (the same for every sample).

    Raises:
        NotImplementedError: `per_sample`, `norms_sq` or `weighted_sum` of a class that
            neither defines `_per_sample` nor overrides the method (the base class itself).
        TypeError: `grad_output` is neither a tensor nor a tuple or list of tensors and
            Nones.
        ValueError: a tensor of `grad_output` is 0-dim or does not have the batch (its
            first tensor's dim 0) first; every entry is None and `args` holds no tensor
            ([error catalogue: functx.kernels](../errors.md#functxkernels)).

    Examples:
        >>> import torch
        >>> from functx.kernels import LayerGradients, layer_gradients
        >>> _ = torch.manual_seed(0)
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

        What a kernel reads: the trainable parameters' names and the batch size (for a
        tuple output, from the first tensor of `grad_output`).

        >>> call = LayerGradients(torch.nn.Linear(3, 2), (a,), torch.randn(4, 2))
        >>> call.names, call.batch
        (['weight', 'bias'], 4)
        >>> lstm = torch.nn.LSTM(3, 2, batch_first=True)  # output: (out, (h_n, c_n))
        >>> LayerGradients(lstm, (torch.randn(4, 5, 3),), (torch.randn(4, 5, 2), None)).batch
        4

        A kernel for a layer `y = w * x` (elementwise): sample b's gradient is `g_b * x_b`.

        >>> class Scale(torch.nn.Module):
        ...     def __init__(self, n):
        ...         super().__init__()
        ...         self.weight = torch.nn.Parameter(torch.ones(n))
        ...     def forward(self, x):
        ...         return self.weight * x
        >>> class ScaleGradients(LayerGradients):
        ...     def _per_sample(self):
        ...         return {"weight": self.grad_output * self.args[0]}
        >>> x, g = torch.randn(4, 3), torch.randn(4, 3)
        >>> grads = ScaleGradients(Scale(3), (x,), g)
        >>> torch.allclose(grads.norms_sq(), (g * x).pow(2).sum(1))
        True
        >>> torch.allclose(grads.weighted_sum(torch.ones(4))["weight"], (g * x).sum(0))
        True

    Differences from torch.func:
        torch.func has no per-layer kernels: per-sample gradients are
        `vmap(grad(...))` of a `functional_call`, every parameter's gradient made B times.
        Opacus's per-layer grad samplers (`register_grad_sampler`) compute them from the
        layer's activations and backprops, also materialised (in `p.grad_sample`). A
        `LayerGradients` answers norms and weighted sums from the same two inputs lazily, so
        a kernel can skip the B copies (functx's Linear and Embedding kernels do, where that
        takes less memory).
    """

    def __init__(self, module: nn.Module, args: tuple, grad_output, kwargs: dict | None = None):
        self.module = module
        self.args = _as_args(args)
        self.kwargs = kwargs or {}
        self.grad_output = grad_output
        self.names = [n for n, p in module.named_parameters() if p.requires_grad]
        self.batch, self._zeros_dtype, self._zeros_device = _batch_of(module, self.args, grad_output)

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
        if not grads:  # no trainable parameters: zeros, not the int 0 of an empty sum
            return torch.zeros(self.batch, dtype=self._zeros_dtype, device=self._zeros_device)
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

        module, kwargs, batch = self.module, self.kwargs, self.batch
        if not self.names:  # nothing trainable: no per-sample gradients to make
            return {}
        params = {n: p.detach() for n, p in module.named_parameters() if n in self.names}
        tensors = [i for i, a in enumerate(self.args) if isinstance(a, Tensor)]
        for i in tensors:  # each is called one sample at a time
            shape = tuple(self.args[i].shape)
            if not shape or shape[0] != batch:
                raise ValueError(
                    f"layer_gradients: args[{i}] has shape {shape}, whose first dim is not the batch ({batch}, "
                    f"grad_output's first dim): pass the inputs the layer was called with, batch first"
                )
        several = not isinstance(self.grad_output, Tensor)

        def one(g_b, *batched):
            args = list(self.args)
            for i, a_b in zip(tensors, batched):
                args[i] = a_b.unsqueeze(0)

            def paired(params):
                """⟨output, its gradient⟩: its gradient is the vjp with that cotangent (as grad,
                which composes with vmap where vjp does not: an LSTM's zero initial state)."""
                out = functional_call(module, params, tuple(args), kwargs)
                # the output of one sample (a batch of one) against its gradient, reported with B
                _check_fits(
                    module, out, g_b, lambda o: (batch, *o.shape[1:]) if o.dim() else (), lambda g: (batch, *g.shape)
                )
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


class ZeroGradients(LayerGradients):
    """A call whose output no gradient reached (`grad_output` all None): every sample's
    gradient is zero, as autograd reads a None gradient. Nothing is materialised for the
    norms and the sum."""

    def _per_sample(self):
        return {n: torch.zeros((self.batch, *p.shape), dtype=p.dtype, device=p.device) for n, p in self._trainable()}

    def norms_sq(self):
        return torch.zeros(self.batch, dtype=self._zeros_dtype, device=self._zeros_device)

    def weighted_sum(self, weights):
        return {n: torch.zeros_like(p) for n, p in self._trainable()}

    def release(self):
        """Nothing is kept: the sum is zeros."""
        self.args = self.kwargs = self.grad_output = None

    def _trainable(self):
        return [(n, p) for n, p in self.module.named_parameters() if n in self.names]


def _as_args(args) -> tuple:
    """The positional inputs as a tuple: anything but a tuple is one input (as
    `functional_call`'s `args`)."""
    return args if isinstance(args, tuple) else (args,)


def _batch_of(module: nn.Module, args: tuple, grad_output) -> tuple:
    """(B, the dtype and device of zero norms), `grad_output`'s types checked: B from its
    first tensor or, when every entry is None (no gradient reached the output), from the
    inputs' first tensor (both batch first). Zero norms take the gradient's dtype and
    device, or the trainable parameters'."""
    if isinstance(grad_output, Tensor):
        given = [grad_output]
    elif isinstance(grad_output, (tuple, list)):
        wrong = [type(g).__name__ for g in grad_output if g is not None and not isinstance(g, Tensor)]
        if wrong:
            raise TypeError(f"layer_gradients: grad_output's entries must be tensors or None, got {wrong[0]}")
        given = [g for g in grad_output if g is not None]
    else:
        raise TypeError(
            f"layer_gradients: grad_output must be a tensor, or a tuple with one entry per output item (a tensor, "
            f"or None for an item without a gradient), got {type(grad_output).__name__}"
        )
    if given:
        first, source = given[0], "grad_output"
    else:
        inputs = [a for a in pytree.tree_leaves(args) if isinstance(a, Tensor)]
        if not inputs:
            raise ValueError(
                "layer_gradients: every grad_output entry is None (no gradient reached the output: the per-sample "
                "gradients are zero) and args holds no tensor to give the batch size: pass the batch-first inputs "
                "the layer was called with"
            )
        first, source = inputs[0], "args"
    if first.dim() == 0:
        raise ValueError(
            f"layer_gradients: the batch size is read from dim 0 of {source}'s first tensor, which is 0-dim: pass "
            f"tensors with the batch first"
        )
    several = not isinstance(grad_output, Tensor)
    for i, g in enumerate(grad_output if several else (grad_output,)):
        if g is not None and (g.dim() == 0 or g.shape[0] != first.shape[0]):
            where = f"[{i}]" if several else ""
            raise ValueError(
                f"layer_gradients: grad_output{where} has shape {tuple(g.shape)}, whose first dim "
                f"is not the batch ({first.shape[0]}, from grad_output's first tensor): every tensor of grad_output "
                f"must have the batch first (None for an output item without a gradient, or not batch first, as an "
                f"LSTM's (h_n, c_n))"
            )
    params = [p for p in module.parameters() if p.requires_grad and p.is_floating_point()]
    like = first if given and first.is_floating_point() else (params[0] if params else None)
    dtype = like.dtype if like is not None else torch.get_default_dtype()
    return first.shape[0], dtype, like.device if like is not None else first.device


def _check_fits(module: nn.Module, output, grad_output, out_shape=None, grad_shape=None) -> None:
    """Raise unless `grad_output` fits the call's `output`: a tensor of the output's shape
    for a tensor; for a tuple, one entry per item, None or a tensor of the item's shape (None
    for an item that is not a tensor). `out_shape` / `grad_shape`: the shape to compare and
    report for a tensor of each (default: its shape; MaterializedGradients compares one
    sample's and reports them with the batch)."""
    out_shape = out_shape or (lambda t: tuple(t.shape))
    grad_shape = grad_shape or (lambda t: tuple(t.shape))
    layer = type(module).__name__
    fix = "pass the gradient of the loss with respect to the layer's output (the output's shape, batch first)"
    if isinstance(output, Tensor):
        if not isinstance(grad_output, Tensor):
            raise ValueError(
                f"layer_gradients: {layer} returned one tensor, of shape {out_shape(output)}, but grad_output is a "
                f"{type(grad_output).__name__}: {fix}, as one tensor"
            )
        if out_shape(output) != grad_shape(grad_output):
            raise ValueError(
                f"layer_gradients: grad_output has shape {grad_shape(grad_output)}, but {layer}'s output has shape "
                f"{out_shape(output)}: {fix}"
            )
        return
    if not isinstance(output, (tuple, list)):
        raise TypeError(
            f"layer_gradients: {layer} returned {type(output).__name__}; per-sample gradients need a layer that "
            f"returns a tensor or a tuple of tensors"
        )
    if isinstance(grad_output, Tensor) or len(grad_output) != len(output):
        count = len(grad_output) if not isinstance(grad_output, Tensor) else 0
        given = "a tensor" if isinstance(grad_output, Tensor) else f"{count} entr{'y' if count == 1 else 'ies'}"
        raise ValueError(
            f"layer_gradients: {layer} returned a {type(output).__name__} of {len(output)} items, but grad_output has "
            f"{given}: pass a tuple with one entry per item (None for an item without a gradient)"
        )
    for i, (o, g) in enumerate(zip(output, grad_output)):
        if g is None:
            continue
        if not isinstance(o, Tensor):
            raise ValueError(
                f"layer_gradients: {layer}'s output[{i}] is a {type(o).__name__}, not a tensor, but grad_output[{i}] "
                f"is a tensor: per-sample gradients read the output's top-level tensors only; pass None there"
            )
        if out_shape(o) != grad_shape(g):
            raise ValueError(
                f"layer_gradients: grad_output[{i}] has shape {grad_shape(g)}, but {layer}'s output[{i}] has shape "
                f"{out_shape(o)}: {fix}"
            )


_UNKNOWN = object()  # _meta_output: the layer cannot run on the meta device


def _meta_output(module: nn.Module, args: tuple, kwargs: dict):
    """The call's output on the meta device (shapes, no data, no computation), to check
    `grad_output` against; `_UNKNOWN` where the layer cannot run there (an op without a meta
    kernel, a forward that reads values). The forward is called directly (`module.forward`),
    so the layer's own hooks do not run; the module is left as it was. Inputs its forward
    refuses are an error."""
    from ..nn.functional_call import _swapped

    def meta(t):
        return t.detach().to("meta") if isinstance(t, Tensor) else t

    named = (*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False))
    state = {name: meta(t) for name, t in named}
    meta_args, meta_kwargs = pytree.tree_map(meta, (args, kwargs))
    try:
        with torch.no_grad(), _swapped(module, state):
            return module.forward(*meta_args, **meta_kwargs)
    except Exception as error:
        if isinstance(error, NotImplementedError) or "meta" in str(error).lower():
            return _UNKNOWN
        shapes = ", ".join(str(tuple(a.shape)) if isinstance(a, Tensor) else type(a).__name__ for a in args)
        raise ValueError(
            f"layer_gradients: {type(module).__name__} cannot be called on args of shapes [{shapes}]: "
            f"{str(error).rstrip('.')}. Pass the inputs the layer was called with, batch first"
        ) from error


_KERNELS: dict = {}  # layer type -> kernel(module, args, grad_output, kwargs) -> LayerGradients | None


def register_layer_gradients(layer_type: type, kernel=None):
    """Make `kernel` the per-sample gradients of layers of exactly `layer_type` (the habit of
    Opacus's `register_grad_sampler`), for `layer_gradients` and so `functx.dp.clipped_grad`.

    `kernel(module, args, grad_output, kwargs)` returns a `LayerGradients`, or None where it
    does not apply to this call (then the layer's gradients are materialised). A
    `LayerGradients` subclass is a kernel itself. Replaces what was registered for the type
    before (functx's own kernels too); subclasses of `layer_type` are not covered. A
    registration lasts for the process: there is no unregistering. As a decorator:
    `@register_layer_gradients(MyLayer)`.

    Args:
        layer_type (type): the layer class (an `nn.Module` subclass), matched exactly.
        kernel (Callable | None, default None): `kernel(module, args, grad_output, kwargs)`
            -> `LayerGradients | None`; None: return a decorator that registers its
            argument.

    Returns:
        Callable: `kernel` itself, or with `kernel=None` the decorator (which returns what
        it decorates).

    Raises:
        TypeError: `layer_type` is not a class; `kernel` (or what the decorator is applied
            to) is not callable
            ([error catalogue: functx.kernels](../errors.md#functxkernels)).

    Examples:
        >>> import torch
        >>> from functx.kernels import LayerGradients, layer_gradients, register_layer_gradients
        >>> _ = torch.manual_seed(0)
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

        A function kernel that declines some calls (None: materialised instead), here
        sequences, where sample b's gradient sums over the positions:

        >>> def scale_kernel(module, args, grad_output, kwargs):
        ...     return ScaleGradients(module, args, grad_output) if args[0].dim() == 2 else None
        >>> register_layer_gradients(Scale, scale_kernel) is scale_kernel
        True
        >>> x, g = torch.randn(4, 5, 3), torch.randn(4, 5, 3)
        >>> per_sample = layer_gradients(Scale(3), (x,), g).per_sample()
        >>> torch.allclose(per_sample["weight"], (g * x).sum(1), atol=1e-6)
        True

    Differences from torch.func:
        torch.func has no per-layer kernels: per-sample gradients are `vmap(grad(...))` of
        a `functional_call`, for every layer alike. Opacus's `register_grad_sampler` maps a
        layer type to a function of (layer, activations, backprops) that returns the
        materialised per-sample gradients; a functx kernel is called with the call's
        inputs, output gradient and keyword inputs, returns a `LayerGradients` that may
        give norms and weighted sums without materialising, and may decline a call.
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
    """The per-sample gradients of `module`'s trainable parameters in one call, as a
    `LayerGradients`: by the kernel registered for the layer's exact type
    (`register_layer_gradients`), or materialised by functx's `vmap` of the layer's vjp for
    a layer without one (or whose kernel returns None for this call).

    functx's own kernels cover `nn.Linear`, `nn.Embedding` (without `max_norm` or
    `scale_grad_by_freq`), zero-padded `nn.Conv1d`/`Conv2d`/`Conv3d`, `nn.LayerNorm` and
    `nn.GroupNorm`, for calls with one positional input, no keyword inputs and one output
    tensor. These and the materialised fallback do the work on the first call of a method
    (`norms_sq`, `weighted_sum`, `per_sample`), not here.

    `grad_output` must fit the call's output: for a layer with a kernel (whose formulas
    read the shapes) it is checked here, against the output of the layer called on the
    meta device (shapes only, no data; the layer's own forward hooks do not run; a layer
    that cannot run there, an op without a meta kernel, is not checked here); for a
    materialised layer, by its own forward, on the first method call. A None entry means
    that item's gradient is zero (as for autograd); with every entry None the per-sample
    gradients are zero (a `ZeroGradients`: the batch size from `args`' first tensor).

    Args:
        module (torch.nn.Module): the layer that was called.
        args (tuple | Any): its positional inputs, batch first; anything but a tuple is one
            input (`layer_gradients(layer, x, g)` is `layer_gradients(layer, (x,), g)`, as
            for `functional_call`'s `args`).
        grad_output (Tensor | tuple): the gradient of the summed per-sample losses with
            respect to the call's output: a tensor of the output's shape, or, for a tuple
            output, a tuple with one entry per item (None for an item without a gradient
            or that is not a tensor).
        kwargs (dict | None, default None): its keyword inputs (the same for every sample).

    Returns:
        LayerGradients: the call's per-sample gradients, kept implicit.

    Raises:
        TypeError: `grad_output` is neither a tensor nor a tuple or list of tensors and
            Nones; the layer returns something other than a tensor or a tuple.
        ValueError: `grad_output` does not fit the call's output (a shape other than the
            output's, a tuple for a tensor output or the wrong number of entries, a tensor
            for an output item that is not one; the message names the expected and given
            shapes); a tensor of `grad_output` or of `args` (materialised layers) without
            the batch first; the layer's forward refuses `args` (a layer with a kernel);
            every entry of `grad_output` is None and `args` holds no tensor.
        Exception: whatever a registered kernel raises
            ([error catalogue: functx.kernels](../errors.md#functxkernels)).

    Examples:
        >>> import torch
        >>> from functx.kernels import layer_gradients
        >>> _ = torch.manual_seed(0)
        >>> a, g = torch.randn(5, 3), torch.randn(5, 2)  # the layer's input, its output's gradient
        >>> grads = layer_gradients(torch.nn.Linear(3, 2), (a,), g)
        >>> grads.norms_sq().shape  # each sample's squared gradient norm
        torch.Size([5])
        >>> total = grads.weighted_sum(torch.ones(5))  # the sum of the per-sample gradients
        >>> torch.allclose(total["weight"], g.T @ a), torch.allclose(total["bias"], g.sum(0))
        (True, True)

        One input may be given alone; `grad_output` must have the output's shape; a None
        gradient is zero:

        >>> torch.equal(layer_gradients(torch.nn.Linear(3, 2), a, g).norms_sq(), grads.norms_sq())
        True
        >>> layer_gradients(torch.nn.Linear(3, 2), a, torch.randn(5, 3))
        Traceback (most recent call last):
        ...
        ValueError: layer_gradients: grad_output has shape (5, 3), but Linear's output has shape (5, 2): pass the gradient of the loss with respect to the layer's output (the output's shape, batch first)
        >>> layer_gradients(torch.nn.Linear(3, 2), a, (None,)).norms_sq()
        tensor([0., 0., 0., 0., 0.])

        On sequences (B, T, d) the norms match torch.func's per-sample gradients, which
        are not made here (the "ghost norm": T is small next to the weight):

        >>> layer = torch.nn.Linear(16, 8)
        >>> a, g = torch.randn(3, 4, 16), torch.randn(3, 4, 8)
        >>> params = {k: v.detach() for k, v in layer.named_parameters()}
        >>> def paired(p, a_b, g_b):  # <output, output gradient>: its gradient is the vjp
        ...     return (torch.func.functional_call(layer, p, (a_b,)) * g_b).sum()
        >>> ref = torch.func.vmap(torch.func.grad(paired), in_dims=(None, 0, 0))(params, a, g)
        >>> torch.allclose(layer_gradients(layer, (a,), g).norms_sq(),
        ...                sum(v.flatten(1).pow(2).sum(1) for v in ref.values()))
        True

        A layer without a kernel (two inputs) is materialised:

        >>> bilinear = torch.nn.Bilinear(3, 2, 4)
        >>> x1, x2, g = torch.randn(5, 3), torch.randn(5, 2), torch.randn(5, 4)
        >>> per_sample = layer_gradients(bilinear, (x1, x2), g).per_sample()
        >>> torch.allclose(per_sample["weight"], torch.einsum("bo,bi,bj->boij", g, x1, x2), atol=1e-6)
        True

    Differences from torch.func:
        torch.func has no per-layer kernels: per-sample gradients are `vmap(grad(...))` of
        a `functional_call`, every parameter's gradient made B times (as the reference
        above). Opacus computes them per layer type from hooks' activations and backprops,
        into `p.grad_sample`. `layer_gradients` takes one call's inputs and output gradient
        and returns an object that gives the norms and weighted sums without the B copies
        where a kernel allows it.
    """
    return _layer_gradients(module, args, grad_output, kwargs, check=True)


def _layer_gradients(module, args, grad_output, kwargs, check: bool) -> LayerGradients:
    """`layer_gradients`; `check=False` (functx.dp, whose output gradients come from
    autograd, shaped as the outputs) skips the meta-device call that checks `grad_output`'s
    shapes for a layer with a kernel."""
    args = _as_args(args)
    _batch_of(module, args, grad_output)  # grad_output's types, the batch size
    if not isinstance(grad_output, Tensor) and all(g is None for g in grad_output):
        return ZeroGradients(module, args, grad_output, kwargs)
    kernel = _KERNELS.get(type(module))
    if kernel is not None:
        if check:  # kernels read the shapes by formulas: a wrong one gives wrong numbers
            output = _meta_output(module, args, kwargs or {})
            if output is not _UNKNOWN:
                _check_fits(module, output, grad_output)
        grads = kernel(module, args, grad_output, kwargs)
        if grads is not None:
            return grads
    # the layer's own forward, called per sample, checks grad_output's shapes
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
    positions = grad_output.shape[2:].numel()
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
