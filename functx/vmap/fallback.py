"""The per-sample loop: vmap's last resort for an op with no rule and no decomposition.

Correct for any op whose outputs are tensors, at the cost of one call per batch element.
It warns once per op (`functx.PerformanceWarning`) so the missing rule gets noticed;
`functx.set_vmap_fallback("error")` turns it into an error. `refuse_if_switched_off` and
`warn_once` apply that setting; old-style autograd.Functions, which vmap also runs once per
batch element (custom_function.py), go through them too.
"""

from __future__ import annotations


import torch

from ..core import config
from ..core.errors import ISSUES, NeedsPerSampleValues, PerformanceWarning, op_name, raise_unbatched_inplace, warn
from ..core.op_facts import returns_view, writes_argument, writes_out

_warned: set = set()


def refuse_if_switched_off(refusal: str) -> None:
    """Under `functx.set_vmap_fallback("error")`, raise `NotImplementedError(refusal)` (what
    is run once per batch element, and that the fallback is switched off) instead of running
    something once per batch element.

        >>> import functx
        >>> with functx.vmap_fallback("error"):
        ...     refuse_if_switched_off("switched off")
        Traceback (most recent call last):
        NotImplementedError: switched off
    """
    if config.fallback == "error":
        raise NotImplementedError(refusal)


def warn_once(key, warned, warning: str) -> None:
    """Under the "warn" setting (the default), `warning` as a `functx.PerformanceWarning` the
    first time `key` (an op, an autograd.Function) runs once per batch element, recorded in
    `warned`; nothing under "silent"."""
    if config.fallback == "warn" and key not in warned:
        warned.add(key)
        warn(warning, PerformanceWarning)


def loop_fallback(op, warning=None):
    """The per-sample loop for `op`; `warning` replaces the default performance warning (for
    ops that run this loop as their rule because no vectorized form exists)."""
    schema = op._schema
    name = op_name(op)
    warning = warning or (
        f"functx.vmap: there is no batching rule for {name}; running it once per "
        f"batch element, which is slow. Please file an issue naming this op: {ISSUES}"
    )
    mutated = [i for i, a in enumerate(schema.arguments) if writes_argument(a) and not a.kwarg_only]
    writes_out_argument = writes_out(op)
    view = returns_view(op)

    def refuse(reason):
        raise NotImplementedError(
            f"functx.vmap: there is no batching rule for {name}, and the per-sample "
            f"fallback cannot run it because {reason}. Please file an issue naming this op: {ISSUES}"
        )

    def fallback(interp, *args, **kwargs):
        if interp.batch_size == 0:
            refuse("the batch is empty (there is no element to run it on)")
        refuse_if_switched_off(
            f"functx.vmap: there is no batching rule for {name} and the per-sample "
            f"fallback is switched off (functx.set_vmap_fallback('error'))."
        )
        if writes_out_argument:
            refuse("it writes into out= arguments")
        if view:
            refuse("it returns a view")
        warn_once(op, _warned, warning)
        for i in mutated:
            if not interp.is_batched(args[i]):
                raise_unbatched_inplace(op, args[i])
        results = []
        for b in range(interp.batch_size):
            results.append(op(*_select(interp, args, b), **_select_kw(interp, kwargs, b)))
        if mutated:
            return args[mutated[0]] if len(mutated) == 1 else tuple(args[i] for i in mutated)
        return _stack_results(interp, results, name)

    return fallback


def _select_one(interp, x, b):
    if interp.is_batched(x):
        return x._value[b]
    if type(x) is list or type(x) is tuple:
        return type(x)(_select_one(interp, e, b) for e in x)
    return x


def _select(interp, args, b):
    return tuple(_select_one(interp, a, b) for a in args)


def _select_kw(interp, kwargs, b):
    return {k: _select_one(interp, v, b) for k, v in kwargs.items()}


def _check_same_shapes(interp, results, name):
    """The elements' results stack into one batched tensor only when their shapes agree;
    where they do not, the op's output shape depends on the values (nonzero, bincount)."""
    shapes = [_shapes_of(r) for r in results]
    for shape in shapes[1:]:
        if shape != shapes[0]:
            raise NeedsPerSampleValues(
                f"vmap: {name} returns a tensor whose shape depends on the values of its input, "
                f"and the per-sample shapes differ between batch elements ({shapes[0]} and {shape}), "
                f"so they cannot be stacked into one batched result. Use a fixed-shape formulation "
                f"instead, e.g. torch.where(mask, x, 0) instead of x[mask], nonzero_static(size=...) "
                f"instead of nonzero, bincount(minlength=...).",
                interp,
                f"{name}'s output shape differs between samples ({shapes[0]} and {shape})",
            )


def _shapes_of(result):
    if isinstance(result, torch.Tensor):
        return tuple(result.shape)
    if type(result) is tuple or type(result) is list:
        return tuple(_shapes_of(r) for r in result)
    return None


def _stack_results(interp, results, name):
    _check_same_shapes(interp, results, name)
    first = results[0]
    if first is None and all(r is None for r in results):
        return None  # ops that only check their inputs (e.g. _linalg_check_errors)
    if isinstance(first, torch.Tensor):
        return interp.wrap(torch.stack(results))
    if type(first) is tuple or type(first) is list:
        out = []
        for i, item in enumerate(first):
            column = [r[i] for r in results]
            if isinstance(item, torch.Tensor):
                out.append(interp.wrap(torch.stack(column)))
            elif type(item) is list:
                out.append([interp.wrap(torch.stack([c[j] for c in column])) for j in range(len(item))])
            else:
                out.append(item)
        return type(first)(out)
    raise NotImplementedError(
        f"functx.vmap: the per-sample fallback for {name} got a {type(first).__name__} "
        f"result; only tensor results can be stacked."
    )
