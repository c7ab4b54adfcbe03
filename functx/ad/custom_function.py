"""`torch.autograd.Function` at a wrapped grad or jvp level.

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

At a wrapped jvp level one level down means duals for this call only (wrapped_forward.py):
the Function is applied one level down to duals of the primals and tangents, so torch
calls its `jvp` there, and the results are taken apart into this level's DualTensors.
"""

from __future__ import annotations

import threading

import optree
import torch
from torch.autograd.forward_ad import _set_fwd_grad_enabled as _forward_grad_enabled

from ..core.forward_ad_state import level_rule
from ..core.custom_function import apply_original, cached_on_class, is_new_style, with_forward
from ..core.level_tensor import LevelTensor
from .direct_reverse import is_differentiated
from .dual_tensor import DUAL_LEVEL, DualTensor, function_inputs, make_duals, unpack_dual
from .lifting import applying_below

_pending = threading.local()  # the level whose single-level Function is being applied


def single_level_function(function):
    """The single-level version of `function`. Made once per Function class
    (`cached_on_class`: not kept alive by functx)."""
    name = function.__name__

    def forward(*args):
        level = _pending.level
        # this level's tensors inside containers too (`F.apply([a, b])`), as torch.func does:
        # torch's autograd does not see them, and one level down they must not be seen either
        values = optree.tree_map(
            lambda a: a._value if getattr(a, "_interp", None) is level else a, args, none_is_leaf=True
        )
        # torch runs a Function's forward with grad and forward grad off; one level down
        # they are what they were outside this level (lower levels record, and a lower
        # jvp level must see the Function to call its jvp).
        with torch.set_grad_enabled(level.prev_grad_mode), _forward_grad_enabled(True), applying_below(level):
            outputs = function.apply(*values)  # one level down (maybe another transform)
        return _wrap_outputs(level, outputs, args, values)

    def jvp(ctx, *tangents):
        if function.jvp is torch.autograd.Function.jvp:
            raise RuntimeError(no_jvp_message(name))
        return function.jvp(ctx, *tangents)

    return with_forward(function, forward, "AtLevel", jvp)


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


def function_jvp_without_formula(function, primals, tangents, kwargs):
    """`(outputs, output tangents)` of a Function without a jvp staticmethod, one level down.
    The transforms above the levels install it (forward.function_jvp_by_double_vjp)."""
    raise RuntimeError(no_jvp_message(function.__name__))


def no_jvp_message(name):
    return (
        f"functx.jvp: the autograd.Function {name} has no jvp staticmethod. Forward-mode "
        f"transforms (jvp, jacfwd, linearize's users) need one: define "
        f"`jvp(ctx, *tangents)` on {name} (torch.func needs it too)."
    )


def apply_at_grad_level(level, function, args, kwargs):
    """`function.apply(*args)` where `level` (a wrapped grad level, or a wrapped jvp level's
    carriers) is the highest level."""
    with level_rule():
        return _apply_at_grad_level(level, function, args, kwargs)


def _apply_at_grad_level(level, function, args, kwargs):
    if not is_new_style(function):
        if not _seen_below(level, function, args):
            return apply_original(function, *args, **kwargs)
        generated = cached_on_class(function, "seen_below", old_style_seen_below)
    else:
        generated = cached_on_class(function, "single_level", single_level_function)
    previous = getattr(_pending, "level", None)
    _pending.level = level
    try:
        return apply_original(generated, *args, **kwargs)
    finally:
        _pending.level = previous


def _seen_below(level, function, args) -> bool:
    """Whether a level below this one differentiates an argument of an old-style Function.
    Its forward runs under torch's no_grad and with forward AD off, so applied here as torch
    applies it such a level would not see its operations: second derivatives through it
    (grad of grad, hessian, jacrev of jacrev, vmap of those) came out wrong (zero for a
    linear Function), and so did a forward level's (`jvp(jacrev)`: the tangent of its result
    was lost, where applied one level down the jvp level calls the Function's jvp or says
    it has none)."""
    return any(
        getattr(a, "_interp", None) is level and _differentiated_below(a._value)
        for a in optree.tree_leaves(args, none_is_leaf=True)
    )


def _differentiated_below(x) -> bool:
    """Whether a level that would not see the Function's forward differentiates `x` (a value
    one level down): autograd tracks it (plain or a functx grad level), or it is a plain
    tensor with a tangent of torch's forward AD (a jvp on the values), which torch's forward
    AD, off in the forward, does not propagate. (A wrapped jvp level below sees the forward's
    ops on its DualTensors whatever torch's mode: `user_forward_ad`; a vmap level's rules run
    on its physical tensors in torch's mode, so the jvp on values under `jvp(vmap(grad))`
    is looked for through it.)"""
    if is_differentiated(x):
        return True
    while isinstance(x, LevelTensor) and type(x) is not DualTensor:
        x = x._value
    return type(x) is torch.Tensor and unpack_dual(x, DUAL_LEVEL)[1] is not None


