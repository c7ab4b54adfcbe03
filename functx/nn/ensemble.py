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
from torch.nn.parameter import is_lazy
from torch.nn.utils._named_member_accessor import NamedMemberAccessor

from ..vmap import vmap
from .functional_call import _swapped, functional_call, require_module, tied_groups
from .stack import stack_state

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
    drawn by one vmapped call with `randomness="different"`: the state of an ensemble, as
    `stack_module_state` returns it for `n` separately built models.

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
    "different".

    Args:
        module (torch.nn.Module): the template model.
        n (int): the number of members, at least 1.
        init (Callable[[nn.Module], None] | None, default None): initialises the module it
            is given in place (runs once, under `vmap`); None: every submodule's
            `reset_parameters()`.

    Returns:
        tuple[dict[str, Tensor], dict[str, Tensor]]: `(params, buffers)`, dicts
        `{name: tensor of shape (n, *shape)}` with the names of
        `module.named_parameters()` / `named_buffers()`. Every tensor is a new leaf;
        parameters require grad as the template's do. Seeded by `torch.manual_seed`
        (the same seed, the same draws), but not the numbers `n` constructor calls would
        draw.

    Raises:
        ValueError: `n` is not a positive int, a bool included ("vmap_init: n must be a
            positive int, got 0").
        TypeError: `module` is not an `nn.Module` ("vmap_init: expected a torch.nn.Module,
            got function (...)"); the error is also an `AttributeError`
            ([error catalogue: modules](../errors.md#modules-functional_call-stack_module_state-make_functional-ensemble)).
        RuntimeError: `init` does what vmap refuses, such as an in-place random op on a
            tensor it made with a plain factory (`torch.empty(2, 4).normal_()`: "vmap:
            Cannot ask for different inplace randomness on an unbatched tensor ...";
            [error catalogue: vmap](../errors.md#vmap-inside-the-function)).

    Examples:
        >>> import torch, functx
        >>> _ = torch.manual_seed(0)
        >>> params, buffers = functx.nn.vmap_init(torch.nn.Linear(100, 3), n=4)
        >>> params["weight"].shape, params["weight"].requires_grad, buffers
        (torch.Size([4, 3, 100]), True, {})
        >>> bool((params["weight"][0] != params["weight"][1]).all())
        True
        >>> bool(params["weight"].abs().max() <= 0.1)  # kaiming uniform: bound 1/sqrt(100)
        True

        A custom `init`, and the ensemble run with `vmap(functional_call)`:

        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.BatchNorm1d(8))
        >>> def init(m):
        ...     torch.nn.init.normal_(m[0].weight, std=0.01)
        ...     torch.nn.init.zeros_(m[0].bias)
        >>> params, buffers = functx.nn.vmap_init(model, 5, init=init)
        >>> bool((params["0.bias"] == 0).all()), buffers["1.running_mean"].shape
        (True, torch.Size([5, 8]))
        >>> def call(params, buffers, x):
        ...     return functx.functional_call(model, (params, buffers), (x,))
        >>> functx.vmap(call, in_dims=(0, 0, None))(params, buffers, torch.randn(4, 3)).shape
        torch.Size([5, 4, 8])

    Differences from torch.func:
        None: torch.func has no `vmap_init`. The nearest is
        `torch.func.stack_module_state([make_model() for _ in range(n)])`, which builds and
        initialises the `n` models one by one.
    """
    require_module(module, "vmap_init")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
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
      models])` would (any pytree of tensors, stacked on dim 0). Keyword args are always
      shared.
    - Gradients of a loss of the output reach the stacked parameters (`loss.backward()`
      then `optimizer.step()` trains all members at once, each with its own gradient).
    - Buffers a forward updates (batch norm running stats in training mode) are updated
      per member, in place in the ensemble's buffers, as N separate modules would be.
      `functional_forward` is the pure version that returns them instead.
    - `len(ensemble)` is N; `ensemble.member(i)` is member i as a standalone module (a
      copy).

    Build from existing models (`Ensemble(models)`; they are copied, not shared), with
    N independently initialised members from one vmapped call
    (`Ensemble.from_factory(make_model, n)`, see `vmap_init`), or from a stacked state
    (`Ensemble.from_state(template, params, buffers)`).

    Args:
        models (Sequence[torch.nn.Module] | torch.nn.ModuleList): the members (any
            iterable of them): of one class, with the same parameter and buffer names,
            shapes, dtypes and `requires_grad`, and every submodule in the same
            training/eval mode. Their tensors are copied.
        in_dims (int | None | tuple, default None): which positional args of the forward
            hold one slice per member: None (every member sees the same input), 0 (all
            positional args split along dim 0), or a tuple with one entry per positional
            arg (as vmap's `in_dims`).
        randomness (str, default "different"): vmap's policy for random ops in the forward
            (dropout): "different" (each member draws its own, as N separate modules
            would), "same" (one draw for all) or "error".

    Raises:
        RuntimeError: at construction, no models, something that is not an `nn.Module`,
            or models that differ (class, submodules, names, shapes, dtypes, a
            submodule's mode, a parameter's `requires_grad`; the message names it and
            starts with "Ensemble: ")
            ([error catalogue: modules](../errors.md#modules-functional_call-stack_module_state-make_functional-ensemble)).
        TypeError: from `from_state` / `from_factory`, a template (or a `make_model()`)
            that is not an `nn.Module` (also an `AttributeError`).
        ValueError: from `from_state`, a stacked state whose names do not match the
            template's, whose leading dims differ, or a stacked tensor whose per-member
            shape or dtype is not the template's tensor's of that name ("Ensemble: the
            stacked state does not match the template: parameter 'weight' is (2, 2, 1),
            torch.float32 in the template but (2, 2), torch.float32 per member ...");
            from `from_factory`, `n` not a positive int. At the forward: positional args that do not fit `in_dims` (a tree
            of another structure, a slice count other than N)
            ([error catalogue: vmap arguments](../errors.md#vmap-arguments)).
        RuntimeError: at the forward, a `randomness` other than the three, or a random op
            under "error"
            ([error catalogue: vmap](../errors.md#vmap-inside-the-function)).

    Examples:
        >>> import torch, functx
        >>> _ = torch.manual_seed(0)
        >>> models = [torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
        ...                               torch.nn.Linear(8, 2)) for _ in range(3)]
        >>> ensemble = functx.nn.Ensemble(models)
        >>> x = torch.randn(5, 4)
        >>> out = ensemble(x)                        # every member sees x
        >>> out.shape, len(ensemble)
        (torch.Size([3, 5, 2]), 3)
        >>> torch.allclose(out[1], models[1](x), atol=1e-6)
        True
        >>> ensemble.stacked[1].running_mean.shape   # per-member running stats, updated
        torch.Size([3, 8])
        >>> opt = torch.optim.SGD(ensemble.parameters(), lr=0.1)
        >>> out.pow(2).mean().backward(); opt.step()
        >>> ensemble.stacked[0].weight.grad.shape
        torch.Size([3, 8, 4])

        One minibatch per member (`in_dims=0`), and one dropout mask per member:

        >>> nets = [torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.Dropout(0.5))
        ...         for _ in range(6)]
        >>> per_member = functx.nn.Ensemble(nets, in_dims=0)
        >>> out = per_member(torch.ones(6, 5, 4))    # member i sees slice i
        >>> out.shape, torch.equal(out[0] == 0, out[1] == 0)
        (torch.Size([6, 5, 2]), False)

        Members initialised independently by one vmapped call:

        >>> fresh = functx.nn.Ensemble.from_factory(lambda: torch.nn.Linear(4, 2), 10)
        >>> fresh(torch.randn(5, 4)).shape, fresh.member(3)
        (torch.Size([10, 5, 2]), Linear(in_features=4, out_features=2, bias=True))

    Differences from torch.func:
        None: torch.func has no `Ensemble`. The nearest is `torch.func.stack_module_state`
        with `torch.func.vmap(torch.func.functional_call)` (torch.func's ensembling
        tutorial), which `Ensemble` packages as a module, writing the members' updated
        buffers back.
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
        params, buffers = stack_state(models, "Ensemble")
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
        require_module(template, "Ensemble.from_factory (what make_model returned)")
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
        (as `stack_module_state` or `vmap_init` return them; used as they are, not copied).
        Every stacked tensor must have the shape `(N, *shape)` and the dtype of the
        template's tensor of that name (`template` may also be another ensemble's
        `stacked` module, whose tensors are themselves stacked): a ValueError names the
        first that does not."""
        require_module(template, "Ensemble.from_state")
        _check_names(template, params, buffers)
        _check_shapes(template, params, buffers)
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


def _check_shapes(template: nn.Module, params: dict[str, Tensor], buffers: dict[str, Tensor]) -> None:
    """Each stacked tensor, less its member dim, has the shape and dtype of the template's
    tensor of that name."""
    for kind, stacked, named in (
        ("parameter", params, template.named_parameters()),
        ("buffer", buffers, template.named_buffers()),
    ):
        for name, t in named:
            if is_lazy(t):  # an uninitialised lazy tensor has no shape to compare yet
                continue
            s = stacked[name]
            shape = t.shape
            if s.dim() == 0 or s.shape[1:] != shape or s.dtype != t.dtype:
                member = f"{tuple(s.shape[1:])}, {s.dtype} per member" if s.dim() else "a 0-dim tensor (no member dim)"
                raise ValueError(
                    f"Ensemble: the stacked state does not match the template: {kind} '{name}' is "
                    f"{tuple(shape)}, {t.dtype} in the template but {member} in the stacked state "
                    f"(stacked shape {tuple(s.shape)})"
                )
