"""Differentially private SGD without per-sample gradients.

DP-SGD needs, per sample, only the norm of its gradient and, for the batch, the clipped sum
Σ_b min(1, C/‖g_b‖) g_b (plus Gaussian noise). `clipped_grad` gets both from one forward and
one backward to the layers' outputs, with functx's per-layer kernels (functx/kernels): the
B copies of every parameter gradient that `vmap(grad)` materialises are never made for
Linear, Embedding, LayerNorm and GroupNorm layers; other layers fall back to `vmap` of their
own vjp. Each layer's work is done in the backward, as soon as its output's gradient is
made (`_Tap`), so that gradient is freed in its turn, as in Opacus's backward hooks.
"""

from __future__ import annotations

from typing import Any

import collections

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch import Tensor

from .kernels.per_sample import _layer_gradients

_CROSS_SAMPLE = (nn.modules.batchnorm._BatchNorm,)
NOISE_CHUNK = 1 << 16  # elements of noise drawn at a time (a chunk is the transient memory)


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
    `max_norm / (‖g_b‖ + 1e-6)`, at most 1, as Opacus's), computed layer by layer from one
    forward and one backward to the layers' outputs, with functx's per-layer kernels
    (`functx.kernels.layer_gradients`), which avoid making the per-sample gradients where
    they can; layers without a kernel go by `vmap` of their own vjp.
    The sum is not divided by the batch size: divide it yourself for the mean.

    Args:
        module (torch.nn.Module): the model; its trainable parameters are the ones
            differentiated. Every parameterised layer must keep the batch on dim 0 of its
            inputs and outputs and return a tensor or a tuple of tensors; layers that mix
            samples (BatchNorm in training mode) are refused.
        loss_fn (Callable): `loss_fn(module(*inputs), targets)` -> one loss per sample,
            shape (B,) (e.g. `F.cross_entropy(..., reduction="none")`).
        inputs (Tensor | tuple): a tensor or a tuple of positional arguments of the
            forward, batch first; the first tensor among them gives the batch size B.
        targets (Any): passed to `loss_fn` as they are.
        max_norm (float): the clipping norm C (keyword-only), > 0.
        noise_multiplier (float, default 0.0): σ, >= 0; 0 for no noise.
        generator (torch.Generator | None, default None): for the noise, drawn in the order
            of `module.named_parameters()`; None: torch's global generator.
        params (dict[str, Tensor] | None, default None): functional state instead of the
            module's own parameters (a dict as for `functx.functional_call`: parameters and
            buffers by name, tied names kept tied): the gradient is taken with respect to
            the parameters given, at their values; the module's other parameters are held
            fixed, and the module is left as it was.

    Returns:
        tuple[dict[str, Tensor], Tensor]: `(grads, norms)`: parameter name -> the clipped
        (noised) sum, shaped as the parameter (zeros where the loss does not reach it); and
        the (B,) per-sample gradient norms before clipping. `module`'s `.grad` fields are
        not touched.

    Raises:
        ValueError: `max_norm` is not a positive number or `noise_multiplier` is not a
            number >= 0 (a bool, None or NaN is refused; checked before any work);
            `loss_fn` does not return shape (B,) (a reduced loss); a BatchNorm layer in
            training mode; a layer whose input or output does not have the batch first; a
            parameter used outside the forward of the module that owns it (`h @ layer.weight`);
            the loss depends on a tensor nested in a layer's output (an LSTM's `(h_n, c_n)`);
            `inputs` holds no tensor.
        TypeError: `params` is not a dict; a parameterised layer returns something other
            than a tensor or a tuple of tensors (a dict)
            ([error catalogue: functx.dp.clipped_grad](../errors.md#functxdpclipped_grad)).

    Examples:
        >>> import torch, functx
        >>> import torch.nn.functional as F
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        >>> x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
        >>> loss = lambda out, y: F.cross_entropy(out, y, reduction="none")
        >>> grads, norms = functx.dp.clipped_grad(model, loss, x, y, max_norm=1.0)
        >>> grads["0.weight"].shape, norms.shape
        (torch.Size([8, 4]), torch.Size([16]))

        The same as torch.func's per-sample gradients, clipped and summed:

        >>> params = {k: v.detach() for k, v in model.named_parameters()}
        >>> def sample_loss(p, xb, yb):
        ...     return loss(torch.func.functional_call(model, p, (xb[None],)), yb[None]).sum()
        >>> per_sample = torch.func.vmap(torch.func.grad(sample_loss), in_dims=(None, 0, 0))(params, x, y)
        >>> ref_norms = torch.cat([g.flatten(1) for g in per_sample.values()], 1).norm(dim=1)
        >>> clip = (1.0 / (ref_norms + 1e-6)).clamp(max=1.0)
        >>> torch.allclose(norms, ref_norms)
        True
        >>> all(torch.allclose(grads[k], torch.einsum("b,b...->...", clip, g), atol=1e-6) for k, g in per_sample.items())
        True

        Noise: N(0, (σ·C)²) from `generator`, parameter by parameter; with `params`, only
        the parameters given are differentiated:

        >>> noisy, _ = functx.dp.clipped_grad(model, loss, x, y, max_norm=1.0, noise_multiplier=0.5,
        ...                                   generator=torch.Generator().manual_seed(1))
        >>> gen = torch.Generator().manual_seed(1)
        >>> all(torch.allclose(noisy[k], g + 0.5 * torch.randn(g.shape, generator=gen), atol=1e-6) for k, g in grads.items())
        True
        >>> head, _ = functx.dp.clipped_grad(model, loss, x, y, max_norm=1.0, params={"2.weight": torch.zeros(3, 8)})
        >>> list(head), torch.equal(model[2].weight, params["2.weight"])  # the module is unchanged
        (['2.weight'], True)

    Differences from torch.func:
        torch.func has no DP-SGD. With torch.func one materialises the B per-sample
        gradients (`vmap(grad(...))` of a `functional_call`, as above), clips, sums and adds
        noise by hand, or uses Opacus (`PrivacyEngine`, per-sample gradients in
        `p.grad_sample`). `functx.dp.clipped_grad` returns the clipped, noised sum and the
        norms as tensors, computed per layer from its input and output gradient (as Opacus's
        ghost clipping): a layer's B gradient copies are made only where they are no larger
        than those, or where it has no kernel. It leaves `.grad` alone and does no privacy
        accounting (track ε with an accountant such as Opacus's).
    """
    _check_clip_arguments(max_norm, noise_multiplier, "functx.dp.clipped_grad")
    if params is not None:
        return _with_state(module, params, loss_fn, inputs, targets, max_norm, noise_multiplier, generator)
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    names = {id(p): n for n, p in module.named_parameters() if p.requires_grad}
    calls = _layer_calls(module, loss_fn, inputs, targets, names)
    norms, summed_per_sample = _per_sample_norms(module, inputs, calls)
    clip = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    grads = _clipped_sums(module, names, clip, calls, summed_per_sample)
    if noise_multiplier > 0:
        _add_noise(grads, noise_multiplier * max_norm, generator)
    return grads, norms.detach()


def _check_clip_arguments(max_norm, noise_multiplier, api: str) -> None:
    """DP-SGD's settings, checked before any work (by `clipped_grad` and functx.distributed's
    `clipped_grad` and `noised_sum`; `api` names the function in the message): a real number
    (not a bool) > 0 for `max_norm`, >= 0 for `noise_multiplier` (NaN fails both)."""
    def number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    if not number(max_norm) or not max_norm > 0:
        raise ValueError(f"{api}: max_norm must be a positive number, got {max_norm!r}")
    if not number(noise_multiplier) or not noise_multiplier >= 0:
        raise ValueError(f"{api}: noise_multiplier must be a number >= 0, got {noise_multiplier!r}")


def _layer_calls(module, loss_fn, inputs, targets, names) -> list:
    """One forward recording every parameterised layer's call, one backward through them,
    each call's per-sample work (`_Call.receive`) done when its output's gradient arrives."""
    layers = _layers(module)
    anchor = torch.zeros((), requires_grad=True)  # what the backward is taken to (`_Tap`)
    calls, losses = _forward(module, layers, loss_fn, inputs, targets, anchor, copy_inputs=False)
    if any(_written_since(call) for call in calls):
        # a layer's input written in place after the call: record copies instead
        calls, losses = _forward(module, layers, loss_fn, inputs, targets, anchor, copy_inputs=True)
    batch = _batch_size(inputs)
    if not isinstance(losses, Tensor) or losses.shape != (batch,):
        raise ValueError(
            f"functx.dp.clipped_grad: loss_fn must return one loss per sample, shape ({batch},), got "
            f"{tuple(losses.shape) if isinstance(losses, Tensor) else type(losses).__name__}: use the loss "
            f"with reduction='none'"
        )
    _check_parameters_used_in_calls_only(losses, calls, names)
    for call in calls:  # the inputs themselves, and the graph, are the backward's to free
        call.versions = call.input_nodes = None
    _mark_shared(calls)
    if losses.requires_grad and any(call.node is not None for call in calls):
        torch.autograd.grad(losses.sum(), anchor, allow_unused=True)
    for call in calls:
        if call.norms_sq is None and call.per_sample is None:  # no gradient reached it
            call.receive((None,) * len(call.tapped))
    return calls


def _mark_shared(calls) -> None:
    """A parameter reached by more than one call (a layer called twice, a tied weight) has
    the sum over the calls as its per-sample gradient, whose norm is not the sum of theirs:
    those calls' per-sample gradients are materialised."""
    ids = [_trainable_ids(call.layer) for call in calls]
    reached = collections.Counter(pid for call_ids in ids for pid in call_ids)
    for call, call_ids in zip(calls, ids):
        call.shared = any(reached[pid] > 1 for pid in call_ids)


def _trainable_ids(layer: nn.Module) -> list:
    """id() of the layer's trainable parameters (as `LayerGradients.names`; a functional
    state's swapped-in tensors included)."""
    return [id(_member(layer, n)) for n, p in layer.named_parameters() if p.requires_grad]


def _per_sample_norms(module, inputs, calls):
    """(the (B,) per-sample gradient norms, id(parameter) -> its (B, *shape) per-sample
    gradients summed over the calls, for the shared parameters)."""
    norms_sq = torch.zeros(_batch_size(inputs), dtype=_dtype(module), device=_device(module, inputs))
    summed_per_sample: dict = {}
    for call in calls:
        if call.shared:
            for local, g in call.per_sample.items():
                pid = id(_member(call.layer, local))
                summed_per_sample[pid] = summed_per_sample[pid] + g if pid in summed_per_sample else g
        else:
            norms_sq = norms_sq + call.norms_sq.to(norms_sq.dtype)
    for g in summed_per_sample.values():
        norms_sq = norms_sq + g.reshape(g.shape[0], -1).pow(2).sum(1).to(norms_sq.dtype)
    return norms_sq.sqrt(), summed_per_sample


def _clipped_sums(module, names, clip, calls, summed_per_sample) -> dict[str, Tensor]:
    """Parameter name -> Σ_b clip_b g_b, in the parameters' order (the noise is drawn in it),
    zeros where the loss does not reach."""
    parameters = dict(module.named_parameters())
    sums: dict = {}  # the first contribution kept as it is (no copy)

    def add(name, g):
        g = g.to(parameters[name].dtype)
        sums[name] = g if name not in sums else sums[name].add_(g)

    for call in calls:
        if not call.shared:
            for local, g in call.gradients.weighted_sum(clip).items():
                add(names[id(_member(call.layer, local))], g)
            call.gradients = None  # its inputs and output gradient, freed before the noise
    for pid in list(summed_per_sample):
        g = summed_per_sample.pop(pid)
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
    layers: list = []
    covered: list = []
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
    """One call of a layer: its inputs (detached), where its output's differentiable
    tensors are (`tapped`: their positions in the output's flattened leaves), and, once
    their gradients arrive, the call's per-sample work: its squared norms and what its
    weighted sum reads (`gradients`), or for a shared parameter its per-sample gradients."""

    __slots__ = (
        "layer", "args", "kwargs", "versions", "input_nodes", "structure", "tapped", "templates",
        "node", "shared", "gradients", "norms_sq", "per_sample",
    )  # fmt: skip

    def __init__(self, layer, args, kwargs, output, copy_inputs: bool):
        keep = (lambda t: t.detach().clone()) if copy_inputs else (lambda t: t.detach())
        self.layer = layer
        self.args: Any = tuple(keep(a) if isinstance(a, Tensor) else a for a in args)
        self.kwargs: Any = {k: keep(v) if isinstance(v, Tensor) else v for k, v in kwargs.items()}
        inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
        self.versions = [(t, t._version) for t in inputs]
        self.input_nodes = [a.grad_fn for a in inputs if a.grad_fn is not None]
        leaves, _ = pytree.tree_flatten(output)
        self.tapped = [i for i, t in enumerate(leaves) if isinstance(t, Tensor) and t.requires_grad]
        self.templates = {i: (t.shape, t.dtype, t.device) for i, t in enumerate(leaves) if isinstance(t, Tensor)}
        # output -> which leaves are its top-level tensors (the ones a kernel reads): None
        # for a top-level item that is not a tensor (a nested tuple: an LSTM's (h_n, c_n))
        self.structure: Any = 0  # one tensor; else, per top-level item, its first leaf (None: not a tensor)
        if not isinstance(output, Tensor):
            structure: list[int | None] = []
            at = 0
            for item in output:
                structure.append(at if isinstance(item, Tensor) else None)
                at += len(pytree.tree_flatten(item)[0])
            self.structure = structure
        self.node: Any = None
        self.gradients: Any = None
        self.norms_sq: Any = None
        self.per_sample: Any = None
        self.shared = False

    def receive(self, grads: tuple) -> None:
        """The gradients of the tapped leaves (None where the loss does not reach): the
        per-sample work, after which the output gradient is dropped unless the weighted sum
        reads it (LayerGradients.release)."""
        received = dict(zip(self.tapped, grads))
        nested = [i for i, g in received.items() if g is not None and i not in self._top_level()]
        if nested:
            raise ValueError(
                f"functx.dp.clipped_grad: the loss depends on a tensor nested inside {type(self.layer).__name__}'s "
                f"output (in a tuple within it, as an LSTM's (h_n, c_n)); per-sample gradients read only the "
                f"output's top-level, batch-first tensors: use those instead (for a one-layer, one-direction "
                f"LSTM, output[:, -1] is h_n[-1])"
            )

        def grad_of(leaf):
            if received.get(leaf) is not None:
                return received[leaf]
            shape, dtype, device = self.templates[leaf]  # not reached: zeros
            return torch.zeros(shape, dtype=dtype, device=device)

        if self.structure == 0:
            grad_output = grad_of(0)
        else:
            grad_output = tuple(None if leaf is None else grad_of(leaf) for leaf in self.structure)
        # autograd made grad_output, shaped as the output: no meta-device check of its shapes
        gradients = _layer_gradients(self.layer, self.args, grad_output, self.kwargs, check=False)
        self.args = self.kwargs = None
        if self.shared:
            self.per_sample = gradients.per_sample()
        else:
            self.norms_sq = gradients.norms_sq()
            gradients.release()
            self.gradients = gradients

    def _top_level(self) -> set:
        return {0} if self.structure == 0 else {leaf for leaf in self.structure if leaf is not None}


def _written_since(call: _Call) -> bool:
    return any(t._version != version for t, version in call.versions)


class _Tap(torch.autograd.Function):
    """Identity on a layer call's differentiable output tensors, whose backward hands their
    gradients to the call (`_Call.receive`) as autograd makes them: each layer's per-sample
    work is done in its turn and its output gradient freed, rather than every output and
    its gradient held until one backward returns. The outputs are copies (the caller may
    write into them in place, which a view made here may not be). `anchor`, a leaf input
    of every tap, is what the backward is taken to, so autograd runs exactly the nodes from
    the loss down to the taps: no parameter's gradient, nothing below the first layer."""

    @staticmethod
    def forward(ctx, call, anchor, *outputs):
        ctx.call = call
        ctx.set_materialize_grads(False)
        return tuple(o.clone() for o in outputs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.call.receive(grads)
        return (None, None, *grads)


def _forward(module, layers, loss_fn, inputs, targets, anchor, copy_inputs: bool):
    """The per-sample losses, with every call of `layers` recorded and its output's
    differentiable tensors passed on through a `_Tap` (forward hooks, removed after, also on
    errors). `copy_inputs`: record copies of the layers' inputs (written in place later)."""
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
            tops = [output] if isinstance(output, Tensor) else [o for o in output if isinstance(o, Tensor)]
            for t in (*(a for a in args if isinstance(a, Tensor)), *tops):
                if t.dim() == 0 or t.shape[0] != batch:
                    raise ValueError(
                        f"functx.dp.clipped_grad: {type(layer).__name__} was called with or returned a tensor of "
                        f"shape {tuple(t.shape)}, whose first dim is not the batch ({batch}): per-sample gradients "
                        f"need every layer to keep the batch first (e.g. batch_first=True)"
                    )
            call = _Call(layer, args, kwargs, output, copy_inputs)
            calls.append(call)
            if not call.tapped:
                return None
            leaves, spec = pytree.tree_flatten(output)
            tapped = _Tap.apply(call, anchor, *(leaves[i] for i in call.tapped))
            call.node = tapped[0].grad_fn
            for i, t in zip(call.tapped, tapped):
                leaves[i] = t
            return pytree.tree_unflatten(leaves, spec)

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
    over = {call.node: call.input_nodes for call in calls if call.node is not None}
    stack: list[Any] = [losses.grad_fn]
    seen: set = set()
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