def old_style_seen_below(function):
    """`function` (old style: forward(ctx, ...)) as a Function of this level whose forward the
    levels below see: it runs the user's forward on this level's tensors only to fill the
    ctx the user's backward reads (torch runs it without grad; its result is not used), and
    takes its result from the Function applied one level down, with the grad mode of outside
    this level, where the lower levels record it. The user's forward runs twice, so one that
    writes its inputs (mark_dirty) is refused. Made once per Function class."""
    name = function.__name__

    def forward(ctx, *args):
        level = _pending.level
        function.forward(ctx, *args)
        if getattr(ctx, "dirty_tensors", None):
            raise RuntimeError(
                f"functx: {name} is an old-style autograd.Function (forward(ctx, ...)) that writes "
                f"its inputs (mark_dirty), differentiated by two nested grad levels here (grad of "
                f"grad, hessian, jacrev of jacrev). functx must run its forward twice there. Write it "
                f"torch 2.x style: forward(*args) without ctx plus a setup_context staticmethod."
            )
        values = optree.tree_map(
            lambda a: a._value if getattr(a, "_interp", None) is level else a, args, none_is_leaf=True
        )
        with torch.set_grad_enabled(level.prev_grad_mode), _forward_grad_enabled(True), applying_below(level):
            outputs = function.apply(*values)  # one level down
        return _wrap_outputs(level, outputs, args, values)

    def backward(ctx, *grads):
        return function.backward(ctx, *grads)

    def jvp(ctx, *tangents):  # a wrapped jvp level applying it to its carriers: `jvp(jvp)`
        if function.jvp is torch.autograd.Function.jvp:
            raise RuntimeError(no_jvp_message(name))
        return function.jvp(ctx, *tangents)

    return type(f"{name}SeenBelow", (torch.autograd.Function,), {
        "forward": staticmethod(forward), "backward": staticmethod(backward), "jvp": staticmethod(jvp),
        "__qualname__": f"{name}SeenBelow",
    })  # fmt: skip


def apply_at_jvp_level(level, function, args, kwargs):
    """`function.apply(*args)` where `level` (a wrapped jvp level) is the highest level."""
    with level_rule():
        return _apply_at_jvp_level(level, function, args, kwargs)


def _apply_at_jvp_level(level, function, args, kwargs):
    # torch's autograd.Function differentiates its tensor arguments, not tensors inside
    # containers: those go in as primals, without tangents (as in torch.func)
    args = tuple(
        a if isinstance(a, torch.Tensor) else optree.tree_map(level._inner, a, none_is_leaf=True) for a in args
    )
    primals, tangents = level.split(args)
    if all(t is None for t in tangents):
        with applying_below(level):
            outputs = function.apply(*primals, **kwargs)
        return level.wrap_outputs(outputs, False)
    if function.jvp is torch.autograd.Function.jvp:  # no forward formula: the double-VJP identity
        with applying_below(level):
            out, out_tangents = function_jvp_without_formula(function, primals, tangents, kwargs)
        return level._wrap_pairs(out, out_tangents)
    # torch's own apply on plain duals, unless a tangent is another level's (a vmap's
    # BatchedTensor): torch would check the view-ness of the jvp's result on that wrapper,
    # which is never a C++ view ("forward is returning a view but the jvp is not")
    plain = not level.over_dual_values and all(
        not isinstance(v, torch.Tensor) or type(v) is torch.Tensor for v in (*primals, *tangents)
    )
    primals, tangents = function_inputs(primals, tangents)
    with _forward_grad_enabled(True):  # not inside __torch_dispatch__: nothing to restore
        duals = make_duals(primals, tangents, None if plain else level, level.over_dual_values)
        if plain:  # torch's own apply on the duals calls its jvp
            with applying_below(level):
                outputs = function.apply(*duals, **kwargs)
        else:  # on this level's carriers: the single-level Function, whose jvp is the user's
            outputs = _apply_at_grad_level(level, function, duals, kwargs)
        for arg, dual in zip(args, duals):  # an input returned (marked dirty): itself
            if outputs is dual:
                return arg
        # (taken apart with forward AD on: applied inside another Function's jvp, where torch
        # has it off, `_unpack_dual` gave no tangent, and jvp(jvp(f)) of a Function whose jvp
        # applies a Function lost its second derivative: zero)
        return level.wrap_outputs(outputs, True)
