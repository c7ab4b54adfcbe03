"""Hessian-vector and Gauss-Newton products: functx vs torch.func (vs plain torch.autograd).

Model: a tanh MLP 128-256-256-10 (101,386 parameters) on a fixed batch of 128 inputs with
cross-entropy, called through `functional_call` (each library's own) with the parameters
given either as one flat vector (split into views inside the function) or as a dict.

Workloads (v: one tangent; V: k = 16 tangents; damping 1e-2):

    HVP, forward-over-reverse   jvp(grad(loss), (p,), (v,))[1]
    HVP, reverse-over-reverse   vjp(grad(loss), p)[1](v)
    HVP, reverse-over-forward   grad(lambda q: jvp(loss, (q,), (v,))[1])(p)
    Hessian @ matrix            vmap over V of the forward-over-reverse HVP; and of the
                                reverse-over-reverse one (vjp once, vmap over its vjp_fn)
    GGN-vector product          J^T H_L J v: Jv by jvp of the network, H_L (Jv) by
                                jvp(grad(loss of the logits)), then vjp of the network
    GGN @ matrix                vmap over V of the GGN-vector product
    CG solve                    10 conjugate-gradient steps on (H + damping I) x = g (g the
                                gradient), each step one forward-over-reverse HVP
                                (an influence-function solve)

Contenders, alternating in one process (the same code, library swapped):
    functx      with functx's transforms and functional_call
    torch.func  with torch.func's
    loop        plain torch.autograd where it is the natural way to write it: a gradient
                with create_graph=True, then one backward per tangent (HVP rows, Hessian @
                matrix, CG)

Values are checked equal (rtol 1e-4) before timing. Target (issue 13): functx/torch.func
<= 1.0x on every row.

Run:  .venv/bin/python benchmarks/ad_hvp.py [--quick] [--threads N]
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

TARGET = 1.0
SIZES = (128, 256, 256, 10)
BATCH = 128
K = 16
DAMPING = 1e-2
CG_STEPS = 10


class Problem:
    """The model, its data, the parameters (flat and as a dict) and the tangents."""

    def __init__(self):
        torch.manual_seed(0)
        layers = []
        for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
            layers.append(nn.Linear(a, b))
            if i < len(SIZES) - 2:
                layers.append(nn.Tanh())
        self.model = nn.Sequential(*layers)
        self.params = {k: v.detach() for k, v in self.model.named_parameters()}
        self.names = list(self.params)
        self.shapes = [self.params[k].shape for k in self.names]
        self.sizes = [self.params[k].numel() for k in self.names]
        self.flat = torch.cat([self.params[k].flatten() for k in self.names])
        self.x = torch.randn(BATCH, SIZES[0])
        self.y = torch.randint(0, SIZES[-1], (BATCH,))
        self.v = torch.randn_like(self.flat) / 10
        self.v_dict = self.unflatten(torch.randn_like(self.flat) / 10)
        self.V = torch.randn(K, self.flat.numel()) / 10

    def unflatten(self, p):
        return {k: t.view(s) for k, t, s in zip(self.names, p.split(self.sizes), self.shapes)}

    # -- the functions the transforms see ------------------------------------------------
    def logits(self, T, params):
        return T.functional_call(self.model, params, (self.x,))

    def loss_dict(self, T):
        return lambda params: F.cross_entropy(self.logits(T, params), self.y)

    def loss_flat(self, T):
        return lambda p: F.cross_entropy(self.logits(T, self.unflatten(p)), self.y)

    def net_flat(self, T):
        return lambda p: self.logits(T, self.unflatten(p))

    def loss_of_logits(self, out):
        return F.cross_entropy(out, self.y)


# -- the workloads, written once for T = functx or torch.func ---------------------------------
def hvp_fwd_rev(T, f, p, v):
    return T.jvp(T.grad(f), (p,), (v,))[1]


def hvp_rev_rev(T, f, p, v):
    return T.vjp(T.grad(f), p)[1](v)[0]


def hvp_rev_fwd(T, f, p, v):
    return T.grad(lambda q: T.jvp(f, (q,), (v,))[1])(p)


def hessian_matrix_fwd_rev(T, f, p, V):
    return T.vmap(lambda t: T.jvp(T.grad(f), (p,), (t,))[1])(V)


def hessian_matrix_rev_rev(T, f, p, V):
    vjp_fn = T.vjp(T.grad(f), p)[1]
    return T.vmap(lambda t: vjp_fn(t)[0])(V)


def ggn_vp(T, problem, p, v):
    net = problem.net_flat(T)
    out, jv = T.jvp(net, (p,), (v,))
    hjv = T.jvp(T.grad(problem.loss_of_logits), (out,), (jv,))[1]
    return T.vjp(net, p)[1](hjv)[0]


def ggn_matrix(T, problem, p, V):
    return T.vmap(lambda t: ggn_vp(T, problem, p, t))(V)


def conjugate_gradient(hvp, g, steps=CG_STEPS, damping=DAMPING):
    """Solve (H + damping I) x = g from x = 0, `steps` iterations."""
    x = torch.zeros_like(g)
    r = g.clone()
    d = r.clone()
    rs = r @ r
    for _ in range(steps):
        hd = hvp(d) + damping * d
        alpha = rs / (d @ hd)
        x = x + alpha * d
        r = r - alpha * hd
        rs_new = r @ r
        d = r + (rs_new / rs) * d
        rs = rs_new
    return x


def cg_solve(T, f, p):
    g = T.grad(f)(p)
    return conjugate_gradient(lambda t: T.jvp(T.grad(f), (p,), (t,))[1], g)


# -- plain torch.autograd ---------------------------------------------------------------------
def plain_gradient(loss, p):
    leaf = p.detach().requires_grad_()
    (g,) = torch.autograd.grad(loss(leaf), leaf, create_graph=True)
    return leaf, g


def plain_hvp(loss, p, v):
    leaf, g = plain_gradient(loss, p)
    return torch.autograd.grad(g, leaf, v)[0]


def plain_hvp_dict(loss, params, v):
    leaves = {k: t.detach().requires_grad_() for k, t in params.items()}
    grads = torch.autograd.grad(loss(leaves), list(leaves.values()), create_graph=True)
    out = torch.autograd.grad(grads, list(leaves.values()), [v[k] for k in leaves])
    return dict(zip(leaves, out))


def plain_hessian_matrix(loss, p, V):
    leaf, g = plain_gradient(loss, p)
    return torch.stack([torch.autograd.grad(g, leaf, t, retain_graph=True)[0] for t in V])


def plain_cg(loss, p):
    leaf, g = plain_gradient(loss, p)
    return conjugate_gradient(lambda t: torch.autograd.grad(g, leaf, t, retain_graph=True)[0], g.detach())


def workloads(problem: Problem):
    P = problem
    flat, v, V, params, vd = P.flat, P.v, P.V, P.params, P.v_dict
    lf, ld = P.loss_flat, P.loss_dict
    plain_lf = P.loss_flat(torch.func)  # torch's functional_call, no transform
    plain_ld = P.loss_dict(torch.func)
    return {
        "HVP forward-over-reverse, flat params": (
            lambda T: hvp_fwd_rev(T, lf(T), flat, v), lambda: plain_hvp(plain_lf, flat, v)),
        "HVP reverse-over-reverse, flat params": (
            lambda T: hvp_rev_rev(T, lf(T), flat, v), lambda: plain_hvp(plain_lf, flat, v)),
        "HVP reverse-over-forward, flat params": (
            lambda T: hvp_rev_fwd(T, lf(T), flat, v), lambda: plain_hvp(plain_lf, flat, v)),
        "HVP forward-over-reverse, dict params": (
            lambda T: hvp_fwd_rev(T, ld(T), params, vd), lambda: plain_hvp_dict(plain_ld, params, vd)),
        "HVP reverse-over-reverse, dict params": (
            lambda T: hvp_rev_rev(T, ld(T), params, vd), lambda: plain_hvp_dict(plain_ld, params, vd)),
        "HVP reverse-over-forward, dict params": (
            lambda T: hvp_rev_fwd(T, ld(T), params, vd), lambda: plain_hvp_dict(plain_ld, params, vd)),
        f"Hessian @ matrix (k={K}), vmap of forward-over-reverse HVP": (
            lambda T: hessian_matrix_fwd_rev(T, lf(T), flat, V), lambda: plain_hessian_matrix(plain_lf, flat, V)),
        f"Hessian @ matrix (k={K}), vmap of reverse-over-reverse vjp_fn": (
            lambda T: hessian_matrix_rev_rev(T, lf(T), flat, V), lambda: plain_hessian_matrix(plain_lf, flat, V)),
        "GGN-vector product (jvp, jvp(grad), vjp)": (lambda T: ggn_vp(T, P, flat, v), None),
        f"GGN @ matrix (k={K}), vmap of the GGN-vector product": (lambda T: ggn_matrix(T, P, flat, V), None),
        f"CG solve, {CG_STEPS} steps of forward-over-reverse HVPs": (
            lambda T: cg_solve(T, lf(T), flat), lambda: plain_cg(plain_lf, flat)),
    }  # fmt: skip


def run(quick: bool = False, rounds: int | None = None, n_threads: int = 1, only: str | None = None) -> dict:
    rounds = rounds or (4 if quick else 20)
    problem = Problem()
    results = []
    for label, (workload, plain) in workloads(problem).items():
        if only is not None and only not in label:
            continue

        def make(workload=workload, plain=plain):
            contenders = {"functx": lambda: workload(functx), "torch.func": lambda: workload(torch.func)}
            if plain is not None:
                contenders["loop"] = plain
            return contenders

        result = measure(label, make, rounds=rounds, n_threads=n_threads)
        result["target"] = TARGET
        result["ratio_met"] = result["ratio"] <= TARGET
        results.append(result)
    return {
        "title": f"Hessian-vector and Gauss-Newton products (target <= {TARGET}x torch.func)",
        "results": results,
        "table": table(results),
        "notes": notes(results)
        + f" Model: tanh MLP {'-'.join(map(str, SIZES))} ({problem.flat.numel():,} parameters), batch {BATCH}, "
        "cross-entropy; `loop` = plain torch.autograd (a create_graph gradient, then one backward per tangent).",
    }


if __name__ == "__main__":
    if "--only" in sys.argv:  # a substring of the row labels, for profiling one row
        i = sys.argv.index("--only")
        only = sys.argv[i + 1]
        del sys.argv[i : i + 2]
        standalone(lambda **kw: run(only=only, **kw), __doc__.splitlines()[0])
    else:
        standalone(run, __doc__.splitlines()[0])
