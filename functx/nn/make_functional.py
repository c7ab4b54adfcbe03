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

from .functional_call import functional_call, require_module
from .stack import check_same_models

__all__ = [
    "FunctionalModule",
    "FunctionalModuleWithBuffers",
    "make_functional",
    "make_functional_with_buffers",
    "combine_state_for_ensemble",
]


class FunctionalModule(nn.Module):
    """The callable that `make_functional` returns: a module whose forward
    `fmodel(params, *args, **kwargs)` runs `stateless_model(*args, **kwargs)` with the
    tensors `params` in place of the parameters named `param_names`.

    `make_functional` builds it from a copy of the model whose parameters are meta-device
    placeholders, so `fmodel.parameters()` yields those placeholders, not trainable
    tensors: train the `params` it returned. The call goes through `functx.functional_call`,
    so `stateless_model` is left as it was and works under `vmap`, `grad` and the other
    transforms.

    Args:
        stateless_model (torch.nn.Module): the module to run. Parameters and buffers not
            named in `param_names` keep the module's own tensors.
        param_names (tuple[str, ...]): the names (as in `named_parameters()`) of the
            tensors that `forward`'s `params` gives, in that order; one name per tied
            group (a value for it is used for every name tied to it).

    Raises:
        ValueError: `fmodel(params, ...)` got a number of tensors other than
            `len(param_names)` ("expected 2 params (in the order make_functional returned
            them), got 1").
        TypeError: at the call, `stateless_model` is not an `nn.Module`; the errors of
            `functx.functional_call` (a TorchScript module: `RuntimeError`)
            ([error catalogue: modules](../errors.md#modules-functional_call-stack_module_state-make_functional-ensemble)).

    Examples:
        >>> import torch, functx
        >>> model = torch.nn.Linear(3, 2)
        >>> fmodel = functx.nn.FunctionalModule(model, ("weight", "bias"))
        >>> fmodel([torch.zeros(2, 3), torch.ones(2)], torch.randn(1, 3))
        tensor([[1., 1.]])

        A function of the weight only (the bias stays the model's), and its Jacobian:

        >>> of_weight = functx.nn.FunctionalModule(model, ("weight",))
        >>> x = torch.randn(1, 3)
        >>> torch.allclose(of_weight([model.weight], x), model(x))
        True
        >>> functx.jacrev(lambda w: of_weight([w], x))(model.weight).shape
        torch.Size([1, 2, 2, 3])

        What `make_functional` returns:

        >>> fmodel, params = functx.make_functional(model)
        >>> isinstance(fmodel, functx.nn.FunctionalModule), fmodel.param_names
        (True, ('weight', 'bias'))

    Differences from torch.func:
        torch.func has no `FunctionalModule`: it is functorch's, deprecated with
        `make_functional` in favour of `torch.func.functional_call`. functorch's constructor
        also takes a `names_map` of tied names (here `functional_call` finds the ties in the
        module); its forward swaps the tensors into the shared module (here they replace
        the module's for the calling thread only), ignores extra `params` and fails with a
        meta-device error on missing ones (here: a ValueError).
    """

    def __init__(self, stateless_model: nn.Module, param_names: tuple[str, ...]) -> None:
        super().__init__()
        self.stateless_model = stateless_model
        self.param_names = param_names

    def forward(self, params: Iterable[Tensor], *args: Any, **kwargs: Any) -> Any:
        return functional_call(self.stateless_model, _named(self.param_names, params, "params"), args, kwargs)


