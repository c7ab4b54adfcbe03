"""`stack_module_state`: the state of M same-shaped models as one batch of tensors,
ready for ensembling with `vmap(functional_call)`."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn
from torch import Tensor

__all__ = ["stack_module_state"]


def stack_module_state(models: Sequence[nn.Module] | nn.ModuleList) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Stack the parameters and the buffers of `models` along a new leading dimension: the
    state of an ensemble, for `vmap(functional_call)` to run all models as one.

    Args:
        models (Sequence[torch.nn.Module] | torch.nn.ModuleList): models of one class, with
            the same parameter and buffer names, shapes and dtypes, and every submodule in
            the same training/eval mode.

    Returns:
        tuple[dict[str, Tensor], dict[str, Tensor]]: `(params, buffers)`, dicts
        `{name: tensor of shape (M, *shape)}` with the names of
        `models[0].named_parameters()` / `named_buffers()`. Every stacked tensor is a new
        leaf, independent of the models (no shared memory, no autograd history); stacked
        parameters require grad when the models' parameters do, so an optimizer can take
        them directly.

    Raises:
        RuntimeError: no models, or models that differ (the message names the parameter,
            buffer or module that differs); a parameter whose `requires_grad` differs
            between the models ("Expected 0.weight from each model to have the same
            .requires_grad", unprefixed as torch.func's)
            ([error catalogue: modules](../errors.md#modules-functional_call-stack_module_state-make_functional-ensemble)).

    Examples:
        >>> import torch, functx
        >>> models = [torch.nn.Linear(3, 2) for _ in range(5)]
        >>> params, buffers = functx.stack_module_state(models)
        >>> params["weight"].shape, params["weight"].is_leaf, params["weight"].requires_grad
        (torch.Size([5, 2, 3]), True, True)
        >>> def call(params, buffers, x):
        ...     return functx.functional_call(models[0], (params, buffers), (x,))
        >>> functx.vmap(call, in_dims=(0, 0, None))(params, buffers, torch.randn(4, 3)).shape
        torch.Size([5, 4, 2])

        Every model on its own minibatch:

        >>> params, buffers = functx.stack_module_state(torch.nn.ModuleList(models))
        >>> functx.vmap(call)(params, buffers, torch.randn(5, 4, 3)).shape
        torch.Size([5, 4, 2])

    Differences from torch.func: none (the same result and errors).
    """
    return stack_state(list(models), "stack_module_state")


def stack_state(models: list[nn.Module], caller: str) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """`stack_module_state(models)` with `caller` naming the API in the errors. The
    requires_grad error is unprefixed for `stack_module_state` (torch.func's exact wording)
    and prefixed with `caller` for the others."""
    check_same_models(models, caller)
    prefix = "" if caller == "stack_module_state" else f"{caller}: "
    all_params = [dict(m.named_parameters()) for m in models]
    all_buffers = [dict(m.named_buffers()) for m in models]
    params = {name: stacked_leaf([p[name] for p in all_params], name, prefix) for name in all_params[0]}
    buffers = {name: stacked_leaf([b[name] for b in all_buffers], name, prefix) for name in all_buffers[0]}
    return params, buffers


def check_same_models(models: list[nn.Module], caller: str) -> None:
    """Raise a RuntimeError naming what differs between `models` (class, training
    mode of any submodule, parameter/buffer names, shapes or dtypes)."""
    if len(models) == 0:
        raise RuntimeError(f"{caller}: Expected at least one model, got 0.")
    first = models[0]
    for i, model in enumerate(models):
        if not isinstance(model, nn.Module):
            raise RuntimeError(f"{caller}: Expected nn.Modules, got {type(model).__name__} at position {i}.")
        if type(model) is not type(first):
            raise RuntimeError(
                f"{caller}: Expected all models to be of the same class, got "
                f"{type(first).__name__} and {type(model).__name__} (model {i})."
            )
    for i, model in enumerate(models[1:], start=1):
        _check_same_modes(first, model, i, caller)
        _check_same_tensors(first.named_parameters(), model.named_parameters(), "parameters", i, caller)
        _check_same_tensors(first.named_buffers(), model.named_buffers(), "buffers", i, caller)


def _check_same_modes(first: nn.Module, model: nn.Module, i: int, caller: str) -> None:
    modes0 = [(name, m.training) for name, m in first.named_modules()]
    modes = [(name, m.training) for name, m in model.named_modules()]
    if [n for n, _ in modes0] != [n for n, _ in modes]:
        raise RuntimeError(f"{caller}: model 0 and model {i} have different submodules.")
    for (name, t0), (_, t) in zip(modes0, modes):
        if t0 != t:
            where = f"submodule '{name}'" if name else "the model"
            raise RuntimeError(
                f"{caller}: Expected all models to have the same training/eval mode: {where} is in "
                f"{'training' if t0 else 'eval'} mode in model 0 and in {'training' if t else 'eval'} mode in model {i}."
            )


def _check_same_tensors(named0, named, kind: str, i: int, caller: str) -> None:
    named0, named = dict(named0), dict(named)
    if list(named0) != list(named):
        only0 = sorted(set(named0) - set(named))
        only = sorted(set(named) - set(named0))
        raise RuntimeError(
            f"{caller}: model 0 and model {i} have different {kind}: only in model 0: {only0}, "
            f"only in model {i}: {only}" + ("" if only0 or only else " (different order)") + "."
        )
    for name, t0 in named0.items():
        t = named[name]
        if t0.shape != t.shape or t0.dtype != t.dtype:
            raise RuntimeError(
                f"{caller}: {kind[:-1]} '{name}' differs between model 0 ({tuple(t0.shape)}, {t0.dtype}) "
                f"and model {i} ({tuple(t.shape)}, {t.dtype})."
            )


def stacked_leaf(tensors: list[Tensor], name: str, prefix: str = "") -> Tensor:
    """`torch.stack(tensors)` as a new leaf that requires grad iff all the tensors do
    (`prefix` starts the error when they differ)."""
    requires_grad = [t.requires_grad for t in tensors]
    if any(requires_grad) and not all(requires_grad):
        raise RuntimeError(f"{prefix}Expected {name} from each model to have the same .requires_grad")
    with torch.no_grad():
        result = torch.stack(tensors)
    return result.requires_grad_(all(requires_grad))
