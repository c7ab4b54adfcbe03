"""Differentially private SGD without per-sample gradients.

DP-SGD needs, per sample, only the norm of its gradient and, for the batch, the clipped sum
Σ_b min(1, C/‖g_b‖) g_b (plus Gaussian noise). `clipped_grad` gets both from one forward and
one backward to the layers' outputs, with functx's per-layer kernels (functx/kernels): the
B copies of every parameter gradient that `vmap(grad)` materialises are never made for
Linear, Embedding, LayerNorm and GroupNorm layers; other layers fall back to `vmap` of their
own vjp.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor

from .kernels import layer_gradients

_CROSS_SAMPLE = (nn.modules.batchnorm._BatchNorm,)
NOISE_CHUNK = 1 << 20  # elements of noise drawn at a time


def clipped_grad(
    module: nn.Module,
    loss_fn,
    inputs,
    targets,
    *,
    max_norm: float,
    noise_multiplier: float = 0.0,
    generator: torch.Generator | None = None,
    params: dict[str, Tensor] | None = None,
) -> tuple[dict[str, Tensor], Tensor]:
    """The DP-SGD gradient of one batch: Σ_b min(1, max_norm / ‖g_b‖) g_b + N(0, (σ·max_norm)²)
    per parameter, where g_b is the gradient of sample b's loss, and the per-sample norms ‖g_b‖.

    Equal to `vmap(grad)` per-sample gradients clipped and summed (the clip factor is
    `max_norm / (‖g_b‖ + 1e-6)`, at most 1, as Opacus's), computed without them.

    Args:
        module: the model; its trainable parameters are the ones differentiated. Layers that
            mix samples (BatchNorm in training mode) are refused.
        loss_fn: `loss_fn(module(*inputs), targets)` -> one loss per sample, shape (B,)
            (e.g. `F.cross_entropy(..., reduction="none")`).
        inputs: a tensor or a tuple of tensors, batch first.
        targets: passed to `loss_fn` as they are.
        max_norm: the clipping norm C.
        noise_multiplier: σ; 0 for no noise.
        generator: for the noise.
        params: functional state instead of the module's own parameters (a dict as for
            `functx.functional_call`: parameters and buffers by name, tied names kept tied):
            the gradient is taken with respect to the parameters given, at their values; the
            module's other parameters are held fixed, and the module is left as it was.

    Returns:
        (grads, norms): parameter name -> the clipped (noised) sum, shaped as the parameter;
        and the (B,) per-sample gradient norms before clipping. `module`'s `.grad` fields are
        not touched.

    Example:
        >>> import torch, functx
        >>> import torch.nn.functional as F
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        >>> x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
        >>> loss = lambda out, y: F.cross_entropy(out, y, reduction="none")
        >>> grads, norms = functx.dp.clipped_grad(model, loss, x, y, max_norm=1.0)
        >>> grads["0.weight"].shape, norms.shape
        (torch.Size([8, 4]), torch.Size([16]))
    """
    if params is not None:
        return _with_state(module, params, loss_fn, inputs, targets, max_norm, noise_multiplier, generator)
    if not isinstance(max_norm, (int, float)) or max_norm <= 0:
        raise ValueError(f"functx.dp.clipped_grad: max_norm must be a positive number, got {max_norm!r}")
    if noise_multiplier < 0:
        raise ValueError(f"functx.dp.clipped_grad: noise_multiplier must be >= 0, got {noise_multiplier!r}")
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    names = {id(p): n for n, p in module.named_parameters() if p.requires_grad}
    per_call = _layer_gradients(module, loss_fn, inputs, targets, names)
    norms, ghost_calls, summed_per_sample = _per_sample_norms(module, inputs, per_call)
    clip = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    grads = _clipped_sums(module, names, clip, ghost_calls, summed_per_sample)
    if noise_multiplier > 0:
        _add_noise(grads, noise_multiplier * max_norm, generator)
    return grads, norms.detach()


def _layer_gradients(module, loss_fn, inputs, targets, names) -> list:
    """One forward recording every parameterised layer's call, one backward to their outputs:
    each call's `layer_gradients` (what it needs to give per-sample norms and weighted sums)."""
    layers = _layers(module)
    calls, losses = _forward(module, layers, loss_fn, inputs, targets, copy_outputs=False)
    if any(_written_since(call) for call in calls):
        # a layer's output (or input) written in place after the call (ReLU(inplace=True)):
        # the gradient of the output as it was is needed; again, handing on a copy
        calls, losses = _forward(module, layers, loss_fn, inputs, targets, copy_outputs=True)
    batch = _batch_size(inputs)
    if not isinstance(losses, Tensor) or losses.shape != (batch,):
        raise ValueError(
            f"functx.dp.clipped_grad: loss_fn must return one loss per sample, shape ({batch},), got "
            f"{tuple(losses.shape) if isinstance(losses, Tensor) else type(losses).__name__}: use the loss "
            f"with reduction='none'"
        )
    _check_parameters_used_in_calls_only(losses, calls, names)
    outputs = [t for call in calls for t in call.outputs()]
    grads = iter(torch.autograd.grad(losses.sum(), outputs, allow_unused=True) if outputs else ())
    per_call = []
    for call in calls:
        received = [next(grads) for _ in call.outputs()]
        received = [torch.zeros_like(t) if g is None else g.detach() for t, g in zip(call.outputs(), received)]
        if isinstance(call.output, Tensor):
            grad_output = received[0]
        else:  # None for the output's non-tensor items
            received = iter(received)
            grad_output = tuple(next(received) if isinstance(o, Tensor) else None for o in call.output)
        per_call.append(layer_gradients(call.layer, call.args, grad_output, call.kwargs))
    return per_call


