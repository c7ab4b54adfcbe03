"""Cold start of the first gradient: functx vs torch.func vs plain torch.autograd.grad.

Each measurement is a FRESH Python process that imports torch (not timed) and then times,
from after `import torch` to the end of the first gradient:

    autograd       torch.autograd.grad of f at x (the baseline: nothing to import)
    torch.func     import torch.func; torch.func.grad(f)(x)
    functx         import functx; functx.grad(f)(x)       (import and first call timed apart)
    functx, dtensor preloaded
                   the same after an untimed `import torch.distributed.tensor`
    import torch.distributed.tensor
                   that import alone

Why the last two: on torch 2.13 the first `__torch_dispatch__` call on any wrapper
subclass makes C++ import `torch.distributed.tensor` lazily (~0.5-1 s on this host), so
that import is part of the first functx.grad call; preloading it shows how much of
functx's cold start is that import. Processes run in rounds, one of each kind per round
in rotating order; "extra over autograd" is the median over rounds of (kind - autograd)
from the same round. Target (from the performance issue): functx at most 0.2 s beyond
plain autograd.

Run:  .venv/bin/python benchmarks/ad_cold_start.py [--quick] [--rounds N]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import markdown_table, standard_main

TARGET_EXTRA_SECONDS = 0.2
DTENSOR = "torch.distributed.tensor"

# The child process: everything after `import torch` up to the end of the first gradient
# is timed; the import of the transform library and its first call are timed apart.
CHILD = r"""
import json, sys, time
import torch
kind = sys.argv[1]
if kind == "functx, dtensor preloaded":
    import torch.distributed.tensor
x = torch.randn(4, 3)
w = torch.randn(3)
def f(w):
    return torch.tanh(x @ w).sum()
dtensor_before = True  # only the transform kinds ask whether their first call imported it
start = time.perf_counter()
if kind == "autograd":
    imported = time.perf_counter()
    w.requires_grad_()
    torch.autograd.grad(f(w), w)
elif kind == "import torch.distributed.tensor":
    import torch.distributed.tensor
    imported = time.perf_counter()
else:
    if kind == "torch.func":
        import torch.func as transforms
    else:
        import functx as transforms
    imported = time.perf_counter()
    dtensor_before = "torch.distributed.tensor" in sys.modules
    transforms.grad(f)(w)
end = time.perf_counter()
print(json.dumps({
    "import_s": imported - start,
    "first_call_s": end - imported,
    "total_s": end - start,
    "dtensor_loaded_by_call": "torch.distributed.tensor" in sys.modules and not dtensor_before,
}))
"""

KINDS = ("autograd", "torch.func", "functx", "functx, dtensor preloaded", f"import {DTENSOR}")


def one_process(kind: str) -> dict:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", CHILD, kind], capture_output=True, text=True, env=env, cwd=repo, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"cold-start child {kind!r} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(quick: bool = False, rounds: int | None = None, n_threads: int | None = None) -> dict:
    """n_threads is accepted for a uniform signature and ignored (each child uses torch's default)."""
    rounds = rounds or (1 if quick else 5)
    samples: dict[str, list[dict]] = {k: [] for k in KINDS}
    for r in range(rounds):
        shift = r % len(KINDS)
        for kind in KINDS[shift:] + KINDS[:shift]:
            samples[kind].append(one_process(kind))

    def median(kind, key="total_s"):
        return statistics.median(s[key] for s in samples[kind])

    def extra(kind):
        return statistics.median(a["total_s"] - b["total_s"] for a, b in zip(samples[kind], samples["autograd"]))

    rows, results = [], {}
    for kind in KINDS:
        results[kind] = {
            "total_s": median(kind),
            "import_s": median(kind, "import_s"),
            "first_call_s": median(kind, "first_call_s"),
            "extra_s": extra(kind),
            "dtensor_loaded_by_call": sum(s["dtensor_loaded_by_call"] for s in samples[kind]),
        }
        r = results[kind]
        transform = kind not in ("autograd", f"import {DTENSOR}")
        rows.append(
            [
                kind,
                f"{r['total_s']:.3f}",
                f"{r['import_s']:.3f}" if transform else "—",
                f"{r['first_call_s']:.3f}" if transform else "—",
                "—" if kind == "autograd" else f"{r['extra_s']:+.3f}",
                f"{r['dtensor_loaded_by_call']}/{rounds}" if transform else "—",
            ]
        )
    functx_extra = results["functx"]["extra_s"]
    target_met = functx_extra <= TARGET_EXTRA_SECONDS
    table = markdown_table(
        [
            "process (after `import torch`)",
            "total s (median)",
            "library import s",
            "first grad call s",
            "extra over autograd s (paired median)",
            f"first call imported {DTENSOR}",
        ],
        rows,
    )
    dtensor_share = results["functx"]["total_s"] - results["functx, dtensor preloaded"]["total_s"]
    notes = (
        f"{rounds} fresh processes per kind, in rotating order. functx extra over plain autograd: "
        f"{functx_extra:.3f} s (target <= {TARGET_EXTRA_SECONDS} s: {'met' if target_met else 'NOT met'}); "
        f"torch.func extra: {results['torch.func']['extra_s']:.3f} s. Of functx's cold start, about "
        f"{dtensor_share:.3f} s is torch's lazy `import {DTENSOR}` (functx minus functx with it preloaded; "
        f"that import alone takes {results[f'import {DTENSOR}']['total_s']:.3f} s); the rest, "
        f"{results['functx, dtensor preloaded']['extra_s']:.3f} s over autograd, is functx's own import and first call."
    )
    return {
        "title": "Cold start of the first grad",
        "results": results,
        "target_met": target_met,
        "functx_extra_s": functx_extra,
        "table": table,
        "notes": notes,
    }


def main():
    standard_main(run, __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
