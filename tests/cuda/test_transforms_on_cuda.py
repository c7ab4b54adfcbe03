"""Every transform, the model zoo's workloads and the Triton kernels on a CUDA device,
against the same computation on the CPU (float64, so the two agree to rounding): what only a
GPU can tell, ready for the day one is lent (scripts/device_check.sh runs this directory).

Also: torch's autograd runs a CUDA backward on its own device thread, which must see the
user's functx levels (functx keeps them per thread and hands them to that thread)."""

from __future__ import annotations

import pytest
import torch

import functx
from tests.autograd_functions import Cube
from tests.zoo.models import make

TOLERANCE = dict(rtol=1e-9, atol=1e-11)


def _to(tree, device):
    return torch.utils._pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tree)


def _net(params, x):
    (w1, b1), (w2, b2) = params
    return torch.tanh(x @ w1.T + b1) @ w2.T + b2


def _params_and_batch():
    generator = torch.Generator().manual_seed(0)
    params = [
        (torch.randn(8, 4, generator=generator, dtype=torch.float64), torch.randn(8, generator=generator, dtype=torch.float64)),
        (torch.randn(2, 8, generator=generator, dtype=torch.float64), torch.randn(2, generator=generator, dtype=torch.float64)),
    ]
    return params, torch.randn(5, 4, generator=generator, dtype=torch.float64)


def _loss(params, x):
    return _net(params, x).pow(2).sum()


TRANSFORMS = {
    "vmap": lambda p, x: functx.vmap(_net, in_dims=(None, 0))(p, x),
    "grad": lambda p, x: functx.grad(_loss)(p, x),
    "per-sample grads": lambda p, x: functx.vmap(functx.grad(_loss), in_dims=(None, 0))(p, x),
    "vjp": lambda p, x: functx.vjp(lambda x: _net(p, x), x)[1](torch.ones(5, 2, dtype=x.dtype, device=x.device)),
    "jvp": lambda p, x: functx.jvp(lambda x: _net(p, x), (x,), (torch.ones_like(x),)),
    "linearize": lambda p, x: functx.linearize(lambda x: _net(p, x), x)[1](torch.ones_like(x)),
    "jacrev": lambda p, x: functx.jacrev(_net, argnums=1)(p, x[0]),
    "jacfwd": lambda p, x: functx.jacfwd(_net, argnums=1)(p, x[0]),
    "hessian": lambda p, x: functx.hessian(lambda x: _loss(p, x))(x[0]),
    "jvp(grad)": lambda p, x: functx.jvp(functx.grad(lambda x: _loss(p, x)), (x,), (torch.ones_like(x),))[1],
    "functional_call ensemble": lambda p, x: functx.vmap(_net, in_dims=(0, None))(
        torch.utils._pytree.tree_map(lambda t: torch.stack([t, 2 * t]), p), x
    ),
    "laplacian": lambda p, x: functx.vmap(functx.laplacian(lambda x: _net(p, x).sum()))(x),
    "jet": lambda p, x: functx.jet(lambda x: _net(p, x), (x,), ((torch.ones_like(x), torch.zeros_like(x)),)),
    "jit": lambda p, x: functx.jit(functx.vmap(functx.grad(_loss), in_dims=(None, 0)))(p, x),
}


@pytest.mark.parametrize("name", TRANSFORMS)
def test_transform_on_the_device_matches_the_cpu(name, device):
    params, batch = _params_and_batch()
    expected = TRANSFORMS[name](params, batch)
    got = TRANSFORMS[name](_to(params, device), _to(batch, device))
    for g, e in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(expected)):
        assert g.device.type == torch.device(device).type
        torch.testing.assert_close(g.cpu(), e, **TOLERANCE)


ZOO = ["mlp", "gpt2", "gpt2_checkpoint", "bert", "vit", "resnet_bn_eval", "unet", "lstm_lm", "mamba_scan", "moe_topk"]


@pytest.mark.parametrize("name", ZOO)
def test_zoo_per_sample_gradients_and_hvp_on_the_device(name, device):
    torch.manual_seed(0)
    model = make(name)
    x, y = model.batch(3)
    params = {k: v.detach() for k, v in model.module.named_parameters()}
    buffers = dict(model.module.named_buffers())

    def loss(params, x, y):
        out = functx.functional_call(model.module, (params, buffers), (x[None],))
        return model.loss(out, y[None])

    def workloads(params, x, y):
        per_sample = functx.vmap(functx.grad(loss), in_dims=(None, 0, 0))(params, x, y)
        direction = {k: torch.ones_like(v) for k, v in params.items()}
        hvp = functx.jvp(lambda p: functx.grad(loss)(p, x[0], y[0]), (params,), (direction,))[1]
        return per_sample, hvp

    expected = workloads(params, x, y)
    model.module.to(device)
    buffers = dict(model.module.named_buffers())
    got = workloads(_to(params, device), _to(x, device), _to(y, device))
    for g, e in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(expected)):
        torch.testing.assert_close(g.cpu(), e, rtol=1e-7, atol=1e-9)


def test_autograd_device_threads_see_the_users_levels(device):
    x = torch.linspace(-1, 1, 6, dtype=torch.float64, device=device).reshape(3, 2)

    def f(x):
        return (Cube.apply(x, 3.0).sin() * x).sum()  # on CUDA its backward runs on the device's autograd thread

    per_sample = functx.vmap(functx.grad(f))(x)
    leaf = x.detach().clone().requires_grad_()
    (expected,) = torch.autograd.grad(f(leaf), leaf)  # rows of a sum are independent: the per-sample gradients
    torch.testing.assert_close(per_sample, expected)
    hvp = functx.jvp(functx.grad(f), (x,), (torch.ones_like(x),))[1]
    leaf = x.detach().clone().requires_grad_()
    (g,) = torch.autograd.grad(f(leaf), leaf, create_graph=True)
    (expected,) = torch.autograd.grad(g, leaf, torch.ones_like(x))
    torch.testing.assert_close(hvp, expected)


def test_triton_kernels_against_the_torch_path(device):
    if device != "cuda":
        pytest.skip("the compiled Triton kernels need CUDA (tests/kernels/test_triton.py runs them interpreted)")
    from functx.kernels import triton_kernels
    from tests.kernels.triton_cases import check_kernels

    if not triton_kernels.available:
        pytest.skip("Triton is not installed")
    assert check_kernels("cuda", extra_linear_shapes=[(4, 300, 257, 130)]) > 0
