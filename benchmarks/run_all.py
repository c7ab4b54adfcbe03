"""Run every benchmark in one process and print one markdown report (the README's tables).

Run:  .venv/bin/python benchmarks/run_all.py [--quick] [--suite all|vmap|ad|nn]
      (vmap suite: full ~1.5 min, quick ~20 s; ad suite: full ~2 min, quick ~40 s on a quiet host;
      nn suite: full ~15 s, quick ~6 s)
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ad_cold_start
import ad_common
import ad_forward
import ad_hvp
import ad_influence
import ad_jacobians
import ad_maml
import ad_per_sample_grads
import nn_module_state
import vmap_mlp
import vmap_overhead
from _harness import environment, markdown_table, standard_arguments

AD_SUITE = (ad_per_sample_grads, ad_jacobians, ad_maml, ad_forward, ad_hvp, ad_influence)


def targets_table(
    overhead: dict | None, mlp: dict | None, ad: list[dict] = (), cold: dict | None = None, nn: dict | None = None
) -> str:
    """One row per target from the performance issue: what it asks, what we measured."""
    rows = []
    if overhead is not None:
        rows += _vmap_target_rows(overhead, mlp)
    for out in ad:
        rows += _ad_target_rows(out)
    if cold is not None:
        rows.append(
            [
                "cold start: first functx.grad (with `import functx`) beyond plain autograd",
                f"<= {ad_cold_start.TARGET_EXTRA_SECONDS} s",
                f"{cold['functx_extra_s']:.3f} s, of which torch's lazy `import torch.distributed.tensor` "
                f"{cold['functx_extra_s'] - cold['results']['functx, dtensor preloaded']['extra_s']:.3f} s "
                f"(torch.func: {cold['results']['torch.func']['extra_s']:.3f} s)",
                "met" if cold["target_met"] else "NOT met",
            ]
        )
    if nn is not None:
        rows += _nn_target_rows(nn)
    return markdown_table(["target", "asked", "measured", "status"], rows)


def _ad_target_rows(out: dict) -> list[list[str]]:
    rows = []
    for r in out["results"]:
        target = r.get("target", ad_common.TARGET_RATIO)
        if target is None:
            continue
        fallback = f"; per-sample loop for {', '.join(r['fallback_ops'])}" if r["fallback_ops"] else ""
        rows.append(
            [
                f"{r['label']}: functx/torch.func",
                f"<= {target}x",
                f"{r['ratio']:.2f}x{fallback}",
                "met" if r["ratio_met"] else "NOT met",
            ]
        )
        if r["loop_met"] is not None:
            rows.append(
                [
                    f"{r['label']}: faster than the torch.autograd loop (torch.func is, {r['torchfunc_vs_loop']:.2f}x)",
                    "functx/loop < 1",
                    f"{r['functx_vs_loop']:.2f}x",
                    "met" if r["loop_met"] else "NOT met",
                ]
            )
    return rows


def _nn_target_rows(out: dict) -> list[list[str]]:
    """Module-state benchmarks: only the functx/torch.func ratio is a target there."""
    rows = []
    for r in out["results"]:
        fallback = f"; per-sample loop for {', '.join(r['fallback_ops'])}" if r["fallback_ops"] else ""
        rows.append(
            [f"{r['label']}: functx/torch.func", f"<= {r['target']}x", f"{r['ratio']:.2f}x{fallback}", "met" if r["ratio_met"] else "NOT met"]
        )
    return rows


def _vmap_target_rows(overhead: dict, mlp: dict) -> list[list[str]]:
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
    return rows


def _mlp_status(result: dict) -> str:
    status = "met" if result["target_met"] else "NOT met"
    if result.get("contended"):
        return f"unreliable ({status} under core contention: rerun on a quiet machine)"
    return status


def main():
    parser = standard_arguments(__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=("all", "vmap", "ad", "nn"), default="all", help="which benchmarks to run")
    parser.add_argument("--ad-threads", type=int, default=1, help="intra-op threads of the AD and nn benchmarks (default 1)")
    args = parser.parse_args()
    env = environment()
    overhead = mlp = cold = nn = None
    ad: list[dict] = []
    if args.suite in ("all", "vmap"):
        overhead = vmap_overhead.run(quick=args.quick, rounds=args.rounds)
        mlp = vmap_mlp.run(quick=args.quick, rounds=args.rounds)
    if args.suite in ("all", "ad"):
        ad = [module.run(quick=args.quick, rounds=args.rounds, n_threads=args.ad_threads) for module in AD_SUITE]
        cold = ad_cold_start.run(quick=args.quick)  # --rounds is for the in-process timers
    if args.suite in ("all", "nn"):
        nn = nn_module_state.run(quick=args.quick, rounds=args.rounds, n_threads=args.ad_threads)
    print("# functx benchmark results\n")
    print(", ".join(f"{k}: {v}" for k, v in env.items()) + "\n")
    print("## Targets\n")
    print(targets_table(overhead, mlp, ad, cold, nn) + "\n")
    for out in (overhead, mlp, *ad, cold, nn):
        if out is None:
            continue
        print(f"## {out['title']}\n")
        print(out["table"] + "\n")
        print(out["notes"] + "\n")


if __name__ == "__main__":
    main()
