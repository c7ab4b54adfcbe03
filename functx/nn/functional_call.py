"""`functional_call`: call a module with parameters and buffers given as data.

The module's own tensors are replaced by the given ones for the duration of one call, for
the calling thread only (per_thread.py), and are back afterwards (also when the call
raises). The given values may be
level tensors of any functx transform (BatchedTensors, grad/jvp wrappers): the module's
forward then runs on them like on any other tensor, which is what makes
`vmap(grad(loss))` over `functional_call` give per-sample gradients.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from typing import Any, Iterator, cast

import torch
import torch.nn as nn
from torch import Tensor
from torch.nn.utils._named_member_accessor import NamedMemberAccessor

from ..core.container_kinds import in_use
from ..core.errors import user_facing
from ..core.containers import is_container
from ..core.recompute import register_context
from .per_thread import rnn_modules, substituted

__all__ = ["functional_call"]


@user_facing
def functional_call(
    module: nn.Module,
    parameter_and_buffer_dicts: dict[str, Tensor] | Sequence[dict[str, Tensor]],
    args: Any = None,
    kwargs: dict[str, Any] | None = None,
    *,
    tie_weights: bool = True,
    strict: bool = False,
    return_state: bool = False,
) -> Any:
    """Call `module` with its parameters and buffers replaced by the given tensors: the
    module's computation as a pure function of its state (what `vmap`, `grad` and ensembles
    transform).

    `functional_call(module, params, x)` computes `module(x)` as if the module's tensors
    were those in `params`, for this call only: afterwards the module holds its own
    parameter and buffer objects again. The given tensors can be anything a transform
    passes (batched, differentiated), which is how `grad` differentiates a module's
    parameters and `vmap(grad(...))` gives per-sample gradients.

    How it behaves:

    - **Names** are those of `module.named_parameters()` and `module.named_buffers()`
      (`"0.weight"`, `"bn.running_mean"`); names not given keep the module's own tensor.
      Parameters and buffers can come in separate dicts (a tuple or list of dicts with
      distinct keys).
    - **`args`**: a tuple is the positional arguments; anything else is the one positional
      argument (pass a tuple argument as `((t1, t2),)`).
    - **Tied weights** (one tensor under two names, `decoder.weight = encoder.weight`):
      with `tie_weights=True` a value given for one name is used for all names of the
      group, and different values for names of one group raise. With
      `tie_weights=False` each name takes only its own value and the others keep the
      module's tensor.
    - **Writes**: a forward that updates a buffer in place (batch-norm running statistics
      in training mode) updates the tensor that was passed; one that re-assigns an
      attribute (`self.count = self.count + 1`) stores the new value in the passed dict
      under that name. The module itself is not changed. `return_state=True` makes the
      call pure instead.
    - **Parametrizations** (`torch.nn.utils.parametrize`): a value for `"weight"` is used
      as the weight itself, bypassing the parametrization (which must then define
      `right_inverse`, as in torch.func); a value for
      `"parametrizations.weight.original"` goes through the parametrization.
    - **Gradients**: pass detached tensors (`{k: v.detach() for k, v in
      model.named_parameters()}`) when you differentiate with `grad` and need no
      `torch.autograd` graph outside it: the gradients then keep no graph, which saves
      memory and time.

    Args:
        module (torch.nn.Module): the module to call. It is left as it was: the same
            parameter and buffer objects, also when its forward raises.
        parameter_and_buffer_dicts (dict[str, Tensor] | Sequence[dict[str, Tensor]]): a
            dict `{name: tensor}` (names as in `module.named_parameters()` /
            `named_buffers()`), or a tuple/list of such dicts with distinct keys. Names not
            given keep the module's own tensor. A TensorDict (`TensorDict.from_module`,
            `TensorDictParams`) works as the dict of its flattened keys (`"0.weight"`).
        args (Any, default None): one positional argument, or a tuple of them.
        kwargs (dict[str, Any] | None, default None): keyword arguments of the forward.
        tie_weights (bool, default True): names that share one tensor in `module` (tied
            weights) keep sharing: a value given for one of them is used for all. With
            False each name takes only its own value.
        strict (bool, default False): the given names must be exactly the module's
            parameters and buffers.
        return_state (bool, default False): make the call pure: the forward runs on clones
            of the buffers (given or not), and the call returns `(output, new_buffers)` with
            every buffer's value after the forward (updated batch-norm statistics), without
            mutating the passed tensors, the dicts or the module. Parameters are not cloned.

    Returns:
        Any: the module's output, or `(output, new_buffers)` with `return_state=True`.
        As in torch.func, without `return_state` a forward that updates a buffer in place
        (batch-norm running stats in training mode) updates the tensor that was passed, and
        one that re-assigns an attribute (`self.count = self.count + 1`) writes the new
        value into the passed dict under that key.

    Raises:
        ValueError: a key in two dicts; different values for names of one tied group
            ("... which are tied. Consider using tie_weights=False").
        RuntimeError: with `strict=True`, missing or unexpected keys (listed).
        TypeError: `module` is not an `nn.Module`
            ([error catalogue: modules](../errors.md#modules-functional_call-stack_module_state-make_functional-ensemble)).

    Examples:
        Other weights for one call; the module keeps its own:

        >>> import torch, functx
        >>> model = torch.nn.Linear(3, 2)
        >>> params = {k: torch.zeros_like(v) for k, v in model.named_parameters()}
        >>> functx.functional_call(model, params, torch.ones(1, 3))
        tensor([[0., 0.]])
        >>> bool(model.weight.abs().sum() > 0)
        True

        Parameters and buffers in separate dicts, and `strict`:

        >>> import torch, functx
        >>> class Affine(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.weight = torch.nn.Parameter(torch.randn(1, 1))
        ...         self.register_buffer("shift", torch.randn(1))
        ...     def forward(self, x):
        ...         return self.weight @ x + self.shift
        >>> mod, x = Affine(), torch.tensor([[5.0]])
        >>> functx.functional_call(mod, ({"weight": torch.ones(1, 1)}, {"shift": torch.zeros(1)}), x).item()
        5.0
        >>> try:
        ...     functx.functional_call(mod, {"weight": torch.ones(1, 1)}, x, strict=True)
        ... except RuntimeError as error:
        ...     print("Missing key(s): 'shift'" in str(error))
        True

        Tied weights (`foo_tied` is `foo`):

        >>> import torch, functx
        >>> class Tied(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.foo = torch.nn.Parameter(torch.tensor(1.0))
        ...         self.foo_tied = self.foo
        ...     def forward(self, x):
        ...         return x + self.foo + self.foo_tied
        >>> mod, zero = Tied(), torch.tensor(0.0)
        >>> mod(zero).item()
        2.0
        >>> functx.functional_call(mod, {"foo": zero}, zero).item()  # foo_tied follows foo
        0.0
        >>> functx.functional_call(mod, {"foo": zero}, zero, tie_weights=False).item()  # foo_tied stays 1
        1.0
        >>> functx.functional_call(mod, {"foo": zero, "foo_tied": zero}, zero).item()
        0.0

        Writes in the forward land in the passed tensors and dict, not in the module:

        >>> import torch, functx
        >>> class Counter(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.register_buffer("count", torch.tensor(0.0))
        ...     def forward(self, x):
        ...         self.count = self.count + 1
        ...         return x + self.count
        >>> mod, state = Counter(), {"count": torch.tensor(0.0)}
        >>> functx.functional_call(mod, state, torch.tensor(0.0)).item(), state["count"].item(), mod.count.item()
        (1.0, 1.0, 0.0)
        >>> bn, batch = torch.nn.BatchNorm1d(2), torch.tensor([[0.0, 2.0], [2.0, 4.0]])
        >>> stats = {k: v.clone() for k, v in bn.named_buffers()}
        >>> _ = functx.functional_call(bn, stats, batch)
        >>> torch.allclose(stats["running_mean"], 0.1 * batch.mean(0)), bn.running_mean.tolist()
        (True, [0.0, 0.0])

        Pure batch norm (`return_state`): the passed state is left as it was:

        >>> import torch, functx
        >>> bn = torch.nn.BatchNorm1d(2)
        >>> state = {k: v.clone() for k, v in bn.named_buffers()}
        >>> out, new_state = functx.functional_call(
        ...     bn, state, torch.tensor([[0., 2.], [2., 4.]]), return_state=True)
        >>> new_state["running_mean"], state["running_mean"]
        (tensor([0.1000, 0.3000]), tensor([0., 0.]))

        The gradient with respect to the parameters, checked against
        `torch.autograd.grad` on the module; detached parameters give gradients without
        a graph:

        >>> import torch, functx
        >>> model = torch.nn.Linear(3, 3)
        >>> x, t = torch.randn(4, 3), torch.randn(4, 3)
        >>> def compute_loss(params, x, t):
        ...     return torch.nn.functional.mse_loss(functx.functional_call(model, params, x), t)
        >>> grads = functx.grad(compute_loss)(dict(model.named_parameters()), x, t)
        >>> reference = torch.autograd.grad(torch.nn.functional.mse_loss(model(x), t), list(model.parameters()))
        >>> all(torch.allclose(grads[k], r) for k, r in zip(grads, reference))
        True
        >>> detached = {k: v.detach() for k, v in model.named_parameters()}
        >>> functx.grad(compute_loss)(detached, x, t)["weight"].grad_fn is None
        True

        Per-sample gradients of a module's loss:

        >>> import torch, functx
        >>> model = torch.nn.Linear(3, 2)
        >>> params = {k: v.detach() for k, v in model.named_parameters()}
        >>> def loss(params, x):
        ...     return functx.functional_call(model, params, (x[None],)).sum()
        >>> grads = functx.vmap(functx.grad(loss), in_dims=(None, 0))(params, torch.randn(5, 3))
        >>> grads["weight"].shape
        torch.Size([5, 2, 3])

        A parametrized weight: by its own name the value is used as is; through
        `parametrizations.weight.original` the parametrization applies:

        >>> import torch, functx
        >>> from torch.nn.utils import parametrize
        >>> class Double(torch.nn.Module):
        ...     def forward(self, w):
        ...         return 2 * w
        ...     def right_inverse(self, w):
        ...         return w / 2
        >>> layer = torch.nn.Linear(2, 1, bias=False)
        >>> _ = parametrize.register_parametrization(layer, "weight", Double())
        >>> x, w = torch.ones(1, 2), torch.ones(1, 2)
        >>> functx.functional_call(layer, {"weight": w}, x).item()
        2.0
        >>> functx.functional_call(layer, {"parametrizations.weight.original": w}, x).item()
        4.0

    Differences from torch.func:
        `return_state`; TensorDict state; the given tensors replace the module's for the
        calling thread only (torch.func's swap is seen by other threads): threads calling
        `functional_call` on one module at once each see their own values. A forward that
        uses `torch.utils.checkpoint` recomputes with the given tensors, so gradients
        through it are right (torch.func recomputes with the module's own and gives a
        wrong gradient).
    """
    given = _merge_dicts(parameter_and_buffer_dicts)
    _check_module(module)
    if kwargs is None:
        kwargs = {}
    if args is None:
        args = ()
    elif not isinstance(args, tuple):
        args = (args,)

    values = _untie(module, given) if tie_weights else dict(given)
    if strict:
        _check_strict(module, values)
    if return_state:
        return _call_pure(module, values, args, kwargs)

    with _swapped(module, values) as after:
        output = module(*args, **kwargs)
    _write_back(parameter_and_buffer_dicts, after)
    return output


def _merge_dicts(dicts: dict[str, Tensor] | Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
    if isinstance(dicts, dict):
        return dicts
    if _is_nested_state(dicts):  # a TensorDict (TensorDictParams, TensorDict.from_module)
        return dict(cast(Any, dicts).flatten_keys(".").items())
    if not isinstance(dicts, Sequence) or isinstance(dicts, (str, bytes)):
        raise ValueError(
            "Expected parameter_and_buffer_dicts to be a dict, or a list/tuple of dicts, "
            f"but got {type(dicts)}"
        )
    if not all(isinstance(d, dict) or _is_nested_state(d) for d in dicts):
        raise ValueError("Expected all elements of parameter_and_buffer_dicts to be dictionaries")
    merged: dict[str, Tensor] = {}
    repeated: list[str] = []
    for d in dicts:
        for key, value in (d if isinstance(d, dict) else _merge_dicts(d)).items():
            if key in merged and key not in repeated:
                repeated.append(key)
            merged[key] = value
    if repeated:
        raise ValueError(
            f"{repeated} appeared in multiple dictionaries; behavior of functional call is ambiguous"
        )
    return merged


class NotAModuleError(TypeError, AttributeError):
    """A module-taking function got something else. A TypeError that says what was
    expected; also an AttributeError, which torch.func raises there (`'function' object has
    no attribute 'named_parameters'`), so code catching that keeps working."""


def require_module(obj, api: str) -> None:
    if not isinstance(obj, nn.Module):
        hint = (
            " For a plain function, call it directly (its tensors are already data)."
            if callable(obj)
            else ""
        )
        raise NotAModuleError(f"{api}: expected a torch.nn.Module, got {type(obj).__name__} ({obj!r:.60}).{hint}")


def _check_module(module: nn.Module) -> None:
    if isinstance(module, (torch.jit.ScriptModule, torch.jit.ScriptFunction)):
        raise RuntimeError("functional_call can't be used with jitted modules")
    require_module(module, "functional_call")
    if isinstance(module, nn.DataParallel):
        raise RuntimeError("functional_call can't be used with nn.DataParallel modules")


def tied_groups(module: nn.Module) -> list[list[str]]:
    """Names of parameters and buffers that share one tensor in `module`, one list per
    tensor (in `named_parameters`/`named_buffers` order; untied tensors give lists of one)."""
    by_tensor: dict[int, list[str]] = {}
    for kind in ("_parameters", "_buffers"):
        for name, tensor in _named_tensors(module, kind):
            by_tensor.setdefault(id(tensor), []).append(name)
    return list(by_tensor.values())


def _named_tensors(module: nn.Module, kind: str, prefix: str = ""):
    """`named_parameters(remove_duplicate=False)` (kind "_parameters") or `named_buffers(...)`
    (kind "_buffers"): the same names in the same order (a submodule reached by two paths
    under each), walked over the modules' dicts directly. Paid by every `functional_call`:
    torch's generators cost 4x as much."""
    own = module.__dict__.get(kind)
    if own:
        for name, tensor in own.items():
            if tensor is not None:
                yield prefix + name, tensor
    for child_name, child in module.__dict__.get("_modules", {}).items():
        if child is not None:
            yield from _named_tensors(child, kind, f"{prefix}{child_name}.")


def _untie(module: nn.Module, given: dict[str, Tensor]) -> dict[str, Tensor]:
    """A new dict where a value given for one name of a tied group is set for all names
    of the group. Tensors are compared by identity: passing the same tensor for two tied
    names is fine, two different tensors are an error (as in torch.func)."""
    values = dict(given)
    for group in tied_groups(module):
        if len(group) < 2:
            continue
        named = [name for name in group if name in given]
        if not named:
            continue
        if len({id(given[name]) for name in named}) > 1:
            raise ValueError(
                f"functional_call got multiple values for keys {sorted(group)}, "
                f"which are tied. Consider using tie_weights=False"
            )
        for name in group:
            values[name] = given[named[0]]
    return values


def _check_strict(module: nn.Module, values: dict[str, Tensor]) -> None:
    missing, unexpected = NamedMemberAccessor(module).check_keys(values)
    errors = []
    if unexpected:
        errors.append(f"Unexpected key(s): {', '.join(map(repr, unexpected))}.")
    if missing:
        errors.append(f"Missing key(s): {', '.join(map(repr, missing))}.")
    if errors:
        raise RuntimeError(
            "Error(s) in reparametrizing for {}:\n\t{}".format(module._get_name(), "\n\t".join(errors))
        )


@contextlib.contextmanager
def _swapped(module: nn.Module, values: dict[str, Tensor]) -> Iterator[dict[str, Tensor]]:
    """`values` in place of the module's tensors for the body, for the calling thread only
    (per_thread.py: other threads calling the module meanwhile see their own or the module's
    tensors); the module as it was afterwards, also on error. Yields a dict that, after the
    body, holds the values at the given names at its end (so re-assignments are visible)."""
    rnn_caches = _save_rnn_caches(module)
    swaps = _swaps()
    swaps.append((module, values))
    try:
        with substituted(module, values) as after:
            yield after
    finally:
        swaps.pop()
        _restore_rnn_caches(rnn_caches)


_active = threading.local()  # .swaps: the calling thread's (module, values) inside _swapped


def _swaps() -> list:
    swaps = getattr(_active, "swaps", None)
    if swaps is None:
        swaps = _active.swaps = []
    return swaps


def _capture_swaps():
    """For a checkpointed function run inside `functional_call`: its recomputation in the
    backward, after the call returned, must see the given tensors again (core/recompute.py;
    it saw the module's own, and the gradient was wrong)."""
    swaps = list(getattr(_active, "swaps", ()))
    if not swaps:
        return None

    @contextlib.contextmanager
    def swapped_again():
        with contextlib.ExitStack() as stack:
            for module, values in swaps:
                stack.enter_context(_swapped(module, values))
            yield

    return swapped_again


register_context(_capture_swaps)


def _save_rnn_caches(module: nn.Module) -> list[tuple[nn.Module, list, list]]:
    """RNN modules cache their weights in `_flat_weights`; the swap bypasses the module's
    `__setattr__`, so the forward refreshes that cache with the swapped-in values. Keep
    the cache as it was, so that the module does not hold on to transform tensors."""
    return [(m, list(m._flat_weights), list(m._flat_weight_refs)) for m in rnn_modules(module) if hasattr(m, "_flat_weights")]


def _restore_rnn_caches(caches: list[tuple[nn.Module, list, list]]) -> None:
    for m, weights, refs in caches:
        setattr(m, "_flat_weights", weights)  # (a list: nn.Module's __setattr__ types tensors and modules)
        setattr(m, "_flat_weight_refs", refs)


def _write_back(dicts: dict[str, Tensor] | Sequence[dict[str, Tensor]], after: dict[str, Tensor]) -> None:
    """torch.func semantics: a value the forward re-assigned replaces the given one (in a
    TensorDict, under its nested key)."""
    for d in [dicts] if isinstance(dicts, dict) or _is_nested_state(dicts) else dicts:
        if isinstance(d, dict):
            for key in d:
                if key in after and after[key] is not d[key]:
                    d[key] = after[key]
            continue
        for key, value in _merge_dicts(d).items():
            if key in after and after[key] is not value:
                cast(Any, d)[tuple(key.split("."))] = after[key]  # a TensorDict: nested keys


def _is_nested_state(obj) -> bool:
    """A container of named tensors with nested keys, as TensorDict (tensordict is not
    imported: a registered container with batch size that flattens its keys)."""
    return not isinstance(obj, dict) and in_use() and is_container(obj) and hasattr(obj, "flatten_keys")


def _call_pure(module: nn.Module, values: dict[str, Tensor], args: tuple, kwargs: dict) -> tuple[Any, dict[str, Tensor]]:
    """The `return_state=True` call: the forward runs on clones of all buffers, and the
    buffers as they are after the forward are returned."""
    values = dict(values)
    clones: dict[int, Tensor] = {}  # one clone per tensor keeps tied buffers tied
    for group in tied_groups(module):
        for name in group:
            if not _is_buffer(module, name):
                continue
            source = values[name] if name in values else module.get_buffer(name)
            if source is None:
                continue
            if id(source) not in clones:
                clones[id(source)] = source.clone()
            values[name] = clones[id(source)]
    buffer_names = [name for name, _ in module.named_buffers()]
    accessor = NamedMemberAccessor(module)
    with _swapped(module, values):
        output = module(*args, **kwargs)
        new_buffers = {name: accessor.get_tensor(name) for name in buffer_names}
    return output, new_buffers


def _is_buffer(module: nn.Module, name: str) -> bool:
    owner_name, _, attr = name.rpartition(".")
    try:
        owner = module.get_submodule(owner_name)
    except AttributeError:
        return False
    return attr in owner._buffers
