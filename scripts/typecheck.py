"""Type-check functx's public API and the README's and the docs' Python examples.

The public API: every module that defines a name of `functx.__all__` (its annotated
functions' bodies too). The examples:
every ```python block of README.md and docs/**/*.md is a program a reader may paste, so each
is written to its own module, self-contained (its imports and data in it), and mypy checks
them with functx from this checkout. Exits with mypy's status: 0 errors is the bar.

    .venv/bin/python scripts/typecheck.py [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def pages():
    yield ROOT / "README.md"
    yield from sorted((ROOT / "docs").rglob("*.md"))


def modules(out: pathlib.Path) -> list[pathlib.Path]:
    written = []
    for page in pages():
        blocks = BLOCK.findall(page.read_text())
        if not blocks:
            continue
        name = re.sub(r"\W", "_", str(page.relative_to(ROOT)).removesuffix(".md"))
        for number, block in enumerate(blocks, start=1):
            path = out / f"example_{name}_{number}.py"
            path.write_text(block)
            written.append(path)
    return written


def public_modules() -> list[str]:
    """The files of the modules that define functx's public names."""
    sys.path.insert(0, str(ROOT))
    import inspect

    import functx

    files = set()
    for name in functx.__all__:
        module = inspect.getmodule(getattr(functx, name))
        path = getattr(module, "__file__", None)
        if path and pathlib.Path(path).resolve().is_relative_to(ROOT / "functx"):
            files.add(str(pathlib.Path(path).resolve()))
    return sorted(files)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", help="write the modules here (default: a temporary directory)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        out = pathlib.Path(args.keep or scratch)
        out.mkdir(parents=True, exist_ok=True)
        files = modules(out)
        env = {**os.environ, "MYPYPATH": str(ROOT)}  # functx from this checkout, however it is installed
        command = [sys.executable, "-m", "mypy", "--no-error-summary", "--hide-error-context", "--follow-imports=silent",
                   "--ignore-missing-imports", "--cache-dir", str(ROOT / ".mypy_cache"), *public_modules(), *map(str, files)]  # fmt: skip
        result = subprocess.run(command, env=env, text=True, capture_output=True)
        print(result.stdout, end="")
        print(result.stderr, end="", file=sys.stderr)
        print(f"typecheck: functx's public API and {len(files)} examples, mypy exit {result.returncode}")
        return result.returncode


if __name__ == "__main__":
    sys.exit(main())
