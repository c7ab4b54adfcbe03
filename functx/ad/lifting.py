"""Tensors made inside a wrapped AD level's function belong to that level.

A wrapped level (wrapped_reverse.py, wrapped_forward.py) sees only ops on its own wrapper
tensors. A buffer the function makes itself (`h = torch.zeros(3)`) is a plain tensor, and
an in-place write of a differentiated value into it (`h[0] = a`, `h.copy_(a)`) would make
the one plain object carry two levels' derivatives: torch's autograd records this level's
history on it, and the level below records its own on the same object, overwriting one
with the other (second derivatives come out 0; torch raises an internal assert for
`h[0] = a`). So while the function runs, factory results are lifted into the level as
constants (`level.lift`), as functorch's dynamic layers do for factory ops: the buffer is
then a wrapper of this level over a plain tensor, one object per level.

A handler of users' torch calls (core/torch_function.py) sees the factories (they have no
tensor argument for dispatch to find); paid only at wrapped levels (never by per-sample
gradients, MAML's inner steps or the outermost `grad`, which are direct).
Inside `__torch_dispatch__` and functx's own code (`functx_code`) torch functions are off,
so rules and bookkeeping never see it. A write into a tensor from outside the function
(a captured tensor) cannot be lifted: it raises `raise_captured_write`'s error, as
torch.func does. Direct levels own no tensors and see no ops: there `CapturedWrites`, a
lighter handler (a dict lookup and an attribute per call),
refuses those writes while the function runs.

    >>> import torch, functx
    >>> def f(a):
    ...     h = torch.zeros(3)
    ...     h[0] = a
    ...     return torch.sin(h).sum()
    >>> functx.grad(functx.grad(f))(torch.tensor(0.5))  # -sin(0.5)
    tensor(-0.4794)
"""

from __future__ import annotations

import torch

from ..core.custom_function import in_function_body
from ..core.forward_ad_state import in_level_rule
from ..core.errors import op_name
from ..core.factories import FACTORIES
from ..core.interpreter import functx_code
from ..core.level_tensor import LevelTensor, call_at_values, level_of
from ..core.torch_function import CallHandler, call_outer, seen_by_outer
from .aliased_writes import function_twin, written_out_of_place


class FactoryLifting(CallHandler):
    """While a wrapped AD level's function runs: floating-point tensors that factories make
    (or `clone` makes of values from outside) become constants of the level. Since the
    handler sees every torch call of the function anyway, a level may also take whole
    composite ops here, before they decompose (`level.torch_function_rules`)."""

    def __init__(self, level):
        self.level = level
        self.below = 0  # inside `applying_below`: what is made there is not this level's

    def torch_function(self, func, types, args, kwargs):
        level = self.level
        rule = level.torch_function_rules.get(func)
        if rule is not None:  # a whole composite op at once (wrapped_forward.py: matmul)
            with seen_by_outer():
                out = rule(level, args, kwargs)
            if out is not NotImplemented:
                return out
        if function_twin(func) is not None:  # an in-place pointwise call: `v.mul_(v)`? (ad/aliased_writes.py)
            out = written_out_of_place(func, args, kwargs, lambda f, a, k: call_outer(f, types, a, k))
            if out is not NotImplemented:
                return out
        if func in _TO_NUMPY and _constant_of(level, args[0]):
            # a constant of the level (a non-differentiated argument, ADLevel.own, or a
            # factory's result) leaves torch as its value does, as it did before it was wrapped
            return call_outer(func, types, (args[0]._value, *args[1:]), kwargs)
        factory = func in FACTORIES
        if level.over_dual_values and not in_level_rule():  # core/dual_values.py
            out = call_at_values(lambda *a, **k: call_outer(func, types, a, k), args, kwargs)
        elif factory:
            out = call_outer(func, types, args, kwargs)
        else:
            return NotImplemented
        if (
            factory
            and isinstance(out, torch.Tensor)
            and (out.is_floating_point() or out.is_complex())
            and level_of(out) < level.level  # plain or from below (a level above made it its own)
            and level.alive
            and not self.below
        ):
            with seen_by_outer():
                return level.lift(out)
        return out


_TO_NUMPY = (torch.Tensor.numpy, torch.Tensor.__array__)


def _constant_of(level, x) -> bool:
    return isinstance(x, LevelTensor) and x._interp is level and not level.depends(x)


