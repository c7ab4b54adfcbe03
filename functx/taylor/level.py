"""Taylor mode's level: `JetTensor`s that hold a primal and its Taylor coefficients.

A `JetTensor` of a jet level of order K stands for a path `x(t) = x0 + x1 t + ... + xK t^K`
through input space: `_value` holds `x0`, `_series` the normalized coefficients `x1..xK`
(`None` for zero), all one level down. An ATen op on one arrives at the level's `process`,
whose handler runs the op's rule from `JET_RULES` in the level's `lower()` state: the rule
computes the output's coefficients from the inputs' by the recurrences of `series.py`, in
torch ops on the values one level down, so they dispatch through the levels below (a vmap
over points or directions; torch's autograd, recording for a `grad` around the jet).

Rules (taylor/rules.py) by shape of op, written once each: linear ops (views, reductions,
indexing: each coefficient mapped), jointly linear ones (add, cat, where's branches),
bilinear ones (mul, matmul, convolution: Cauchy products), pointwise functions through their
derivative recurrences, piecewise-linear ones (relu, abs, max: the primal's branch); then,
as every rule table, the op's composite kernel or its `torch._decomp` decomposition, run on
the level's tensors (softmax, layer norm, gelu come apart into ops with rules); and last,
`taylor/fallback.py`: the op's coefficients by nested forward mode at this order (right for
any differentiable op, one `functx.PerformanceWarning` per op).

An in-place op writing into a jet that is not a view and has none (a temporary inside a
composite: `rms_norm`'s `add_`, `cosine_similarity`'s `clamp_min_`) runs out of place and the
jet takes the result. Other writes are refused (a write through a view changes the path of
every tensor sharing its memory, which their coefficients would not follow; a plain tensor
cannot take coefficients): write out of place.

    >>> import torch
    >>> from functx.core.interpreter import interpreting
    >>> with interpreting(JetLevel(2)) as level:
    ...     x = level.wrap(torch.tensor(0.0), [torch.tensor(1.0), None])   # x(t) = t
    ...     y = torch.cos(x)                                                 # 1 - t^2/2 + ...
    ...     primal, (c1, c2) = level.unwrap(y)
    >>> primal.item(), abs(c1.item()), c2.item()
    (1.0, 0.0, -0.5)
"""

from __future__ import annotations

import torch

from ..core.errors import op_name
from ..core.interpreter import Interpreter
from ..core.level_tensor import LevelTensor, is_user_detach, wrapper_like
from ..core.op_facts import mutated_argument, returns_view, writes_out
from ..core.rules import RuleTable

_restore_outside = torch._C._RestorePythonTLSSnapshot


class JetTensor(LevelTensor):
    """A tensor inside `functx.jet`: a primal (`_value`) and its normalized Taylor
    coefficients (`_series`, K of them, None for zero), one level down."""

    _series: list

    def __repr__(self):
        return f"JetTensor(level={self._interp.level}, primal={self._value!r}, series={self._series!r})"

    __str__ = __repr__

    @property
    def requires_grad(self):
        """What the primal reports (torch's autograd around the jet records on the values)."""
        return self._value.requires_grad


def _fallback_factory(op):
    from .fallback import nested_forward_fallback

    return nested_forward_fallback(op)


JET_RULES = RuleTable("jet", fallback=_fallback_factory)
"""The jet level's rules: `rule(level, *args, **kwargs)` with the op's arguments."""


class JetLevel(Interpreter):
    """One `jet` level of order `order` (see the module docstring); with `collapse` (a
    `Collapse`, taylor/collapse.py), a collapsed one: the coefficients below the top carry
    one value per direction (a vmap level's batch), the top one their (weighted) sum."""

    __slots__ = ("order", "collapse", "first_order")
    forward_mode = False

    def __init__(self, order: int, collapse=None):
        self.order = order
        self.collapse = collapse
        super().__init__()
        # a collapsed level's linear terms are first coefficients: its rules run them at an
        # order-1 level of their own (never on the stack: its tensors meet no op)
        self.first_order = JetLevel(1) if collapse is not None and order > 1 else None
        self.refresh()

    def apply_function(self, function, args, kwargs):
        """An autograd.Function with this level's tensors among its arguments: its Taylor
        coefficients by nested forward mode through its own derivatives (taylor/fallback.py)."""
        from .fallback import taylor_by_nested_jvp

        return taylor_by_nested_jvp(self, function.apply, args, kwargs)

    def popped(self):
        if self.first_order is not None:
            self.first_order.alive = False

    def refresh(self):
        self.lower = _restore_outside
        self.handler_of = JET_RULES.lookup(_handler if self.collapse is None else _collapsed_handler)

    # -- values of this level ------------------------------------------------------------
    def wrap(self, primal: torch.Tensor, series: list) -> JetTensor:
        """The level's tensor for `primal` with normalized coefficients `series` (K of them)."""
        wrapper = wrapper_like(JetTensor, primal, self)
        wrapper._series = list(series)
        return wrapper

    def is_jet(self, x) -> bool:
        return type(x) is JetTensor and x._interp is self

    def series_of(self, x) -> list:
        """`[x0, x1, ..., xK]` of a tensor: a jet of this level's coefficients, anything else
        a constant (`[x, None, ...]`)."""
        if type(x) is JetTensor and x._interp is self:
            return [x._value, *x._series]
        return [x] + [None] * self.order

    def unwrap(self, x) -> tuple:
        """`(primal, [x1..xK])` of a jet of this level (normalized coefficients)."""
        return x._value, list(x._series)

    def wrap_series(self, series: list):
        """The level's tensor for a series `[y0, y1, ..., yK]`; `y0` alone where it is not a
        floating tensor (booleans, indices: no coefficients)."""
        y0 = series[0]
        if not (y0.is_floating_point() or y0.is_complex()):
            return y0
        return self.wrap(y0, series[1:])

    def __repr__(self):
        state = "" if self.alive else ", dead"
        return f"JetLevel(level={self.level}, order={self.order}{state})"


