"""functx/core/patches.py names every change functx makes to torch, each is in place, once,
and can be undone where it can be."""

import ast
import pathlib
import subprocess
import sys

import pytest
import torch

import functx
from functx.core.patches import PATCHES, WAYS_IN, install, installed, patch, way_in

ROOT = pathlib.Path(functx.__file__).parent


def _run(script: str) -> list:
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()


def test_every_registered_change_is_installed():
    functx.vmap(torch.sin)(torch.ones(2))  # the kernels come with the first transform
    functx.jvp(torch.sin, (torch.ones(2),), (torch.ones(2),))
    attributes = {entry.attribute for entry in PATCHES if entry.kind == "attribute"}
    assert {"apply", "backward", "make_autograd_impl", "_checkpoint_without_reentrant_generator"} <= attributes
    assert any(entry.kind == "kernels" and "lazy" in entry.attribute for entry in PATCHES)
    for entry in PATCHES:
        assert installed(entry), entry.attribute
        assert entry.why and entry.installed_by.startswith("functx."), entry


def test_installing_again_changes_nothing():
    before = [(entry, entry.library) for entry in PATCHES]
    for entry in PATCHES:
        install(entry)
        if entry.kind == "attribute":  # the registering call again: same entry, same object
            patch(entry.owner, entry.attribute, entry.replacement, entry.why)
    assert [(entry, entry.library) for entry in PATCHES] == before
    assert torch.autograd.backward.__module__ == "functx.ad.user_backward"


def test_a_second_replacement_of_one_attribute_is_refused():
    with pytest.raises(RuntimeError, match="patched twice"):
        patch(torch.autograd, "backward", lambda *a, **k: None, "a test")


def test_undo_gives_torch_its_own_back_and_install_puts_functx_back():
    """In a fresh process: every attribute back to torch's object, lazy_bits' kernels gone
    (torch's Conjugate fallback again), then functx's back; the transforms still right."""
    script = (
        "import torch, functx\n"
        "from functx.core.patches import PATCHES, install, installed, undo\n"
        "functx.vmap(torch.sin)(torch.ones(2))\n"
        "conj = lambda: [l for l in torch._C._dispatch_dump_table('aten::mul.Tensor').splitlines() if l.startswith('Conjugate')][0]\n"
        "undoable = [e for e in PATCHES if e.kind == 'attribute' or e.reset is not None]\n"
        "for e in undoable: undo(e)\n"
        "print(all(not installed(e) for e in undoable), 'backend fallback' in conj(),\n"
        "      torch.autograd.backward.__module__ == 'torch.autograd',\n"
        "      torch.autograd.Function.apply.__func__.__module__ == 'torch.autograd.function')\n"
        "for e in undoable: install(e)\n"
        "x = torch.tensor([1.0 + 2.0j])\n"
        "print(all(installed(e) for e in PATCHES), 'backend fallback' not in conj(),\n"
        "      torch.allclose(functx.grad(lambda v: (v * v.conj()).real.sum())(torch.tensor([3.0])), torch.tensor([6.0])))\n"
    )
    assert _run(script) == ["True"] * 7


