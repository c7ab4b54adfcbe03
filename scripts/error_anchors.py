"""Give every row of the error catalogue (docs/errors.md) an anchor, so that a message can
be linked to (`errors.md#e-vmap-chunk_size-should-be-none-or-greater-than-0`) and the
page's finder (docs/javascripts/error_finder.js: paste a message, get its row) can jump
to it.

The anchor is made from the row's first message (its first backticked text): placeholders
(`<op>`) and punctuation dropped, its first eight words joined with "-", prefixed `e-`
(a numbered suffix where two rows would share one). mkdocs runs `on_page_markdown` as a
hook (mkdocs.yml `hooks:`), so the catalogue stays a plain table to edit.
"""

from __future__ import annotations

import re

CATALOGUE = "errors.md"
_ROW = re.compile(r"^\| (?!Message \||Warning \||---)(?P<first>.+?) \| ")
_CODE = re.compile(r"(`+)\s?(?P<code>.+?)\s?\1")


def message_of(first_cell: str) -> str:
    """The message text of a row's first cell: its backticked parts, joined."""
    return " ".join(match.group("code") for match in _CODE.finditer(first_cell)) or first_cell


def slug(message: str) -> str:
    words = re.findall(r"[a-z0-9_]+", re.sub(r"<[^<>]*>", " ", message.lower()))
    return "e-" + "-".join(words[:8])


def rows(markdown: str) -> list[tuple[int, str, str]]:
    """(line index, anchor, message text) of every catalogue row, in page order."""
    found, taken = [], set()
    for index, line in enumerate(markdown.splitlines()):
        match = _ROW.match(line)
        if not match:
            continue
        first = match.group("first")
        codes = list(_CODE.finditer(first))
        anchor = slug(codes[0].group("code") if codes else first)
        unique, n = anchor, 2
        while unique in taken:
            unique, n = f"{anchor}-{n}", n + 1
        taken.add(unique)
        found.append((index, unique, message_of(first)))
    return found


def with_anchors(markdown: str) -> str:
    """The catalogue with a linkable anchor at the start of each row."""
    lines = markdown.splitlines()
    for index, anchor, _ in rows(markdown):
        link = f'<a class="error-row" id="{anchor}" href="#{anchor}" title="Link to this error">#</a>'
        lines[index] = "| " + link + " " + lines[index][2:]
    return "\n".join(lines) + ("\n" if markdown.endswith("\n") else "")


def on_page_markdown(markdown: str, page, **kwargs) -> str:  # the mkdocs hook
    return with_anchors(markdown) if page.file.src_uri == CATALOGUE else markdown
