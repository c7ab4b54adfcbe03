"""A user's TorchDispatchMode around functx transforms (core/dispatch_modes.py).

Under torch.func a mode around `vmap(f)(x)` sees the plain-tensor ops of the computation (the
physical shapes); functx used to hand it the ops on its wrappers and then crash on torch's
internal assert. References: the plain per-sample loop's FLOP count (torch's FlopCounterMode),
torch.func's values, and what the mode saw (every argument a plain tensor).
"""

import pytest
import torch
import torch.func as tf
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils.flop_counter import FlopCounterMode
from torch.utils._pytree import tree_leaves

import functx
from functx.core import current_stack
from functx.core.level_tensor import LevelTensor


class Recording(TorchDispatchMode):
    """Runs every op, recording its name and the types of its tensor arguments."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [a for a in tree_leaves((args, kwargs or {})) if isinstance(a, torch.Tensor)]
        self.ops.append((func, [type(t) for t in tensors]))
        return func(*args, **(kwargs or {}))

    def saw_wrappers(self):
        return [(str(func), kinds) for func, kinds in self.ops if any(issubclass(k, LevelTensor) for k in kinds)]


def _loss(w, x):
    return torch.tanh(w @ x).sin().sum()


TRANSFORMS = {
    "vmap": lambda lib: lib.vmap(lambda x: torch.tanh(W @ x)),
    "vmap(grad)": lambda lib: lambda xs: lib.vmap(lib.grad(_loss), in_dims=(None, 0))(W, xs),
    "grad(vmap)": lambda lib: lambda xs: lib.grad(lambda w: lib.vmap(lambda x: _loss(w, x))(xs).sum())(W),
    "jacrev": lambda lib: lambda xs: lib.jacrev(lambda x: torch.tanh(W @ x))(xs[0]),
    "jacfwd": lambda lib: lambda xs: lib.jacfwd(lambda x: torch.tanh(W @ x))(xs[0]),
    "hessian": lambda lib: lambda xs: lib.hessian(lambda x: _loss(W, x))(xs[0]),
    "jvp(grad)": lambda lib: lambda xs: lib.jvp(lib.grad(lambda x: _loss(W, x)), (xs[0],), (xs[1],))[1],
    "vmap(vjp)": lambda lib: lambda xs: lib.vmap(lambda x: lib.vjp(lambda y: torch.tanh(W @ y), x)[1](x)[0])(xs),
}
torch.manual_seed(0)
W, XS = torch.randn(8, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_a_mode_around_a_transform_sees_plain_tensors_only(name):
    expected = TRANSFORMS[name](tf)(XS)
    with Recording() as mode:
        actual = TRANSFORMS[name](functx)(XS)
        assert _get_current_dispatch_mode_stack() == [mode]  # the stack as the user left it
    torch.testing.assert_close(actual, expected)
    assert mode.ops, "the mode saw none of the computation"
    assert mode.saw_wrappers() == []
    products = (torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.mv.default, torch.ops.aten.addmv.default)
    assert any(func in products for func, _ in mode.ops), "the mode did not see the products"
    assert current_stack() == ()


def test_flop_count_is_the_per_sample_loops():
    """A FLOP counter around vmap counts the real products, as around the loop it replaces."""
    columns = XS.unsqueeze(-1)  # (4, 8, 1): matrix products, which the counter counts
    with FlopCounterMode(display=False) as loop:
        for x in columns:
            W @ x
    with FlopCounterMode(display=False) as vmapped:
        functx.vmap(lambda x: W @ x)(columns)
    with FlopCounterMode(display=False) as reference:
        tf.vmap(lambda x: W @ x)(columns)
    assert loop.get_total_flops() == 2 * 4 * 8 * 8
    assert vmapped.get_total_flops() == loop.get_total_flops() == reference.get_total_flops()


def test_flop_count_of_per_sample_gradients_is_the_per_sample_loops():
    """Per-sample gradients of a linear map: the forward products and the weight gradients'
    outer products, counted as the loop of torch.autograd.grad counts them (4 * 2 * 128)."""
    columns = XS.unsqueeze(-1)
    with FlopCounterMode(display=False) as loop:
        for x in columns:
            w = W.clone().requires_grad_()
            torch.autograd.grad((w @ x).sum(), w)
    with FlopCounterMode(display=False) as counter:
        functx.vmap(functx.grad(lambda w, x: (w @ x).sum()), in_dims=(None, 0))(W, columns)
    assert loop.get_total_flops() == 4 * 2 * (2 * 8 * 8)
    assert counter.get_total_flops() == loop.get_total_flops()


def test_two_modes_both_see_plain_tensors_in_order():
    with Recording() as outer, Recording() as inner:
        functx.vmap(functx.grad(_loss), in_dims=(None, 0))(W, XS)
        assert _get_current_dispatch_mode_stack() == [outer, inner]
    assert outer.saw_wrappers() == [] and inner.saw_wrappers() == []
    # the inner mode hands each op on to the outer one: both saw the same ops
    assert [f for f, _ in outer.ops] == [f for f, _ in inner.ops]


def test_the_stacks_are_restored_after_an_exception():
    def failing(x):
        raise ValueError("user error")

    with Recording() as mode:
        with pytest.raises(ValueError, match="user error"):
            functx.vmap(functx.grad(lambda x: failing(x)))(XS)
        assert _get_current_dispatch_mode_stack() == [mode]
    assert current_stack() == ()
    assert _get_current_dispatch_mode_stack() == []


_MODE_INSIDE = """
import torch, functx
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from functx.core import current_stack

