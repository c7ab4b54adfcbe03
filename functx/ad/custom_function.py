"""`torch.autograd.Function` at a grad or jvp level.

A torch 2.x style Function (`forward` without ctx, plus `setup_context`) is turned into a
*single-level* Function for the level (torch.func does the same): its `forward` unwraps
this level's tensors and applies the user's Function one level down (so every lower level
handles it in turn, and the user's `forward` finally runs on plain tensors: numpy or
`.item()` in it are fine), then wraps the outputs; its `setup_context`, `backward` and
`jvp` are the user's, applied by torch's autograd to this level's wrappers. So the user's
backward is the derivative at every level (`grad(vmap(F.apply))`, `vmap(grad(F.apply))`,
`grad(grad(F.apply))`), and their `jvp` is the forward derivative.

An old-style Function (`forward(ctx, ...)`, no `setup_context`) cannot be split like that:
torch's own `apply` runs it on this level's wrappers, so its backward is this level's
derivative and the levels below see the operations of its forward.
"""

from __future__ import annotations

import threading

import torch
from torch.autograd.forward_ad import _set_fwd_grad_enabled as _forward_grad_enabled

from ..core.custom_function import apply_original, is_new_style, register_level_rule, user_backward

_pending = threading.local()  # the level whose single-level Function is being applied
_single_level: dict = {}


def single_level_function(function):
    """The single-level version of `function` (cached per Function class)."""
    try:
        return _single_level[function]
    except KeyError:
        pass
    name = function.__name__

    def forward(*args):
        level = _pending.level
        values = tuple(a._value if getattr(a, "_interp", None) is level else a for a in args)
        # torch runs a Function's forward with grad and forward grad off; one level down
        # they are what they were outside this level (lower levels record, and a lower
        # jvp level must see the Function to call its jvp).
        with torch.set_grad_enabled(level.prev_grad_mode), _forward_grad_enabled(True):
            outputs = function.apply(*values)  # one level down (maybe another transform)
        return _wrap_outputs(level, outputs, args, values)

    def setup_context(ctx, inputs, output):
        return function.setup_context(ctx, inputs, output)

    def backward(ctx, *grads):
        return user_backward(function)(ctx, *grads)

    def jvp(ctx, *tangents):
        if function.jvp is torch.autograd.Function.jvp:
            raise RuntimeError(
                f"functx.jvp: the autograd.Function {name} has no jvp staticmethod. Forward-mode "
                f"transforms (jvp, jacfwd, linearize's users) need one: define "
                f"`jvp(ctx, *tangents)` on {name} (torch.func needs it too)."
            )
        return function.jvp(ctx, *tangents)

    members = {
        "forward": staticmethod(forward),
        "setup_context": staticmethod(setup_context),
        "backward": staticmethod(backward),
        "jvp": staticmethod(jvp),
        "__qualname__": f"{name}AtLevel",
    }
    generated = type(f"{name}AtLevel", (torch.autograd.Function,), members)
    _single_level[function] = generated
    return generated


def _wrap_outputs(level, outputs, args, values):
    def wrap(out):
        if not isinstance(out, torch.Tensor):
            return out
        for arg, value in zip(args, values):  # an input returned (e.g. marked dirty): itself
            if out is value:
                return arg
        return level.wrap(out)

    if type(outputs) is tuple or type(outputs) is list:
        return type(outputs)(wrap(o) for o in outputs)
    return wrap(outputs)


def apply_at_grad_level(level, function, args, kwargs):
    """`function.apply(*args)` where `level` (a grad or jvp level) is the highest level."""
    if not is_new_style(function):
        return apply_original(function, *args, **kwargs)
    generated = single_level_function(function)
    previous = getattr(_pending, "level", None)
    _pending.level = level
    try:
        return apply_original(generated, *args, **kwargs)
    finally:
        _pending.level = previous


register_level_rule("grad", apply_at_grad_level)
register_level_rule("jvp", apply_at_grad_level)
