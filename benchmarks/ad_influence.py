"""Influence functions the way dattri computes them: functx vs torch.func (vs plain autograd).

dattri (a data-attribution library built on torch.func) scores training points by
influence: per-sample gradients of test points, then an inverse-Hessian-vector product for
each by conjugate gradient, written as its `ihvp_at_x_cg` is: one `vjp` of `grad(loss)` at
the parameters (reverse over reverse), then `vmap` over the test gradients of a CG loop of
10 steps, each calling that `vjp_fn` (so the Hessian-vector products run under vmap).

Model: an MLP 784-16-10 (ReLU; 12,730 parameters, flat, split into views inside the loss),
a training batch of 256 for the Hessian, 16 test points; float64 (10 CG steps on this
ill-conditioned Hessian amplify float32 rounding past any tolerance that still checks that
the contenders agree).

Rows:
    per-sample gradients     vmap(grad(loss of one test point)) over the 16 test points
    CG inverse-HVPs          vjp(grad(train loss)) once, vmap over the 16 gradients of 10
                             CG steps with regularization 1e-2 (dattri's `_cg`)
    whole routine            both

Contenders, alternating in one process: functx and torch.func (the same code), and plain
torch.autograd (a per-sample loop of autograd.grad; one create_graph gradient, then one
backward per HVP and test point). Values checked equal (rtol 1e-4) before timing. Target
(issue 27): functx/torch.func <= 1.1x.

Run:  .venv/bin/python benchmarks/ad_influence.py [--quick] [--threads N]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.func
import torch.nn as nn
import torch.nn.functional as F

import functx
from ad_common import measure, notes, standalone, table

TARGET = 1.1
SIZES = (784, 16, 10)
TRAIN, TEST = 256, 16
CG_STEPS = 10
REGULARIZATION = 1e-2


class Problem:
    def __init__(self):
        torch.manual_seed(0)
        # float64: 10 CG steps on an ill-conditioned Hessian amplify float32 rounding past
        # any tolerance that would still check the contenders agree
        self.model = nn.Sequential(nn.Linear(SIZES[0], SIZES[1]), nn.ReLU(), nn.Linear(SIZES[1], SIZES[2])).double()
        params = {k: v.detach() for k, v in self.model.named_parameters()}
        self.names = list(params)
        self.shapes = [params[k].shape for k in self.names]
        self.sizes = [params[k].numel() for k in self.names]
        self.flat = torch.cat([params[k].flatten() for k in self.names])
        D = torch.float64
        self.x_train, self.y_train = torch.randn(TRAIN, SIZES[0], dtype=D), torch.randint(0, SIZES[-1], (TRAIN,))
        self.x_test, self.y_test = torch.randn(TEST, SIZES[0], dtype=D), torch.randint(0, SIZES[-1], (TEST,))

    def unflatten(self, p):
        return {k: t.view(s) for k, t, s in zip(self.names, p.split(self.sizes), self.shapes)}

    def loss(self, T):
        """loss(p, x, y) of a batch, through T's functional_call."""
        return lambda p, x, y: F.cross_entropy(T.functional_call(self.model, self.unflatten(p), (x,)), y)


def per_sample_gradients(T, problem):
    loss = problem.loss(T)
    one = lambda p, x, y: loss(p, x[None], y[None])
    return T.vmap(T.grad(one), in_dims=(None, 0, 0))(problem.flat, problem.x_test, problem.y_test)


def cg_inverse_hvps(T, problem, vectors):
    """dattri's ihvp_at_x_cg (mode rev-rev): vjp of the gradient once, CG under vmap."""
    loss = problem.loss(T)
    train_loss = lambda p: loss(p, problem.x_train, problem.y_train)
    _, vjp_fn = T.vjp(T.grad(train_loss), problem.flat)

    def hvp(v):
        return vjp_fn(v)[0] + REGULARIZATION * v

    return T.vmap(lambda v: conjugate_gradient(hvp, v))(vectors)


def conjugate_gradient(hvp, v):
    """dattri's `_cg`: CG_STEPS steps on H x = v from x = v (its start), no tolerance."""
    x = torch.clone(v)
    g_pre = v - hvp(x)
    d = d_pre = g_pre
    for _ in range(CG_STEPS):
        ad = hvp(d)
        alpha = torch.dot(g_pre, d_pre) / torch.dot(d, ad)
        x = x + alpha * d
        g = g_pre - alpha * ad
        beta = torch.dot(g, g) / torch.dot(g_pre, g_pre)
        g_pre = d_pre = g
        d = g + beta * d
    return x


def routine(T, problem):
    return cg_inverse_hvps(T, problem, per_sample_gradients(T, problem))


# -- plain torch.autograd ---------------------------------------------------------------------
def plain_per_sample_gradients(problem):
    loss = problem.loss(torch.func)  # torch's functional_call, no transform
    rows = []
    for x, y in zip(problem.x_test, problem.y_test):
        leaf = problem.flat.detach().requires_grad_()
        rows.append(torch.autograd.grad(loss(leaf, x[None], y[None]), leaf)[0])
    return torch.stack(rows)


def plain_cg_inverse_hvps(problem, vectors):
    loss = problem.loss(torch.func)
    leaf = problem.flat.detach().requires_grad_()
    (g,) = torch.autograd.grad(loss(leaf, problem.x_train, problem.y_train), leaf, create_graph=True)

    def hvp(v):
        return torch.autograd.grad(g, leaf, v, retain_graph=True)[0] + REGULARIZATION * v

    return torch.stack([conjugate_gradient(hvp, v) for v in vectors])


def workloads(problem):
    vectors = plain_per_sample_gradients(problem)
    return {
        "per-sample gradients (16 test points)": (
            lambda T: per_sample_gradients(T, problem), lambda: plain_per_sample_gradients(problem)),
        "CG inverse-HVPs (16 x 10 steps, vmap over vjp_fn)": (
            lambda T: cg_inverse_hvps(T, problem, vectors), lambda: plain_cg_inverse_hvps(problem, vectors)),
        "whole routine": (
            lambda T: routine(T, problem),
            lambda: plain_cg_inverse_hvps(problem, plain_per_sample_gradients(problem))),
    }


def run(quick: bool = False, rounds: int | None = None, n_threads: int = 1) -> dict:
    rounds = rounds or (4 if quick else 20)
    problem = Problem()
    results = []
    for label, (workload, plain) in workloads(problem).items():

        def make(workload=workload, plain=plain):
            return {"functx": lambda: workload(functx), "torch.func": lambda: workload(torch.func), "loop": plain}

        result = measure(label, make, rounds=rounds, n_threads=n_threads)
        result["target"] = TARGET
        result["ratio_met"] = result["ratio"] <= TARGET
        results.append(result)
    return {
        "title": f"Influence functions, dattri's CG routine (target <= {TARGET}x torch.func)",
        "results": results,
        "table": table(results),
        "notes": notes(results)
        + f" Model: MLP {'-'.join(map(str, SIZES))} ({problem.flat.numel():,} parameters), {TRAIN} training "
        f"points, {TEST} test points, {CG_STEPS} CG steps; `loop` = plain torch.autograd.",
    }


if __name__ == "__main__":
    standalone(run, __doc__.splitlines()[0])
