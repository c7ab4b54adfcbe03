"""The level tensor and the dispatcher.

A `LevelTensor` is a `torch.Tensor` wrapper subclass that holds the value one level down
(`_value`: a plain tensor or a lower level's tensor) and the interpreter of its level
(`_interp`). Every ATen op that touches one arrives in `__torch_dispatch__`; the dispatcher
finds the highest live level among the arguments and hands the op to that interpreter,
whose rule computes on values one level down. Those computations dispatch again, through
the lower levels, which is what makes transforms compose.

This is the hot path: no pytree library here, one pass over the arguments.
"""

from __future__ import annotations

import torch

from .errors import op_name


class LevelTensor(torch.Tensor):
    """Base of every transform's wrapper tensor. Subclasses set `_value` and `_interp`."""

    _value: torch.Tensor
    _interp: object

    # Ops reach us as ATen ops only; no Python-level __torch_function__ work per call.
    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, op, types, args=(), kwargs=None):
        top = None
        for a in args:
            if isinstance(a, LevelTensor):
                interp = a._interp
                if top is None or interp.level > top.level:
                    top = interp
            elif type(a) is list or type(a) is tuple:
                for e in a:
                    if isinstance(e, LevelTensor):
                        interp = e._interp
                        if top is None or interp.level > top.level:
                            top = interp
        if kwargs:
            for a in kwargs.values():
                if isinstance(a, LevelTensor):
                    interp = a._interp
                    if top is None or interp.level > top.level:
                        top = interp
                elif type(a) is list or type(a) is tuple:
                    for e in a:
                        if isinstance(e, LevelTensor):
                            interp = e._interp
                            if top is None or interp.level > top.level:
                                top = interp
        else:
            kwargs = {}
        if not top.alive:
            return _dispatch_with_dead_levels(op, args, kwargs)
        return top.process(op, args, kwargs)


def _unwrap_dead(x):
    while isinstance(x, LevelTensor) and not x._interp.alive:
        x = x._interp.unwrap_dead(x)
    if type(x) is list or type(x) is tuple:
        return type(x)(_unwrap_dead(e) for e in x)
    return x


def _dispatch_with_dead_levels(op, args, kwargs):
    """A level tensor escaped its transform: replace every dead wrapper by what its
    interpreter says it stands for (vmap: the physical tensor with the batch dim) and
    run the op again, so the highest live level (or plain torch) handles it."""
    args = tuple(_unwrap_dead(a) for a in args)
    kwargs = {k: _unwrap_dead(v) for k, v in kwargs.items()}
    return op(*args, **kwargs)


def level_of(x) -> int:
    """Level of a level tensor, 0 for anything else (plain tensors sit below every level)."""
    return x._interp.level if isinstance(x, LevelTensor) else 0


__all__ = ["LevelTensor", "level_of", "op_name"]
