"""vmap over a TensorDict against vmap over the same tensors in a dict (issue 29).

A TensorDict of K leaves (batch size [B], each leaf (B, 16)) goes through a per-element
function that reads every leaf (a sum of tanh's). Contenders, alternating in one process:

    functx, TensorDict     functx.vmap over the TensorDict (in_dims address its batch dim)
    functx, dict           functx.vmap over a dict of the same tensors (pytree leaves)
    torch.func, TensorDict torch.func.vmap over the TensorDict (tensordict's own hooks)

Target (issue 29): functx over a TensorDict within 1.1x of functx over the dict (paired
median). Values checked equal before timing.

Run:  .venv/bin/python benchmarks/vmap_tensordict.py [--quick] [--threads N]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.func

import functx
from _harness import interleaved, markdown_table, threads

TARGET = 1.1
BATCH = 32


def _function(data):
    total = 0
    for key in sorted(data.keys()):
        total = total + data[key].tanh().sum()
    return total


def run(quick: bool = False, rounds: int | None = None, n_threads: int = 1) -> dict:
    from tensordict import TensorDict

    rounds = rounds or (4 if quick else 20)
    rows = []
    for leaves in (4, 16, 64):
        data = {f"k{i}": torch.randn(BATCH, 16) for i in range(leaves)}
        td = TensorDict(data, [BATCH])
        timed = {
            "functx, TensorDict": lambda: functx.vmap(_function)(td),
            "functx, dict": lambda: functx.vmap(_function)(data),
            "torch.func, TensorDict": lambda: torch.func.vmap(_function)(td),
        }
        with threads(n_threads):
            results = {name: fn() for name, fn in timed.items()}
            for out in results.values():
                torch.testing.assert_close(out, results["functx, dict"])
            timings = interleaved(timed, rounds=rounds, block_seconds=0.02, warmup_calls=2)
        ratio = timings.paired_quantile(0.5, lambda a, b: a / b, "functx, TensorDict", "functx, dict")
        vs_torch = timings.paired_quantile(0.5, lambda a, b: a / b, "functx, TensorDict", "torch.func, TensorDict")
        rows.append([
            f"{leaves} leaves",
            *(f"{timings.median(name) * 1e6:.0f}" for name in timed),
            f"{ratio:.2f}x",
            f"{vs_torch:.2f}x",
            "met" if ratio <= TARGET else "NOT met",
        ])
    header = ["TensorDict of K leaves, batch 32", *(f"{name} µs" for name in timed), "TensorDict / dict (functx)", "functx / torch.func (TensorDict)", f"<= {TARGET}x"]
    return {"title": "vmap over a TensorDict vs the same tensors in a dict", "table": markdown_table(header, rows),
            "notes": f"{n_threads} intra-op thread(s), {rounds} alternating rounds, medians and the median of paired ratios."}


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    report = run(args.quick, args.rounds, args.threads)
    print(f"## {report['title']}\n\n{report['table']}\n\n{report['notes']}")
