"""Forward mode: jvp of a tiny function, jacfwd of an MLP, and nested forward mode
(jvp of jvp, jacfwd of jacfwd, jvp of grad), functx vs torch.func; target <= 1.2x
torch.func (issue: "Derivatives you can trust") for the first two.

Tiny function: an MLP R^16 -> R^8 (tanh, 32 hidden), one input, float32, 1 thread.
jacfwd: the tanh MLP R^256 -> R^256 of ad_jacobians.py. The nested rows have no target.

Run:  .venv/bin/python benchmarks/ad_forward.py [--quick] [--threads N]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.func

import functx
from ad_common import measure, notes, standalone, table

FORWARD_TARGET = 1.2
IN, HIDDEN, OUT = 16, 32, 8


def workloads():
    torch.manual_seed(0)
    w1, w2 = torch.randn(HIDDEN, IN) / 4, torch.randn(OUT, HIDDEN) / 6
    x, t, u = torch.randn(IN), torch.randn(IN), torch.randn(IN)
    big = [torch.randn(256, 256) / 16 for _ in range(3)]
    xb = torch.randn(256)

    def f(v):
        return torch.tanh(torch.tanh(v @ w1.T) @ w2.T)

    def s(v):
        return f(v).pow(2).sum()

    def mlp256(v):
        for w in big:
            v = torch.tanh(w @ v)
        return v

    return {
        f"jvp, MLP {IN}-{HIDDEN}-{OUT}": (FORWARD_TARGET, lambda T: T.jvp(f, (x,), (t,))),
        "jacfwd, tanh MLP R^256 -> R^256": (FORWARD_TARGET, lambda T: T.jacfwd(mlp256)(xb)),
        f"jvp(jvp), MLP {IN}-{HIDDEN}-{OUT}": (None, lambda T: T.jvp(lambda v: T.jvp(f, (v,), (t,))[1], (x,), (u,))),
        f"jvp(grad) (HVP), MLP {IN}-{HIDDEN}-{OUT}": (None, lambda T: T.jvp(T.grad(s), (x,), (t,))),
        f"jacfwd(jacfwd), MLP {IN}-{HIDDEN}-{OUT}": (None, lambda T: T.jacfwd(T.jacfwd(s))(x)),
    }


def run(quick: bool = False, rounds: int | None = None, n_threads: int = 1) -> dict:
    rounds = rounds or (8 if quick else 40)
    results = []
    for label, (target, workload) in workloads().items():

        def make(workload=workload):
            return {"functx": lambda: workload(functx), "torch.func": lambda: workload(torch.func)}

        result = measure(label, make, rounds=rounds, n_threads=n_threads)
        result["target"] = target
        if target is not None:
            result["ratio_met"] = result["ratio"] <= target
        results.append(result)
    return {"title": "Forward mode (target <= 1.2x for jvp and jacfwd)", "results": results, "table": table(results), "notes": notes(results)}


if __name__ == "__main__":
    standalone(run, __doc__.splitlines()[0])
