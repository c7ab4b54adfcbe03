"""Shared pieces of the automatic-differentiation benchmarks (ad_*.py).

Every AD benchmark times up to three contenders computing the same thing, alternating in
one process with `_harness.interleaved`:

    functx      the functx transform
    torch.func  the same code with `torch.func` in place of `functx`
    loop        plain `torch.autograd` in a Python loop (per sample, per Jacobian row, per
                task), where such a loop is the natural way to write it without transforms

and reports medians and the median of paired per-round ratios. The targets (from the
performance issue) are the same for every AD benchmark:

    functx/torch.func <= 1.5x                        (paired median)
    functx faster than the loop wherever torch.func is
"""

from __future__ import annotations

import os
from typing import Callable

import optree
import torch

from _harness import fallback_warnings, interleaved, markdown_table, threads

TARGET_RATIO = 1.5
CONTENDERS = ("functx", "torch.func", "loop")


def assert_all_close(results: dict[str, object], rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """Every contender's result (a pytree of tensors) equals the first one's."""
    (first_name, first), *others = results.items()
    for name, result in others:
        expected, got = optree.tree_leaves(first), optree.tree_leaves(result)
        assert len(expected) == len(got), f"{name} returned {len(got)} tensors, {first_name} {len(expected)}"
        for e, g in zip(expected, got):
            torch.testing.assert_close(g, e, rtol=rtol, atol=atol, msg=lambda m: f"{name} vs {first_name}: {m}")


def measure(
    label: str,
    make_contenders: Callable[[], dict[str, Callable[[], object]]],
    *,
    rounds: int,
    n_threads: int,
    block_seconds: float = 0.02,
) -> dict:
    """Build the contenders (name -> zero-argument callable), check they agree, record
    functx's per-sample-loop fallbacks, time them alternately; return one result dict."""
    with threads(n_threads):
        timed = make_contenders()
        assert_all_close({name: fn() for name, fn in timed.items()})
        fallbacks = fallback_warnings(timed["functx"])
        # The correctness and fallback calls above already warmed every contender up.
        timings = interleaved(timed, rounds=rounds, block_seconds=block_seconds, warmup_calls=0)

    def ratio(numerator, denominator, q=0.5):
        return timings.paired_quantile(q, lambda a, b: a / b, numerator, denominator)

    has_loop = "loop" in timed
    result = {
        "label": label,
        "threads": n_threads,
        "rounds": rounds,
        **{f"{name}_ms": timings.median(name) * 1e3 for name in timed},
        "ratio": ratio("functx", "torch.func"),
        "ratio_iqr": (ratio("functx", "torch.func", 0.25), ratio("functx", "torch.func", 0.75)),
        "functx_vs_loop": ratio("functx", "loop") if has_loop else None,
        "torchfunc_vs_loop": ratio("torch.func", "loop") if has_loop else None,
        "fallback_ops": fallbacks,
        "steal_fraction": timings.steal_fraction,
        "load_avg_1min": os.getloadavg()[0],
    }
    result["ratio_met"] = result["ratio"] <= TARGET_RATIO
    # "Faster than the loop wherever torch.func is": only asked where torch.func beats it.
    if has_loop and result["torchfunc_vs_loop"] < 1:
        result["loop_met"] = result["functx_vs_loop"] < 1
    else:
        result["loop_met"] = None
    return result


def status(result: dict) -> str:
    """'met' / 'NOT met' for both AD targets of one benchmark, in words."""
    target = result.get("target", TARGET_RATIO)
    if target is None:
        return "no target"
    parts = [f"<= {target}x torch.func: {'met' if result['ratio_met'] else 'NOT met'}"]
    if result["loop_met"] is None:
        parts.append("vs loop: n/a" if result["functx_vs_loop"] is None else "vs loop: n/a (loop faster than torch.func)")
    else:
        parts.append(f"faster than loop: {'met' if result['loop_met'] else 'NOT met'}")
    return "; ".join(parts)


def _ms(value) -> str:
    return "—" if value is None else f"{value:.2f}"


def _x(value) -> str:
    return "—" if value is None else f"{value:.2f}x"


def table(results: list[dict]) -> str:
    rows = []
    for r in results:
        q1, q3 = r["ratio_iqr"]
        rows.append(
            [
                r["label"],
                _ms(r.get("functx_ms")),
                _ms(r.get("torch.func_ms")),
                _ms(r.get("loop_ms")),
                f"{r['ratio']:.2f}x ({q1:.2f}–{q3:.2f})",
                _x(r["functx_vs_loop"]),
                _x(r["torchfunc_vs_loop"]),
                status(r),
                f"{r['load_avg_1min']:.1f}",
            ]
        )
    header = [
        "benchmark",
        "functx ms",
        "torch.func ms",
        "loop ms",
        "functx/torch.func: paired median (IQR)",
        "functx/loop",
        "torch.func/loop",
        "targets",
        "load avg",
    ]
    return markdown_table(header, rows)


def notes(results: list[dict]) -> str:
    steals = [r["steal_fraction"] for r in results if r["steal_fraction"] is not None]
    fallbacks = {r["label"]: r["fallback_ops"] for r in results if r["fallback_ops"]}
    fallback_text = "; ".join(f"{label}: {', '.join(ops)}" for label, ops in fallbacks.items()) or "none"
    return (
        f"{results[0]['threads']} intra-op thread(s); {', '.join(sorted({str(r['rounds']) for r in results}))} "
        f"alternating rounds per benchmark; max CPU steal during a benchmark: "
        f"{'n/a' if not steals else f'{max(steals):.0%}'}; load avg = 1-minute load average after it. "
        f"functx per-sample-loop fallbacks hit: {fallback_text}."
    )


def standalone(run: Callable[..., dict], description: str) -> None:
    """`main()` of an ad_*.py script: parse the standard arguments, run, print markdown."""
    from _harness import environment, print_report, standard_arguments

    parser = standard_arguments(description)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1: stable on a shared host)")
    args = parser.parse_args()
    env = environment()
    print_report(run(quick=args.quick, rounds=args.rounds, n_threads=args.threads), env)
