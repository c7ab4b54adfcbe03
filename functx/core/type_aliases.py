"""The types of the public API's arguments, named once (torch.func's `argnums_t` and
`in_dims_t`): annotations that IDEs and type checkers show, and that the reference pages
print.

    >>> from functx.core.type_aliases import Argnums
    >>> Argnums
    typing.Union[int, tuple[int, ...]]
"""

from __future__ import annotations

from typing import Any, Callable, Union

Argnums = Union[int, tuple[int, ...]]  # which positional arguments to differentiate
InDims = Union[int, None, tuple[Any, ...], list[Any], dict[Any, Any]]  # per argument: the mapped dim (None: not mapped), nested like the inputs
OutDims = Union[int, None, tuple[Any, ...], list[Any], dict[Any, Any]]  # per output: where its batch dim goes
Function = Callable[..., Any]  # a function of tensors (and pytrees of them)
