"""Where functx's AD is far from torch.func: the same results by other compositions of
functx's public transforms, timed against the benchmarked form (evidence for what to change).

    hessian   functx.hessian(h) (reverse-over-reverse, jacrev(jacrev(h))) vs
              functx.jacfwd(functx.jacrev(h)) (forward-over-reverse, torch.func's form)
    jacfwd    functx.jacfwd(f) (one forward-mode JVP per input column) vs functx.jacrev(f)
              (one VJP per output row): the same Jacobian
    MAML      the all-functx step, whose outermost grad level wraps every tensor (each op
              and each backward formula of the outer level goes through Python dispatch),
              vs the same step with the outer gradient taken by plain torch.autograd
              (what a "plain autograd for the lowest grad level" fast path could give)

Each line is timed alternating with its torch.func counterpart; ratios are paired medians.
Not part of run_all.py (it measures proposals, not targets).

Run:  .venv/bin/python benchmarks/ad_alternatives.py [--quick] [--threads N]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.func

import ad_jacobians as jac
import ad_maml as maml
import functx
from _harness import interleaved, markdown_table, threads
from ad_common import assert_all_close, standalone


def hessian_contenders():
    mlp = jac.tanh_mlp(jac.linear_params((jac.HESSIAN_IN, jac.HESSIAN_HIDDEN, jac.HESSIAN_HIDDEN), seed=2))

    def h(x):
        return mlp(x).sum()

    x = torch.randn(jac.HESSIAN_IN)
    forms = {
        "functx.hessian(h)": functx.hessian(h),
        "functx.jacrev(functx.grad(h))": functx.jacrev(functx.grad(h)),
        "functx.jacfwd(functx.jacrev(h))": functx.jacfwd(functx.jacrev(h)),
        "torch.func.hessian(h)": torch.func.hessian(h),
        "torch.func.jacrev(torch.func.grad(h))": torch.func.jacrev(torch.func.grad(h)),
    }
    return {name: (lambda fn=fn: fn(x)) for name, fn in forms.items()}, "torch.func.hessian(h)"


def jacfwd_contenders():
    f = jac.tanh_mlp(jac.linear_params((jac.JAC_SIZE,) * 3, seed=0))
    x = torch.randn(jac.JAC_SIZE)
    forms = {
        "functx.jacfwd(f)": functx.jacfwd(f),
        "functx.jacrev(f)": functx.jacrev(f),
        "torch.func.jacfwd(f)": torch.func.jacfwd(f),
        "torch.func.jacrev(f)": torch.func.jacrev(f),
    }
    return {name: (lambda fn=fn: fn(x)) for name, fn in forms.items()}, "torch.func.jacfwd(f)"


def maml_outer_by_autograd(transforms, params, data):
    """The MAML step with tasks under `transforms.vmap`, inner steps by `transforms.grad`,
    and the outer (second-order) gradient by plain torch.autograd."""

    def task_loss(p, xs, ys, xq, yq):
        for _ in range(maml.INNER_STEPS):
            grads = transforms.grad(maml.mse)(p, xs, ys)
            p = {k: p[k] - maml.INNER_LR * grads[k] for k in p}
        return maml.mse(p, xq, yq)

    def step():
        leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
        loss = transforms.vmap(task_loss, in_dims=(None, 0, 0, 0, 0))(leaves, *data).sum()
        return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))

    return step


def maml_contenders():
    params, data = maml.init_params(), maml.sine_tasks()
    ours, theirs = maml.meta_gradient(functx), maml.meta_gradient(torch.func)
    return {
        "functx: grad(vmap(grad))": lambda: ours(params, *data),
        "functx: vmap(grad), outer torch.autograd": maml_outer_by_autograd(functx, params, data),
        "torch.func: grad(vmap(grad))": lambda: theirs(params, *data),
        "torch.func: vmap(grad), outer torch.autograd": maml_outer_by_autograd(torch.func, params, data),
    }, "torch.func: grad(vmap(grad))"


def run(quick: bool = False, rounds: int | None = None, n_threads: int = 1) -> dict:
    rounds = rounds or (8 if quick else 30)
    rows = []
    with threads(n_threads):
        for workload, make in (("hessian", hessian_contenders), ("jacfwd", jacfwd_contenders), ("MAML", maml_contenders)):
            contenders, reference = make()
            assert_all_close({name: fn() for name, fn in contenders.items()})
            timings = interleaved(contenders, rounds=rounds, block_seconds=0.03, warmup_calls=1)
            for name in contenders:
                rows.append(
                    [
                        workload,
                        name,
                        f"{timings.median(name) * 1e3:.2f}",
                        f"{timings.paired_ratio(name, reference):.2f}x",
                    ]
                )
    table = markdown_table(["workload", "form", "ms", "/ benchmarked torch.func form (paired median)"], rows)
    return {
        "title": "AD: alternative compositions (what would close the gaps)",
        "table": table,
        "notes": f"{n_threads} intra-op thread(s), {rounds} alternating rounds per workload.",
    }


if __name__ == "__main__":
    standalone(run, __doc__.splitlines()[0])
