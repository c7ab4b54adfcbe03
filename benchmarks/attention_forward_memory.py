"""Peak memory of forward mode through attention (issue 30): `functx.jvp` of
`F.scaled_dot_product_attention` (the fused CPU kernel, whose tangent functx computes over
blocks of query rows: functx/ad/aten_forward_rules.py) against `torch.func.jvp` of the math
form `softmax(q kᵀ / √d) v` (torch.func cannot differentiate the fused kernel forward), for
growing sequence lengths; and the time of each, paired. Each measurement runs in a fresh
process (peak resident memory, minus the process's memory after the inputs are made).

    python benchmarks/attention_forward_memory.py            # L = 1024, 2048, 4096
    python benchmarks/attention_forward_memory.py --quick    # L = 1024, 2048
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

HEADS, DIM = 4, 64
# glibc returns large freed blocks to the OS only above its mmap threshold, which it raises as
# blocks are freed; fixed low, a freed block leaves the resident set at once, so the peak is
# what was live at once (without it, a loop of freed blocks of a few MiB reads as growth)
_CHILD_ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}


def _measure(contender: str, length: int) -> dict:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    if contender == "functx":
        import functx

        def run(q, k, v, tq):
            return functx.jvp(lambda u: F.scaled_dot_product_attention(u, k, v), (q,), (tq,))
    else:
        import torch.func

        def run(q, k, v, tq):
            return torch.func.jvp(lambda u: ((u @ k.mT) * DIM**-0.5).softmax(-1) @ v, (q,), (tq,))

    run(*(torch.randn(1, HEADS, 16, DIM, generator=g) for _ in range(4)))  # imports, first-call setup
    q, k, v, tq = (torch.randn(1, HEADS, length, DIM, generator=g) for _ in range(4))
    # ru_maxrss is a high-water mark: the one measured call is the first of this size
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    out = run(q, k, v, tq)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    del out
    return {"peak_growth_mib": (peak - before) / 1024, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", nargs=2)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_measure(args.child[0], int(args.child[1]))))
        return
    lengths = [1024, 2048] if args.quick else [1024, 2048, 4096]
    print(f"jvp of attention, 1 x {HEADS} heads x L x {DIM}, float32, 1 thread; peak memory growth of the jvp call")
    print("| L | functx (fused kernel, blocked tangent) | torch.func (math form) | memory ratio | time ratio |")
    print("|---|---|---|---|---|")
    for length in lengths:
        results = {}
        for contender in ("functx", "torch.func"):
            line = subprocess.run(
                [sys.executable, __file__, "--child", contender, str(length)],
                capture_output=True, text=True, check=True, env=_CHILD_ENV,
            ).stdout.strip().splitlines()[-1]
            results[contender] = json.loads(line)
        a, b = results["functx"], results["torch.func"]
        print(
            f"| {length} | {a['peak_growth_mib']:.0f} MiB, {a['seconds'] * 1e3:.0f} ms | "
            f"{b['peak_growth_mib']:.0f} MiB, {b['seconds'] * 1e3:.0f} ms | "
            f"{a['peak_growth_mib'] / max(b['peak_growth_mib'], 1e-9):.2f}x | {a['seconds'] / b['seconds']:.2f}x |"
        )


if __name__ == "__main__":
    main()
