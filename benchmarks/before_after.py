"""Before/after: the same workloads on two versions of functx, paired round by round.

A refactoring of the dispatch path (the interpreter contract's steps) must not make any
workload slower. Two versions cannot share one process (both are `functx`), so each round
starts one child process per version, in an order that alternates between rounds; each
child times every workload (the fastest of several blocks of calls, 1 intra-op thread) and prints the
seconds per call. Per workload the report gives each version's median over rounds and the
median of the paired ratios after/before (same round), which cancels most drift of the
shared host's speed.

Workloads: what the contract's changes touch. A chain of 200 tiny pointwise ops under 1, 2
and 3 nested vmaps (per-op dispatch), user code under `vmap(vmap(jacfwd(f)))` (stacked
torch-function handling), per-sample gradients of an MLP and of a small CNN, a MAML step,
jvp of a tiny MLP, a Hessian-vector product, and nested forward mode.

Run:  .venv/bin/python benchmarks/before_after.py --before HEAD~1 [--after .] [--rounds 10]
      (`--before` / `--after`: a git revision, checked out into a temporary worktree, or a
      directory holding a `functx` package; `--only SUBSTRING` picks workloads)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def workloads():
    """name -> a zero-argument call, built on the `functx` the process imported."""
    import torch
    import torch.nn.functional as F

    import functx

    torch.manual_seed(0)
    bias = torch.randn(8, 4)

    def chain(x):
        for _ in range(66):
            x = torch.sin(x) * 0.5 + bias
        return x

    def nested_vmap(depth):
        f = chain
        for _ in range(depth):
            f = functx.vmap(f)
        return f

    x1, x2, x3 = torch.randn(3, 8, 4), torch.randn(3, 3, 8, 4), torch.randn(2, 2, 2, 8, 4)
    v1, v2, v3 = nested_vmap(1), nested_vmap(2), nested_vmap(3)

    def pointwise(v):
        for _ in range(10):
            v = torch.tanh(v) * 0.9 + v.sin()
        return v.sum()

    jac_stack = functx.vmap(functx.vmap(functx.jacfwd(pointwise)))
    xj = torch.randn(2, 2, 4)

    w1, b1, w2, b2 = torch.randn(32, 16) / 4, torch.zeros(32), torch.randn(10, 32) / 6, torch.zeros(10)
    mlp = {"w1": w1, "b1": b1, "w2": w2, "b2": b2}

    def mlp_loss(p, x, y):
        h = torch.relu(F.linear(x, p["w1"], p["b1"]))
        return F.cross_entropy(F.linear(h, p["w2"], p["b2"]).unsqueeze(0), y.unsqueeze(0))

    xs, ys = torch.randn(16, 16), torch.randint(0, 10, (16,))
    per_sample_mlp = functx.vmap(functx.grad(mlp_loss), in_dims=(None, 0, 0))

    conv = {"c": torch.randn(4, 1, 3, 3) / 3, "cb": torch.zeros(4), "l": torch.randn(10, 4 * 6 * 6) / 12, "lb": torch.zeros(10)}

    def cnn_loss(p, x, y):
        h = F.max_pool2d(torch.relu(F.conv2d(x.unsqueeze(0), p["c"], p["cb"])), 2)
        return F.cross_entropy(F.linear(h.flatten(1), p["l"], p["lb"]), y.unsqueeze(0))

    xc, yc = torch.randn(8, 1, 14, 14), torch.randint(0, 10, (8,))
    per_sample_cnn = functx.vmap(functx.grad(cnn_loss), in_dims=(None, 0, 0))

    maml_params = {"w0": torch.randn(16, 1), "b0": torch.zeros(16), "w1": torch.randn(1, 16) / 4, "b1": torch.zeros(1)}

    def maml_net(p, x):
        return F.linear(torch.relu(F.linear(x, p["w0"], p["b0"])), p["w1"], p["b1"])

    def task_loss(p, xs_, ys_, xq, yq):
        for _ in range(2):
            g = functx.grad(lambda q: F.mse_loss(maml_net(q, xs_), ys_))(p)
            p = {k: p[k] - 0.01 * g[k] for k in p}
        return F.mse_loss(maml_net(p, xq), yq)

    tasks = [torch.randn(4, 5, 1) for _ in range(4)]
    meta = functx.grad(lambda p: functx.vmap(task_loss, in_dims=(None, 0, 0, 0, 0))(p, *tasks).sum())

    wt1, wt2 = torch.randn(32, 16) / 4, torch.randn(8, 32) / 6

    def tiny(v):
        return torch.tanh(torch.tanh(v @ wt1.T) @ wt2.T)

    def tiny_sum(v):
        return tiny(v).pow(2).sum()

    xt, tt, ut = torch.randn(16), torch.randn(16), torch.randn(16)

    return {
        "chain x200, vmap": lambda: v1(x1),
        "chain x200, vmap(vmap)": lambda: v2(x2),
        "chain x200, vmap(vmap(vmap))": lambda: v3(x3),
        "vmap(vmap(jacfwd)) pointwise x30": lambda: jac_stack(xj),
        "per-sample grads, MLP 16-32-10 x16": lambda: per_sample_mlp(mlp, xs, ys),
        "per-sample grads, CNN 1x14x14 x8": lambda: per_sample_cnn(conv, xc, yc),
        "MAML, 4 tasks x 2 inner steps": lambda: meta(maml_params),
        "jvp, tiny MLP": lambda: functx.jvp(tiny, (xt,), (tt,)),
        "HVP jvp(grad), tiny MLP": lambda: functx.jvp(functx.grad(tiny_sum), (xt,), (tt,)),
        "jvp(jvp), tiny MLP": lambda: functx.jvp(lambda v: functx.jvp(tiny, (v,), (tt,))[1], (xt,), (ut,)),
        "jacfwd(jacfwd), tiny MLP": lambda: functx.jacfwd(functx.jacfwd(tiny_sum))(xt),
    }


def child(only: str | None, blocks: int, block_seconds: float) -> None:
    """Time every workload in this process; print {name: seconds per call} as JSON."""
    import torch

    torch.set_num_threads(1)
    result = {}
    for name, fn in workloads().items():
        if only and only not in name:
            continue
        for _ in range(3):
            fn()
        calls, start = 0, time.perf_counter()
        while time.perf_counter() - start < block_seconds / 2 or calls < 1:
            fn()
            calls += 1
        per_block = max(1, round(calls * block_seconds / (time.perf_counter() - start)))
        samples = []
        for _ in range(blocks):
            start = time.perf_counter()
            for _ in range(per_block):
                fn()
            samples.append((time.perf_counter() - start) / per_block)
        result[name] = min(samples)  # load on the shared host only ever adds time
    import functx

    print(json.dumps({"functx": functx.__file__, "times": result}))


def _tree(spec: str, keep: list) -> str:
    """A directory holding the `functx` package for `spec`: a directory as given, else a git
    revision checked out into a temporary worktree (removed at the end)."""
    if os.path.isdir(os.path.join(spec, "functx")):
        return os.path.abspath(spec)
    path = tempfile.mkdtemp(prefix="functx-bench-")
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "-q", path, spec], check=True)
    keep.append(path)
    return path


def _run_child(tree: str, args) -> dict:
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, os.path.join(HERE, "before_after.py"), "--child", "--blocks", str(args.blocks)]
    if args.only:
        command += ["--only", args.only]
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True, cwd=tree)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    if not report["functx"].startswith(tree):
        raise RuntimeError(f"the child imported {report['functx']}, not the functx of {tree}")
    return report["times"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="HEAD")
    parser.add_argument("--after", default=ROOT)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--blocks", type=int, default=9)
    parser.add_argument("--only")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.only, args.blocks, block_seconds=0.03)
        return
    made: list = []
    try:
        trees = {"before": _tree(args.before, made), "after": _tree(args.after, made)}
        rounds = {"before": [], "after": []}
        for r in range(args.rounds):
            order = ("before", "after") if r % 2 == 0 else ("after", "before")
            for which in order:
                rounds[which].append(_run_child(trees[which], args))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        for path in made:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", path], check=False)
    names = list(rounds["after"][0])
    print(f"before: {args.before}   after: {args.after}   rounds: {args.rounds} (1 thread)\n")
    print("| workload | before (µs) | after (µs) | after/before (median of paired ratios) |")
    print("|---|---:|---:|---:|")
    for name in names:
        before = [t[name] for t in rounds["before"]]
        after = [t[name] for t in rounds["after"]]
        ratio = statistics.median(a / b for a, b in zip(after, before))
        print(f"| {name} | {statistics.median(before) * 1e6:.0f} | {statistics.median(after) * 1e6:.0f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
