"""Per-op dispatch overhead of vmap: functx vs torch.func vs eager, 1 and 2 nested levels.

The workload is a chain of 200 tiny pointwise ops (sin, mul by a Python scalar, add of a
closed-over unbatched [8, 4] tensor, repeating) on an [8, 4] tensor: the kernels cost
almost nothing, so the time is dispatch. For each vmap depth L we report

    raw per op       = time(f under L levels of vmap) / 200
    overhead per op  = (time under vmap - time eager on [8, 4]) / 200 / L   (paired per round)

Both are medians over alternating rounds; the overhead also gets its 10th percentile over
rounds (p10), an estimate for a quiet machine, since host load only ever adds time.
Target (from the performance issue): functx overhead <= 15 us per op per level (median).
Run:  .venv/bin/python benchmarks/vmap_overhead.py [--quick]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.func

import functx
from _harness import fallback_warnings, interleaved, markdown_table, standard_main, threads, us

N_OPS = 200
SHAPE = (8, 4)
BATCH_OUTER, BATCH_INNER = 4, 8
TARGET_US_PER_OP_PER_LEVEL = 15.0


def make_chain(constant: torch.Tensor):
    """f(x): N_OPS pointwise ops cycling sin, mul by a scalar, add an unbatched tensor."""

    def chain(x):
        for i in range(N_OPS):
            step = i % 3
            if step == 0:
                x = x.sin()
            elif step == 1:
                x = x * 0.5
            else:
                x = x + constant
        return x

    return chain


def nested(vmap, f, levels: int):
    for _ in range(levels):
        f = vmap(f)
    return f


def contenders():
    """(functx fallback ops, name -> zero-argument callable); vmapped inputs have the batch
    dims in front."""
    torch.manual_seed(0)
    constant = torch.randn(SHAPE)
    f = make_chain(constant)
    x0 = torch.randn(SHAPE)
    x1 = torch.randn(BATCH_INNER, *SHAPE)
    x2 = torch.randn(BATCH_OUTER, BATCH_INNER, *SHAPE)
    f1, g1 = nested(functx.vmap, f, 1), nested(torch.func.vmap, f, 1)
    f2, g2 = nested(functx.vmap, f, 2), nested(torch.func.vmap, f, 2)
    for ours, theirs, x in ((f1, g1, x1), (f2, g2, x2)):
        torch.testing.assert_close(ours(x), theirs(x))
    fallbacks = fallback_warnings(lambda: f2(x2))
    return fallbacks, {
        "eager": lambda: f(x0),
        "functx x1": lambda: f1(x1),
        "torch.func x1": lambda: g1(x1),
        "functx x2": lambda: f2(x2),
        "torch.func x2": lambda: g2(x2),
    }


def run(quick: bool = False, rounds: int | None = None) -> dict:
    """Time everything with 1 intra-op thread; return the numbers and a markdown table."""
    rounds = rounds or (50 if quick else 250)
    with threads(1):
        fallbacks, timed = contenders()
        timings = interleaved(timed, rounds=rounds, block_seconds=0.005)
    eager = timings.median("eager")
    rows, results = [], []
    for levels in (1, 2):
        ours, theirs = f"functx x{levels}", f"torch.func x{levels}"

        def overhead(t_vmap, t_eager, levels=levels):
            return (t_vmap - t_eager) / N_OPS / levels

        result = {
            "levels": levels,
            "eager_us_per_op": eager / N_OPS * 1e6,
            "functx_us_per_op": timings.median(ours) / N_OPS * 1e6,
            "torchfunc_us_per_op": timings.median(theirs) / N_OPS * 1e6,
            "functx_overhead_us": timings.paired_median(overhead, ours, "eager") * 1e6,
            "functx_overhead_p10_us": timings.paired_quantile(0.1, overhead, ours, "eager") * 1e6,
            "torchfunc_overhead_us": timings.paired_median(overhead, theirs, "eager") * 1e6,
            "ratio": timings.paired_ratio(ours, theirs),
        }
        result["target_met"] = result["functx_overhead_us"] <= TARGET_US_PER_OP_PER_LEVEL
        results.append(result)
        rows.append(
            [
                str(levels),
                f"{result['eager_us_per_op']:.1f}",
                f"{result['functx_us_per_op']:.1f}",
                f"{result['torchfunc_us_per_op']:.1f}",
                f"{result['functx_overhead_us']:.1f} (p10 {result['functx_overhead_p10_us']:.1f})",
                f"{result['torchfunc_overhead_us']:.1f}",
                f"{result['ratio']:.2f}x",
                f"<= {TARGET_US_PER_OP_PER_LEVEL:.0f}: {'met' if result['target_met'] else 'NOT met'}",
            ]
        )
    table = markdown_table(
        [
            "vmap levels",
            "eager µs/op",
            "functx µs/op",
            "torch.func µs/op",
            "functx overhead µs/op/level: median (p10)",
            "torch.func overhead µs/op/level",
            "functx/torch.func (paired median)",
            "target (functx overhead)",
        ],
        rows,
    )
    spread = ", ".join(
        f"{name}: {us(lo)}–{us(hi)} µs/call" for name in timings.per_round for lo, hi in [timings.spread(name)]
    )
    steal = timings.steal_fraction
    notes = (
        f"{N_OPS} ops on {list(SHAPE)}, batch {BATCH_INNER} (x1) / {BATCH_OUTER}x{BATCH_INNER} (x2), "
        f"1 thread, {rounds} alternating rounds; CPU steal during run: "
        f"{'n/a' if steal is None else f'{steal:.0%}'}; functx per-sample-loop fallbacks hit: "
        f"{', '.join(fallbacks) if fallbacks else 'none'}. IQR per call: {spread}."
    )
    return {"title": "vmap per-op overhead (chain of 200 pointwise ops)", "results": results, "table": table, "notes": notes}


def main():
    standard_main(run, __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
