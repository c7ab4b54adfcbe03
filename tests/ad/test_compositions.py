"""Every composition up to depth 3 of {vmap, grad, vjp, jvp, jacrev}, functx against torch.func.

Each transform maps a function Tensor -> Tensor to another such function, so the same
chain can be built from functx and from torch.func (the oracle) and compared in float64.
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
    }


CHAINS = [c for depth in (1, 2, 3) for c in itertools.product(("vmap", "grad", "vjp", "jvp", "jacrev"), repeat=depth)]


@pytest.mark.parametrize("function", sorted(FUNCTIONS))
@pytest.mark.parametrize("chain", CHAINS, ids=["-".join(c) for c in CHAINS])
def test_composition_matches_torch_func(function, chain):
    f_functx = f_oracle = FUNCTIONS[function]
    ours, theirs = transforms(functx), transforms(tf)
    for name in reversed(chain):  # chain[0] is the outermost transform
        f_functx, f_oracle = ours[name](f_functx), theirs[name](f_oracle)
    x = torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(f_functx(x), f_oracle(x))
