"""functx/core/patches.py names every change functx makes to torch, and each is in place."""

import ast
import pathlib

import functx  # noqa: F401  (installs the patches)
from functx.core.patches import PATCHES, installed

ROOT = pathlib.Path(functx.__file__).parent


def test_every_listed_patch_is_installed():
    for entry in PATCHES:
        assert installed(entry), entry[:3]


def _assignments_to_torch(tree):
    """`torch.x.y = ...` and `<module alias>.attr = ...` at module level of a file."""
    aliases = {"torch"}
    for node in tree.body:
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name.startswith("torch")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            aliases |= {a.asname or a.name for a in node.names}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Attribute):
                    root = target
                    while isinstance(root, ast.Attribute):
                        root = root.value
                    if isinstance(root, ast.Name) and root.id in aliases:
                        yield target.attr


def test_no_module_patches_torch_outside_the_list():
    """A new module-level assignment to a torch attribute must be listed in patches.py."""
    listed = {attribute for _, attribute, _, _ in PATCHES}
    for path in ROOT.rglob("*.py"):
        for attribute in _assignments_to_torch(ast.parse(path.read_text())):
            assert attribute in listed, f"{path.relative_to(ROOT)} patches torch's {attribute}: list it in core/patches.py"


def test_conjugate_kernels_are_installed_at_the_first_transform_only():
    """core/lazy_bits.py leaves torch's Conjugate fallback alone until a transform runs (a
    plain conj-view product pays ~6 µs more through its kernel), then registers once."""
    import subprocess
    import sys

    script = (
        "import torch, functx\n"
        "table = lambda: [l for l in torch._C._dispatch_dump_table('aten::mul.Tensor').splitlines() if l.startswith('Conjugate')][0]\n"
        "before = table()\n"
        "functx.grad(torch.sin)(torch.tensor(1.0)); functx.vmap(torch.sin)(torch.ones(2))\n"
        "after = table()\n"
        "print('backend fallback' in before, 'backend fallback' not in after)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "True"]
