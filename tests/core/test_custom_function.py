"""How functx sees torch.autograd.Function.apply (functx/core/custom_function.py): torch's
behaviour is untouched with no transform running, early-bound `F.apply` works, other
threads are unaffected, and errors leave the stack as it was."""

import gc
import threading
import warnings
import weakref

import pytest
import torch

import functx
from functx.core import current_stack
from tests.autograd_functions import Cube, NumpyTanh, SignSTE

D = torch.float64


def test_no_transform_is_plain_torch(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a level was asked to apply a Function with no transform running")

    from functx.ad.direct_forward import DirectJvpLevel
    from functx.ad.wrapped_forward import WrappedJvpLevel
    from functx.ad.wrapped_reverse import WrappedGradLevel
    from functx.core.interpreter import Interpreter
    from functx.vmap.interpreter import VmapInterpreter

    for kind in (Interpreter, VmapInterpreter, WrappedGradLevel, WrappedJvpLevel, DirectJvpLevel):
        monkeypatch.setattr(kind, "apply_function", refuse)
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


def _function_defined_per_call(kind):
    """A new Function class on every call, as code that defines one inside a function makes."""
    if kind == "old-style":

        class OldCube(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                ctx.save_for_backward(x)
                return x**3

            @staticmethod
            def backward(ctx, grad):
                (x,) = ctx.saved_tensors
                return 3 * x**2 * grad

        return OldCube

    class LocalCube(torch.autograd.Function):
        generate_vmap_rule = kind == "generate_vmap_rule"

        @staticmethod
        def forward(x):
            return x**3

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0])
            ctx.save_for_forward(inputs[0])

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return 3 * x**2 * grad

        @staticmethod
        def jvp(ctx, tangent):
            (x,) = ctx.saved_tensors
            return 3 * x**2 * tangent

    if kind == "vmap staticmethod":

        def vmap(info, in_dims, x):
            return LocalCube.apply(x), in_dims[0]

        LocalCube.vmap = staticmethod(vmap)
    return LocalCube


@pytest.mark.parametrize("kind", ["generate_vmap_rule", "vmap staticmethod", "old-style"])
def test_functions_defined_per_call_are_not_kept_alive(kind):
    """functx's per-class caches (signature, generated vmap rule, single-level Function, the
    once-per-Function warning) must not keep a Function class alive after its last use."""
    x = torch.randn(3, 2, dtype=D)

    def use_once():
        F = _function_defined_per_call(kind)
        f = lambda v: F.apply(v).sum()
        expected_grad = 3 * x**2
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", functx.PerformanceWarning)  # old-style under vmap
            torch.testing.assert_close(functx.vmap(F.apply)(x), x**3)
            torch.testing.assert_close(functx.grad(f)(x[0]), expected_grad[0])
            torch.testing.assert_close(functx.vmap(functx.grad(f))(x), expected_grad)
            torch.testing.assert_close(functx.grad(lambda v: functx.vmap(F.apply)(v).sum())(x), expected_grad)
            torch.testing.assert_close(functx.vjp(F.apply, x)[1](torch.ones_like(x))[0], expected_grad)
            torch.testing.assert_close(functx.jacrev(F.apply)(x[0]), torch.diag(expected_grad[0]))
            if kind != "old-style":  # no jvp staticmethod
                torch.testing.assert_close(functx.jvp(F.apply, (x,), (torch.ones_like(x),))[1], expected_grad)
                torch.testing.assert_close(functx.jacfwd(F.apply)(x[0]), torch.diag(expected_grad[0]))
                torch.testing.assert_close(functx.hessian(f)(x[0]), torch.diag(6 * x[0]))
                torch.testing.assert_close(
                    functx.vmap(functx.jvp, in_dims=(None, 0, 0))(F.apply, (x,), (torch.ones_like(x),))[1],
                    expected_grad,
                )
        return weakref.ref(F)

    refs = [use_once() for _ in range(3)]
    gc.collect()
    assert [r() for r in refs] == [None] * 3


def test_outputs_keep_their_function_alive_until_backward():
    """The other side of not caching Functions for good: a graph made under a transform from
    a Function defined per call still finds the Function's backward later."""

    def forward_only(x):
        return functx.vmap(_function_defined_per_call("generate_vmap_rule").apply)(x).sum()

    x = torch.randn(3, 2, dtype=D, requires_grad=True)
    y = forward_only(x)
    gc.collect()
    (g,) = torch.autograd.grad(y, x)
    torch.testing.assert_close(g, 3 * x.detach() ** 2)


def test_a_subclass_does_not_use_its_parents_cached_rules():
    """The caches live in each class's own __dict__: a subclass overriding forward and
    backward is batched and differentiated with its own."""

    class Square(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(x):
            return x**2

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0])

        @staticmethod
        def backward(ctx, grad):
            return 2 * ctx.saved_tensors[0] * grad

    class Cubed(Square):
        @staticmethod
        def forward(x):
            return x**3

        @staticmethod
        def backward(ctx, grad):
            return 3 * ctx.saved_tensors[0] ** 2 * grad

    x = torch.randn(4, 3, dtype=D)
    for F, power in ((Square, 2), (Cubed, 3), (Square, 2)):
        torch.testing.assert_close(functx.vmap(F.apply)(x), x**power)
        torch.testing.assert_close(functx.vmap(functx.grad(lambda v: F.apply(v).sum()))(x), power * x ** (power - 1))
        torch.testing.assert_close(functx.grad(lambda v: functx.vmap(F.apply)(v).sum())(x), power * x ** (power - 1))


def test_apply_keeps_its_name():
    """Error messages and wrappers name it as they name torch's own: `vmap(apply, ...)`."""
    assert functx.vmap(Cube.apply).__name__ == Cube.apply.__name__ == "apply"
    assert Cube.apply.__qualname__ == "Function.apply"
