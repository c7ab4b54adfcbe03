"""`functx.rearrange`: einops' `rearrange`, as `torch.func.rearrange`.

A pattern compiles (once per tensor rank, pattern and axis lengths) into a plan of three
tensor ops: a reshape that splits the input's dimensions into elementary axes, a permute
into the output's order of axes, and a reshape that merges them into the output's
dimensions. Each is a view where torch can make one, and plain torch ops, so `rearrange`
works inside every functx transform.
"""

from __future__ import annotations

import functools
import math

import torch

from .parsing import ELLIPSIS, parse_pattern


def rearrange(tensor, pattern: str, **axes_lengths: int) -> torch.Tensor:
    """Reorder, split, merge, add or drop (size-1) dimensions of `tensor`, following an einops
    pattern (https://einops.rocks/api/rearrange/).

    `pattern` is `"<input dims> -> <output dims>"`: names stand for axes, `(a b)` for one
    dimension made of two axes, `1` or `()` for a dimension of size 1, `...` for the other
    dimensions. `axes_lengths` gives the lengths of axes that a split cannot infer. A list or
    tuple of tensors is stacked first (a new leading dimension).

    Args:
        tensor (Tensor | Sequence[Tensor]): a tensor, or a sequence of tensors of one shape.
        pattern (str): the rearrangement pattern.
        **axes_lengths (int): lengths of axes, by name.

    Returns:
        Tensor: the rearranged tensor (a view of `tensor` where possible).

    Raises:
        ValueError: a malformed pattern, an axis on one side only, a rank or length that
            does not fit ([error catalogue: rearrange](../errors.md#rearrange)).
        TypeError: an axis length that is not an int.

    Examples:
        >>> import torch, functx
        >>> images = torch.randn(32, 30, 40, 3)  # b h w c
        >>> functx.rearrange(images, "b h w c -> b c h w").shape
        torch.Size([32, 3, 30, 40])
        >>> functx.rearrange(images, "b h w c -> (b h) w c").shape
        torch.Size([960, 40, 3])
        >>> functx.rearrange(images, "b (h1 h) (w1 w) c -> (b h1 w1) h w c", h1=2, w1=2).shape
        torch.Size([128, 15, 20, 3])
        >>> functx.rearrange([images[0], images[1]], "n h w c -> h (n w) c").shape
        torch.Size([30, 80, 3])
        >>> functx.rearrange(images, "b ... c -> b (...) c").shape
        torch.Size([32, 1200, 3])

    Differences from torch.func:
        The same patterns as functorch's `rearrange`. The parsed plan is cached per rank,
        pattern and axis lengths with their types, so `b=3.0` is refused on every call
        (functorch's cache, keyed on values, accepts it after a call with `b=3`).
    """
    if not isinstance(tensor, torch.Tensor):
        tensor = torch.stack(tensor)
    # the key holds the lengths' types: 3.0 == 3 would find the plan made for 3 (torch.func's
    # cache has that hole) and skip the check that refuses floats
    key = tuple(sorted((name, length, type(length)) for name, length in axes_lengths.items()))
    return _plan(tensor.dim(), pattern, key)(tensor)


@functools.lru_cache(256)
def _plan(ndim: int, pattern: str, lengths: tuple) -> "_Plan":
    axes_lengths = {name: length for name, length, _ in lengths}
    left, right = parse_pattern(pattern, axes_lengths)
    if left.has_ellipsis:
        named = len(left.entries) - 1
        if named > ndim:
            raise ValueError(
                f"Number of dimensions in pattern ({named}) must be less than or equal to the number of "
                f"dimensions in the tensor ({ndim})"
            )
        ellipsis_axes = tuple((ELLIPSIS, i) for i in range(ndim - named))
    else:
        if len(left.entries) != ndim:
            raise ValueError(
                f"Number of dimensions in pattern ({len(left.entries)}) must be equal to the number of "
                f"dimensions in the tensor ({ndim})"
            )
        ellipsis_axes = ()
    return _Plan(left.entries, right.entries, ellipsis_axes, axes_lengths, pattern)


class _Plan:
    """Splitting reshape, permute, merging reshape (see the module docstring)."""

    __slots__ = ("input_groups", "order", "output_groups", "lengths", "pattern")

    def __init__(self, left, right, ellipsis_axes, lengths, pattern):
        # per input dimension: its axes (names, (ELLIPSIS, i)); a unit dimension has none
        self.input_groups = []
        for entry in left:
            if entry == ELLIPSIS:
                self.input_groups.extend((a,) for a in ellipsis_axes)
            else:
                self.input_groups.append(entry)
        elementary = [a for group in self.input_groups for a in group]
        position = {a: i for i, a in enumerate(elementary)}
        self.output_groups = []
        for entry in right:
            if entry == ELLIPSIS:
                self.output_groups.extend((a,) for a in ellipsis_axes)
            else:
                self.output_groups.append(
                    tuple(a for name in entry for a in (ellipsis_axes if name == ELLIPSIS else (name,)))
                )
        self.order = [position[a] for group in self.output_groups for a in group]
        self.lengths = lengths
        self.pattern = pattern

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        sizes: dict[str, int] = {}
        for dim, group in enumerate(self.input_groups):
            self._bind(group, tensor.shape[dim], sizes)
        split = [sizes[a] for group in self.input_groups for a in group]
        out = tensor.reshape(split) if len(split) != tensor.dim() else tensor
        if self.order != list(range(len(self.order))):
            out = out.permute(self.order)
        return out.reshape([math.prod(sizes[a] for a in group) for group in self.output_groups])

    def _bind(self, group, size: int, sizes: dict) -> None:
        """The lengths of the axes that make one input dimension of length `size`."""
        if not group:
            if size != 1:
                raise ValueError(
                    f"rearrange('{self.pattern}'): a dimension written as 1 or () has length {size}, not 1"
                )
            return
        known, unknown = 1, []
        for axis in group:
            length = self.lengths.get(axis) if type(axis) is str else None
            if length is None:
                unknown.append(axis)
            else:
                if length < 0:
                    raise ValueError(f"rearrange('{self.pattern}'): axis {axis} has a negative length {length}")
                sizes[axis] = length
                known *= length
        if len(unknown) > 1:
            names = ", ".join(str(a) for a in unknown)
            raise ValueError(
                f"rearrange('{self.pattern}'): cannot infer the lengths of axes {names} of a dimension of "
                f"length {size} (give all but one of them as keyword arguments)"
            )
        if unknown:
            if known == 0 or size % known:
                raise ValueError(
                    f"rearrange('{self.pattern}'): a dimension of length {size} cannot be split into axes "
                    f"{group} with the lengths given ({known} does not divide {size})"
                )
            sizes[unknown[0]] = size // known
        elif known != size:
            raise ValueError(
                f"rearrange('{self.pattern}'): the axes {group} have lengths multiplying to {known}, "
                f"but the dimension has length {size}"
            )
