"""Tensors the functionalized function makes belong to its level.

A buffer the function makes (`buf = torch.zeros(3)`, `idx = torch.arange(4)`,
`y = captured.clone()`) and then writes into (`buf[0] = x`) must be a tensor of the level,
or the write could not be functionalized. Factories take no tensor argument for the
dispatcher to find, so a handler of torch calls (core/torch_function.py), live while the function runs, lifts their
results into the level (torch.func's C++ functionalize does the same with a thread-local
dispatch key). Views and results of other ops on captured tensors are left alone: they
alias state from outside, and functionalize passes writes to them through (or refuses
writes of values from inside), as torch.func does.

    >>> import torch, functx
    >>> def f(x):
    ...     buf = torch.zeros(3)
    ...     buf[1:].add_(x)
    ...     return buf
    >>> functx.functionalize(f)(torch.ones(2))
    tensor([0., 1., 1.])
"""

from __future__ import annotations

import torch

from ..core.factories import FACTORIES
from ..core.level_tensor import level_of
from ..core.torch_function import CallHandler, call_outer, seen_by_outer


class FactoryLifting(CallHandler):
    """While a functionalize level's function runs: what factories make is the level's (and
    `tensor_split` gets tensor split points as a list, see `_split_points_as_list`)."""

    def __init__(self, level):
        self.level = level

    def torch_function(self, func, types, args, kwargs):
        if func in _TENSOR_SPLITS:
            with seen_by_outer():
                args, kwargs = _split_points_as_list(self.level, args, kwargs)
        elif func not in FACTORIES:
            return NotImplemented
        out = call_outer(func, types, args, kwargs)
        if (
            func in FACTORIES
            and isinstance(out, torch.Tensor)
            and out.layout is torch.strided  # (torch's functional tensors wrap strided tensors)
            and level_of(out) < self.level.level  # plain or from below (a level above made it its own)
            and self.level.alive
        ):
            with seen_by_outer():
                return self.level.wrap(out)
        return out


_TENSOR_SPLITS = frozenset([torch.tensor_split, torch.Tensor.tensor_split])


def _split_points_as_list(level, args, kwargs):
    """`tensor_split` with a tensor of split points: torch's C++ composite reads that tensor's
    data directly, which a tensor of the level (a functional tensor) does not have (torch.func
    fails there). The points decide shapes, so they are taken as Python ints here."""
    if len(args) > 1 and level_of(args[1]) == level.level:
        args = (args[0], args[1].tolist(), *args[2:])
    elif level_of(kwargs.get("indices_or_sections")) == level.level:
        kwargs = {**kwargs, "indices_or_sections": kwargs["indices_or_sections"].tolist()}
    elif level_of(kwargs.get("tensor_indices_or_sections")) == level.level:
        kwargs = {**kwargs, "tensor_indices_or_sections": kwargs["tensor_indices_or_sections"].tolist()}
    return args, kwargs
