"""Shared plumbing of the tutorials: command line, output folder, timing, figures.

Every tutorial runs as `python tutorials/<name>.py [--quick] [--out DIR]`; `--quick` (or the
environment variable FUNCTX_TUTORIAL_QUICK=1) makes it run in a few seconds for CI, with
smaller sizes and fewer steps. Figures go to `DIR` (default `tutorials/out/<name>/`, which
git ignores).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent


def parse_args(name: str, description: str):
    """`args.quick` (bool) and `args.out` (a Path that exists)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few steps (CI)")
    parser.add_argument("--out", type=Path, default=HERE / "out" / name, help="folder for the figures")
    args = parser.parse_args()
    args.quick = args.quick or os.environ.get("FUNCTX_TUTORIAL_QUICK") == "1"
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def median_time(fn, repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of `fn()` in seconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def save(fig, out: Path, filename: str, what_to_see: str) -> Path:
    """Save a figure and tell the reader what it shows."""
    path = out / filename
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"saved {path}\n  what you should see: {what_to_see}")
    return path


__all__ = ["parse_args", "median_time", "save", "plt"]
