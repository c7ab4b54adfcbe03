"""A MAML step: functx vs torch.func vs a torch.autograd loop over tasks.

Sine-wave regression with a 1-40-40-1 ReLU MLP (parameters a dict of tensors, the model a
plain function of it). One meta-gradient step over 5 tasks (10 support and 10 query
points each): per task, 3 inner SGD steps (lr 0.01) on the support loss with `grad`, then
the query loss of the adapted parameters; the outer gradient of the summed query losses
with respect to the initial parameters is second order (it differentiates through the
inner gradients).

Contenders, alternating in one process:
    functx      functx.grad(meta_loss) with meta_loss = functx.vmap(task_loss)(...).sum()
                and functx.grad inside task_loss
    torch.func  the same code with torch.func
    loop        plain torch.autograd: tasks in a Python loop, inner steps with
                torch.autograd.grad(create_graph=True), one outer backward

Run:  .venv/bin/python benchmarks/ad_maml.py [--quick] [--threads N]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.func
import torch.nn.functional as F

import functx
from ad_common import measure, notes, standalone, table

SIZES = (1, 40, 40, 1)
TASKS, POINTS, INNER_STEPS, INNER_LR = 5, 10, 3, 0.01


def init_params() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(i, o) for i, o in zip(SIZES[:-1], SIZES[1:])]
    return {f"{kind}{i}": getattr(layer, kind).detach() for i, layer in enumerate(layers) for kind in ("weight", "bias")}


def net(params, x):
    depth = len(SIZES) - 1
    for i in range(depth):
        x = F.linear(x, params[f"weight{i}"], params[f"bias{i}"])
        if i < depth - 1:
            x = F.relu(x)
    return x


def mse(params, x, y):
    return F.mse_loss(net(params, x), y)


def sine_tasks():
    """(x_support, y_support, x_query, y_query), each (TASKS, POINTS, 1)."""
    torch.manual_seed(1)
    amplitude = torch.rand(TASKS, 1, 1) * 4.9 + 0.1
    phase = torch.rand(TASKS, 1, 1) * torch.pi
    xs, xq = (torch.rand(TASKS, POINTS, 1) * 10 - 5 for _ in range(2))
    return xs, amplitude * torch.sin(xs + phase), xq, amplitude * torch.sin(xq + phase)


def meta_gradient(transforms):
    """The MAML meta-gradient written against a torch.func-like module (functx or torch.func)."""

    def task_loss(params, xs, ys, xq, yq):
        for _ in range(INNER_STEPS):
            grads = transforms.grad(mse)(params, xs, ys)
            params = {k: params[k] - INNER_LR * grads[k] for k in params}
        return mse(params, xq, yq)

    def meta_loss(params, xs, ys, xq, yq):
        return transforms.vmap(task_loss, in_dims=(None, 0, 0, 0, 0))(params, xs, ys, xq, yq).sum()

    return transforms.grad(meta_loss)


def loop_meta_gradient(params, xs, ys, xq, yq):
    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
    total = 0
    for t in range(xs.shape[0]):
        adapted = leaves
        for _ in range(INNER_STEPS):
            grads = torch.autograd.grad(mse(adapted, xs[t], ys[t]), list(adapted.values()), create_graph=True)
            adapted = {k: adapted[k] - INNER_LR * g for k, g in zip(adapted, grads)}
        total = total + mse(adapted, xq[t], yq[t])
    return dict(zip(leaves, torch.autograd.grad(total, list(leaves.values()))))


def make_contenders():
    params, data = init_params(), sine_tasks()
    ours, theirs = meta_gradient(functx), meta_gradient(torch.func)
    return {
        "functx": lambda: ours(params, *data),
        "torch.func": lambda: theirs(params, *data),
        "loop": lambda: loop_meta_gradient(params, *data),
    }


def run(quick: bool = False, rounds: int | None = None, n_threads: int = 1) -> dict:
    rounds = rounds or (8 if quick else 60)
    label = f"MAML step: {TASKS} tasks under vmap, {INNER_STEPS} inner grad steps, MLP {'-'.join(map(str, SIZES))}"
    results = [measure(label, make_contenders, rounds=rounds, n_threads=n_threads)]
    return {"title": "MAML (second-order meta-gradient)", "results": results, "table": table(results), "notes": notes(results)}


if __name__ == "__main__":
    standalone(run, __doc__.splitlines()[0])
