"""Jacobians and Hessians: functx vs torch.func vs torch.autograd loops over rows/columns.

Workloads:
    jacrev   of an MLP R^256 -> R^256 (256-256-256, tanh hidden layer and tanh output)
    jacfwd   of the same MLP
    hessian  of a scalar function of R^128: tanh-MLP 128-64-64, outputs summed

Contenders, alternating in one process:
    functx      functx.jacrev(f)(x) / functx.jacfwd(f)(x) / functx.hessian(h)(x)
    torch.func  the same with torch.func
    loop        plain torch.autograd, one pass per Jacobian row or column:
                jacrev:  torch.autograd.grad of each output element (reverse mode, 256 backwards)
                jacfwd:  torch.autograd.forward_ad dual numbers, one forward per input element
                hessian: the gradient with create_graph, then one backward per gradient element

functx's jacfwd is forward mode (torch's forward formulas on jvp-level wrappers, under
vmap); its hessian is reverse-over-reverse (torch.func's is forward-over-reverse).

Run:  .venv/bin/python benchmarks/ad_jacobians.py [--quick] [--threads N]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.autograd.forward_ad as fwAD
import torch.func
import torch.nn.functional as F

import functx
from ad_common import measure, notes, standalone, table

JAC_SIZE = 256
HESSIAN_IN, HESSIAN_HIDDEN = 128, 64


def linear_params(sizes, seed: int):
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(i, o) for i, o in zip(sizes[:-1], sizes[1:])]
    return [(layer.weight.detach(), layer.bias.detach()) for layer in layers]


def tanh_mlp(params):
    """x -> tanh(W_n ... tanh(W_1 x + b_1) ... + b_n), weights closed over."""

    def f(x):
        for w, b in params:
            x = torch.tanh(F.linear(x, w, b))
        return x

    return f


def loop_jacrev(f, x):
    """Row by row: a backward pass per output element, the graph kept between them."""
    x = x.detach().requires_grad_()
    out = f(x)
    flat = out.reshape(-1)
    rows = [torch.autograd.grad(flat[i], x, retain_graph=True)[0] for i in range(flat.numel())]
    return torch.stack(rows).reshape(*out.shape, *x.shape)


def loop_jacfwd(f, x):
    """Column by column: a forward-mode (dual number) evaluation per input element."""
    columns = []
    basis = torch.eye(x.numel(), dtype=x.dtype).reshape(x.numel(), *x.shape)
    with fwAD.dual_level():
        for tangent in basis:
            columns.append(fwAD.unpack_dual(f(fwAD.make_dual(x, tangent))).tangent)
    jac = torch.stack(columns)  # (in, *out)
    return jac.reshape(x.numel(), -1).t().reshape(*columns[0].shape, *x.shape)


def loop_hessian(h, x):
    """Gradient with create_graph, then a backward pass per gradient element."""
    x = x.detach().requires_grad_()
    (gradient,) = torch.autograd.grad(h(x), x, create_graph=True)
    flat = gradient.reshape(-1)
    rows = [torch.autograd.grad(flat[i], x, retain_graph=True)[0] for i in range(flat.numel())]
    return torch.stack(rows).reshape(*x.shape, *x.shape)


def jacobian_workload(transform: str):
    def make():
        f = tanh_mlp(linear_params((JAC_SIZE, JAC_SIZE, JAC_SIZE), seed=0))
        x = torch.randn(JAC_SIZE)
        ours, theirs = getattr(functx, transform)(f), getattr(torch.func, transform)(f)
        loop = loop_jacrev if transform == "jacrev" else loop_jacfwd
        return {"functx": lambda: ours(x), "torch.func": lambda: theirs(x), "loop": lambda: loop(f, x)}

    return make


def hessian_workload():
    def make():
        mlp = tanh_mlp(linear_params((HESSIAN_IN, HESSIAN_HIDDEN, HESSIAN_HIDDEN), seed=2))

        def h(x):
            return mlp(x).sum()

        x = torch.randn(HESSIAN_IN)
        ours, theirs = functx.hessian(h), torch.func.hessian(h)
        return {"functx": lambda: ours(x), "torch.func": lambda: theirs(x), "loop": lambda: loop_hessian(h, x)}

    return make


def run(quick: bool = False, rounds: int | None = None, n_threads: int = 1) -> dict:
    rounds = rounds or (6 if quick else 40)
    configs = [
        (f"jacrev, MLP R^{JAC_SIZE} -> R^{JAC_SIZE}", jacobian_workload("jacrev")),
        (f"jacfwd, MLP R^{JAC_SIZE} -> R^{JAC_SIZE}", jacobian_workload("jacfwd")),
        (f"hessian, tanh-MLP R^{HESSIAN_IN} -> R (summed)", hessian_workload()),
    ]
    results = [measure(label, make, rounds=rounds, n_threads=n_threads) for label, make in configs]
    return {
        "title": "Jacobians and Hessians",
        "results": results,
        "table": table(results),
        "notes": notes(results),
    }


if __name__ == "__main__":
    standalone(run, __doc__.splitlines()[0])
