"""The documentation site's own code: the copy button's prompt stripping (a pasted example
must run) and the settings that keep the site readable and offline."""

from __future__ import annotations

import inspect
import json
import pathlib
import shutil
import subprocess
import textwrap

import pytest

import functx

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "docs" / "javascripts" / "copy_prompts.js"
NODE = shutil.which("node")


def _copyable(*texts: str) -> list[str]:
    program = f"const {{copyableText}} = require({json.dumps(str(SCRIPT))}); process.stdout.write(JSON.stringify({json.dumps(list(texts))}.map(copyableText)))"
    result = subprocess.run([NODE, "-e", program], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.skipif(NODE is None, reason="node is not installed (the copy button's script is JavaScript)")
def test_copy_button_strips_prompts_and_results():
    session = ">>> import torch\n>>> def f(x):\n...     return x * 2\n...\n>>> f(torch.ones(2))\ntensor([2., 2.])\n"
    plain = "import torch\nx = torch.ones(2)  # >>> inside a comment stays\n"
    got = _copyable(session, plain)
    assert got == ["import torch\ndef f(x):\n    return x * 2\n\nf(torch.ones(2))\n", plain]


@pytest.mark.skipif(NODE is None, reason="node is not installed")
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
    assert "javascripts/copy_prompts.js" in config and SCRIPT.exists()
    assert "stylesheets/reading.css" in config and (ROOT / "docs" / "stylesheets" / "reading.css").exists()
    assert "font: false" in config  # Material otherwise loads Google Fonts
    assert "navigation.footer" in config  # previous / next links
    for page in sorted((ROOT / "docs" / "api").glob("*.md")):
        assert page.read_text().startswith("---\nsearch:\n  boost:"), f"{page.name}: API pages rank first in search"
