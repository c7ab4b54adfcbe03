"""What an op's schema says about aliasing and mutation, read once per op and cached: the one
place functx reads `alias_info` (which arguments an op writes, whether it is a view).

- `writes_of(op)`: every argument it writes (in place, `out=`) and which return is which;
- `mutated_argument(op)`: the positional argument an in-place op writes and returns;
- `writes_argument(argument)`, `writes_out(op)`, `writes_any(op)`: one argument, the `out=`
  arguments, any argument;
- `is_view(op)`: its first result aliases an argument it does not write (`returns_view`:
  any result does);
  `is_view_of_first(op)`: the one result (or list) aliases the first argument, unwritten;
- `is_inplace_view(op)`: it changes its argument's metadata in place (`squeeze_`).

    >>> import torch
    >>> writes = writes_of(torch.ops.aten.add_.Tensor)
    >>> writes.positions, writes.names, writes.returns
    ([0], [], [0])
    >>> writes_of(torch.ops.aten.max.dim_max).names
    ['max', 'max_values']
    >>> writes_of(torch.ops.aten.add.Tensor) is None, is_view(torch.ops.aten.t.default)
    (True, True)
    >>> mutated_argument(torch.ops.aten.add_.Tensor), writes_out(torch.ops.aten.add.out)
    (0, True)
"""

from __future__ import annotations

import torch


class Writes:
    """The arguments an op writes: positions (in-place `self`) and keyword names (`out=`
    arguments), and for each return the argument it is (position or name), or None."""

    __slots__ = ("positions", "names", "returns")

    def __init__(self, op):
        by_alias = {}
        self.positions, self.names = [], []
        for i, a in enumerate(op._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                where = a.name if a.kwarg_only else i
                (self.names if a.kwarg_only else self.positions).append(where)
                by_alias[frozenset(a.alias_info.before_set)] = where
        self.returns = [
            by_alias.get(frozenset(r.alias_info.before_set)) if r.alias_info is not None and r.alias_info.is_write else None
            for r in op._schema.returns
        ]

    def targets(self, args, kwargs):
        """The written arguments of one call."""
        for i in self.positions:
            if i < len(args):
                yield args[i]
        for name in self.names:
            if name in kwargs:
                yield kwargs[name]

    @staticmethod
    def argument(where, args, kwargs):
        return args[where] if type(where) is int else kwargs[where]


_writes: dict = {}
_views: dict = {}


def writes_of(op) -> Writes | None:
    """`Writes` of an op that writes into an argument, None for every other op."""
    try:
        return _writes[op]
    except KeyError:
        writes = Writes(op)
        _writes[op] = writes if writes.positions or writes.names else None
        return _writes[op]


def is_view(op) -> bool:
    """Whether an op's (first) result aliases an argument it does not write: a view op."""
    try:
        return _views[op]
    except KeyError:
        returns = op._schema.returns
        _views[op] = bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write
        return _views[op]


def writes_argument(argument) -> bool:
    """Whether the op writes this schema argument."""
    info = argument.alias_info
    return info is not None and info.is_write


_mutated: dict = {}


def mutated_argument(op):
    """Index of the argument an in-place op writes and returns (its `self`), or None."""
    try:
        return _mutated[op]
    except KeyError:
        pass
    index = None
    schema = op._schema
    returns = schema.returns
    if len(returns) == 1 and writes_argument(returns[0]):
        for i, argument in enumerate(schema.arguments):
            if writes_argument(argument) and not argument.kwarg_only:
                index = i
                break
    _mutated[op] = index
    return index


def writes_out(op) -> bool:
    """Whether the op writes a keyword argument (`out=`)."""
    return any(a.kwarg_only and writes_argument(a) for a in op._schema.arguments)


def writes_any(op) -> bool:
    """Whether the op writes any argument."""
    return any(writes_argument(a) for a in op._schema.arguments)


def is_inplace_view(op) -> bool:
    """Whether the op changes its argument's sizes or strides in place (`squeeze_`, `t_`)."""
    return torch.Tag.inplace_view in op.tags


def is_view_of_first(op) -> bool:
    """One tensor (or one list of tensors: `split`, `unbind`) returned, aliases of the first
    argument that the op does not write (`detach` aside: it aliases but drops derivatives)."""
    if op is torch.ops.aten.detach.default:
        return False
    schema = op._schema
    if len(schema.returns) != 1 or not schema.arguments:
        return False
    out, first = schema.returns[0].alias_info, schema.arguments[0].alias_info
    return out is not None and not out.is_write and first is not None and not first.is_write


def returns_view(op) -> bool:
    """Whether any result aliases an argument the op does not write."""
    return any(r.alias_info is not None and not writes_argument(r) for r in op._schema.returns)