def _handler(op, rule):
    """The whole of `op` at a jet level: its rule in the level's `lower()` state; writes
    refused; autograd's own detach of a saved wrapper kept whole."""
    mutated = mutated_argument(op)
    if mutated is not None or writes_out(op):
        return _write(op, mutated)
    if op is torch.ops.aten.detach.default:
        return _detach
    if returns_view(op):

        def handle_view(level, args, kwargs):
            args[0]._has_views = True  # (a write into it would no longer be its own)
            with level.lower():
                return rule(level, *args, **kwargs)

        return handle_view

    def handle(level, args, kwargs):
        with level.lower():
            return rule(level, *args, **kwargs)

    return handle


def _runs_on_jets(op, rule) -> bool:
    """Whether the op's rule computes on the level's tensors (a decomposition, a rule written
    with ops on jets, one that never reads coefficients): each op inside is handled on its own."""
    return JET_RULES.how(op) == "decomposition" or getattr(rule, "on_jets", False)


def _collapsed_handler(op, rule):
    """The whole of `op` at a collapsed jet level: the rule twice, once without the top
    coefficients (every term of the output's top coefficient but the linear one, one per
    direction, then summed over the directions) and once with the top coefficients alone as
    first ones (the linear term `J(x0) x_K`, on the sum); their sum is the output's top
    coefficient. Right because the top coefficient of any op's output is `J(x0) x_K` plus
    a polynomial in the lower coefficients (Faa di Bruno)."""
    plain = _handler(op, rule)
    if mutated_argument(op) is not None or writes_out(op) or op is torch.ops.aten.detach.default or _runs_on_jets(op, rule):
        return plain
    viewing = returns_view(op)

    def handle(level, args, kwargs):
        if viewing:
            args[0]._has_views = True
        with level.lower():
            return _split_at_the_top(level, rule, args, kwargs)

    return handle


def _split_at_the_top(level, rule, args, kwargs):
    tops = []

    def below_top(x):
        if type(x) is list or type(x) is tuple:
            return type(x)(below_top(e) for e in x)
        if not level.is_jet(x):
            return x
        tops.append(x._series[-1])
        return level.wrap(x._value, x._series[:-1] + [None])

    linear_level = level.first_order or level

    def top_alone(x):
        if type(x) is list or type(x) is tuple:
            return type(x)(top_alone(e) for e in x)
        if not level.is_jet(x):
            return x
        return linear_level.wrap(x._value, [x._series[-1]] + [None] * (linear_level.order - 1))

    lower_terms = rule(level, *below_top(args), **{k: below_top(v) for k, v in kwargs.items()})
    linear_term = None
    if any(t is not None for t in tops):
        linear_term = rule(linear_level, *top_alone(args), **{k: top_alone(v) for k, v in kwargs.items()})
    collapse = level.collapse
    if isinstance(lower_terms, torch.Tensor):
        return _collapsed_output(level, collapse, lower_terms, linear_term)
    return type(lower_terms)(
        _collapsed_output(level, collapse, out, None if linear_term is None else linear_term[i])
        for i, out in enumerate(lower_terms)
    )


def _collapsed_output(level, collapse, out, linear):
    if not level.is_jet(out):
        return out
    top = out._series[-1] if getattr(out, "_top_summed", False) else collapse.summed(out._series[-1])
    if isinstance(linear, JetTensor) and linear._series[0] is not None:
        top = linear._series[0] if top is None else top + linear._series[0]
    out._series[-1] = top
    return out


def _out_of_place(op):
    """The functional overload of an in-place op (`add_.Scalar` -> `add.Scalar`), or None."""
    packet = getattr(torch.ops.aten, op._schema.name.split("::")[-1].rstrip("_"), None)
    return getattr(packet, op._overloadname, None) if packet is not None else None


def _write(op, mutated):
    functional = _out_of_place(op) if mutated is not None else None

    def write(level, args, kwargs):
        target = args[mutated] if mutated is not None else None
        if (
            functional is not None
            and level.is_jet(target)
            and not target._is_view()
            and not getattr(target, "_has_views", False)
        ):
            result = functional(*args, **kwargs)  # (dispatched again: this level's rule)
            if level.is_jet(result):
                target._value, target._series = result._value, result._series
            else:
                target._value, target._series = result, [None] * level.order
            return target
        raise RuntimeError(
            f"functx.jet: {op_name(op)} writes in place into a tensor that is a view, has views, "
            f"or carries no Taylor coefficients, and a value in the write carries them. Jets "
            f"follow values, not memory: the write would change the tensors sharing its memory "
            f"without their coefficients. Write it out of place "
            f"(`y = x + 1` for `x += 1`, `torch.relu(x)` for `relu_`, `nn.ReLU()` without "
            f"inplace=True, `torch.where(mask, value, x)` for an indexed assignment)."
        )

    return write


def _detach(level, args, kwargs):
    """`x.detach()` from user code stops the coefficients (a constant path); autograd's detach
    of a wrapper it saves stands for the same jet."""
    x = args[0]
    if is_user_detach():
        with level.lower():
            return x._value.detach()
    return level.wrap(x._value, x._series)
