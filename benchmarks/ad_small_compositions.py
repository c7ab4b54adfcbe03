"""Compositions inside vmap on a tiny function, where Python dispatch is most of the time:
functx vs torch.func (no target; not in run_all.py).

An MLP R^16 -> R^8 (tanh, 32 hidden) over 64 samples, float32, 1 thread:
vmap(grad), vmap(vmap(grad)), vmap(jacrev), vmap(hessian), vmap(jvp), vmap(jacfwd),
vmap(vjp) and jacrev(jacrev). See the README, "`grad`, `jacrev` and `jvp` inside `vmap`",
for which of them run on vmap's physical tensors.

Run:  .venv/bin/python benchmarks/ad_small_compositions.py [--quick] [--threads N]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.func

import functx
from ad_common import measure, notes, standalone, table

SAMPLES, IN, HIDDEN, OUT = 64, 16, 32, 8


def workloads():
    torch.manual_seed(0)
    w1, w2 = torch.randn(HIDDEN, IN) / 4, torch.randn(OUT, HIDDEN) / 6
    x, t = torch.randn(SAMPLES, IN), torch.randn(SAMPLES, IN)

    def f(v):
        return torch.tanh(torch.tanh(v @ w1.T) @ w2.T)

    def s(v):
        return f(v).pow(2).sum()

    return {
        "vmap(grad)": lambda T: T.vmap(T.grad(s))(x),
        "vmap(vmap(grad))": lambda T: T.vmap(T.vmap(T.grad(s)))(x.view(8, 8, IN)),
        "vmap(jacrev)": lambda T: T.vmap(T.jacrev(f))(x),
        "vmap(hessian)": lambda T: T.vmap(T.hessian(s))(x),
        "vmap(jvp)": lambda T: T.vmap(lambda v, d: T.jvp(f, (v,), (d,)))(x, t),
        "vmap(jacfwd)": lambda T: T.vmap(T.jacfwd(f))(x),
        "vmap(vjp)": lambda T: T.vmap(lambda v: T.vjp(f, v)[1](torch.ones(OUT))[0])(x),
        "jacrev(jacrev)": lambda T: T.jacrev(T.jacrev(s))(x[0]),
    }


def run(quick: bool = False, rounds: int | None = None, n_threads: int = 1) -> dict:
    rounds = rounds or (8 if quick else 40)
    results = []
    for label, workload in workloads().items():

        def make(workload=workload):
            return {"functx": lambda: workload(functx), "torch.func": lambda: workload(torch.func)}

        result = measure(label + f", MLP {IN}-{HIDDEN}-{OUT}, {SAMPLES} samples", make, rounds=rounds, n_threads=n_threads)
        result["target"] = None
        results.append(result)
    return {"title": "Small compositions inside vmap (no target)", "results": results, "table": table(results), "notes": notes(results)}


if __name__ == "__main__":
    standalone(run, __doc__.splitlines()[0])
