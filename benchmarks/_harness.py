"""Shared timing harness: interleaved (alternating) timing of several contenders in one process.

Why interleave: the benchmark host is a small shared machine (2 cores, CPU steal, other
people's test runs). Timing contender A for ten seconds and then contender B for ten
seconds lets a burst of load land on one of them only. Here every *round* times one block
of calls of every contender, back to back, in an order that rotates each round, so load
bursts hit all contenders about equally. Per contender we report the median over rounds;
between two contenders we report the median of the per-round ratios (paired ratios),
which cancels most of the slow drift in machine speed.

The garbage collector stays on: the Python objects a Python dispatcher allocates per op,
and the collections they trigger, are part of what a user pays.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import os
import platform
import statistics
import subprocess
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class Timings:
    """Seconds per call, one entry per round, for every contender (same round order)."""

    per_round: dict[str, list[float]] = field(default_factory=dict)
    calls_per_block: dict[str, int] = field(default_factory=dict)
    steal_fraction: float | None = None

    def median(self, name: str) -> float:
        return statistics.median(self.per_round[name])

    def spread(self, name: str) -> tuple[float, float]:
        """Inter-quartile range (25th, 75th percentile) of seconds per call."""
        q = statistics.quantiles(self.per_round[name], n=4)
        return q[0], q[2]

    def paired_ratio(self, numerator: str, denominator: str) -> float:
        """Median over rounds of numerator/denominator measured in the same round."""
        pairs = zip(self.per_round[numerator], self.per_round[denominator])
        return statistics.median(a / b for a, b in pairs)

    def paired_median(self, fn: Callable[..., float], *names: str) -> float:
        """Median over rounds of fn(t_name1, t_name2, ...) taken from the same round."""
        return self.paired_quantile(0.5, fn, *names)

    def paired_quantile(self, q: float, fn: Callable[..., float], *names: str) -> float:
        """q-quantile over rounds of fn(t_name1, ...) from the same round. A low quantile
        (0.1) estimates what a quiet machine gives: host load only ever adds time."""
        values = sorted(fn(*v) for v in zip(*(self.per_round[n] for n in names)))
        position = q * (len(values) - 1)
        low = int(position)
        high = min(low + 1, len(values) - 1)
        return values[low] + (values[high] - values[low]) * (position - low)


def _cpu_times():
    """(busy+idle total, steal) jiffies from /proc/stat, or None where unavailable."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    steal = fields[7] if len(fields) > 7 else 0
    return sum(fields[:8]), steal


def _calibrate(fn: Callable[[], object], block_seconds: float, max_calls: int) -> int:
    """Calls per block so that one block lasts about `block_seconds` (at least one call)."""
    calls = 1
    while True:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - start
        if elapsed >= block_seconds / 4 or calls >= max_calls:
            per_call = elapsed / calls
            return max(1, min(max_calls, round(block_seconds / per_call)))
        calls *= 4


def interleaved(
    contenders: dict[str, Callable[[], object]],
    *,
    rounds: int,
    block_seconds: float = 0.02,
    warmup_calls: int = 3,
    max_calls: int = 10_000,
) -> Timings:
    """Time every contender `rounds` times, alternating them, one block per round each.

    Each block runs `fn()` a calibrated number of times (so a block lasts roughly
    `block_seconds`) and records the mean time per call of that block. The order of the
    contenders rotates every round so that none is always first (cache and frequency
    effects after switching) or always last.
    """
    names = list(contenders)
    for name in names:
        for _ in range(warmup_calls):
            contenders[name]()
    timings = Timings()
    for name in names:
        timings.calls_per_block[name] = _calibrate(contenders[name], block_seconds, max_calls)
        timings.per_round[name] = []
    before = _cpu_times()
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            fn = contenders[name]
            calls = timings.calls_per_block[name]
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            timings.per_round[name].append((time.perf_counter() - start) / calls)
    after = _cpu_times()
    if before and after and after[0] > before[0]:
        timings.steal_fraction = (after[1] - before[1]) / (after[0] - before[0])
    gc.collect()
    return timings


def fallback_warnings(fn: Callable[[], object]) -> list[str]:
    """Names of ops for which functx emitted a PerformanceWarning (per-sample loop) in fn()."""
    from functx import PerformanceWarning

    # functx warns once per op per process; forget that for the call so every
    # configuration reports its own fallbacks (private state, restored afterwards).
    warned = getattr(importlib.import_module("functx.vmap.fallback"), "_warned", set())
    already = set(warned)
    warned.clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", PerformanceWarning)
            fn()
    finally:
        warned |= already
    ops = []
    for w in caught:
        if issubclass(w.category, PerformanceWarning):
            text = str(w.message)
            # "functx.vmap: there is no batching rule for aten::mm; ..." -> "aten::mm"
            word = next((t.rstrip(";,.:") for t in text.split() if t.startswith("aten::")), text[:80])
            if word not in ops:
                ops.append(word)
    return ops


def environment() -> dict[str, str]:
    """What a results table must state: when, on what, with which torch and threads."""
    return {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cores": str(os.cpu_count()),
        "default_threads": str(torch.get_num_threads()),
        "functx": _git_state(),
    }


def _git_state() -> str:
    """Commit of the checkout being measured, and whether functx/ has uncommitted changes."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(
            ["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--", "functx"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if not head:
        return "unknown"
    return f"{head}{' + uncommitted changes in functx/' if dirty else ''}"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


class threads:
    """Context manager: run with `n` intra-op threads (None: leave as is), then restore."""

    def __init__(self, n: int | None):
        self.n = n

    def __enter__(self):
        self.saved = torch.get_num_threads()
        if self.n is not None:
            torch.set_num_threads(self.n)
        return self

    def __exit__(self, *exc):
        torch.set_num_threads(self.saved)
        return False


def us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f}"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def standard_arguments(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run, ~10-20 s)")
    parser.add_argument("--rounds", type=int, default=None, help="override the number of rounds")
    return parser


def print_report(out: dict, env: dict[str, str]) -> None:
    """Print one benchmark's result (`run()`'s dict) as markdown: title, environment, table, notes."""
    print(f"## {out['title']}\n")
    print(", ".join(f"{k}: {v}" for k, v in env.items()) + "\n")
    print(out["table"] + "\n")
    print(out["notes"])


def standard_main(run: Callable[..., dict], description: str) -> None:
    """`main()` of a benchmark script: parse the standard arguments, run, print markdown."""
    args = standard_arguments(description).parse_args()
    print_report(run(quick=args.quick, rounds=args.rounds), environment())
