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
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _ZERO_GRID], capture_output=True, text=True, check=True).stdout.split()
    differing, answered, zeros = map(int, out)
    assert differing == 0
    assert answered >= 20 and zeros >= 15  # the grid reaches results, not only errors