def _per_sample_norms(module, inputs, per_call):
    """(the (B,) per-sample gradient norms, the calls whose parameters no other call reaches,
    id(parameter) -> its (B, *shape) per-sample gradients for the others). A parameter
    reached by more than one call (a layer called twice, a tied weight) has the sum over the
    calls as its per-sample gradient, whose norm is not the sum of theirs: materialised."""
    reached: dict = {}
    for call in per_call:
        for local in call.names:
            reached.setdefault(id(_member(call.module, local)), []).append(call)
    shared = {pid for pid, seen in reached.items() if len(seen) > 1}
    norms_sq = torch.zeros(_batch_size(inputs), dtype=_dtype(module), device=_device(module, inputs))
    summed_per_sample: dict = {}
    ghost_calls = []
    for call in per_call:
        if any(id(_member(call.module, local)) in shared for local in call.names):
            for local, g in call.per_sample().items():
                pid = id(_member(call.module, local))
                summed_per_sample[pid] = summed_per_sample[pid] + g if pid in summed_per_sample else g
        else:
            norms_sq = norms_sq + call.norms_sq().to(norms_sq.dtype)
            ghost_calls.append(call)
    for g in summed_per_sample.values():
        norms_sq = norms_sq + g.reshape(g.shape[0], -1).pow(2).sum(1).to(norms_sq.dtype)
    return norms_sq.sqrt(), ghost_calls, summed_per_sample


def _clipped_sums(module, names, clip, ghost_calls, summed_per_sample) -> dict[str, Tensor]:
    """Parameter name -> Σ_b clip_b g_b, in the parameters' order (the noise is drawn in it),
    zeros where the loss does not reach."""
    parameters = dict(module.named_parameters())
    sums: dict = {}  # the first contribution kept as it is (no copy)

    def add(name, g):
        g = g.to(parameters[name].dtype)
        sums[name] = g if name not in sums else sums[name].add_(g)

    for call in ghost_calls:
        for local, g in call.weighted_sum(clip).items():
            add(names[id(_member(call.module, local))], g)
    for pid, g in summed_per_sample.items():
        add(names[pid], torch.tensordot(clip.to(g.dtype), g, dims=1))
    return {name: sums[name] if name in sums else torch.zeros_like(p) for name, p in parameters.items() if p.requires_grad}


def _add_noise(grads: dict[str, Tensor], std: float, generator: torch.Generator | None) -> None:
    """Add N(0, std²) noise to every tensor of `grads`, in place and in the dict's order (the
    order fixes which numbers of `generator` each tensor gets: functx.distributed draws the
    same noise as `clipped_grad` by calling this). Non-contiguous entries are replaced by
    contiguous copies first."""
    for name, g in grads.items():
        if not g.is_contiguous():
            g = grads[name] = g.contiguous()
        # drawn in chunks: an embedding's (V, D) noise at once would double its memory
        for chunk in g.view(-1).split(NOISE_CHUNK):
            noise = torch.randn(chunk.shape, generator=generator, dtype=g.dtype, device=g.device)
            chunk.add_(noise, alpha=std)


def _member(module: nn.Module, name: str) -> Tensor:
    """The tensor at a dotted name (`get_parameter` refuses the plain tensors a functional
    state swaps in)."""
    owner, _, attribute = name.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, attribute)


def _with_state(module, params, loss_fn, inputs, targets, max_norm, noise_multiplier, generator):
    """`clipped_grad` at the functional state `params`: the module runs with them swapped in
    (as functional_call swaps them), the given parameters differentiated (detached copies
    that require grad: the caller's tensors are not touched), the others held fixed."""
    from .nn.functional_call import _swapped, _untie

    if not isinstance(params, dict):
        raise TypeError(f"functx.dp.clipped_grad: params must be a dict of name -> tensor, got {type(params).__name__}")
    own = dict(module.named_parameters(remove_duplicate=False))
    given = _untie(module, params)
    values = {name: p.detach() for name, p in own.items()}  # held fixed unless given
    for name, t in given.items():
        values[name] = t.detach().requires_grad_() if name in own and t.is_floating_point() else t
    with _swapped(module, values):
        return clipped_grad(
            module, loss_fn, inputs, targets, max_norm=max_norm, noise_multiplier=noise_multiplier, generator=generator
        )