class Passing(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))

W, XS = torch.randn(8, 8), torch.randn(4, 8)

def body(x):
    with Passing():
        return torch.tanh(W @ x).sum()

try:
    functx.vmap(body)(XS)
except functx.core.dispatch_modes.ModeInsideTransformError as error:
    assert current_stack() == () and _get_current_dispatch_mode_stack() == []
    print("refused:", error)
"""


def test_a_mode_entered_inside_a_transformed_function_is_refused_clearly():
    """Such a mode sees ops on functx's wrappers (torch gives functx no say before it does);
    where functx then makes a tensor from no tensor arguments (vmap's first shape check of an
    op does), torch asserts, and the error says what to do. A fresh process: the shape checks
    are cached per op signature, so in this one an earlier test may have made them."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _MODE_INSIDE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "refused:" in done.stdout and "Enter the mode around the transform call" in done.stdout


def test_a_mode_entered_inside_vmap_around_an_inner_transform_sees_plain_tensors():
    """A mode entered inside vmap's function, around a grad: the grad stands the mode in too,
    so the grad's ops reach it as plain tensors, with the batch's shapes."""
    seen = []

    def body(x):
        with Recording() as mode:
            out = functx.grad(lambda y: torch.sin(y).sum())(x)
        seen.append(mode)
        return out

    torch.testing.assert_close(functx.vmap(body)(XS), torch.cos(XS))
    (mode,) = seen
    assert mode.ops and mode.saw_wrappers() == []
    assert current_stack() == () and _get_current_dispatch_mode_stack() == []


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.sampled_from(["vmap", "grad", "jacrev", "jacfwd"]), min_size=1, max_size=3),
    st.sampled_from(["sin", "tanh", "mm"]),
)
def test_random_transform_stacks_under_a_mode(stack, op):
    """Random stacks of transforms around one op family: under a recording mode, functx's values
    equal torch.func's (outside any mode), and the mode saw plain tensors only."""

    def f(x):
        return {"sin": torch.sin, "tanh": torch.tanh, "mm": lambda v: W[:3, :3] @ v}[op](x).sum()

    def build(lib):
        g = f
        for name in reversed(stack):
            inner = g
            if name == "vmap":
                g = (lambda h: lambda x: lib.vmap(h)(x).sum())(inner)
            elif name == "grad":
                g = (lambda h: lambda x: lib.grad(h)(x).sum())(inner)
            else:
                g = (lambda h, t=getattr(lib, name): lambda x: t(h)(x).sum())(inner)
        return g

    x = torch.randn(*(2,) * stack.count("vmap"), 3, dtype=torch.float64)  # each vmap takes a dim
    expected = build(tf)(x)
    with Recording() as mode:
        actual = build(functx)(x)
    torch.testing.assert_close(actual, expected)
    assert mode.saw_wrappers() == []
