"""The one door for users' torch calls (functx/core/torch_function.py): one TorchFunctionMode
per thread, calling the live levels' handlers innermost first, with torch's own rule for a
mode's handler (its own calls are not seen by itself or the levels inside it) kept."""

import pathlib
import re

import pytest
import torch

import functx
from functx.core import torch_function as tf
from functx.core.interpreter import current_stack

FUNCTX = pathlib.Path(functx.__file__).parent


class Recorder(tf.CallHandler):
    """Records the name of each torch call it sees, then lets it through."""

    def __init__(self, name, log, action=None):
        self.name, self.log, self.action = name, log, action

    def torch_function(self, func, types, args, kwargs):
        self.log.append((self.name, func.__name__))
        if self.action is not None:
            return self.action(func, types, args, kwargs)
        return NotImplemented


def _functx_modes_on_torch_stack():
    stack = [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]
    return [m for m in stack if isinstance(m, tf._UserCalls)]


def test_functx_defines_one_torch_function_mode():
    defined = []
    for path in FUNCTX.rglob("*.py"):
        defined += [(path.name, m) for m in re.findall(r"^class (\w+)\([^)]*TorchFunctionMode[^)]*\)", path.read_text(), re.M)]
    assert defined == [("torch_function.py", "_UserCalls")]


@pytest.mark.parametrize(
    "stack, handlers",
    [
        # the two vmaps', jacfwd's own vmap over the basis, and its wrapped jvp's lifting
        (lambda f: functx.vmap(functx.vmap(functx.jacfwd(f))), 4),
        (lambda f: functx.vmap(functx.grad(f)), 2),  # randomness + the direct grad's writes
        (lambda f: functx.grad(lambda x: functx.grad(f)(x).sum()), 2),
        (lambda f: functx.jvp(lambda x: functx.vjp(f, x)[0], (torch.ones(2, 3),), (torch.ones(2, 3),))[1], 2),
    ],
)
def test_stacked_levels_share_one_mode(stack, handlers):
    seen = []

    def f(x):
        seen.append((len(_functx_modes_on_torch_stack()), len(tf.live_handlers())))
        return x.sin().sum()

    transformed = stack(f)
    if not isinstance(transformed, torch.Tensor):
        transformed(torch.randn(2, 3, 3))
    assert seen and seen[-1] == (1, handlers), seen
    # and nothing is left behind
    assert _functx_modes_on_torch_stack() == [] and tf.live_handlers() == () and current_stack() == ()


def test_handlers_innermost_first_and_call_outer():
    log = []
    outer = Recorder("outer", log)
    inner = Recorder("inner", log, action=lambda func, types, args, kwargs: tf.call_outer(func, types, args, kwargs) * 2)
    x = torch.ones(3)
    with outer, inner:
        out = torch.add(x, 1)
    assert log == [("inner", "add"), ("outer", "add")]
    torch.testing.assert_close(out, torch.full((3,), 4.0))
    assert tf.live_handlers() == () and _functx_modes_on_torch_stack() == []


def test_a_handlers_own_calls_reach_only_outer_handlers_when_asked():
    log = []

    def draws_more(func, types, args, kwargs):
        if func is torch.add:
            torch.mul(args[0], 1)  # not seen by anyone: as inside a mode's handler
            with tf.seen_by_outer():
                torch.sub(args[0], 1)  # seen by the outer handler only
            with tf.seen_here_and_outer():
                torch.div(args[0], 1)  # seen by this handler and the outer one
        return NotImplemented

    x = torch.ones(2)
    with Recorder("outer", log), Recorder("inner", log, action=draws_more):
        torch.add(x, 1)
    assert log == [
        ("inner", "add"), ("outer", "sub"), ("inner", "div"), ("outer", "div"), ("outer", "add"),
    ]  # fmt: skip


def test_a_handler_added_inside_a_handler_sees_with_the_outer_ones():
    log = []

    def opens_a_level(func, types, args, kwargs):
        if func is torch.add:
            with Recorder("opened", log):
                torch.mul(args[0], 1)  # today's rule for a mode pushed inside a handler
        return NotImplemented

    x = torch.ones(2)
    with Recorder("outer", log), Recorder("middle", log, action=opens_a_level), Recorder("inner", log):
        torch.add(x, 1)
    assert log == [("inner", "add"), ("middle", "add"), ("opened", "mul"), ("outer", "mul"), ("outer", "add")]


def test_state_is_restored_after_an_exception_in_a_handler():
    def boom(func, types, args, kwargs):
        raise ValueError("boom")

    log = []
    x = torch.ones(2)
    with Recorder("outer", log):
        with pytest.raises(ValueError, match="boom"):
            with Recorder("inner", log, action=boom):
                torch.add(x, 1)
        assert len(tf.live_handlers()) == 1 and len(_functx_modes_on_torch_stack()) == 1
        torch.sin(x)
    assert log[-1] == ("outer", "sin")
    assert tf.live_handlers() == () and _functx_modes_on_torch_stack() == []


def test_a_users_mode_inside_a_transform_still_sees_the_calls():
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    def f(x):
        with Count():
            return torch.randn(3) * 0 + x.sin()

    out = functx.vmap(f, randomness="different")(torch.zeros(4, 3))
    torch.testing.assert_close(out, torch.zeros(4, 3))
    assert Count.calls >= 3
