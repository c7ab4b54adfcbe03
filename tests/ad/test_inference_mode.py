"""The AD transforms under `torch.inference_mode()` and on tensors made in it.

Inference mode switches autograd's recording off for every tensor whatever the grad mode,
so a transform that only turned grad mode on would silently return zeros. torch.func's
transforms work there; functx's must too (grad_level.outside_inference_mode)."""

import pytest
import torch
import torch.func as tf
from torch.testing import assert_close

import functx

D = torch.float64
f = lambda v: (v.sin() * v).sum()
CASES = {
    "grad": lambda T, x: T.grad(f)(x[0]),
    "vmap_grad": lambda T, x: T.vmap(T.grad(f))(x),
    "grad_grad": lambda T, x: T.grad(lambda v: T.grad(f)(v).sum())(x[0]),
    "grad_and_value": lambda T, x: T.grad_and_value(f)(x[0]),
    "vjp": lambda T, x: T.vjp(torch.sin, x)[1](torch.ones_like(x))[0],
    "jvp": lambda T, x: T.jvp(torch.sin, (x,), (torch.ones_like(x),))[1],
    "jacrev": lambda T, x: T.jacrev(torch.sin)(x[0]),
    "jacfwd": lambda T, x: T.jacfwd(torch.sin)(x[0]),
    "hessian": lambda T, x: T.hessian(f)(x[0]),
    "linearize": lambda T, x: T.linearize(torch.sin, x)[1](torch.ones_like(x)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_transforms_called_under_inference_mode(name):
    x = torch.randn(3, 4, dtype=D)
    want = CASES[name](tf, x)
    with torch.inference_mode():
        got = CASES[name](functx, x)
    assert_close(got, want)


@pytest.mark.parametrize("name", ["grad", "vmap_grad", "vjp", "jvp", "jacrev", "hessian"])
def test_inputs_made_under_inference_mode(name):
    with torch.inference_mode():
        x = torch.randn(3, 4, dtype=D)
    assert_close(CASES[name](functx, x), CASES[name](tf, x.clone()))