def _assignments_to_torch(tree):
    """`torch.x.y = ...`, `setattr(torch..., ...)` and `<torch module alias>.attr = ...`
    anywhere in a file (module level or inside functions)."""
    aliases = {"torch"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name.startswith("torch")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            aliases |= {a.asname or a.name for a in node.names}
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
        for target in targets:
            if isinstance(target, ast.Attribute):
                root = target
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and root.id in aliases:
                    yield target.attr, node.lineno


def test_no_module_patches_torch_outside_the_registry():
    """An assignment to a torch attribute (anywhere in functx/) must go through
    core/patches.patch; a torch.library.Library made by a module that registers no kernels
    through core/patches.kernels is an unlisted change too."""
    for path in ROOT.rglob("*.py"):
        source = path.read_text()
        for attribute, line in _assignments_to_torch(ast.parse(source)):
            raise AssertionError(f"{path.relative_to(ROOT)}:{line} assigns torch's {attribute}: use core/patches.patch")
        if "torch.library.Library(" in source and path.name != "patches.py":
            assert "kernels(" in source, f"{path.relative_to(ROOT)} makes a torch.library.Library outside core/patches.kernels"


def test_the_source_check_sees_an_assignment():
    tree = ast.parse("import torch.utils.checkpoint as c\ndef f():\n    c.x = 1\n    torch.autograd.y = 2\n")
    assert [a for a, _ in _assignments_to_torch(tree)] == ["x", "y"]


def test_conjugate_kernels_are_installed_at_the_first_transform_only():
    """core/lazy_bits.py leaves torch's Conjugate fallback alone until a transform runs (a
    plain conj-view product pays ~6 µs more through its kernel), then registers once."""
    script = (
        "import torch, functx\n"
        "table = lambda: [l for l in torch._C._dispatch_dump_table('aten::mul.Tensor').splitlines() if l.startswith('Conjugate')][0]\n"
        "before = table()\n"
        "functx.grad(torch.sin)(torch.tensor(1.0)); functx.vmap(torch.sin)(torch.ones(2))\n"
        "after = table()\n"
        "print('backend fallback' in before, 'backend fallback' not in after)\n"
    )
    assert _run(script) == ["True", "True"]


_ZERO_GRID = r'''
import warnings
import torch
aten = torch.ops.aten
Z = lambda shape, dt=torch.float64: torch._efficientzerotensor(shape, dtype=dt)
R = lambda *s: torch.randn(*s, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
inf = torch.tensor([1.0, float("inf"), -2.0], dtype=torch.float64)
PAIRS = [(Z((2, 3)), R(3)), (R(2, 3), Z((3,))), (Z((3,)), Z((2, 3))), (Z(()), inf), (inf, Z((3,), torch.float32)),
         (Z((2, 3), torch.complex128), R(3)), (Z((3,), torch.float32), torch.tensor(2)), (Z((3,)), R(4)),
         (Z((3,)), 2.5), (R(3), Z(())), (Z((3,)), R(3)), (R(4, 3), Z((1, 3))), (Z((3,), torch.complex128), R(3).to(torch.complex128)),
         (2.5, Z((3,))), (Z((3,), torch.float32), 2), (Z((2,), torch.float32), 1j), (3, Z((2,), torch.int64)), (Z((2,), torch.int64), 0)]
OPS = (aten.mul.Tensor, aten.div.Tensor, aten.dot.default, aten.vdot.default, aten.linalg_cross.default)

def run():
    out = []
    for op in OPS:
        for a, b in PAIRS:
            try:
                r = op(a, b)
            except Exception as e:
                out.append((str(op), type(e).__name__))
                continue
            values = None if r._is_zerotensor() else torch.nan_to_num(r, nan=123.0, posinf=7.0, neginf=-7.0).tolist()
            out.append((str(op), tuple(r.shape), r.dtype, str(r.device), r._is_zerotensor(), values))
    return out

before = run()
import functx
with warnings.catch_warnings():
    warnings.simplefilter("error")
    functx.vmap(torch.sin)(torch.randn(2))
after = run()
print(sum(b != a for b, a in zip(before, after)), sum(len(b) > 2 for b in before), sum(len(b) > 2 and b[4] for b in before))
'''


def test_zero_tensor_kernels_answer_as_torchs_own_outside_levels():
    """core/lazy_bits.py's kernels at the ZeroTensor key (mul, div, linalg_cross, dot, vdot)
    replace torch's from the first transform on: away from level tensors they answer what
    torch's answered (shape, dtype, device, an efficient zero or div's inf/NaN, the same
    errors), and installing them warns nothing."""
    differing, answered, zeros = map(int, _run(_ZERO_GRID))
    assert differing == 0
    assert answered >= 20 and zeros >= 15  # the grid reaches results, not only errors


_MODE_BASES = {"TorchFunctionMode", "TorchDispatchMode"}


def _dispatcher_classes(tree):
    """Classes that are a way in: a torch mode, or a class defining `__torch_dispatch__`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            bases = {getattr(b, "id", getattr(b, "attr", None)) for b in node.bases}
            methods = {m.name for m in node.body if isinstance(m, ast.FunctionDef)}
            if bases & _MODE_BASES or "__torch_dispatch__" in methods:
                yield node.name, node.lineno


def test_every_dispatcher_in_functx_is_a_registered_way_in():
    registered = {(entry.installed_by, entry.dispatcher.__name__) for entry in WAYS_IN}
    found = set()
    for path in ROOT.rglob("*.py"):
        module = "functx." + ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for name, line in _dispatcher_classes(ast.parse(path.read_text())):
            assert (module, name) in registered, f"{path.relative_to(ROOT)}:{line} {name} is a way in not registered with core/patches.way_in"
            found.add((module, name))
    assert found == registered
    assert len({entry.what for entry in WAYS_IN}) == len(WAYS_IN) == 3


def test_the_source_check_sees_a_mode_and_a_dispatch_class():
    tree = ast.parse(
        "class M(torch.overrides.TorchFunctionMode): pass\n"
        "class T(torch.Tensor):\n    def __torch_dispatch__(cls, *a): pass\n"
        "class Plain: pass\n"
    )
    assert [name for name, _ in _dispatcher_classes(tree)] == ["M", "T"]


def test_a_second_dispatcher_for_one_way_in_is_refused():
    class Another:
        pass

    with pytest.raises(RuntimeError, match="one door per way in"):
        way_in(WAYS_IN[0].what, Another, "a second door")
    assert Another not in [entry.dispatcher for entry in WAYS_IN]
