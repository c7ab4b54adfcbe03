"""Run every benchmark in one process and print one markdown report (the README's tables).

Run:  .venv/bin/python benchmarks/run_all.py [--quick]      (full: ~1.5 min; quick: ~20 s)
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import vmap_mlp
import vmap_overhead
from _harness import environment, markdown_table, standard_arguments


def targets_table(overhead: dict, mlp: dict) -> str:
    """One row per target from the performance issue: what it asks, what we measured."""
    rows = []
    for r in overhead["results"]:
        rows.append(
            [
                f"vmap overhead per op per level ({r['levels']} level{'s' if r['levels'] > 1 else ''})",
                f"<= {vmap_overhead.TARGET_US_PER_OP_PER_LEVEL:.0f} µs",
                f"{r['functx_overhead_us']:.1f} µs, p10 {r['functx_overhead_p10_us']:.1f} µs "
                f"(torch.func {r['torchfunc_overhead_us']:.1f} µs)",
                "met" if r["target_met"] else "NOT met",
            ]
        )
    for r in mlp["results"]:
        fallback = f"; per-sample loop for {', '.join(r['fallback_ops'])}" if r["fallback_ops"] else ""
        rows.append(
            [
                f"MLP batch {r['batch']}, {r['threads']} thread{'s' if r['threads'] > 1 else ''}: functx/torch.func",
                f"<= {r['target']}x",
                f"{r['ratio']:.2f}x{fallback}",
                _mlp_status(r),
            ]
        )
    return markdown_table(["target", "asked", "measured", "status"], rows)


def _mlp_status(result: dict) -> str:
    status = "met" if result["target_met"] else "NOT met"
    if result.get("contended"):
        return f"unreliable ({status} under core contention: rerun on a quiet machine)"
    return status


def main():
    args = standard_arguments(__doc__.splitlines()[0]).parse_args()
    env = environment()
    overhead = vmap_overhead.run(quick=args.quick, rounds=args.rounds)
    mlp = vmap_mlp.run(quick=args.quick, rounds=args.rounds)
    print("# functx benchmark results\n")
    print(", ".join(f"{k}: {v}" for k, v in env.items()) + "\n")
    print("## Targets\n")
    print(targets_table(overhead, mlp) + "\n")
    for out in (overhead, mlp):
        print(f"## {out['title']}\n")
        print(out["table"] + "\n")
        print(out["notes"] + "\n")


if __name__ == "__main__":
    main()
