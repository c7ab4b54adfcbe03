"""Compositions up to depth 3 of {vmap, grad, vjp, jvp, jacrev, jacfwd, hessian}, functx against torch.func.

Each transform maps a function Tensor -> Tensor to another such function, so the same
chain can be built from functx and from torch.func (the oracle) and compared in float64.

Which chains run (7 transforms give 7 + 49 + 343 chains per function, too many for CI):
every chain of depth 1 and 2 for every function; at depth 3 every chain of the original five
{vmap, grad, vjp, jvp, jacrev} for every function, plus, for the mlp only, every depth-3
chain that contains jacfwd or hessian (forward-over-forward, forward-over-reverse and
reverse-over-forward at every position of the chain).
"""

import itertools

import pytest
import torch
import torch.func as tf
import torch.nn.functional as F

import functx

D = torch.float64
g = torch.Generator().manual_seed(0)
W1, B1, W2 = torch.randn(5, 4, dtype=D, generator=g), torch.randn(5, dtype=D, generator=g), torch.randn(3, 5, dtype=D, generator=g)
KERNEL = torch.randn(2, 1, 2, 2, dtype=D, generator=g)
TANGENT_SCALE = 0.3


def mlp(x):
    return W2 @ torch.tanh(W1 @ x + B1)


def convnet(x):
    image = x.reshape(1, 1, 2, 2).expand(1, 1, 2, 2).repeat(1, 1, 2, 2)  # (1, 1, 4, 4)
    return F.relu(F.conv2d(image, KERNEL, padding=1)).flatten().sin()[:3] * x.sum()


def shape_control_flow(x):
    y = x.sin()
    if y.shape[0] > 2:  # control flow on shapes is fine under every transform
        y = y[:3] * y[1:].sum()
    for _ in range(y.dim()):
        y = y.cumsum(0) * 0.5
    return y


FUNCTIONS = {"mlp": mlp, "convnet": convnet, "shape_control_flow": shape_control_flow}


def transforms(lib):
    return {
        "vmap": lambda f: lambda x: lib.vmap(f)(torch.stack([x, 0.5 * x + 1.0])).sum(0),
        "grad": lambda f: lambda x: lib.grad(lambda y: f(y).sum())(x),
        "vjp": lambda f: lambda x: lib.vjp(f, x)[1](torch.ones_like(f(x)))[0],
        "jvp": lambda f: lambda x: lib.jvp(f, (x,), (torch.full_like(x, TANGENT_SCALE),))[1],
        # rows of the Jacobian weighted by their index, so a wrong row order shows
        "jacrev": lambda f: lambda x: torch.einsum("o...,o->...", lib.jacrev(f)(x), torch.arange(1.0, f(x).shape[0] + 1, dtype=D)),
        # the forward-mode Jacobian, contracted with the same weighting: shape of x again
        "jacfwd": lambda f: lambda x: torch.einsum("o...,o->...", lib.jacfwd(f)(x), torch.arange(1.0, f(x).shape[0] + 1, dtype=D)),
        # Hessian of the summed output (shape x.shape + x.shape), its rows weighted by index
        # (a symmetric matrix, so this is also the weighted sum of its columns): shape of x
        "hessian": lambda f: lambda x: torch.einsum("i...,i->...", lib.hessian(lambda y: f(y).sum())(x), torch.arange(1.0, x.shape[0] + 1, dtype=D)),
    }


BASE = ("vmap", "grad", "vjp", "jvp", "jacrev")
FORWARD = ("jacfwd", "hessian")
ALL = BASE + FORWARD
CHAINS = [c for depth in (1, 2, 3) for c in itertools.product(BASE, repeat=depth)]  # test_custom_function.py
CASES = (
    [(c, f) for depth in (1, 2) for c in itertools.product(ALL, repeat=depth) for f in sorted(FUNCTIONS)]
    + [(c, f) for c in itertools.product(BASE, repeat=3) for f in sorted(FUNCTIONS)]
    + [(c, "mlp") for c in itertools.product(ALL, repeat=3) if set(c) & set(FORWARD)]
)


@pytest.mark.parametrize(("chain", "function"), CASES, ids=[f"{'-'.join(c)}-{f}" for c, f in CASES])
def test_composition_matches_torch_func(function, chain):
    f_functx = f_oracle = FUNCTIONS[function]
    ours, theirs = transforms(functx), transforms(tf)
    for name in reversed(chain):  # chain[0] is the outermost transform
        f_functx, f_oracle = ours[name](f_functx), theirs[name](f_oracle)
    x = torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(f_functx(x), f_oracle(x))
