"""The einops pattern language, as `rearrange` reads it: `"b (h w) c -> b h w c"`.

A side of a pattern is a sequence of *entries*, one per tensor dimension:
  - an axis name (`b`): a group of one axis;
  - a parenthesized group (`(h w)`): one dimension that is the product of its axes,
    outermost first; `()` and `1` (outside parentheses) are a dimension of size 1 with no
    name, and a `1` inside parentheses stands for nothing;
  - `...`: any number of dimensions (at most once per side; on the left, not inside
    parentheses); `(...)` on the right flattens them into one.
Other numbers are anonymous axes of that length, which `rearrange` refuses (as torch.func).
Errors are ValueErrors worded as torch.func's (functorch.einops).

    >>> left, right = parse_pattern("b (h w) ... -> b h w (...)", {"h": 2})
    >>> left.entries
    [('b',), ('h', 'w'), '…']
    >>> right.entries
    [('b',), ('h',), ('w',), ('…',)]
"""

from __future__ import annotations

import keyword
from collections.abc import Mapping

from ..core.errors import warn

ELLIPSIS = "\u2026"  # one character standing for "..." in a parsed side


class Side:
    """One side of a pattern (see the module docstring): `entries` holds a tuple of axis names
    per dimension (`()` for a unit dimension; ELLIPSIS among the names for `(...)`), or
    ELLIPSIS itself for a bare `...`."""

    __slots__ = ("entries", "names", "has_ellipsis", "ellipsis_in_group", "numbers")

    def __init__(self):
        self.entries: list = []
        self.names: set[str] = set()  # axis names, and ELLIPSIS if there is one
        self.has_ellipsis = False
        self.ellipsis_in_group = False
        self.numbers: list[int] = []  # anonymous axes of a length other than 1


def _check_name(name: str) -> None:
    if not name.isidentifier():
        raise ValueError(f"Invalid axis identifier: {name}\nnot a valid python identifier")
    if name.startswith("_") or name.endswith("_"):
        raise ValueError(f"Invalid axis identifier: {name}\naxis name should should not start or end with underscore")
    if keyword.iskeyword(name):
        warn(f"It is discouraged to use axes names that are keywords: {name}", RuntimeWarning)
    if name == "axis":
        warn(
            "It is discouraged to use 'axis' as an axis name and will raise an error in future",
            FutureWarning,
        )


def _tokens(text: str):
    """Split a side into "(", ")" and words (names, numbers, ELLIPSIS)."""
    word = ""
    for char in text:
        if char in "() ":
            if word:
                yield word
                word = ""
            if char != " ":
                yield char
        elif char.isalnum() or char == "_" or char == ELLIPSIS:
            word += char
        else:
            raise ValueError(f"Unknown character '{char}'")
    if word:
        yield word


def parse_side(text: str) -> Side:
    """Parse one side of a pattern (see the module docstring)."""
    side = Side()
    if "." in text:
        if "..." not in text:
            raise ValueError("Expression may contain dots only inside ellipsis (...)")
        if text.count("...") != 1 or text.count(".") != 3:
            raise ValueError("Expression may contain dots only inside ellipsis (...); only one ellipsis for tensor ")
        text = text.replace("...", ELLIPSIS)
        side.has_ellipsis = True
    group = None  # the names of an open parenthesis
    for token in _tokens(text):
        if token == "(":
            if group is not None:
                raise ValueError("Axis composition is one-level (brackets inside brackets not allowed)")
            group = []
        elif token == ")":
            if group is None:
                raise ValueError("Brackets are not balanced")
            side.entries.append(tuple(group))
            group = None
        else:
            _add_word(side, group, token)
    if group is not None:
        raise ValueError(f"Imbalanced parentheses in expression: '{text}'")
    return side


def _add_word(side: Side, group, word: str) -> None:
    if word in side.names and word != ELLIPSIS:
        raise ValueError(f"Indexing expression contains duplicate dimension '{word}'")
    if word == ELLIPSIS:
        side.names.add(ELLIPSIS)
        if group is None:
            side.entries.append(ELLIPSIS)
        else:
            group.append(ELLIPSIS)
            side.ellipsis_in_group = True
        return
    if word.isdecimal():
        if int(word) == 1:
            if group is None:
                side.entries.append(())  # a unit dimension; inside parentheses a 1 is nothing
            return
        if int(word) < 1:
            raise ValueError(f"Anonymous axis should have positive length, not {int(word)}")
        side.numbers.append(int(word))
        if group is None:
            side.entries.append((f"{word}-axis",))
        return
    _check_name(word)
    side.names.add(word)
    if group is None:
        side.entries.append((word,))
    else:
        group.append(word)


def parse_pattern(pattern: str, axes_lengths: Mapping[str, int]) -> tuple[Side, Side]:
    """The two sides of a `rearrange` pattern, checked as torch.func checks them."""
    sides = pattern.split("->")
    if len(sides) != 2:
        raise ValueError("Pattern must contain a single '->' separator")
    if ELLIPSIS in axes_lengths:
        raise ValueError(f"'{ELLIPSIS}' is not an allowed axis identifier")
    left, right = parse_side(sides[0]), parse_side(sides[1])
    if right.has_ellipsis and not left.has_ellipsis:
        raise ValueError(f"Ellipsis found in right side, but not left side of a pattern {pattern}")
    if left.ellipsis_in_group:
        raise ValueError(f"Ellipsis is parenthesis in the left side is not allowed: {pattern}")
    for length in axes_lengths.values():
        if type(length) is not int:
            raise TypeError(f"rearrange axis lengths must be integers, got: {type(length)}")
    if left.numbers or right.numbers:
        raise ValueError("rearrange only supports unnamed axes of size 1")
    only_one_side = left.names ^ right.names
    if only_one_side:
        raise ValueError(f"Identifiers only on one side of rearrange expression (should be on both): {only_one_side}")
    unknown = set(axes_lengths) - left.names
    if unknown:
        raise ValueError(f"Identifiers not found in rearrange expression: {unknown}")
    return left, right
