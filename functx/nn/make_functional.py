"""The legacy functorch API: `make_functional`, `make_functional_with_buffers`,
`combine_state_for_ensemble`. New code should prefer `functional_call` and
`stack_module_state`; these are kept so that functorch code runs unchanged."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor
from torch.nn.utils._named_member_accessor import NamedMemberAccessor

from .functional_call import functional_call
from .stack import check_same_models

__all__ = [
    "FunctionalModule",
    "FunctionalModuleWithBuffers",
    "make_functional",
    "make_functional_with_buffers",
    "combine_state_for_ensemble",
]


class FunctionalModule(nn.Module):
    """What `make_functional` returns: `fmodel(params, *args, **kwargs)` runs the
    model's forward with `params` (a sequence, in the order `make_functional` returned
    them) as its parameters.

    Example:
        >>> import torch, functx
        >>> fmodel, params = functx.make_functional(torch.nn.Linear(3, 2))
        >>> isinstance(fmodel, functx.nn.FunctionalModule), [p.shape for p in params]
        (True, [torch.Size([2, 3]), torch.Size([2])])
        >>> fmodel([torch.zeros(2, 3), torch.ones(2)], torch.randn(1, 3))
        tensor([[1., 1.]])
    """

    def __init__(self, stateless_model: nn.Module, param_names: tuple[str, ...]) -> None:
        super().__init__()
        self.stateless_model = stateless_model
        self.param_names = param_names

    def forward(self, params: Iterable[Tensor], *args: Any, **kwargs: Any) -> Any:
        return functional_call(self.stateless_model, _named(self.param_names, params, "params"), args, kwargs)


class FunctionalModuleWithBuffers(nn.Module):
    """What `make_functional_with_buffers` returns:
    `fmodel(params, buffers, *args, **kwargs)`.

    Example:
        >>> import torch, functx
        >>> fmodel, params, buffers = functx.make_functional_with_buffers(torch.nn.BatchNorm1d(2).eval())
        >>> isinstance(fmodel, functx.nn.FunctionalModuleWithBuffers), len(params), len(buffers)
        (True, 2, 3)
        >>> stats = [torch.tensor([1.0, 2.0]), torch.tensor([4.0, 4.0]), buffers[2]]  # mean, var, count
        >>> torch.allclose(fmodel(params, stats, torch.tensor([[3.0, 4.0]])), torch.ones(1, 2))
        True
    """

    def __init__(self, stateless_model: nn.Module, param_names: tuple[str, ...], buffer_names: tuple[str, ...]) -> None:
        super().__init__()
        self.stateless_model = stateless_model
        self.param_names = param_names
        self.buffer_names = buffer_names

    def forward(self, params: Iterable[Tensor], buffers: Iterable[Tensor], *args: Any, **kwargs: Any) -> Any:
        state = (_named(self.param_names, params, "params"), _named(self.buffer_names, buffers, "buffers"))
        return functional_call(self.stateless_model, state, args, kwargs)


def _named(names: tuple[str, ...], values: Iterable[Tensor], what: str) -> dict[str, Tensor]:
    values = tuple(values)
    if len(values) != len(names):
        raise ValueError(f"expected {len(names)} {what} (in the order make_functional returned them), got {len(values)}")
    return dict(zip(names, values))


def _extract(model_copy: nn.Module, named_members) -> tuple[tuple[str, ...], tuple[Tensor, ...]]:
    """Take the (deduplicated) tensors out of `model_copy`, leaving meta-device
    placeholders so the copy holds no memory; tied names get one shared placeholder,
    so `functional_call` still sees them as tied."""
    unique = tuple(named_members(remove_duplicate=True))
    placeholders: dict[int, Tensor] = {}
    accessor = NamedMemberAccessor(model_copy)
    for name, tensor in tuple(named_members(remove_duplicate=False)):
        if id(tensor) not in placeholders:
            placeholder = torch.empty_like(tensor, device="meta")
            placeholders[id(tensor)] = nn.Parameter(placeholder, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else placeholder
        accessor.set_tensor(name, placeholders[id(tensor)])
    names = tuple(name for name, _ in unique)
    return names, tuple(t for _, t in unique)


def make_functional(model: nn.Module, disable_autograd_tracking: bool = False) -> tuple[FunctionalModule, tuple[Tensor, ...]]:
    """Split `model` into a function and its parameters: returns `(fmodel, params)`
    with `fmodel(params, *args, **kwargs) == model(*args, **kwargs)` computed
    functionally (functorch's API).

    `params` are copies of the model's parameters (new leaves; `requires_grad` as in the
    model, or False with `disable_autograd_tracking=True`), in `named_parameters()`
    order; `fmodel` calls a copy of `model`, so `model` itself is never touched. Tied
    parameters appear once. A model with buffers needs `make_functional_with_buffers`.

    Example:
        >>> import torch, functx
        >>> model = torch.nn.Linear(3, 2)
        >>> fmodel, params = functx.make_functional(model)
        >>> x = torch.randn(4, 3)
        >>> torch.allclose(fmodel(params, x), model(x))
        True
        >>> grads = functx.grad(lambda p, x: fmodel(p, x).sum())(params, x)
        >>> [g.shape for g in grads]
        [torch.Size([2, 3]), torch.Size([2])]
    """
    if len(list(model.buffers())) > 0:
        raise RuntimeError(
            "make_functional(model): `model` has buffers. Please use make_functional_with_buffers(model) instead."
        )
    model_copy = copy.deepcopy(model)
    names, params = _extract(model_copy, model_copy.named_parameters)
    if disable_autograd_tracking:
        params = tuple(p.requires_grad_(False) for p in params)
    return FunctionalModule(model_copy, names), params


def make_functional_with_buffers(
    model: nn.Module, disable_autograd_tracking: bool = False
) -> tuple[FunctionalModuleWithBuffers, tuple[Tensor, ...], tuple[Tensor, ...]]:
    """Split `model` into a function, its parameters and its buffers: returns
    `(fmodel, params, buffers)` with `fmodel(params, buffers, *args, **kwargs)` equal
    to `model(*args, **kwargs)` (functorch's API).

    `params` and `buffers` are copies (in `named_parameters()` / `named_buffers()`
    order); `fmodel` calls a copy of `model`, which is never touched. A forward that
    updates buffers in place (batch norm in training mode) updates the given `buffers`.

    Example:
        >>> import torch, functx
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2)).eval()
        >>> fmodel, params, buffers = functx.make_functional_with_buffers(model)
        >>> x = torch.randn(4, 3)
        >>> torch.allclose(fmodel(params, buffers, x), model(x))
        True
    """
    model_copy = copy.deepcopy(model)
    param_names, params = _extract(model_copy, model_copy.named_parameters)
    buffer_names, buffers = _extract(model_copy, model_copy.named_buffers)
    if disable_autograd_tracking:
        params = tuple(p.requires_grad_(False) for p in params)
    return FunctionalModuleWithBuffers(model_copy, param_names, buffer_names), params, buffers


def combine_state_for_ensemble(
    models: Sequence[nn.Module],
) -> tuple[FunctionalModuleWithBuffers, tuple[Tensor, ...], tuple[Tensor, ...]]:
    """Prepare `models` (same class and structure) for ensembling with `vmap`:
    returns `(fmodel, params, buffers)` where every parameter and buffer is stacked
    over the models along a new leading dim (functorch's API). As in functorch the
    stacked tensors do not require grad: call `p.requires_grad_()` to train them.

    Example:
        >>> import torch, functx
        >>> models = [torch.nn.Linear(3, 2) for _ in range(4)]
        >>> fmodel, params, buffers = functx.combine_state_for_ensemble(models)
        >>> x = torch.randn(5, 3)
        >>> functx.vmap(fmodel, in_dims=(0, 0, None))(params, buffers, x).shape
        torch.Size([4, 5, 2])
    """
    models = list(models)
    check_same_models(models, "combine_state_for_ensemble")
    fmodel, _, _ = make_functional_with_buffers(models[0])
    params = tuple(_stack_detached([dict(m.named_parameters())[n] for m in models]) for n in fmodel.param_names)
    buffers = tuple(_stack_detached([dict(m.named_buffers())[n] for m in models]) for n in fmodel.buffer_names)
    return fmodel, params, buffers


def _stack_detached(tensors: list[Tensor]) -> Tensor:
    with torch.no_grad():
        return torch.stack(tensors)
