"""Ensembles as one module: N models of one architecture run as a single vmapped call.

`Ensemble` holds the stacked state of its members as its own parameters and buffers
(so optimizers, `state_dict`, `.to()` and `.train()` work as for any module) and runs
`vmap(functional_call)` over them in `forward`. `vmap_init` / `Ensemble.from_factory`
initialise N members independently with one vmapped call.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor
from torch.nn.utils._named_member_accessor import NamedMemberAccessor

from ..vmap import vmap
from .functional_call import _swapped, functional_call, tied_groups
from .stack import check_same_models, stack_module_state

__all__ = ["Ensemble", "vmap_init"]


def reset_all_parameters(module: nn.Module) -> None:
    """The default initialiser: call `reset_parameters()` of every submodule that has one
    (what the constructors of torch's layers do)."""
    for m in module.modules():
        reset = getattr(m, "reset_parameters", None)
        if callable(reset):
            reset()


def vmap_init(
    module: nn.Module,
    n: int,
    init: Callable[[nn.Module], None] | None = None,
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The stacked `(params, buffers)` of `n` independently initialised copies of `module`,
    drawn by one vmapped call with `randomness="different"`.

    `module` is a template: only its structure, shapes, dtypes and devices are used (it is
    left unchanged). `init(m)` initialises a module in place — by default it calls
    `reset_parameters()` of every submodule, which is how torch's layers initialise
    themselves (kaiming-uniform `Linear`/`Conv` weights, ones/zeros batch norm, ...).

    Why not `vmap(make_model, randomness="different")`: a constructor creates *unbatched*
    tensors and then initialises them in place (`nn.init.*_`), and an in-place random op on
    an unbatched tensor cannot give each member its own numbers (vmap refuses it, as
    torch.func does). Here the template's tensors are first stacked `n` times and swapped into
    the module as batched tensors, so `init`'s in-place writes (`uniform_`, `normal_`,
    `zero_`, `fill_`, also through `.data`) land in a batched tensor, each member drawing
    its own numbers. An `init` that re-assigns a tensor built from scratch (`self.w =
    nn.Parameter(torch.randn(...))`) also works: factories draw per member under
    "different". Returned tensors are new leaves; parameters require grad as the
    template's do.

    Example:
        >>> import torch, functx
        >>> params, buffers = functx.nn.vmap_init(torch.nn.Linear(100, 3), n=4)
        >>> params["weight"].shape
        torch.Size([4, 3, 100])
        >>> bool((params["weight"][0] != params["weight"][1]).all())
        True
        >>> bool(params["weight"].abs().max() <= 0.1)  # kaiming uniform: bound 1/sqrt(100)
        True
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"vmap_init: n must be a positive int, got {n!r}")
    init = reset_all_parameters if init is None else init
    template = copy.deepcopy(module)
    param_names = [name for name, _ in template.named_parameters()]
    buffer_names = [name for name, _ in template.named_buffers()]
    requires_grad = {name: p.requires_grad for name, p in template.named_parameters()}
    with torch.no_grad():
        state = {name: _repeat(t, n) for name, t in (*template.named_parameters(), *template.named_buffers())}

    def init_one(state: dict[str, Tensor]) -> dict[str, Tensor]:
        with _swapped(template, state):
            init(template)
            accessor = NamedMemberAccessor(template)
            return {name: accessor.get_tensor(name) for name in state}

    with torch.no_grad():
        new = vmap(init_one, randomness="different")(state)
    params = {name: new[name].detach().requires_grad_(requires_grad[name]) for name in param_names}
    buffers = {name: new[name].detach() for name in buffer_names}
    return params, buffers


def _repeat(t: Tensor, n: int) -> Tensor:
    return t.detach().unsqueeze(0).expand(n, *t.shape).clone()


