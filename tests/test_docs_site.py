"""The documentation site's own code: the copy button's prompt stripping (a pasted example
must run), the error catalogue's anchors and finder (a pasted message finds its row), the
long tables' filter and sort, and the settings that keep the site readable and offline."""

from __future__ import annotations

import inspect
import json
import pathlib
import shutil
import subprocess
import textwrap

import pytest

import sys

import torch

import functx

ROOT = pathlib.Path(__file__).resolve().parent.parent
JAVASCRIPTS = ROOT / "docs" / "javascripts"
SCRIPT = JAVASCRIPTS / "copy_prompts.js"
NODE = shutil.which("node")
needs_node = pytest.mark.skipif(NODE is None, reason="node is not installed (the site's scripts are JavaScript)")

sys.path.insert(0, str(ROOT / "scripts"))
import error_anchors  # noqa: E402  (scripts/: the mkdocs hook)


def _node(script: pathlib.Path, function: str, *calls: list) -> list:
    """`function(*args)` of the site script `script` for each argument list in `calls`, in node."""
    program = (
        f"const m = require({json.dumps(str(script))}); "
        f"const calls = JSON.parse(require('fs').readFileSync(0, 'utf8')); "
        f"process.stdout.write(JSON.stringify(calls.map(args => m.{function}(...args))))"
    )
    result = subprocess.run([NODE, "-e", program], input=json.dumps(list(calls)), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _copyable(*texts: str) -> list[str]:
    return _node(SCRIPT, "copyableText", *([t] for t in texts))


@needs_node
def test_copy_button_strips_prompts_and_results():
    session = ">>> import torch\n>>> def f(x):\n...     return x * 2\n...\n>>> f(torch.ones(2))\ntensor([2., 2.])\n"
    plain = "import torch\nx = torch.ones(2)  # >>> inside a comment stays\n"
    got = _copyable(session, plain)
    assert got == ["import torch\ndef f(x):\n    return x * 2\n\nf(torch.ones(2))\n", plain]


@needs_node
@pytest.mark.parametrize("name", ["vmap", "grad", "jvp", "jacrev", "hessian", "functional_call", "jet", "laplacian"])
def test_a_copied_reference_example_runs(name):
    """The examples of a reference entry, copied as the site's button copies them, run as a
    script (their printed results gone)."""
    doc = inspect.getdoc(getattr(functx, name))
    examples = doc.split("Examples:", 1)[1].split("Differences from torch.func", 1)[0]
    session = "\n".join(line for line in textwrap.dedent(examples).splitlines() if line.startswith((">>>", "...")))
    (code,) = _copyable(session + "\n")
    assert ">>>" not in code and code.strip()
    namespace: dict = {}
    exec(compile(code, f"<copied example of functx.{name}>", "exec"), namespace)


def test_the_site_loads_its_own_script_and_styles_and_no_outside_font():
    config = (ROOT / "mkdocs.yml").read_text()
    for script in ("copy_prompts.js", "error_finder.js", "tables.js"):
        assert f"javascripts/{script}" in config and (JAVASCRIPTS / script).exists()
    assert "scripts/error_anchors.py" in config  # the hook that gives each catalogue row its anchor
    assert "stylesheets/reading.css" in config and (ROOT / "docs" / "stylesheets" / "reading.css").exists()
    assert "font: false" in config  # Material otherwise loads Google Fonts
    assert "navigation.footer" in config  # previous / next links
    for page in sorted((ROOT / "docs" / "api").glob("*.md")):
        assert page.read_text().startswith("---\nsearch:\n  boost:"), f"{page.name}: API pages rank first in search"


# -- the error catalogue: an anchor per row, and a finder that takes a pasted message ---------

CATALOGUE = (ROOT / "docs" / "errors.md").read_text(encoding="utf-8")


def test_every_catalogue_row_has_its_own_anchor():
    rows = error_anchors.rows(CATALOGUE)
    table_rows = [line for line in CATALOGUE.splitlines() if line.startswith("| ") and not line.startswith(("| Message |", "| Warning |"))]
    assert len(rows) == len(table_rows) > 100
    anchors = [anchor for _, anchor, _ in rows]
    assert len(set(anchors)) == len(anchors) and all(a.startswith("e-") for a in anchors)
    marked = error_anchors.with_anchors(CATALOGUE)
    for anchor in anchors:
        assert marked.count(f'id="{anchor}"') == 1
    # the hook touches the catalogue only
    page = type("Page", (), {"file": type("File", (), {"src_uri": "semantics.md"})()})()
    assert error_anchors.on_page_markdown(CATALOGUE, page) == CATALOGUE


def _with_fallback_off(f):
    def run():
        with functx.vmap_fallback("error"):
            f()
    return run


x = torch.randn(4, 3)
# a real functx error, and words of the catalogue row that must come first for its message
REAL_ERRORS = {
    "in_dims of a wrong type": (lambda: functx.vmap(torch.sin, in_dims="a")(x), "expected in_dims to be int"),
    "batch sizes differ": (lambda: functx.vmap(torch.add)(x, torch.randn(5, 3)), "the same size in the mapped dimension"),
    "chunk_size 0": (lambda: functx.vmap(torch.sin, chunk_size=0)(x), "chunk_size should be None or greater than 0"),
    "randomness": (lambda: functx.vmap(lambda t: t + torch.rand(3))(x), "called random operation while in randomness error mode"),
    "grad of a matrix": (lambda: functx.grad(torch.sin)(x), "to return a scalar Tensor"),
    "argnums out of range": (lambda: functx.grad(lambda a: a.sum(), argnums=3)(x), "but only <n> positional inputs"),
    "jvp primals not a tuple": (lambda: functx.jvp(torch.sin, x, x), "Expected primals to be a tuple"),
    "jvp tangent shape": (lambda: functx.jvp(torch.sin, (x,), (torch.randn(2),)), "to have the same shape"),
    "has_aux without aux": (lambda: functx.grad(lambda a: a.sum(), has_aux=True)(x), "(output, aux) if has_aux is True"),
    "fallback mode": (lambda: functx.set_vmap_fallback("loud"), "vmap fallback mode must be one of"),
    ".item() with the fallback off": (_with_fallback_off(lambda: functx.vmap(lambda t: t * float(t.sum()))(x)), "calling .item()"),
    "strict functional_call": (lambda: functx.functional_call(torch.nn.Linear(3, 2), {"weight": torch.zeros(2, 3)}, (x,), strict=True), "Error(s) in reparametrizing"),
    "stack of no models": (lambda: functx.stack_module_state([]), "Expected at least one model"),
    "jacrev chunk_size 0": (lambda: functx.jacrev(torch.sin, chunk_size=0)(x), "chunk_size should be greater than 0"),
    "integer grad": (lambda: functx.grad(lambda a: a.sum())(torch.ones(3, dtype=torch.long)), "only floating-point or complex tensors can be differentiated"),
    "non-tensor output": (lambda: functx.vmap(lambda t: 3)(x), "must only return Tensors"),
}


@needs_node
def test_a_pasted_error_message_finds_its_catalogue_row_first():
    """Each real error's message, pasted into the finder (its ranking, run in node), ranks its
    own catalogue row first."""
    rows = [{"id": anchor, "text": text} for _, anchor, text in error_anchors.rows(CATALOGUE)]
    text_of = {row["id"]: row["text"] for row in rows}
    messages = {}
    for case, (raise_it, _) in REAL_ERRORS.items():
        with pytest.raises(Exception) as caught:
            raise_it()
        messages[case] = str(caught.value)
    ranked = _node(JAVASCRIPTS / "error_finder.js", "rankRows", *([message, rows] for message in messages.values()))
    for (case, (_, expected)), hits in zip(REAL_ERRORS.items(), ranked):
        assert hits, f"{case}: no row found for {messages[case]!r}"
        best = text_of[hits[0]["id"]]
        assert expected.replace("`", "") in best.replace("`", ""), f"{case}: {messages[case]!r} ranked {best!r} first"


# -- long tables: filter and sort -------------------------------------------------------------

@needs_node
def test_long_tables_filter_by_every_word_and_sort_numbers_as_numbers():
    tables = JAVASCRIPTS / "tables.js"
    rows = ["`nonzero` indexing pass, NOT vectorized (per-sample fallback)", "`add` pointwise pass, vectorized"]
    assert _node(tables, "rowMatches", *([row, "fallback INDEXING"] for row in rows)) == [True, False]
    assert _node(tables, "rowMatches", [rows[1], ""], [rows[1], "add  vectorized"]) == [True, True]
    order = _node(tables, "compareCells", ["9", "10"], ["97%", "100%"], ["add", "Abs"], ["aten::add.Tensor", "aten::abs"], ["-", "3"])
    assert order[0] < 0 and order[1] < 0 and order[2] > 0 and order[3] > 0 and order[4] != 0
