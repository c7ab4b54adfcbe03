"""The import graph of `functx/` has no circle and no import running up a layer.

Read from the source (every `import`, at module level or inside a function, and every
`importlib.import_module("functx...")` with a literal name), so a lazy import that hides a
circle from Python's import machinery is still seen. The layers, from the bottom (a module
may import its own layer and those below; docs/architecture.md draws them):
"""

import ast
import pathlib

import functx

ROOT = pathlib.Path(functx.__file__).parent

# From the bottom up: a module may import modules of its own layer and of the layers below.
LAYERS = [
    ("core",),
    ("vmap", "functionalize", "einops"),
    ("ad",),
    ("library", "nn", "taylor"),
    ("kernels", "staging"),
    ("dp", "explain"),
    ("distributed", "__init__"),
]


def _module_name(path: pathlib.Path) -> str:
    parts = ["functx", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1]) if parts[-1] == "__init__" else ".".join(parts)


def _imports(path: pathlib.Path, name: str, modules):
    """The functx modules `path` imports (absolute names), with the line of each. `from p
    import x` imports the submodule p.x where there is one (and p runs first: counted
    unless p is this module's own package, which is running already), else p."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            module = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
            submodules = [f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in modules]
            yield from ((m, node.lineno) for m in submodules)
            if len(submodules) < len(node.names) or not name.startswith(f"{module}."):
                yield module, node.lineno
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module":
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                yield node.args[0].value, node.lineno


def _graph():
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    edges = {}
    for name, path in modules.items():
        targets = {}
        for target, line in _imports(path, name, modules):
            if target in modules and target != name:
                targets.setdefault(target, line)
        edges[name] = targets
    return modules, edges


def _layer(name: str) -> int:
    parts = name.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    for index, layer in enumerate(LAYERS):
        if top in layer:
            return index
    raise AssertionError(f"{name} is in no layer: add its package to LAYERS (tests/test_layering.py)")


def _circles(edges):
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    _, edges = _graph()
    circles = _circles(edges)
    assert not circles, "import circles (break each: move the shared part down, or register from above):\n" + "\n".join(
        " -> ".join(c) for c in circles
    )


def test_no_import_runs_up_a_layer():
    modules, edges = _graph()
    upward = [
        f"{source} (layer {_layer(source)}) imports {target} (layer {_layer(target)}) at line {line}"
        for source, targets in edges.items()
        for target, line in targets.items()
        if _layer(target) > _layer(source)
    ]
    assert not upward, "\n".join(upward)


def test_the_graph_is_read():
    """The reader sees the imports it must (a broken reader would pass the tests above)."""
    _, edges = _graph()
    assert "functx.core.interpreter" in edges["functx.core.level_tensor"]
    assert "functx.core.level_tensor" in edges["functx.core.dual_values"]
    assert "functx.vmap.rules.user_rules" in edges["functx.vmap.rules.collectives"]
    assert "functx.ad.collectives" in edges["functx.distributed"]  # `from .ad import collectives`
    assert "functx.ad.collectives" in edges["functx.ad.forward"]  # inside a function
    assert "functx.core" not in edges["functx.core.custom_function"]  # `from . import interpreter`
    assert len(edges) > 90
    assert _circles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]