class Ensemble(nn.Module):
    """N models of one architecture as one module whose forward runs them all in one
    vmapped call and stacks their outputs on dim 0.

    The members' parameters and buffers are stacked (shape `(N, *shape)`) and held by the
    submodule `ensemble.stacked`, a copy of the first model whose tensors were replaced by
    the stacked ones: they are real `nn.Parameter`s / buffers of the ensemble, so
    `ensemble.parameters()` goes to an optimizer, `state_dict()` / `load_state_dict()`,
    `.to()`, `.double()`, `.train()` / `.eval()` work as usual (state-dict keys are
    `"stacked." + name`). Do not call `ensemble.stacked` itself: its tensors have the
    extra member dim.

    - `forward(*args, **kwargs)` returns what `torch.stack([m(*args, **kwargs) for m in
      models])` would (any pytree of tensors, stacked on dim 0). `in_dims` says which
      positional args hold one slice per member: `None` (default: every member sees the
      same input), `0` (all positional args split along dim 0), or a tuple with one
      entry per positional arg (as vmap's `in_dims`). Keyword args are always shared.
    - Gradients of a loss of the output reach the stacked parameters (`loss.backward()`
      then `optimizer.step()` trains all members at once, each with its own gradient).
    - Buffers a forward updates (batch norm running stats in training mode) are updated
      per member, in place in the ensemble's buffers, as N separate modules would be.
      `functional_forward` is the pure version that returns them instead.
    - `randomness` is vmap's policy for random ops in the forward (dropout):
      "different" (default: each member draws its own, as N separate modules would),
      "same" or "error".

    Build from existing models (`Ensemble(models)`; they are copied, not shared) or with
    N independently initialised members from one vmapped call:
    `Ensemble.from_factory(make_model, n)` (see `vmap_init`).

    Example:
        >>> import torch, functx
        >>> models = [torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
        ...                               torch.nn.Linear(8, 2)) for _ in range(3)]
        >>> ensemble = functx.nn.Ensemble(models)
        >>> x = torch.randn(5, 4)
        >>> out = ensemble(x)                        # every member sees x
        >>> out.shape
        torch.Size([3, 5, 2])
        >>> torch.allclose(out[1], models[1](x), atol=1e-6)
        True
        >>> ensemble.stacked[1].running_mean.shape   # per-member running stats, updated
        torch.Size([3, 8])
        >>> opt = torch.optim.SGD(ensemble.parameters(), lr=0.1)
        >>> out.pow(2).mean().backward(); opt.step()
        >>> ensemble.stacked[0].weight.grad.shape
        torch.Size([3, 8, 4])
        >>> per_member = functx.nn.Ensemble.from_factory(lambda: torch.nn.Linear(4, 2), 6, in_dims=0)
        >>> per_member(torch.randn(6, 5, 4)).shape    # member i sees slice i
        torch.Size([6, 5, 2])
    """

    def __init__(
        self,
        models: Sequence[nn.Module] | nn.ModuleList,
        *,
        in_dims: int | None | tuple = None,
        randomness: str = "different",
    ):
        super().__init__()
        models = list(models)
        check_same_models(models, "Ensemble")
        params, buffers = stack_module_state(models)
        self._init_from_state(models[0], params, buffers, in_dims, randomness)

    @classmethod
    def from_factory(
        cls,
        make_model: Callable[[], nn.Module],
        n: int,
        *,
        init: Callable[[nn.Module], None] | None = None,
        in_dims: int | None | tuple = None,
        randomness: str = "different",
    ) -> "Ensemble":
        """An ensemble of `n` members of the architecture `make_model()` builds, each
        initialised independently by one vmapped call of `init` (default: every
        submodule's `reset_parameters()`); see `vmap_init`. `make_model` is called once."""
        template = make_model()
        return cls.from_state(template, *vmap_init(template, n, init), in_dims=in_dims, randomness=randomness)

    @classmethod
    def from_state(
        cls,
        template: nn.Module,
        params: dict[str, Tensor],
        buffers: dict[str, Tensor],
        *,
        in_dims: int | None | tuple = None,
        randomness: str = "different",
    ) -> "Ensemble":
        """An ensemble of the architecture `template` with the stacked `params`/`buffers`
        (as `stack_module_state` or `vmap_init` return them; used as they are, not copied)."""
        ensemble = cls.__new__(cls)
        nn.Module.__init__(ensemble)
        ensemble._init_from_state(template, params, buffers, in_dims, randomness)
        return ensemble

    def _init_from_state(self, template, params, buffers, in_dims, randomness) -> None:
        self.in_dims = in_dims
        self.randomness = randomness
        stacked = copy.deepcopy(template)
        _check_names(stacked, params, buffers)
        sizes = {t.shape[0] for t in (*params.values(), *buffers.values())}
        if len(sizes) > 1:
            raise ValueError(f"Ensemble: stacked tensors have different member counts {sorted(sizes)}")
        for group in tied_groups(stacked):  # tied names share one stacked tensor
            name = next((n for n in group if n in params or n in buffers), None)
            if name is None:
                continue
            is_param = name in params
            value = nn.Parameter(params[name], requires_grad=params[name].requires_grad) if is_param else buffers[name]
            for tied in group:
                owner_name, _, attr = tied.rpartition(".")
                owner = stacked.get_submodule(owner_name)
                (owner._parameters if is_param else owner._buffers)[attr] = value
        self.stacked = stacked
        self._num_members = sizes.pop() if sizes else 0

    def __len__(self) -> int:
        """The number of members."""
        return self._num_members

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        params = dict(self.stacked.named_parameters())
        buffers = dict(self.stacked.named_buffers())
        out, new_buffers = self.functional_forward(params, buffers, *args, **kwargs)
        with torch.no_grad():
            for name, value in new_buffers.items():
                buffers[name].copy_(value)
        return out

    def functional_forward(self, params: dict[str, Tensor], buffers: dict[str, Tensor], *args: Any, **kwargs: Any) -> tuple[Any, dict[str, Tensor]]:
        """Pure forward: `(outputs, new_buffers)` for the stacked `params`/`buffers` given
        (names as in `ensemble.stacked.named_parameters()` / `named_buffers()`; names not
        given use the ensemble's own). Nothing is mutated; `new_buffers` holds every
        buffer after the forward (stacked), e.g. updated running stats. Composes with
        functx transforms (e.g. `functx.grad` over `params`)."""
        module = self.stacked
        params = {**dict(module.named_parameters()), **params}
        buffers = {**dict(module.named_buffers()), **buffers}

        def one_member(params, buffers, args, kwargs):
            return functional_call(module, (params, buffers), args, kwargs, return_state=True)

        run = vmap(one_member, in_dims=(0, 0, self.in_dims, None), randomness=self.randomness)
        return run(params, buffers, args, kwargs)

    def member(self, i: int) -> nn.Module:
        """Member `i` as a standalone module (a copy: its tensors are new leaves)."""
        module = copy.deepcopy(self.stacked)
        accessor = NamedMemberAccessor(module)
        with torch.no_grad():
            for name, p in module.named_parameters():
                accessor.set_tensor(name, nn.Parameter(p[i].clone(), requires_grad=p.requires_grad))
            for name, b in module.named_buffers():
                accessor.set_tensor(name, b[i].clone())
        return module

    def extra_repr(self) -> str:
        return f"members={len(self)}, in_dims={self.in_dims}, randomness={self.randomness!r}"


def _check_names(template: nn.Module, params: dict[str, Tensor], buffers: dict[str, Tensor]) -> None:
    expected_params = [name for name, _ in template.named_parameters()]
    expected_buffers = [name for name, _ in template.named_buffers()]
    if sorted(params) != sorted(expected_params) or sorted(buffers) != sorted(expected_buffers):
        raise ValueError(
            f"Ensemble: the stacked state does not match the template: expected parameters "
            f"{expected_params} and buffers {expected_buffers}, got {sorted(params)} and {sorted(buffers)}"
        )
