"""A griffe extension for the API reference (mkdocs.yml, mkdocstrings' python handler).

It adapts the docstring text griffe parses (the source is untouched) to two habits of
functx's docstrings that griffe's Google-style parser reads otherwise:

- doctests are headed `Example:`; griffe reads only `Examples:` as the examples section
  (rendered as highlighted Python sessions) and takes `Example:` for an admonition, whose
  `>>>` lines Markdown would turn into nested quotes;
- a `Returns:` section is one description over several lines at the same indentation;
  griffe would read each line as a separate returned value. Its continuation lines are
  indented one step further.
"""

from __future__ import annotations

import re

import griffe

_EXAMPLE = re.compile(r"^([ \t]*)Example:[ \t]*$", re.MULTILINE)
_RETURNS = re.compile(r"^([ \t]*)Returns:[ \t]*$")


def _one_returns_item(text: str) -> str:
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        match = _RETURNS.match(lines[i])
        i += 1
        if not match:
            continue
        base, item = len(match.group(1)), None
        while i < len(lines):
            line = lines[i]
            if line.strip():
                indent = len(line) - len(line.lstrip())
                if indent <= base:
                    break  # the section ended
                if item is None:
                    item = indent
                elif indent == item:
                    lines[i] = "    " + line
            i += 1
    return "\n".join(lines)


class FunctxDocstrings(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _one_returns_item(_EXAMPLE.sub(r"\1Examples:", obj.docstring.value))