class applying_below:
    """While a wrapped level applies a `torch.autograd.Function` one level down
    (ad/custom_function.py): the Function's forward runs on the tensors of the levels below
    (finally plain ones), so the tensors it makes (`torch.as_tensor` of a NumPy result) are
    theirs, not constants of this level. Lifted here, the Function's result was this level's
    constant and lost the graph or tangent the levels below gave it: a NumPy-forward
    Function under `hessian` or `grad(jvp)` came out wrong."""

    __slots__ = ("_handler",)

    def __init__(self, level):
        self._handler = level._lifting

    def __enter__(self):
        self._handler.below += 1

    def __exit__(self, *exc):
        self._handler.below -= 1


def raise_captured_write(op, transform: str):
    """An in-place op would write a differentiated value of an AD level into a tensor that
    is not the level's (made outside the function): torch.func refuses it too, with a
    RuntimeError saying the op "would mutate a captured Tensor"."""
    raise RuntimeError(
        f"functx.{transform}: {op_name(op)} writes in place into a tensor that was not made inside "
        f"the transformed function (a captured tensor), but the value it writes depends on the "
        f"inputs being differentiated: it would mutate a captured Tensor (torch.func refuses "
        f"it too). Make the tensor inside the function (e.g. `buf = torch.zeros(...)` there, or "
        f"`buf = captured.clone()`, and return it), or use the out-of-place op."
    )


# Python names of the tensor methods that write into `self` besides those ending in one `_`
_INPLACE_DUNDERS = frozenset(
    f"__i{name}__" for name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul",
                                "and", "or", "xor", "lshift", "rshift")
) | {"__setitem__"}  # fmt: skip


def _named_in_place(func) -> bool:
    name = getattr(func, "__name__", "")
    return name in _INPLACE_DUNDERS or (name.endswith("_") and not name.endswith("__"))


_WRITES_IN_PLACE: dict = {}  # torch function -> `_named_in_place(func)`


def _writes_in_place(func) -> bool:
    """Whether torch function `func` writes into its first argument (`copy_`, `add_`,
    `index_put_`, `__setitem__`, `__iadd__`, `torch._foreach_mul_`...)."""
    try:
        return _WRITES_IN_PLACE[func]
    except KeyError:
        writes = _WRITES_IN_PLACE[func] = _named_in_place(func)
        return writes
    except TypeError:  # not hashable
        return _named_in_place(func)


def _tensors(items):
    """The tensors among `items`, one level of lists and tuples opened (`torch.cat`'s
    inputs, `index_put_`'s indices, `_foreach_*` lists)."""
    for x in items:
        if isinstance(x, torch.Tensor):
            yield x
        elif type(x) is list or type(x) is tuple:
            for e in x:
                if isinstance(e, torch.Tensor):
                    yield e


_MADE_AT = "_functx_made_at"


def _mark_made(out, number, args):
    """Record on the tensors a call of the function returned (other than its arguments) that
    they were made while the level numbered `number` ran (levels opened inside have larger
    numbers and overwrite it). A result that is a view of a tensor the call made itself (a
    decomposition's temporary: `repeat` returns a view of one) has that base marked too;
    a view of an argument or of an argument's base (`captured[1:]`) has not."""
    given = set()
    for a in _tensors(args):
        given.add(id(a))
        if a._base is not None:
            given.add(id(a._base))
    if isinstance(out, torch.Tensor):
        outs = (out,)
    elif isinstance(out, (tuple, list)):  # several outputs (also namedtuples: torch.max)
        outs = out
    else:
        return
    for o in outs:
        if isinstance(o, torch.Tensor) and id(o) not in given:
            if getattr(o, _MADE_AT, 0) < number:  # (an outer level never lowers an inner mark)
                setattr(o, _MADE_AT, number)
            base = o._base
            if base is not None and id(base) not in given and getattr(base, _MADE_AT, 0) < number:
                setattr(base, _MADE_AT, number)


def mark_made_at(x: torch.Tensor, number: int) -> None:
    """`x` counts as made while the level `number` ran, for the captured-write check
    (`CapturedWrites`; an outer level never lowers an inner level's mark)."""
    if getattr(x, _MADE_AT, 0) < number:
        setattr(x, _MADE_AT, number)