def _layers(module: nn.Module) -> list:
    """The outermost modules that own trainable parameters directly: each is one layer with
    its submodules (nn.MultiheadAttention reads its `out_proj`'s weight without calling it,
    so a submodule is never trusted to see its own parameters' uses)."""
    layers, covered = [], []
    for name, sub in module.named_modules():
        if isinstance(sub, _CROSS_SAMPLE) and sub.training:
            raise ValueError(
                f"functx.dp.clipped_grad: {name or 'the module'} ({type(sub).__name__}) mixes the samples "
                f"of a batch in training mode, so per-sample gradients are not defined; replace it "
                f"(GroupNorm, LayerNorm) or put it in eval mode"
            )
        if any(name.startswith(prefix) for prefix in covered):
            continue
        if any(p.requires_grad for p in sub.parameters(recurse=False)):
            layers.append(sub)
            covered.append(f"{name}." if name else "")
    return layers


class _Call:
    """One call of a layer: its inputs (detached), its output, and what is needed to check
    them afterwards (versions: written in place since?; the inputs' graph nodes)."""

    __slots__ = ("layer", "args", "kwargs", "output", "versions", "input_nodes")

    def __init__(self, layer, args, kwargs, output):
        self.layer = layer
        self.args = tuple(a.detach() if isinstance(a, Tensor) else a for a in args)
        self.kwargs = {k: v.detach() if isinstance(v, Tensor) else v for k, v in kwargs.items()}
        self.output = output
        inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
        self.versions = [(t, t._version) for t in (*inputs, *self.outputs())]
        self.input_nodes = [a.grad_fn for a in inputs if a.grad_fn is not None]

    def outputs(self) -> list:
        return [self.output] if isinstance(self.output, Tensor) else [o for o in self.output if isinstance(o, Tensor)]


def _written_since(call: _Call) -> bool:
    return any(t._version != version for t, version in call.versions)


def _forward(module, layers, loss_fn, inputs, targets, copy_outputs: bool):
    """The per-sample losses, with every call of `layers` recorded (forward hooks, removed
    after, also on errors). `copy_outputs`: later code gets a copy of each layer's output,
    so that writes into it leave the recorded one as it was."""
    calls: list = []

    batch = _batch_size(inputs)

    def recorder(layer):
        def record(_, args, kwargs, output):
            if not isinstance(output, Tensor) and not (
                isinstance(output, (tuple, list)) and any(isinstance(o, Tensor) for o in output)
            ):
                raise TypeError(
                    f"functx.dp.clipped_grad: {type(layer).__name__} returned {type(output).__name__}; layers "
                    f"owning parameters must return a tensor or a tuple of tensors"
                )
            call = _Call(layer, args, kwargs, output)
            for t in (*(a for a in args if isinstance(a, Tensor)), *call.outputs()):
                if t.dim() == 0 or t.shape[0] != batch:
                    raise ValueError(
                        f"functx.dp.clipped_grad: {type(layer).__name__} was called with or returned a tensor of "
                        f"shape {tuple(t.shape)}, whose first dim is not the batch ({batch}): per-sample gradients "
                        f"need every layer to keep the batch first (e.g. batch_first=True)"
                    )
            calls.append(call)
            if not copy_outputs:
                return None
            if isinstance(output, Tensor):
                return output.clone()
            return type(output)(o.clone() if isinstance(o, Tensor) else o for o in output)

        return record

    hooks = [layer.register_forward_hook(recorder(layer), with_kwargs=True) for layer in layers]
    try:
        with torch.enable_grad():
            losses = loss_fn(module(*inputs), targets)
    finally:
        for hook in hooks:
            hook.remove()
    return calls, losses


def _check_parameters_used_in_calls_only(losses, calls, names) -> None:
    """Walk the autograd graph from the losses, stepping over every recorded call (from its
    output's node to its inputs' nodes): a trainable parameter reached on the way is used
    outside its layer's forward (`h @ layer.weight`), where no kernel sees it. Refuse."""
    if not isinstance(losses, Tensor) or losses.grad_fn is None:
        return
    over = {}
    for call in calls:
        for output in call.outputs():
            if output.grad_fn is not None:
                over.setdefault(output.grad_fn, []).extend(call.input_nodes)
    stack, seen = [losses.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node in over:
            stack.extend(over[node])
            continue
        variable = getattr(node, "variable", None)
        if variable is not None:
            if id(variable) in names:
                raise ValueError(
                    f"functx.dp.clipped_grad: the parameter {names[id(variable)]!r} is used outside the forward of "
                    f"the module that owns it (e.g. `h @ module.weight`), where its per-sample gradients cannot be "
                    f"computed from the module's calls. Use it through a module call (tie weights by assigning the "
                    f"Parameter to another module) instead."
                )
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)


def _batch_size(inputs: tuple) -> int:
    for a in inputs:
        if isinstance(a, Tensor):
            return a.shape[0]
    raise ValueError("functx.dp.clipped_grad: inputs must include a tensor with the batch first")


def _dtype(module: nn.Module):
    for p in module.parameters():
        if p.dtype.is_floating_point:
            return p.dtype
    return torch.get_default_dtype()


def _device(module: nn.Module, inputs: tuple):
    for p in module.parameters():
        return p.device
    return inputs[0].device
