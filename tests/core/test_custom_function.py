"""How functx sees torch.autograd.Function.apply (functx/core/custom_function.py): torch's
behaviour is untouched with no transform running, early-bound `F.apply` works, other
threads are unaffected, and errors leave the stack as it was."""

import threading

import pytest
import torch

import functx
from functx.core import current_stack
from functx.core import custom_function
from tests.autograd_functions import Cube, NumpyTanh, SignSTE

D = torch.float64


def test_no_transform_is_plain_torch(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a level was asked to apply a Function with no transform running")

    for kind in ("vmap", "grad", "jvp"):
        monkeypatch.setitem(custom_function._LEVEL_RULES, kind, refuse)
    x = torch.randn(3, dtype=D, requires_grad=True)
    y = Cube.apply(x, 2.0)
    assert type(y.grad_fn).__name__ == "CubeBackward"
    (g,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(g, 6 * x.detach() ** 2)
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        tangent = fwAD.unpack_dual(SignSTE.apply(fwAD.make_dual(x.detach(), torch.ones(3, dtype=D)))).tangent
    torch.testing.assert_close(tangent, (x.detach().abs() <= 2).to(D))


def test_apply_bound_before_any_transform():
    apply = NumpyTanh.apply  # bound at "import time"
    x = torch.randn(4, dtype=D)
    torch.testing.assert_close(functx.grad(lambda v: apply(v).sum())(x), 1 - torch.tanh(x) ** 2)
    torch.testing.assert_close(functx.vmap(apply)(x[None]), torch.tanh(x)[None])


def test_defaults_and_keyword_arguments_are_bound_like_torch():
    class Scale(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(x, scale=3.0):
            return x * scale

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.scale = inputs[1]

        @staticmethod
        def backward(ctx, grad):
            return grad * ctx.scale, None

    x = torch.randn(2, 3, dtype=D)
    torch.testing.assert_close(functx.vmap(Scale.apply)(x), 3 * x)
    torch.testing.assert_close(functx.vmap(lambda v: Scale.apply(v, scale=0.5))(x), 0.5 * x)
    torch.testing.assert_close(functx.grad(lambda v: Scale.apply(v, scale=0.5).sum())(x), torch.full_like(x, 0.5))


def test_other_threads_are_unaffected():
    inside, done = threading.Event(), threading.Event()
    seen = {}

    def other_thread():
        inside.wait()
        x = torch.randn(3, requires_grad=True)
        y = Cube.apply(x, 1.0)
        seen["grad_fn"] = type(y.grad_fn).__name__
        seen["stack"] = current_stack()
        done.set()

    thread = threading.Thread(target=other_thread)
    thread.start()

    def f(v):
        inside.set()
        done.wait(timeout=30)
        return Cube.apply(v, 1.0)

    functx.vmap(f)(torch.randn(2, 3))
    thread.join()
    assert seen == {"grad_fn": "CubeBackward", "stack": ()}


def test_errors_inside_a_function_leave_the_stack_as_it_was():
    class Boom(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(x):
            return x * 2

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, grad):
            raise ValueError("boom in backward")

    x = torch.randn(2, 3)
    with pytest.raises(ValueError, match="boom in backward"):
        functx.vmap(functx.grad(lambda v: Boom.apply(v).sum()))(x)
    assert current_stack() == ()
    with pytest.raises(ValueError, match="boom in backward"):
        functx.grad(lambda v: functx.vmap(Boom.apply)(v).sum())(x)
    assert current_stack() == ()
    torch.testing.assert_close(functx.vmap(Boom.apply)(x), 2 * x)
