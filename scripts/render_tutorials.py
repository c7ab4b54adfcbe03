"""Render the tutorials (tutorials/*.py) as pages of the documentation site.

A tutorial is a script in the "percent" format: its module docstring introduces it, then
`# %% [markdown]` cells (comment lines) explain and `# %%` cells hold the code. The page is
the docstring (its first line the title), then the cells in order: markdown as markdown,
code as Python blocks. After the cell that saves a figure (`save(fig, out, "name.png",
"what you should see")`), the figure is shown when docs/images/ holds a copy of it, else a
note says where running the tutorial writes it.

What the script prints is captured at build time: each tutorial runs once in its quick mode
(`--quick`, the sizes CI runs), with `print` recorded together with the tutorial's line that
printed it (the innermost line of the tutorial on the stack: a print in `_common.py` counts
where the tutorial called it), and each code cell is followed by what its lines printed. A
tutorial that fails fails the build. `FUNCTX_DOCS_RUN_TUTORIALS=0` skips the runs (a faster
local preview; the pages then say that no output was captured).

mkdocs runs this script through the gen-files plugin (mkdocs.yml), so the pages are made
at build time from the current scripts. On its own it writes the pages into a folder:

    .venv/bin/python scripts/render_tutorials.py --out /tmp/tutorial-pages
"""

from __future__ import annotations

import ast
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TUTORIALS = ROOT / "tutorials"
IMAGES = ROOT / "docs" / "images"
CELL = re.compile(r"^[ \t]*# %%(?P<markdown>[ \t]*\[markdown\])?[ \t]*$")


# Put first on the tutorial's PYTHONPATH as sitecustomize.py, so that every process of the run
# records its prints (the distributed tutorial's ranks are processes of their own).
RECORDER = """\
import builtins, json, os, sys, time
_print = builtins.print
_script = os.environ["FUNCTX_RECORD_SCRIPT"]
_log = os.path.join(os.environ["FUNCTX_RECORD_DIR"], f"{os.getpid()}.jsonl")


def _recording_print(*args, sep=None, end=None, file=None, flush=False):
    if file is None or file is sys.stdout:
        text = (" " if sep is None else sep).join(map(str, args)) + ("\\n" if end is None else end)
        line, frame = 0, sys._getframe(1)
        while frame is not None and not line:  # the innermost line of the tutorial running
            if frame.f_code.co_filename == _script:
                line = frame.f_lineno
            frame = frame.f_back
        with open(_log, "a", encoding="utf-8") as log:
            log.write(json.dumps([time.time(), line, text]) + "\\n")
    _print(*args, sep=sep, end=end, file=file, flush=flush)


builtins.print = _recording_print
"""


def printed(path: Path, timeout: float = 600.0) -> list[tuple[int, str]]:
    """(line of the tutorial, text) of every print of one `--quick` run of the tutorial at
    `path`, in the order printed. Raises RuntimeError (with the end of its stderr) when the
    run fails."""
    path = path.resolve()
    with tempfile.TemporaryDirectory(prefix=f"functx-{path.stem}-") as tmp:
        tmp = Path(tmp)
        (tmp / "site").mkdir()
        (tmp / "log").mkdir()
        (tmp / "site" / "sitecustomize.py").write_text(RECORDER, encoding="utf-8")
        out = tmp / "out"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp / "site"), os.environ.get("PYTHONPATH")])),
            "FUNCTX_RECORD_SCRIPT": str(path),
            "FUNCTX_RECORD_DIR": str(tmp / "log"),
        }
        result = subprocess.run(
            [sys.executable, str(path), "--quick", "--out", str(out)],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
        )
        if result.returncode != 0:
            raise RuntimeError(f"tutorials/{path.name} failed while its output was captured "
                               f"(exit {result.returncode}):\n{result.stderr[-3000:]}")
        records = [json.loads(row) for log in (tmp / "log").glob("*.jsonl") for row in log.read_text(encoding="utf-8").splitlines()]
    shown_out = f"tutorials/out/{path.stem}"
    return [(line, text.replace(str(out), shown_out)) for _, line, text in sorted(records, key=lambda r: r[0])]


def _dedent(lines: list[str]) -> list[str]:
    """The lines without their common indentation (blank lines ignored), blank ends removed."""
    while lines and not lines[0].strip():
        lines = lines[1:]
    while lines and not lines[-1].strip():
        lines = lines[:-1]
    indents = [len(line) - len(line.lstrip()) for line in lines if line.strip()]
    cut = min(indents, default=0)
    return [line[cut:] if line.strip() else "" for line in lines]


def _markdown_cell(lines: list[str]) -> str:
    out = []
    for line in _dedent(lines):
        if line.startswith("# "):
            out.append(line[2:])
        elif line.startswith("#"):
            out.append(line[1:])
        else:
            out.append(line)
    return "\n".join(out)


def _docstring_markdown(doc: str) -> tuple[str, str]:
    """(title, body as markdown). A `Run:` paragraph (commands, one a line) becomes a code block."""
    title, _, rest = doc.strip().partition("\n")
    out: list[str] = []
    lines = rest.strip("\n").splitlines()
    i = 0
    while i < len(lines):
        match = re.match(r"^Run:\s+(\S.*)$", lines[i])
        if not match:
            out.append(lines[i])
            i += 1
            continue
        commands = [match.group(1).strip()]
        i += 1
        while i < len(lines) and lines[i].startswith(" ") and lines[i].strip():
            commands.append(lines[i].strip())
            i += 1
        # "python x.py    (a few seconds)" -> "python x.py    # a few seconds"
        commands = [re.sub(r"^(.*?\S)(\s{2,})\((.*)\)$", r"\1\2# \3", c) for c in commands]
        out += ["Run:", "", "```bash", *commands, "```", ""]
    return title.strip().rstrip("."), "\n".join(out).strip()