class CapturedWrites(CallHandler):
    """While the function of a *direct* AD level runs (direct_reverse.py, direct_forward.py):
    refuse an in-place write of a value the level differentiates into a tensor from outside
    the function, as wrapped levels (`raise_captured_write`) and torch.func do.

    A direct level owns no tensors: torch's autograd or forward AD records on the values
    themselves, so such a write left the caller's tensor with the level's history
    (`captured.copy_(x)` under the outermost `grad`: `grad_fn=<CopyBackwards>` on the
    user's tensor after the transform returned; through a view, `CopySlices`), which no
    dispatch-level check sees. This handler sees the user's torch calls: each tensor a call
    returns is marked as made while the level ran (`_mark_made`), and a write whose target's
    base (a view's `_base`) is unmarked and does not depend on the level itself, of a value
    that depends on it (`level.differentiates`), is refused before anything is written.
    Writes of values the level does not differentiate (`captured.add_(1)`, a constant, a
    detached value, BatchNorm's running statistics) stay allowed, as do writes into what
    the function made. Only the user's own calls are seen (torch functions are off inside
    functx's code and inside each handled call), and the check costs a name test per call;
    the handler leaves when the function has returned (`DirectGradLevel.seal`), so a backward
    is not checked."""

    def __init__(self, level, transform: str):
        self.level = level
        self.transform = transform
        self.number = level.level

    def torch_function(self, func, types, args, kwargs):
        # Paid by every torch call of the function: kept to a dict lookup and an attribute.
        try:
            writes_first = _WRITES_IN_PLACE[func]
        except (KeyError, TypeError):  # (first call of `func`; or it is not hashable)
            writes_first = _writes_in_place(func)
        if kwargs:
            in_place = writes_first or "out" in kwargs
            if in_place:
                with functx_code():
                    self._check(func, args, kwargs, writes_first)
        else:
            in_place = writes_first
            if in_place:
                with functx_code():
                    self._check(func, args, {}, True)
        if writes_first:  # `v.mul_(v)`: out of place, then copied in (ad/aliased_writes.py)
            with functx_code():
                out = written_out_of_place(func, args, kwargs, self._call(types))
            if out is not NotImplemented:
                return out
        # (the common case, no handler outside this one, without a call of `call_outer`)
        out = call_outer(func, types, args, kwargs) if self.mode.depth else func(*args, **kwargs)
        # A call may return a tensor it was given (an in-place op its target, `contiguous()`
        # or `.to()` their input as it is): that tensor was not made here.
        if in_place:
            return out
        if type(out) is torch.Tensor and out._base is None:
            for a in args:
                if a is out:
                    return out
            if getattr(out, _MADE_AT, 0) < self.number:  # (the innermost level's number stays)
                out._functx_made_at = self.number
        else:
            _mark_made(out, self.number, args)
        return out

    def _call(self, types):
        """How this handler's own calls go on: to the outer handlers, if any, and torch."""
        if self.mode.depth:
            return lambda f, a, k: call_outer(f, types, a, k)
        return lambda f, a, k: f(*a, **k)

    def _check(self, func, args, kwargs, in_place):
        if in_function_body():  # a Function's own staticmethods (core/custom_function.py)
            return
        targets = list(_tensors([args[0]])) if in_place and args else []
        values = list(_tensors(args[1:] if in_place else args))
        for key, value in kwargs.items():
            (targets if key == "out" else values).extend(_tensors([value]))
        level = self.level
        for target in targets:
            if level.is_own_leaf(target):
                # torch refuses this for a leaf; a direct level's leaf for an input the
                # caller tracks is a view of it (to stay connected), which torch lets be
                # written, and the gradient came out with respect to the written value
                # (vjp(vjp) with a closure over the outer input: a wrong value)
                raise RuntimeError(
                    f"functx.{self.transform}: {op_name(func)} writes in place into an input the "
                    f"transform differentiates: a leaf Variable that requires grad is being used in "
                    f"an in-place operation (torch and torch.func refuse it too). Write into a copy "
                    f"(`x = x.clone()` first) or use the out-of-place op."
                )
            if self._made_inside(target):
                continue
            if any(level.differentiates(v) for v in values):
                raise_captured_write(func, self.transform)

    def _made_inside(self, target) -> bool:
        """Whether the tensor `target` writes into (its base, for a view) was made while the
        function ran (at this level or one opened inside it), or depends on the level (a
        result of a transform called inside, made in functx's code, unmarked). The wrappers
        of levels opened inside are looked through: a wrapped level lifts the plain tensor a
        factory made (which this handler marked) into a new wrapper."""
        x = target
        while True:
            base = x._base if x._base is not None else x
            if getattr(base, _MADE_AT, 0) >= self.number:  # (a view made inside of a captured tensor is not)
                return True
            if not (isinstance(x, LevelTensor) and x._interp.level > self.number):
                # (a dual tensor is a view of its primal: the view may carry the tangent)
                return self.level.differentiates(x) or self.level.differentiates(base)
            x = x._value
