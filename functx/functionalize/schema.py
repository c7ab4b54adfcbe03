"""What an op's schema says about aliasing: which arguments it writes, whether it is a view.

    >>> import torch
    >>> writes = writes_of(torch.ops.aten.add_.Tensor)
    >>> writes.positions, writes.names, writes.returns
    ([0], [], [0])
    >>> writes_of(torch.ops.aten.max.dim_max).names
    ['max', 'max_values']
    >>> writes_of(torch.ops.aten.add.Tensor) is None, is_view(torch.ops.aten.t.default)
    (True, True)
"""

from __future__ import annotations


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