def _text(node: ast.AST, constants: dict[str, object]) -> str:
    """The text of a string expression: literals, f-strings over module constants, `+`;
    anything else (a conditional suffix) is left out."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value))
            elif isinstance(value, ast.FormattedValue) and isinstance(value.value, ast.Name):
                parts.append(str(constants.get(value.value.id, "{" + value.value.id + "}")))
            else:
                parts.append("{" + ast.unparse(value.value) + "}")
        return "".join(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _text(node.left, constants) + _text(node.right, constants)
    return ""


def _figures(tree: ast.Module) -> list[tuple[int, str, str]]:
    """(line, file name, what you should see) of every `save(fig, out, "x.png", text)` call."""
    constants = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant):
            for target in stmt.targets:
                if isinstance(target, ast.Name):
                    constants[target.id] = stmt.value.value
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "save"
            and len(node.args) >= 3
            and isinstance(node.args[2], ast.Constant)
            and str(node.args[2].value).endswith(".png")
        ):
            what = _text(node.args[3], constants) if len(node.args) > 3 else ""
            found.append((node.lineno, node.args[2].value, what))
    return sorted(found)


def _figure_block(name: str, filename: str, what: str) -> str:
    what = what.strip()
    if (IMAGES / filename).exists():
        caption = f"*`{filename}`: {what}*" if what else f"*`{filename}`*"
        return f"![{filename}](../images/{filename})\n\n{caption}"
    seen = f" What you should see: {what}" if what else ""
    return (
        f'!!! note "Figure `{filename}`"\n'
        f"    Running the tutorial writes this figure to `tutorials/out/{name}/{filename}`.{seen}"
    )


def _output_block(texts: list[str]) -> str:
    text = "".join(texts).strip("\n")
    return "*Printed (the `--quick` run, when this site was built):*\n\n```text\n" + text + "\n```"


def render(path: Path, output: list[tuple[int, str]] | None = None) -> str:
    """The markdown page of one tutorial script; `output`: what it printed (`printed(path)`),
    shown after the code cells that printed it (None: not captured)."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    name = path.stem
    title, intro = _docstring_markdown(ast.get_docstring(tree) or name)
    first = tree.body[0]
    start = first.end_lineno if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) else 0
    lines = source.splitlines()

    # cells: (kind, first line number (1-based), lines)
    cells: list[tuple[str, int, list[str]]] = [("code", start + 1, [])]
    for number in range(start + 1, len(lines) + 1):
        line = lines[number - 1]
        match = CELL.match(line)
        if match:
            cells.append(("markdown" if match.group("markdown") else "code", number + 1, []))
        else:
            cells[-1][2].append(line)

    figures = _figures(tree)
    parts = [
        f"# {title}",
        f'!!! info "Run it"\n'
        f"    This page is the script `tutorials/{name}.py` rendered as it is; "
        f"run it with `.venv/bin/python tutorials/{name}.py` (add `--quick` for a few-second run) "
        f"after `.venv/bin/pip install -e '.[tutorials]'`. It prints what it measures and "
        f"writes its figures to `tutorials/out/{name}/`. "
        + ("What it printed in its `--quick` run when this site was built follows each cell "
           "(tiny sizes: the numbers of a full run differ; timings are of the machine that "
           "built the site)." if output is not None else
           "This build did not run the tutorials (`FUNCTX_DOCS_RUN_TUTORIALS=0`), so no output is shown."),
        intro,
    ]
    for index, (kind, first_line, body) in enumerate(cells):
        last_line = cells[index + 1][1] - 2 if index + 1 < len(cells) else len(lines)
        if kind == "markdown":
            text = _markdown_cell(body)
            if text:
                parts.append(text)
            continue
        code = _dedent(body)
        if code:
            parts.append("```python\n" + "\n".join(code) + "\n```")
        cell_output = [text for line, text in output or () if first_line <= line <= last_line]
        if cell_output:
            parts.append(_output_block(cell_output))
        for line, filename, what in figures:
            if first_line <= line <= last_line:
                parts.append(_figure_block(name, filename, what))
    return "\n\n".join(parts) + "\n"


def pages() -> dict[str, str]:
    """Page path (relative to docs/) -> markdown, for every tutorial (tutorials/*.py but the
    `_` helpers). mkdocs.yml's nav lists them: a tutorial missing there fails the strict
    build (`validation: omitted_files: warn`)."""
    scripts = sorted(p for p in TUTORIALS.glob("*.py") if not p.name.startswith("_"))
    if os.environ.get("FUNCTX_DOCS_RUN_TUTORIALS", "1") == "0":
        outputs: list[list[tuple[int, str]] | None] = [None] * len(scripts)
    else:  # two at a time: each pins its own threads
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            outputs = list(pool.map(printed, scripts))
    return {f"tutorials/{p.stem}.md": render(p, out) for p, out in zip(scripts, outputs)}


if __name__ == "<run_path>":  # run by mkdocs-gen-files during `mkdocs build` / `mkdocs serve`
    import mkdocs_gen_files

    for page, text in pages().items():
        with mkdocs_gen_files.open(page, "w") as f:
            f.write(text)

elif __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder to write the pages into")
    out = parser.parse_args().out
    for page, text in pages().items():
        target = out / page
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
        print(target)