class FunctionalModuleWithBuffers(nn.Module):
    """The callable that `make_functional_with_buffers` returns: a module whose
    forward `fmodel(params, buffers, *args, **kwargs)` runs
    `stateless_model(*args, **kwargs)` with the tensors `params` and `buffers` in place of
    the parameters named `param_names` and the buffers named `buffer_names`.

    The call goes through `functx.functional_call`: `stateless_model` is left as it was, and
    a forward that updates buffers in place (batch norm in training mode) updates the
    tensors given in `buffers`.

    Args:
        stateless_model (torch.nn.Module): the module to run. Parameters and buffers not
            named keep the module's own tensors.
        param_names (tuple[str, ...]): the names (as in `named_parameters()`) of the
            tensors that `forward`'s `params` gives, in that order.
        buffer_names (tuple[str, ...]): the names (as in `named_buffers()`) of the tensors
            that `forward`'s `buffers` gives, in that order.

    Raises:
        ValueError: `fmodel(params, buffers, ...)` got a number of params or buffers other
            than `len(param_names)` / `len(buffer_names)` ("expected 3 buffers (in the
            order make_functional returned them), got 2").
        TypeError: at the call, `stateless_model` is not an `nn.Module`; the errors of
            `functx.functional_call` (a TorchScript module: `RuntimeError`)
            ([error catalogue: modules](../errors.md#modules-functional_call-stack_module_state-make_functional-ensemble)).

    Examples:
        >>> import torch, functx
        >>> bn = torch.nn.BatchNorm1d(2).eval()
        >>> fmodel = functx.nn.FunctionalModuleWithBuffers(
        ...     bn, ("weight", "bias"), ("running_mean", "running_var"))
        >>> stats = [torch.tensor([1.0, 2.0]), torch.tensor([4.0, 4.0])]  # mean, var
        >>> torch.allclose(fmodel([bn.weight, bn.bias], stats, torch.tensor([[3.0, 4.0]])),
        ...                torch.ones(1, 2))
        True

        Batch norm as a function of its statistics only (no parameters named):

        >>> of_stats = functx.nn.FunctionalModuleWithBuffers(bn, (), ("running_mean", "running_var"))
        >>> torch.allclose(of_stats([], stats, torch.tensor([[3.0, 4.0]])), torch.ones(1, 2))
        True

        What `make_functional_with_buffers` returns; in training mode the forward updates
        the buffers it is given:

        >>> fmodel, params, buffers = functx.make_functional_with_buffers(torch.nn.BatchNorm1d(2))
        >>> isinstance(fmodel, functx.nn.FunctionalModuleWithBuffers), fmodel.buffer_names
        (True, ('running_mean', 'running_var', 'num_batches_tracked'))
        >>> _ = fmodel(params, buffers, torch.tensor([[0.0, 2.0], [2.0, 4.0]]))
        >>> buffers[0]
        tensor([0.1000, 0.3000])

    Differences from torch.func:
        torch.func has no `FunctionalModuleWithBuffers`: it is functorch's, deprecated with
        `make_functional_with_buffers` in favour of `torch.func.functional_call`.
        functorch's constructor also takes the maps of tied names (here
        `functional_call` finds the ties in the module); its forward swaps the tensors
        into the shared module (here they replace the module's for the calling thread
        only), ignores extra tensors and leaves missing ones to fail later or not at all
        (here: a ValueError).
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
    """Split `model` into a function and its parameters (functorch's API): returns
    `(fmodel, params)`, where `fmodel(params, *args, **kwargs)` computes
    `model(*args, **kwargs)` with `params` as the model's parameters.

    New code can call `functx.functional_call` with a dict of the parameters instead; this
    is kept so that functorch code runs unchanged.

    Args:
        model (torch.nn.Module): the model, without buffers (a model with buffers, such as
            batch norm, needs `make_functional_with_buffers`). It is deep-copied and never
            touched.
        disable_autograd_tracking (bool, default False): return `params` with
            `requires_grad=False`: enough for functx's transforms (`grad` tracks its
            inputs itself), and no autograd graph is recorded through them. The model's
            own parameters are unchanged.

    Returns:
        tuple[FunctionalModule, tuple[Tensor, ...]]: `(fmodel, params)`. `params` are
        `nn.Parameter` copies of the model's parameters (new leaves, no memory shared with
        `model`), in `named_parameters()` order, tied parameters once. `fmodel` holds a
        copy of `model` whose parameters are meta-device placeholders.

    Raises:
        RuntimeError: `model` has buffers ("make_functional(model): `model` has buffers.
            Please use make_functional_with_buffers(model) instead.").
        TypeError: `model` is not an `nn.Module` ("make_functional: expected a
            torch.nn.Module, got function (...)"); the error is also an `AttributeError`, as
            functorch raises there
            ([error catalogue: modules](../errors.md#modules-functional_call-stack_module_state-make_functional-ensemble)).

    Examples:
        >>> import torch, functx
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Linear(3, 2)
        >>> fmodel, params = functx.make_functional(model)
        >>> x = torch.randn(4, 3)
        >>> torch.allclose(fmodel(params, x), model(x))
        True
        >>> [p.shape for p in params], params[0] is model.weight
        ([torch.Size([2, 3]), torch.Size([2])], False)

        Per-sample gradients (`vmap` over the batch, `grad` over the params):

        >>> fmodel, params = functx.make_functional(model, disable_autograd_tracking=True)
        >>> def loss(params, x, y):
        ...     return torch.nn.functional.mse_loss(fmodel(params, x[None]), y[None])
        >>> grads = functx.vmap(functx.grad(loss), in_dims=(None, 0, 0))(params, x, torch.randn(4, 2))
        >>> [g.shape for g in grads]
        [torch.Size([4, 2, 3]), torch.Size([4, 2])]

    Differences from torch.func:
        torch.func has no `make_functional`: it is functorch's (`functorch.make_functional`),
        which PyTorch 2.0 deprecated in favour of `torch.func.functional_call`. The same
        results and the same buffers error, but functx's warns nothing (functorch's emits
        a FutureWarning), and its `fmodel` raises a ValueError naming the counts on a
        wrong number of `params` (functorch's ignores extra ones) and runs through
        `functx.functional_call` (the tensors replace the copy's for the calling thread
        only). For a `model` that is not a module functorch fails with "'function' object
        has no attribute 'buffers'"; functx raises a TypeError that says what it expected
        (an `AttributeError` too).
    """
    require_module(model, "make_functional")
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
    """Split `model` into a function, its parameters and its buffers (functorch's
    API): returns `(fmodel, params, buffers)`, where `fmodel(params, buffers, *args,
    **kwargs)` computes `model(*args, **kwargs)` with those tensors as the model's state.

    A forward that updates buffers in place (batch norm in training mode) updates the
    tensors passed as `buffers`; in eval mode, or with `functx.functional_call(...,
    return_state=True)`, the call is pure.

    Args:
        model (torch.nn.Module): the model. It is deep-copied and never touched.
        disable_autograd_tracking (bool, default False): return `params` with
            `requires_grad=False` (buffers never require grad); the model's own parameters
            are unchanged.

    Returns:
        tuple[FunctionalModuleWithBuffers, tuple[Tensor, ...], tuple[Tensor, ...]]:
        `(fmodel, params, buffers)`. `params` (`nn.Parameter`s) and `buffers` are copies
        of the model's (new tensors, no memory shared with `model`), in
        `named_parameters()` / `named_buffers()` order, tied tensors once. `fmodel` holds a
        copy of `model` whose tensors are meta-device placeholders.

    Raises:
        TypeError: `model` is not an `nn.Module` ("make_functional_with_buffers: expected a
            torch.nn.Module, got list (...)"); the error is also an `AttributeError`, as
            functorch raises there
            ([error catalogue: modules](../errors.md#modules-functional_call-stack_module_state-make_functional-ensemble)).

    Examples:
        >>> import torch, functx
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2)).eval()
        >>> fmodel, params, buffers = functx.make_functional_with_buffers(model)
        >>> x = torch.randn(4, 3)
        >>> torch.allclose(fmodel(params, buffers, x), model(x))
        True
        >>> len(params), [b.shape for b in buffers]
        (4, [torch.Size([2]), torch.Size([2]), torch.Size([])])

        Per-sample gradients of a model with buffers (eval mode: the statistics are
        shared, not updated):

        >>> def loss(params, buffers, x):
        ...     return fmodel(params, buffers, x[None]).sum()
        >>> grads = functx.vmap(functx.grad(loss), in_dims=(None, None, 0))(params, buffers, x)
        >>> grads[0].shape
        torch.Size([4, 2, 3])

        In training mode the forward updates the buffers it is given, not the model's:

        >>> bn = torch.nn.BatchNorm1d(2)
        >>> fmodel, params, buffers = functx.make_functional_with_buffers(bn)
        >>> _ = fmodel(params, buffers, torch.tensor([[0.0, 2.0], [2.0, 4.0]]))
        >>> buffers[0], bn.running_mean
        (tensor([0.1000, 0.3000]), tensor([0., 0.]))

    Differences from torch.func:
        torch.func has no `make_functional_with_buffers`: it is functorch's, which PyTorch
        2.0 deprecated in favour of `torch.func.functional_call`. The same results, but
        functx's warns nothing (functorch's emits a FutureWarning), and its `fmodel` raises
        a ValueError naming the counts on a wrong number of tensors (functorch's ignores
        extra ones, and a missing buffer may go unnoticed) and runs through
        `functx.functional_call` (the tensors replace the copy's for the calling thread
        only). For a `model` that is not a module functorch fails with "'function' object
        has no attribute 'named_parameters'"; functx raises a TypeError that says what it
        expected (an `AttributeError` too).
    """
    require_module(model, "make_functional_with_buffers")
    model_copy = copy.deepcopy(model)
    param_names, params = _extract(model_copy, model_copy.named_parameters)
    buffer_names, buffers = _extract(model_copy, model_copy.named_buffers)
    if disable_autograd_tracking:
        params = tuple(p.requires_grad_(False) for p in params)
    return FunctionalModuleWithBuffers(model_copy, param_names, buffer_names), params, buffers


def combine_state_for_ensemble(
    models: Sequence[nn.Module],
) -> tuple[FunctionalModuleWithBuffers, tuple[Tensor, ...], tuple[Tensor, ...]]:
    """Prepare `models` (one class and structure) for ensembling with `vmap`
    (functorch's API): returns `(fmodel, params, buffers)`, every parameter and buffer
    stacked over the models along a new leading dimension, for
    `vmap(fmodel)(params, buffers, ...)` to run all models as one.

    Args:
        models (Sequence[torch.nn.Module]): the models (any iterable of them): of one
            class, with the same parameter and buffer names, shapes and dtypes, and every
            submodule in the same training/eval mode.

    Returns:
        tuple[FunctionalModuleWithBuffers, tuple[Tensor, ...], tuple[Tensor, ...]]:
        `(fmodel, params, buffers)`. `fmodel` is `make_functional_with_buffers(models[0])`'s;
        `params` and `buffers` hold tensors of shape `(M, *shape)` in `fmodel.param_names`
        / `fmodel.buffer_names` order, new tensors that share no memory with the models.
        As in functorch they do not require grad: call `p.requires_grad_()` to train them.
        `fmodel` itself runs one model: call it under `vmap`.

    Raises:
        RuntimeError: no models, something that is not an `nn.Module`, or models that
            differ (class, submodules, parameter or buffer names, shapes, dtypes, or a
            submodule's training/eval mode; the message names what differs)
            ([error catalogue: modules](../errors.md#modules-functional_call-stack_module_state-make_functional-ensemble)).

    Examples:
        >>> import torch, functx
        >>> _ = torch.manual_seed(0)
        >>> models = [torch.nn.Linear(3, 2) for _ in range(4)]
        >>> fmodel, params, buffers = functx.combine_state_for_ensemble(models)
        >>> x = torch.randn(5, 3)
        >>> out = functx.vmap(fmodel, in_dims=(0, 0, None))(params, buffers, x)  # same x
        >>> out.shape, torch.allclose(out[2], models[2](x))
        (torch.Size([4, 5, 2]), True)

        Each model on its own minibatch (`in_dims=0` everywhere), trained through `grad`:

        >>> params = tuple(p.requires_grad_() for p in params)
        >>> def loss(params, xs):
        ...     return functx.vmap(fmodel)(params, buffers, xs).pow(2).mean()
        >>> grads = functx.grad(loss)(params, torch.randn(4, 5, 3))
        >>> [g.shape for g in grads]
        [torch.Size([4, 2, 3]), torch.Size([4, 2])]

        Batch norm and dropout: buffers stacked too, and one dropout mask per model:

        >>> net = lambda: torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4),
        ...                                   torch.nn.Dropout(0.5))
        >>> fmodel, params, buffers = functx.combine_state_for_ensemble([net() for _ in range(3)])
        >>> buffers[0].shape
        torch.Size([3, 4])
        >>> functx.vmap(fmodel, in_dims=(0, 0, None), randomness="different")(
        ...     params, buffers, torch.randn(5, 3)).shape
        torch.Size([3, 5, 4])

    Differences from torch.func:
        torch.func has no `combine_state_for_ensemble`: it is functorch's, which PyTorch
        2.0 deprecated in favour of `torch.func.stack_module_state` (dicts, stacked
        parameters that require grad). functx's warns nothing (functorch's emits a
        FutureWarning), takes any iterable of models, and checks what functorch does not
        (names, shapes, dtypes and every submodule's mode), naming the difference; for a
        non-module it raises a RuntimeError (functorch: an AttributeError).
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
