"""User-defined operators under functx: `torch.library.custom_op` with `register_autograd`
under grad at every level, batching rules from `functx.library.register_vmap` and from
`torch.library.register_vmap` (functx/library.py, functx/vmap/rules/custom_ops.py)."""

import numpy as np
import pytest
import torch

import functx

D = torch.float64


@torch.library.custom_op("functx_tests::numpy_sin", mutates_args=())
def numpy_sin(x: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.sin(x.detach().cpu().numpy())).to(x.device)


@numpy_sin.register_fake
def _(x):
    return torch.empty_like(x)


def _sin_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _sin_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return grad * torch.cos(x)


numpy_sin.register_autograd(_sin_backward, setup_context=_sin_setup)

torch_rule_calls = []


@torch.library.register_vmap("functx_tests::numpy_sin")
def _numpy_sin_vmap(info, in_dims, x):
    torch_rule_calls.append((info.batch_size, in_dims))
    return numpy_sin(x), in_dims[0]


def test_custom_op_under_grad_at_every_level():
    x = torch.randn(3, 4, dtype=D)
    loss = lambda v: numpy_sin(v).sum()
    torch.testing.assert_close(functx.grad(loss)(x), x.cos())
    torch.testing.assert_close(functx.grad(lambda v: functx.grad(loss)(v).sum())(x), -x.sin())
    torch.testing.assert_close(functx.vmap(functx.grad(loss))(x), x.cos())
    torch.testing.assert_close(functx.grad(lambda v: functx.vmap(loss)(v).sum())(x), x.cos())
    torch.testing.assert_close(functx.vjp(numpy_sin, x)[1](torch.ones_like(x))[0], x.cos())
    torch.testing.assert_close(functx.jacrev(numpy_sin)(x[0]), torch.diag(x[0].cos()))
    torch.testing.assert_close(functx.hessian(lambda v: numpy_sin(v).sum())(x[0]), torch.diag(-x[0].sin()))


def test_torch_registered_vmap_rule_is_used():
    x = torch.randn(5, 4, dtype=D)
    torch_rule_calls.clear()
    with functx.vmap_fallback("error"):
        torch.testing.assert_close(functx.vmap(numpy_sin)(x), x.sin())
        torch.testing.assert_close(functx.vmap(numpy_sin, in_dims=1)(x), x.sin().T)
    assert torch_rule_calls == [(5, (0,)), (4, (1,))]  # the in_dim as passed, as torch.func gives it


_lib = torch.library.Library("functx_tests", "FRAGMENT")
_lib.define("scaled_add(Tensor x, Tensor y, float alpha) -> Tensor")
_lib.impl("scaled_add", lambda x, y, alpha: x + alpha * y, "CompositeExplicitAutograd")


def test_functx_library_rule_for_a_library_defined_op_and_late_registration():
    op = torch.ops.functx_tests.scaled_add.default
    xs, y = torch.randn(4, 3, dtype=D), torch.randn(3, dtype=D)
    with pytest.warns(functx.PerformanceWarning, match="functx_tests::scaled_add"):
        torch.testing.assert_close(functx.vmap(op, in_dims=(0, None, None))(xs, y, 2.0), xs + 2 * y)
    calls = []

    @functx.library.register_vmap("functx_tests::scaled_add")
    def rule(info, in_dims, x, y, alpha):
        calls.append(in_dims)
        x = x if in_dims[0] is not None else x.expand(info.batch_size, *x.shape)
        y = y if in_dims[1] is not None else y.expand(info.batch_size, *y.shape)
        return op(x, y, alpha), 0

    with functx.vmap_fallback("error"):  # the rule registered after the op's first vmap is used
        torch.testing.assert_close(functx.vmap(op, in_dims=(0, None, None))(xs, y, 2.0), xs + 2 * y)
        torch.testing.assert_close(functx.vmap(op, in_dims=(None, 0, None))(y, xs, 0.5), y + 0.5 * xs)
    assert calls == [(0, None, None), (None, 0, None)]


def test_register_vmap_rejects_what_is_not_an_operator():
    with pytest.raises(TypeError, match="expected an operator"):
        functx.library.register_vmap(lambda x: x, lambda *a: a)
    with pytest.raises(ValueError, match="like 'mylib::op'"):
        functx.library.register_vmap("no_namespace", lambda *a: a)
