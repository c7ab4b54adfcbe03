"""Check that the API reference covers functx's public API and that every public function
and class has a runnable example.

Public API: the names in `functx.__all__`; for the modules among them (`functx.nn`,
`functx.library`, and the lazily loaded `functx.dp` and `functx.kernels`), their public
names (the module's `__all__`, else the functions and classes it defines whose names do not
start with an underscore).

Fails (exit 1, naming them) when
- a public name is not rendered by a mkdocstrings `::: functx.<name>` directive in a page
  under docs/ (`::: functx.nn.functional_call` and `::: functx.functional_call` both count
  for an object exported in both places; `::: functx.<module>` counts for the whole module);
- a public function or class has no `>>>` example in its docstring;
- a directive names an object by a path that is also a submodule's (`::: functx.vmap`: the
  function at run time, the package functx/vmap/ to the docs generator, which reads the
  source), so the page would show the module;
- a public function or class lacks a section of its reference entry (issue 32):
  functions: Args (every parameter named, with its type), Returns, Raises (linking the
  error catalogue), Examples (at least two `>>>` lines that call it) and "Differences from
  torch.func"; classes: the same without Returns (Args: the constructor's parameters);
  warning and exception classes: Examples (two `>>>` lines naming it) and "Differences
  from torch.func" (they take no arguments, return and raise nothing); a class whose
  constructor takes no arguments (a namespace) needs two example lines naming it, not
  calling it.

Run: .venv/bin/python scripts/check_docs_api.py
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DIRECTIVE = re.compile(r"^:::\s+(functx(?:\.[A-Za-z_][A-Za-z0-9_]*)*)\s*$", re.MULTILINE)


def public_api() -> dict[str, object]:
    """Dotted name -> object, for every public name (modules expanded into their members)."""
    import functx

    api: dict[str, object] = {}
    for name in functx.__all__:
        obj = getattr(functx, name)  # loads functx.dp / functx.kernels through __getattr__
        if isinstance(obj, types.ModuleType):
            module = importlib.import_module(f"functx.{name}")
            members = getattr(module, "__all__", None)
            if members is None:
                members = [
                    n
                    for n, o in vars(module).items()
                    if not n.startswith("_")
                    and (inspect.isfunction(o) or inspect.isclass(o))
                    and o.__module__ == module.__name__
                ]
            for member in members:
                api[f"functx.{name}.{member}"] = getattr(module, member)
        else:
            api[f"functx.{name}"] = obj
    return api


SECTIONS = ("Args:", "Returns:", "Raises:", "Examples:", "Differences from torch.func")


def _sections_for(obj: object) -> tuple[str, ...]:
    """The sections a reference entry for `obj` must have."""
    if inspect.isclass(obj) and issubclass(obj, BaseException):
        return ("Examples:", "Differences from torch.func")
    if inspect.isclass(obj):
        return tuple(s for s in SECTIONS if s != "Returns:")
    return SECTIONS


def _parameters(obj: object) -> list[inspect.Parameter]:
    try:
        return list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError):  # a builtin's constructor
        return []


def reference_gaps(name: str, obj: object) -> list[str]:
    """What the reference entry of `obj` (public as `name`) lacks (empty: complete)."""
    doc = inspect.getdoc(obj) or ""
    sections = _sections_for(obj)
    parameters = [p for p in _parameters(obj) if not p.name.startswith("_")] if "Args:" in sections else []
    if not parameters and inspect.isclass(obj):
        sections = tuple(s for s in sections if s != "Args:")  # nothing to construct it from
    gaps = [f"no '{section}' section" for section in sections if section not in doc]
    if "Args:" in doc:
        args = re.split(r"^\s*(?:Returns|Raises|Examples|Attributes|Methods):", doc.split("Args:", 1)[1], maxsplit=1, flags=re.M)[0]
        for parameter in parameters:
            stars = {parameter.VAR_POSITIONAL: "*", parameter.VAR_KEYWORD: "**"}.get(parameter.kind, "")
            shown = stars + parameter.name
            if not re.search(rf"^\s+{re.escape(shown)} \(", args, re.M):
                gaps.append(f"Args: no entry '{shown} (type...)' for parameter {parameter.name}")
    if "Raises:" in sections and "Raises:" in doc and "errors.md" not in doc.split("Raises:", 1)[1]:
        gaps.append("Raises: no link to the error catalogue (errors.md)")
    short = name.rpartition(".")[2]
    # a class that takes nothing (a warning, a namespace of policies) is named, not called
    named_only = inspect.isclass(obj) and (issubclass(obj, BaseException) or not _parameters(obj))
    called = short if named_only else f"{short}("
    calls = [line for line in doc.splitlines() if line.lstrip().startswith(">>>") and called in line]
    if len(calls) < 2:
        gaps.append(f"Examples: {len(calls)} example lines {'call' if called.endswith('(') else 'name'} it (at least 2)")
    return gaps


def documented() -> set[str]:
    """The identifiers of every `::: functx...` directive under docs/."""
    found: set[str] = set()
    for page in sorted((ROOT / "docs").rglob("*.md")):
        found.update(DIRECTIVE.findall(page.read_text(encoding="utf-8")))
    return found


def _is_submodule(dotted: str) -> bool:
    try:
        return importlib.util.find_spec(dotted) is not None
    except (ImportError, ValueError):
        return False


def main() -> int:
    api = public_api()
    rendered = documented()
    rendered_ids = set()
    shadowed = []
    for ident in sorted(rendered):
        module, _, attr = ident.rpartition(".")
        try:
            obj = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            continue  # a nested name (functx.kernels.LayerGradients.norms_sq); mkdocs checks it
        rendered_ids.add(id(obj))
        if not isinstance(obj, types.ModuleType) and _is_submodule(ident):
            # `functx.vmap` is the function at run time, but the docs generator reads the
            # source and finds the package functx/vmap/ under that name
            shadowed.append(f"{ident} (use '::: {obj.__module__}.{obj.__qualname__}' with options: heading)")

    def covered(name: str, obj: object) -> bool:
        parent = name.rpartition(".")[0]
        return name in rendered or parent in rendered or id(obj) in rendered_ids

    missing = sorted(name for name, obj in api.items() if not covered(name, obj))
    no_example = sorted(  # its own docstring (__doc__), not one inherited from a base class
        name
        for name, obj in api.items()
        if (inspect.isfunction(obj) or inspect.isclass(obj)) and ">>>" not in (obj.__doc__ or "")
    )
    for name in missing:
        print(f"not in the API reference (no '::: {name}' in docs/*.md): {name}")
    for name in no_example:
        print(f"no runnable example ('>>>') in the docstring of {name}")
    for name in shadowed:
        print(f"a '::: ' directive would render a submodule, not the object of that name: {name}")
    entries = {id(obj): name for name, obj in api.items() if inspect.isfunction(obj) or inspect.isclass(obj)}
    incomplete = {name: reference_gaps(name, api[name]) for name in sorted(entries.values())}
    for name, gaps in incomplete.items():
        for gap in gaps:
            print(f"{name}'s reference entry: {gap}")
    if missing or no_example or shadowed or any(incomplete.values()):
        return 1
    print(
        f"docs API check: {len(api)} public names, all in the reference; {len(entries)} functions "
        f"and classes, each with a full reference entry (Args, Returns, Raises, Examples, "
        f"Differences from torch.func)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
