"""Forward mode: `jvp`, `linearize`, `jacfwd`, `hessian` (torch.func signatures).

`jvp` runs the function at a jvp level (chosen by choose.py): wrapped (wrapped_forward.py,
tangents held by the level's DualTensors and computed per op by torch's forward formulas,
so they nest) or, right inside vmap, direct (direct_forward.py). An op torch has no forward
formula for falls back to the double-VJP identity: for u ↦ vjp(u) = Jᵀu, ⟨Jᵀu, t⟩ = ⟨u, Jt⟩,
so Jt = ∇_u ⟨vjp(u), t⟩, which needs only reverse mode (twice), so jvp never fails for lack
of a forward formula. At a wrapped level that is done per op (`jvp_by_double_vjp`); at a
direct level, where torch raises inside vmap's C++ calls, for the whole function.
`linearize` uses the identity on purpose: it records the function once and never re-runs it.
"""

from __future__ import annotations

import functools
import re
import sys
from typing import Any, Optional

import torch
from torch.autograd.forward_ad import _set_fwd_grad_enabled

from ..core import pytree
from ..core.torch_function import CallHandler
from ..core.type_aliases import Argnums, Function
from ..core.custom_function import in_function_body
from ..core.control_flow import any_sample
from ..core.errors import PerformanceWarning, PrimalDtypeError, user_facing, warn
from ..core.interpreter import current_stack, functx_code, interpreting, top_interpreter
from ..vmap import vmap
from .arguments import check_argnums, check_outputs, identity_rows, own_arguments, replace_argnums, select_argnums
from .choose import JACFWD, JVP, choose_level
from .direct_forward import DirectJvpLevel
from .level import differentiating_the_backward, dual_level, outside_inference_mode
from .reverse import _split_aux, _vjp_with_argnums, grad
from . import custom_function, wrapped_forward
from .custom_function import no_jvp_message
from .library_ops import prepare_forward_mode
from .wrapped_forward import NO_FORWARD_FORMULA, WrappedJvpLevel

_JVP = "jvp(f, primals, tangents)"


def _tangent_map(vjp_fn, flat_out, out_spec, backward_of=None, library_op=None):
    """jvp_fn(flat_tangents) -> flat output tangents, by differentiating vjp_fn. `backward_of`
    (a Function's name): vjp_fn is that Function's backward, which may have no derivative in
    torch ops (NumPy or an extension's kernel inside, a detached cotangent): the tangents
    would come out 0, a wrong value, so they are checked (`_check_identity`). `library_op`:
    vjp_fn is that torch.library operator's backward, whose gradients must depend on the
    cotangent (`_check_gradient_given`)."""

    def pairing(cotangent, flat_tangents, create_graph=True):
        grads = pytree.tree_leaves(vjp_fn(pytree.tree_unflatten(out_spec, list(cotangent)), create_graph=create_graph))
        if library_op is not None and create_graph:
            _check_gradient_given(library_op, grads, flat_tangents)
        total = 0
        for g, t in zip(grads, flat_tangents):
            if t.is_inference():  # made under torch.inference_mode(): cannot be saved for backward
                t = t.clone()
            total = total + (g * t).sum()
        return total

    def jvp_fn(flat_tangents):
        zeros = [torch.zeros_like(o) for o in flat_out]
        tangents = list(grad(lambda *u: pairing(u, flat_tangents), argnums=tuple(range(len(zeros))))(*zeros))
        if backward_of is not None:
            ones = [torch.ones_like(o) for o in flat_out]
            _check_identity(pairing(ones, flat_tangents, create_graph=False), tangents, backward_of)
        return tangents

    return jvp_fn


def _check_identity(paired, tangents, name):
    """The pairing is linear in the cotangent u, so at u = ones, <Jᵀ1, t> must equal the sum
    of the tangents Jt the identity gave: it does not where the backward has no derivative
    (Jt came out 0). Checked for every sample of the vmap levels around."""
    if not isinstance(paired, torch.Tensor):  # no differentiated output
        return
    via = sum(t.sum() for t in tangents)
    scale = paired.abs() + sum(t.abs().sum() for t in tangents)
    tolerance = torch.finfo(paired.dtype).eps ** 0.5 * 10
    if any_sample((paired - via).abs() > tolerance * scale):
        raise RuntimeError(
            f"functx.jvp: the autograd.Function {name} has no jvp staticmethod, and its backward "
            f"is not differentiable in torch ops (NumPy, an extension's kernel, or a detached "
            f"cotangent), so the double-VJP identity, functx's forward derivative of a Function "
            f"without jvp, cannot go through it: define `jvp(ctx, *tangents)` on {name}."
        )


_NO_GRADIENT_GIVEN = "gives no gradient for differentiated argument"


def _check_gradient_given(op, grads, flat_tangents):
    """An operator's backward that gives an input carrying a nonzero tangent no gradient
    (None, or one that does not depend on the cotangent) gives the identity no derivative to
    differentiate: the tangent would come out 0. It may be that the derivative is 0, or that
    the operator skipped it because its caller passed a flag from `requires_grad`, which is
    False for a tensor at a forward-mode level (torch.func's rule; `F.linear_cross_entropy`
    did: ad/torch_nn_rules.py). Raised as torch's no-forward-formula error: `functx.jvp` then
    computes the whole function by reverse mode (its caller sees `requires_grad=True`); where
    nothing can (`functx.jet`), the user reads this."""
    cotangent_level = top_interpreter()
    for position, (g, t) in enumerate(zip(grads, flat_tangents)):
        if not cotangent_level.depends(g) and any_sample((t != 0).any()):
            raise NotImplementedError(
                f"{NO_FORWARD_FORMULA} {op} that does not support it, and its backward "
                f"(register_autograd) {_NO_GRADIENT_GIVEN} {position}, "
                f"which carries a nonzero tangent: functx cannot tell a zero derivative from one "
                f"the operator skipped (a flag its caller set from `requires_grad`, which is False "
                f"at a forward-mode level, as in torch.func). Give the operator a forward rule "
                f"(`torch.library.register_autograd` has none; functx.ad.library_ops."
                f"register_forward_rule does), or differentiate it in reverse mode."
            )


def _check_primals_tangents(primals, tangents, api):
    if not isinstance(primals, tuple):
        raise RuntimeError(f"{api}: Expected primals to be a tuple. E.g. it should be valid to call f(*primals).")
    flat_primals, primals_spec = pytree.tree_flatten(primals)
    flat_tangents, tangents_spec = pytree.tree_flatten(tangents)
    if primals_spec != tangents_spec:
        raise RuntimeError(
            f"{api}: Expected primals and tangents to have the same python structure. For example, "
            f"if primals is a tuple of 3 tensors, tangents also must be. Got primals with structure "
            f"{primals_spec} and tangents with structure {tangents_spec}"
        )
    if not flat_primals:
        raise RuntimeError(f"{api}: Expected primals to contain at least one Tensor.")
    for p, t in zip(flat_primals, flat_tangents):
        if not isinstance(p, torch.Tensor) or not isinstance(t, torch.Tensor):
            bad = p if not isinstance(p, torch.Tensor) else t
            raise RuntimeError(f"{api}: Expected primals and tangents to only contain Tensors, got {type(bad)}")
        if p.shape != t.shape:
            raise RuntimeError(
                f"{api}: Expected primals and tangents to have the same shape, got a primal of shape "
                f"{tuple(p.shape)} and a tangent of shape {tuple(t.shape)}"
            )
    return flat_tangents




# torch gives its functional collectives no forward formula; ad/collectives.py gives them
# functx's, loaded by the first forward transform after torch's module is imported (it costs
# an import of torch.distributed's collectives, which `import functx` does not pay).
_FUNCTIONAL_COLLECTIVES = "torch.distributed._functional_collectives"


def _check_primal_dtypes(flat_primals, api):
    """Only floating-point and complex primals have tangents (torch.func's ValueError)."""
    for p in flat_primals:
        if isinstance(p, torch.Tensor) and not (p.is_floating_point() or p.is_complex()):
            raise PrimalDtypeError(
                f"{api}: Expected primal to be floating point or complex, but got: {p.dtype}. Only "
                f"floating-point or complex primals have tangents: convert it (x.float()) or close "
                f"over it instead of passing it."
            )


def _forward_jvp(func, primals, flat_tangents, has_aux, api, needs, wrapped=False):
    """One jvp at a new jvp level: (flat outputs, flat output tangents or None where an
    output does not depend on the primals, output structure, aux). `wrapped`: at a wrapped
    level whatever choose.py would pick (it computes an op without a forward formula by the
    double-VJP identity on that op alone)."""
    flat_primals, primals_spec = pytree.tree_flatten(primals)
    _check_primal_dtypes(flat_primals, api)
    with functx_code():
        prepare_forward_mode()
        if _FUNCTIONAL_COLLECTIVES in sys.modules:
            from . import collectives  # noqa: F401  (their forward rules, registered on first import)
        level = WrappedJvpLevel() if wrapped else choose_level(needs, (flat_primals, flat_tangents))
    if type(level) is DirectJvpLevel:
        try:
            return _jvp_at(level, func, flat_primals, primals_spec, flat_tangents, has_aux, api)
        except RuntimeError as error:
            if not (_LAYOUT_CHECKS.search(str(error)) or _NO_JVP_STATICMETHOD.search(str(error))):
                raise
        # torch's forward AD on plain primals with vmap's BatchedTensor tangents: its C++
        # checks of a view's tangent read bits vmap's wrappers do not carry (the conj bit of
        # `x.conj()`, materialized under vmap; a Function's view-ness), and refuse a program
        # torch.func computes (`vmap(jvp)` of an FFT power spectrum, `X * X.conj()`, with an
        # unbatched primal). A wrapped level makes the tangent of every view itself: run it
        # there (the function runs again, as the double-VJP fallback below reruns it). There
        # too an autograd.Function without a jvp staticmethod gets its tangent by the
        # double-VJP identity on it alone, which torch's forward AD cannot do.
        return _forward_jvp(func, primals, flat_tangents, has_aux, api, needs, wrapped=True)
    return _jvp_at(level, func, flat_primals, primals_spec, flat_tangents, has_aux, api)


# torch's checks that a view's tangent is laid out as its primal (or a Function's jvp returns
# a view where its forward does): see `_forward_jvp`
_LAYOUT_CHECKS = re.compile(
    r"Expected the output of forward differentiable view operations to have the tangent have the same layout"
    r"|is returning a view (?:\(or an input as-is\) )?but the jvp is not returning a view"
)


# an autograd.Function without a jvp staticmethod met by a direct level (functx's error on
# values, torch's under vmap): see `_forward_jvp`
_NO_JVP_STATICMETHOD = re.compile(r"has no jvp staticmethod|You must implement the jvp function for custom autograd")


def _jvp_at(level, func, flat_primals, primals_spec, flat_tangents, has_aux, api):
    with outside_inference_mode(), dual_level(), _set_fwd_grad_enabled(True), interpreting(level):
        with functx_code():
            duals = [level.dual(p, t) for p, t in zip(flat_primals, flat_tangents)]
        output, aux = _split_aux(func(*pytree.tree_unflatten(primals_spec, duals)), has_aux, api)
        with functx_code():
            flat_out, out_spec = pytree.tree_flatten(output)
            check_outputs(flat_out, output, api)
            pairs = [level.unpack(o) for o in flat_out]
            aux = pytree.tree_map(lambda a: level.unpack(a)[0] if isinstance(a, torch.Tensor) else a, aux)
    return [p for p, _ in pairs], [t for _, t in pairs], out_spec, aux


def _double_vjp_jvp(func, primals, flat_tangents, has_aux, api, backward_of=None, library_op=None):
    """The same as `_forward_jvp`, by the double-VJP identity (reverse mode only)."""
    with differentiating_the_backward():
        output, vjp_fn, aux = _vjp_with_argnums(func, primals, {}, None, has_aux, api)
    flat_out, out_spec = pytree.tree_flatten(output)
    tangents = _tangent_map(vjp_fn, flat_out, out_spec, backward_of, library_op)(flat_tangents)
    return flat_out, [None if independent else t for t, independent in zip(tangents, vjp_fn.independent_outputs)], out_spec, aux


def _warn_no_forward_formula(error):
    warn(
        f"functx.jvp: {str(error).splitlines()[0]} Computing it by the double-VJP identity "
        "instead (two reverse passes; needs the op's double backward).",
        PerformanceWarning,
    )


class _ModeRegions(CallHandler):
    """While the whole-function double-VJP fallback runs the user's function: whether a
    torch call took a value the fallback differentiates while grad mode (`torch.no_grad()`)
    or forward AD (`_set_fwd_grad_enabled(False)`) was off. Forward mode's rules for such a
    region are not reverse mode's (no_grad stops no tangent; a forward-AD-off region stops
    them where reverse mode does not), so the identity would give a wrong value there: a
    jvp(jvp) of a Huber loss of `x * no_grad(x**2)` did."""

    def __init__(self):
        self.crossed = False

    def torch_function(self, func, types, args, kwargs):
        if not self.crossed and not (torch.is_grad_enabled() and torch._C._is_fwd_grad_enabled()) and not in_function_body():
            self.crossed = any(_tracked(t) for t in pytree.tree_leaves((args, kwargs)))
        return NotImplemented


def _tracked(x) -> bool:
    """Whether `x`, or the value under its wrappers (a jvp level's primal), requires grad."""
    while isinstance(x, torch.Tensor):
        if x.requires_grad:
            return True
        x = getattr(x, "_value", None)
    return False


def _jvp_flat(func, primals, flat_tangents, has_aux, api, needs=JVP):
    try:
        return _forward_jvp(func, primals, flat_tangents, has_aux, api, needs)
    except NotImplementedError as error:
        if NO_FORWARD_FORMULA not in str(error):
            raise
        _warn_no_forward_formula(error)
        regions = _ModeRegions()

        def watched(*args):
            with regions:
                return func(*args)

        result = _double_vjp_jvp(watched, primals, flat_tangents, has_aux, api)
        if not regions.crossed:
            return result
        # The function turns grad mode or forward AD off around differentiated values, where
        # the identity over the whole function is wrong. A wrapped level applies it to the op
        # without a formula alone (torch's forward AD on values, a direct level, cannot);
        # jvp(jvp) of a Huber loss of `x * no_grad(x ** 2)` computes there.
        try:
            return _forward_jvp(func, primals, flat_tangents, has_aux, api, needs, wrapped=True)
        except NotImplementedError as again:
            if NO_FORWARD_FORMULA not in str(again) or _forward_level_outside():
                # (under another forward transform the op may be that level's, a jvp on values
                # whose torch forward AD met the op in this one's formulas: its own fallback
                # decides, and the outermost refuses: jvp(jvp(jacfwd)) of a Huber loss of
                # `x * no_grad(x ** 2)` was refused by the middle jvp)
                raise
            raise RuntimeError(
                f"{api}: {str(error).splitlines()[0]} functx computes such a jvp by the double-VJP "
                f"identity (reverse mode), but the function turns off grad mode (torch.no_grad()) or "
                f"forward AD (_set_fwd_grad_enabled(False)) around values being differentiated, where "
                f"reverse mode's rules are not forward mode's: the result would be wrong. Move that "
                f"region out of the function (or use .detach() for what it should stop), or avoid the "
                f"op without a forward formula."
            ) from again


def _forward_level_outside() -> bool:
    return any(isinstance(level, (DirectJvpLevel, WrappedJvpLevel)) for level in current_stack())


def jvp_by_double_vjp(op, primals, tangents, kwargs, error, backward_of=None):
    """`(output, output tangents)` of one ATen op with no forward formula (called by a
    wrapped jvp level, one level down): the double-VJP identity on the op alone."""
    _warn_no_forward_formula(error)
    index = [i for i, t in enumerate(tangents) if t is not None]

    def of_differentiated(*values):
        args = list(primals)
        for i, v in zip(index, values):
            args[i] = v
        return op(*args, **kwargs)

    library_op = op if backward_of is None and getattr(op, "namespace", "aten") != "aten" else None
    flat_out, flat_tangents, out_spec, _ = _double_vjp_jvp(
        of_differentiated, tuple(primals[i] for i in index), [tangents[i] for i in index], False, _JVP, backward_of, library_op
    )
    missing = object()  # an output with no tangent (None is not a pytree leaf)
    tangents = pytree.tree_unflatten(out_spec, [missing if t is None else t for t in flat_tangents])
    return pytree.tree_unflatten(out_spec, flat_out), pytree.tree_map(lambda t: None if t is missing else t, tangents)


wrapped_forward.op_jvp_without_formula = jvp_by_double_vjp  # the levels sit below the transforms


def function_jvp_by_double_vjp(function, primals, tangents, kwargs):
    """`(outputs, output tangents)` of an autograd.Function without a jvp staticmethod (old
    style or new, called by a wrapped jvp level one level down): the double-VJP identity
    through its backward, which must then be differentiable (torch.func raises "You must
    implement the jvp function"). A `@once_differentiable` backward (whose second derivative
    functx, as torch.func, takes as zero) or one that is not written in torch ops raises."""
    name = function.__name__
    code = getattr(function.backward, "__code__", None)
    if code is not None and "once_differentiable" in code.co_qualname:
        raise RuntimeError(
            f"{no_jvp_message(name)} Its backward is @once_differentiable, so the double-VJP "
            f"identity (functx's forward derivative of a Function without jvp) cannot go through it."
        )
    error = NotImplementedError(f"{NO_FORWARD_FORMULA} the autograd.Function {name}, which has no jvp staticmethod.")
    try:
        return jvp_by_double_vjp(lambda *xs: function.apply(*xs, **kwargs), primals, tangents, {}, error, name)
    except RuntimeError as failure:
        if _NUMPY_ON_A_LEVEL not in str(failure):
            raise
        raise RuntimeError(
            f"{no_jvp_message(name)} functx differentiates its backward instead (the double-VJP "
            f"identity), but the backward calls NumPy, which cannot take the tensors being "
            f"differentiated: define `jvp(ctx, *tangents)` on {name}, or write its backward in torch ops."
        ) from failure


_NUMPY_ON_A_LEVEL = ".numpy() is not supported for tensor subclasses"


custom_function.function_jvp_without_formula = function_jvp_by_double_vjp


def jvp_op_by_op(func, primal, tangent):
    """The tangent of `func(primal)` (a tuple of tensors) along `tangent` by each op's own
    derivative, never by running `func` again as a whole under reverse mode (`jvp`'s last
    resort, which lets the function's code see `requires_grad=True`): for a function that
    is one op with fixed arguments (functx.jet's fallback), where that could only repeat
    the op's own answer."""
    try:
        flat_out, flat_tangents, _, _ = _forward_jvp(func, (primal,), [tangent], False, _JVP, JVP)
    except NotImplementedError as error:
        if NO_FORWARD_FORMULA not in str(error) or _NO_GRADIENT_GIVEN in str(error):
            raise
        # an op the wrapped level does not take the identity for alone (keyword arguments:
        # index_reduce's include_self): the identity over `func`, which is that op
        flat_out, flat_tangents, _, _ = _double_vjp_jvp(func, (primal,), [tangent], False, _JVP)
    return tuple(torch.zeros_like(o) if t is None else t for o, t in zip(flat_out, flat_tangents))


@user_facing
def jvp(func: Function, primals: Any, tangents: Any, *, strict: bool = False, has_aux: bool = False) -> tuple[Any, ...]:
    """Evaluate `func(*primals)` and its Jacobian-vector product with `tangents` (forward
    mode): returns `(output, jvp_out)`, or `(output, jvp_out, aux)` with `has_aux=True`.

    `jvp_out` is the Jacobian of `func` at `primals` times `tangents`: the directional
    derivative of `func` along `tangents`. `func` runs once, carrying a tangent beside each
    value, so the cost does not grow with the number of outputs: forward mode suits
    functions with few inputs (or one direction) and many outputs, such as the derivative
    of a function of one scalar.

    How it behaves:

    - **`primals` and `tangents` are tuples** with one entry per positional argument of
      `func` (`(x,)` for one argument); `tangents` mirrors `primals`' structure and shapes.
      Every tensor leaf of `primals` carries a tangent. `func`'s keyword arguments take
      their defaults; fix other values with a closure (`lambda x: func(x, scale=2.0)`).
    - **One call, one direction.** Under `vmap` over the tangents, many directions at
      once: the columns of an identity matrix give the whole Jacobian (what `jacfwd`
      does).
    - **`jvp_out` mirrors the output** (a tuple or dict for a tuple or dict output). An
      output that does not depend on the primals gets a zero tangent; `strict=True`
      raises instead.
    - **Forward over reverse**: `jvp(grad(f), (x,), (v,))` is a Hessian-vector product,
      computed without forming the Hessian.
    - **`torch.no_grad()` does not stop tangents**, inside `func` or outside (forward mode
      does not follow grad mode, as in torch.func); `.detach()` does
      ([detach](../semantics.md#detach-stop-gradient)).

    Args:
        func (Callable): a function of tensors (pytrees of them) returning tensors, or
            `(output, aux)` with `has_aux=True`.
        primals (tuple): the point, a tuple with one entry per positional argument of
            `func` (tensors or pytrees of floating-point or complex tensors).
        tangents (tuple): the direction, structured and shaped like `primals`.
        strict (bool, default False): raise if an output does not depend on the
            primals (otherwise its tangent is zeros).
        has_aux (bool, default False): `func` returns `(output, aux)`; aux (tensors or
            pytrees of them) is returned as is, without a tangent.

    Returns:
        tuple: `(output, jvp_out)`: `func(*primals)` and the derivative of `func` at
        `primals` along `tangents`, structured like the output; with `has_aux=True`,
        `(output, jvp_out, aux)`.

    Raises:
        RuntimeError: primals or tangents not a tuple, not tensors, of different
            structure or shapes; with `strict=True`, an output independent of the inputs;
            with `has_aux=True`, no `(output, aux)` pair
            ([error catalogue](../errors.md#jvp-linearize-jacfwd)).
        ValueError: a primal of an integer or boolean dtype (as torch.func; the error is
            also a RuntimeError, `functx.core.errors.PrimalDtypeError`).

    Examples:
        The derivative of sin along ones:

        >>> import torch, functx
        >>> x = torch.tensor([0.0, 1.0])
        >>> out, tangent = functx.jvp(torch.sin, (x,), (torch.ones(2),))
        >>> torch.allclose(out, torch.sin(x)), torch.allclose(tangent, torch.cos(x))
        (True, True)

        A function of one scalar, R -> R^3: one JVP is its whole derivative:

        >>> import torch, functx
        >>> f = lambda t: t * torch.tensor([1.0, 2.0, 3.0])
        >>> value, derivative = functx.jvp(f, (torch.tensor(2.0),), (torch.tensor(1.0),))
        >>> value.tolist(), derivative.tolist()
        ([2.0, 4.0, 6.0], [1.0, 2.0, 3.0])

        Several inputs take one tangent each; pytree outputs get pytree tangents (here
        d(x * y) = dx * y + x * dy):

        >>> import torch, functx
        >>> x, y = torch.randn(5), torch.randn(5)
        >>> _, tangent = functx.jvp(lambda a, b: a * b, (x, y), (torch.ones(5), torch.ones(5)))
        >>> torch.allclose(tangent, x + y)
        True
        >>> _, tangents = functx.jvp(lambda a: {"sin": a.sin(), "sq": a ** 2}, (x,), (torch.ones(5),))
        >>> torch.allclose(tangents["sin"], x.cos()), torch.allclose(tangents["sq"], 2 * x)
        (True, True)

        `has_aux`, and `strict` for an output that does not depend on the input:

        >>> import torch, functx
        >>> x = torch.tensor([0.0, 1.0])
        >>> out, tangent, aux = functx.jvp(lambda t: (t.exp(), t.argmax()), (x,), (torch.ones(2),), has_aux=True)
        >>> torch.allclose(tangent, x.exp()), aux.item()
        (True, 1)
        >>> functx.jvp(lambda t: torch.ones(2), (x,), (torch.ones(2),))[1].tolist()
        [0.0, 0.0]
        >>> try:
        ...     functx.jvp(lambda t: torch.ones(2), (x,), (torch.ones(2),), strict=True)
        ... except RuntimeError as error:
        ...     print("independent of the inputs" in str(error))
        True

        All directions at once under `vmap` (the Jacobian's columns), checked against
        `torch.autograd.functional.jacobian`:

        >>> import torch, functx
        >>> f = lambda t: torch.stack([t.prod(), t.sum(), t.norm()])
        >>> x = torch.randn(4)
        >>> columns = functx.vmap(lambda v: functx.jvp(f, (x,), (v,))[1])(torch.eye(4))
        >>> torch.allclose(columns.T, torch.autograd.functional.jacobian(f, x))
        True

        A Hessian-vector product, forward over reverse:

        >>> import torch, functx
        >>> x = torch.tensor([0.0, 1.0])
        >>> f = lambda x: (x ** 3).sum()
        >>> _, hvp = functx.jvp(functx.grad(f), (x,), (torch.ones(2),))
        >>> hvp.tolist()  # 6 x * v
        [0.0, 6.0]

        `torch.no_grad()` does not stop the tangent; `.detach()` does:

        >>> import torch, functx
        >>> def f(x):
        ...     with torch.no_grad():
        ...         c = x ** 2
        ...     return x - c
        >>> x = torch.tensor([1.0, 2.0])
        >>> functx.jvp(f, (x,), (torch.ones(2),))[1].tolist()  # 1 - 2 x
        [-1.0, -3.0]
        >>> functx.jvp(lambda t: t - (t ** 2).detach(), (x,), (torch.ones(2),))[1].tolist()
        [1.0, 1.0]

    Differences from torch.func:
        An op with no forward-mode formula (a `torch.library` operator with only
        `register_autograd`, an `autograd.Function` without `jvp`) gets its tangent from
        its reverse-mode formula (the double-VJP identity, with a
        `functx.PerformanceWarning`) where torch.func raises or, for library operators,
        silently returns zeros. An integer primal raises a RuntimeError (torch.func: a
        ValueError); a `None` leaf of a primal (with `None` as its tangent) passes through
        where torch.func raises.
    """
    return _jvp_call(func, primals, tangents, strict, has_aux)


def _zeros_where_none(flat_out, flat_tangent_out):
    """The output tangents, a zero tangent where an output does not depend on the primals."""
    return [torch.zeros_like(o) if t is None else t for o, t in zip(flat_out, flat_tangent_out)]


def _jvp_call(func, primals, tangents, strict, has_aux):
    """`jvp(func, primals, tangents, strict=..., has_aux=...)`."""
    flat_tangents = _check_primals_tangents(primals, tangents, _JVP)
    flat_out, flat_tangent_out, out_spec, aux = _jvp_flat(func, primals, flat_tangents, has_aux, _JVP)
    if strict and any(t is None for t in flat_tangent_out):
        raise RuntimeError(
            "jvp(f, primals, tangents, strict=True): The output of f is independent of the inputs. "
            "This is not allowed with strict=True."
        )
    flat_tangent_out = _zeros_where_none(flat_out, flat_tangent_out)
    output = pytree.tree_unflatten(out_spec, flat_out)
    tangent_out = pytree.tree_unflatten(out_spec, flat_tangent_out)
    return (output, tangent_out, aux) if has_aux else (output, tangent_out)


@user_facing
def linearize(func: Function, *primals: Any) -> tuple[Any, Function]:
    """Evaluate `func(*primals)` once and return `(output, jvp_fn)`: `jvp_fn(*tangents)`
    gives the Jacobian-vector product at `primals` without running `func` again.

    `jvp_fn` is the linear approximation of `func` at `primals`: `func(primals + t)` is
    about `output + jvp_fn(t)` for small `t`. Use it when the tangents come one at a time
    at one point (an iterative solver, Newton-Krylov steps): each call reuses the
    recording of `func` made by `linearize`.

    How it behaves:

    - **Cost**: `func` runs once, under reverse mode; each `jvp_fn` call is two backward
      passes over that recording (a VJP and its derivative). The recording, with the
      tensors `func` saved for its backward, lives as long as `jvp_fn`: memory that `jvp`
      does not keep. When all tangents are known up front, `vmap` over `jvp` (or
      `jacfwd`) is usually cheaper.
    - **Tangents** are passed positionally, one per primal, structured and shaped like it;
      the result is structured like `output`. `jvp_fn` can be called any number of times,
      also under `vmap` (many directions at once).
    - **Random ops** inside `func` draw once: `jvp_fn` differentiates the draws that
      `output` was computed with.
    - `func`'s keyword arguments take their defaults; fix other values with a closure.

    Args:
        func (Callable): a function of tensors (pytrees of them) returning tensors
            (pytrees of them).
        *primals (Tensor | pytree): the point, passed to `func` positionally; every tensor
            leaf (floating-point or complex) gets a tangent.

    Returns:
        tuple: `(output, jvp_fn)`. `jvp_fn(*tangents)` takes tangents shaped like
        `primals` (one per primal) and returns the output's tangent, structured like
        `output`; call it as often as needed (also under `vmap`).

    Raises:
        RuntimeError: `func` returns a non-tensor; `jvp_fn` given tangents of another
            structure or shape than the primals
            ([error catalogue](../errors.md#jvp-linearize-jacfwd)).
        ValueError: a primal (or a leaf of it) that is not a tensor; an integer or boolean
            primal (as torch.func; also a RuntimeError, `PrimalDtypeError`).

    Examples:
        >>> import torch, functx
        >>> output, jvp_fn = functx.linearize(torch.sin, torch.zeros(3, 3))
        >>> jvp_fn(torch.ones(3, 3))  # cos(0) * 1
        tensor([[1., 1., 1.],
                [1., 1., 1.],
                [1., 1., 1.]])

        The same as `jvp` along every tangent, and the linear approximation it is:

        >>> import torch, functx
        >>> f = lambda x: x.exp() * x.sin()
        >>> x = torch.tensor([0.5, 1.0])
        >>> output, jvp_fn = functx.linearize(f, x)
        >>> v = torch.tensor([1.0, -2.0])
        >>> torch.allclose(jvp_fn(v), functx.jvp(f, (x,), (v,))[1])
        True
        >>> t = 1e-3 * v
        >>> torch.allclose(f(x + t), output + jvp_fn(t), atol=1e-5)
        True

        Many directions, one evaluation (two primals, so two tangents per direction):

        >>> import torch, functx
        >>> out, jvp_fn = functx.linearize(lambda a, b: a * b, torch.tensor(2.0), torch.tensor(3.0))
        >>> functx.vmap(jvp_fn)(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])).tolist()  # b, a
        [3.0, 2.0]

        `func` runs once; a random draw is the same for `output` and `jvp_fn`:

        >>> import torch, functx
        >>> calls = []
        >>> def noisy(x):
        ...     calls.append(1)
        ...     return x * torch.rand(2)
        >>> output, jvp_fn = functx.linearize(noisy, torch.ones(2))
        >>> torch.allclose(jvp_fn(torch.ones(2)), output), len(calls)  # d(x r) = r dx, and x = 1
        (True, 1)

    Differences from torch.func:
        functx records the function once under reverse mode and derives the tangents from
        that record (the double-VJP identity), so `func` may use ops without forward-mode
        formulas, and runs once (torch.func runs it twice, tracing it with `make_fx`:
        random ops draw different numbers for `output` and for `jvp_fn`). Being reverse
        mode, it follows grad mode: a value computed under `torch.no_grad()` inside `func`
        is a constant for `jvp_fn`, where torch.func's `linearize` and `jvp` differentiate
        through it.
    """
    return _linearize_call(func, primals)


def _linearize_call(func, primals):
    """`linearize(func, *primals)`: the recording of one reverse-mode run, differentiated
    per call (the double-VJP identity) — unless `func` turns grad mode off around a value
    being differentiated (`torch.no_grad()`), where reverse mode stops a tangent forward
    mode carries (`_ModeRegions`): there `jvp_fn` runs `func` again under forward mode,
    so that it always equals `jvp`."""
    api = "linearize(func, *primals)"
    _check_primal_dtypes(pytree.tree_leaves(primals), api)
    regions = _ModeRegions()

    def watched(*args):
        with regions:
            return func(*args)

    with differentiating_the_backward():
        output, vjp_fn, _ = _vjp_with_argnums(watched, primals, {}, None, False, api)
    flat_out, out_spec = pytree.tree_flatten(output)
    tangent_map = _tangent_map(vjp_fn, flat_out, out_spec)
    if regions.crossed:
        del vjp_fn, tangent_map  # (the recording is of no use: free it)

        def tangent_map(flat_tangents):
            flat_out, flat_tangent_out, _, _ = _jvp_flat(func, primals, flat_tangents, False, api)
            return _zeros_where_none(flat_out, flat_tangent_out)

    @user_facing
    def jvp_fn(*tangents):
        flat_tangents = _check_primals_tangents(primals, tangents, api)
        return pytree.tree_unflatten(out_spec, tangent_map(flat_tangents))

    return output, jvp_fn


def jacfwd(
    func: Function,
    argnums: Argnums = 0,
    has_aux: bool = False,
    *,
    randomness: str = "error",
    chunk_size: Optional[int] = None,
) -> Function:
    """The Jacobian of `func` with respect to its `argnums` arguments, by forward mode: one
    vectorized Jacobian-vector product per input element. Best when the inputs are fewer
    than the outputs.

    `jacfwd(func)(*args)` pushes every column of an identity matrix the size of the
    differentiated inputs through `func` at once (`vmap` of `jvp` over the tangents), so
    the cost grows with the number of input elements, not of output elements. `jacrev` is
    the reverse-mode twin, cheaper for many inputs and few outputs; both give the same
    matrix.

    How it behaves:

    - **Shapes and structure** are `jacrev`'s: `output.shape + input.shape` per leaf, the
      output's structure outside and the differentiated arguments' inside (a tuple for
      tuple `argnums`).
    - **`randomness`**: `func` runs under `vmap` over the tangent columns, so random ops
      (`torch.rand`, dropout in training mode) follow `vmap`'s `randomness`: "error" (the
      default) refuses them, "same" gives every column the same draws (the Jacobian of one
      random function, usually what is wanted), "different" gives each column its own.
    - **`chunk_size`** bounds memory: at most that many columns per vectorized call; the
      result is the same.
    - **`has_aux`**: `func` returns `(output, aux)`; `aux` is returned once, without
      tangents. Returning the output itself as aux gives the value with its Jacobian.
    - **Composition**: `vmap(jacfwd(f))` gives one Jacobian per example, and
      `jacfwd(jacrev(f))` the Hessian (forward over reverse).
    - **`torch.no_grad()` does not stop tangents** (forward mode does not follow grad mode,
      as in torch.func); `.detach()` does.
    - **Ops without a forward-mode formula** (an `autograd.Function` without `jvp`, a
      `torch.library` operator with only `register_autograd`) get their tangents from
      their backward (see `jvp`).

    Args:
        func (Callable): a function of tensors (pytrees of them) returning real tensors
            (pytrees of them), or `(output, aux)` with `has_aux=True`.
        argnums (int | tuple[int, ...], default 0): the positional arguments to
            differentiate (real floating-point tensors, or pytrees of them); the others,
            and keyword arguments, are passed through.
        has_aux (bool, default False): `func` returns `(output, aux)`; the result is
            `(jacobian, aux)`.
        randomness (str, default "error"): as `vmap`'s, for the vectorized JVPs: "error",
            "different" or "same".
        chunk_size (int | None, default None): compute at most this many Jacobian columns
            at a time (bounds memory).

    Returns:
        Callable: a function of `func`'s arguments returning the Jacobian, structured as
        `jacrev`'s; with `has_aux=True`, `(jacobian, aux)`.

    Raises:
        ValueError: `chunk_size` < 1, a differentiated argument that is not a tensor; an
            integer or boolean input (as torch.func; also a RuntimeError,
            `PrimalDtypeError`).
        RuntimeError: bad `argnums`; a complex input; a complex
            output; random ops with `randomness="error"`; an invalid `randomness`; with
            `has_aux=True`, no `(output, aux)` pair
            ([error catalogue](../errors.md#jvp-linearize-jacfwd)).

    Examples:
        A pointwise function has a diagonal Jacobian; `jacfwd` and `jacrev` agree:

        >>> import torch, functx
        >>> x = torch.randn(5)
        >>> torch.allclose(functx.jacfwd(torch.sin)(x), torch.diag(torch.cos(x)))
        True
        >>> f = lambda x: torch.stack([x.sum(), x.prod(), x.max()])
        >>> torch.allclose(functx.jacfwd(f)(x), functx.jacrev(f)(x))
        True

        Batched Jacobians under `vmap`, checked against a loop:

        >>> import torch, functx
        >>> x = torch.randn(64, 5)
        >>> jacobians = functx.vmap(functx.jacfwd(torch.sin))(x)
        >>> jacobians.shape
        torch.Size([64, 5, 5])
        >>> torch.allclose(jacobians, torch.stack([torch.diag(row.cos()) for row in x]))
        True

        The value along with the Jacobian, as aux:

        >>> import torch, functx
        >>> def g(x):
        ...     result = x.sin()
        ...     return result, result
        >>> x = torch.randn(5)
        >>> jacobian, value = functx.jacfwd(g, has_aux=True)(x)
        >>> torch.allclose(value, x.sin()), torch.allclose(jacobian, torch.diag(x.cos()))
        (True, True)

        Another argument (`argnums=1`) or several, against the closed forms of
        `x + y ** 2`, and a Hessian forward over reverse:

        >>> import torch, functx
        >>> def f(x, y):
        ...     return x + y ** 2
        >>> x, y = torch.randn(5), torch.randn(5)
        >>> torch.allclose(functx.jacfwd(f, argnums=1)(x, y), torch.diag(2 * y))
        True
        >>> jx, jy = functx.jacfwd(f, argnums=(0, 1))(x, y)
        >>> torch.allclose(jx, torch.eye(5)), torch.allclose(jy, torch.diag(2 * y))
        (True, True)
        >>> hessian = functx.jacfwd(functx.jacrev(lambda t: t.sin().sum()))(x)
        >>> torch.allclose(hessian, torch.diag(-x.sin()))
        True

        A tall function (2 inputs, 100 outputs), in chunks of one column, checked against
        `torch.autograd.functional.jacobian`:

        >>> import torch, functx
        >>> f = lambda p: torch.sin(p[0] * torch.linspace(0, 1, 100) + p[1])
        >>> p = torch.tensor([2.0, 0.5])
        >>> jacobian = functx.jacfwd(f, chunk_size=1)(p)
        >>> jacobian.shape, torch.allclose(jacobian, torch.autograd.functional.jacobian(f, p))
        (torch.Size([100, 2]), True)

        Random ops need `randomness`; with "same" every column sees the same draw:

        >>> import torch, functx
        >>> def noisy(x):
        ...     r = torch.rand(())
        ...     return x * r, r
        >>> try:
        ...     functx.jacfwd(noisy, has_aux=True)(torch.ones(3))
        ... except RuntimeError as error:
        ...     print("randomness error mode" in str(error))
        True
        >>> jacobian, r = functx.jacfwd(noisy, has_aux=True, randomness="same")(torch.ones(3))
        >>> torch.allclose(jacobian, r * torch.eye(3))
        True

        `torch.no_grad()` does not stop tangents; `.detach()` does:

        >>> import torch, functx
        >>> def f(x):
        ...     with torch.no_grad():
        ...         c = x ** 2
        ...     return x - c
        >>> x = torch.tensor([1.0, 2.0])
        >>> functx.jacfwd(f)(x).tolist()  # diag(1 - 2 x)
        [[-1.0, 0.0], [0.0, -3.0]]
        >>> functx.jacfwd(lambda t: t - (t ** 2).detach())(x).tolist()
        [[1.0, 0.0], [0.0, 1.0]]

    Differences from torch.func:
        `chunk_size` (torch.func's jacfwd has none); ops without forward-mode formulas
        work (see `jvp`), where torch.func raises "forward-mode AD not implemented". An
        integer input raises a RuntimeError (torch.func: a ValueError).
    """
    if chunk_size is not None and not (isinstance(chunk_size, int) and chunk_size > 0):
        raise ValueError("jacfwd: `chunk_size` should be greater than 0.")

    @user_facing
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        return _jacfwd_call(func, argnums, has_aux, randomness, chunk_size, args, kwargs)

    return wrapper


def _jacfwd_call(func, argnums, has_aux, randomness, chunk_size, args, kwargs):
    """`jacfwd(func, argnums, has_aux, randomness=..., chunk_size=...)(*args, **kwargs)`."""
    api = "jacfwd(f, argnums)"
    checked = check_argnums(argnums, len(args), api)
    diff = select_argnums(args, checked)
    flat_diff, diff_spec = pytree.tree_flatten(diff)
    for x in flat_diff:
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{api}: Thing passed to transform API must be Tensor, got {type(x)}")
        if x.is_complex():
            raise RuntimeError("jacfwd: Expected all inputs to be real but received complex tensor")

    def of_diff(*flat):
        # runs at the jvp level (or the double-VJP's grad level): the other arguments are
        # the function's own there (a write into one is a valid program)
        own = own_arguments(top_interpreter(), args, checked)
        return func(*replace_argnums(own, checked, pytree.tree_unflatten(diff_spec, list(flat))), **kwargs)

    def push_jvp(*basis):
        flat_out, flat_tangents, out_spec, aux = _jvp_flat(of_diff, tuple(flat_diff), list(basis), has_aux, api, JACFWD)
        for out in flat_out:
            if out.is_complex():
                raise RuntimeError("jacfwd: Expected all outputs to be real but received complex tensor")
        tangents = [torch.zeros_like(o) if t is None else t for o, t in zip(flat_out, flat_tangents)]
        return pytree.tree_unflatten(out_spec, tangents), aux

    total = sum(x.numel() for x in flat_diff)
    if total == 0:  # no columns: one JVP (zero tangents) gives the outputs' shapes and aux
        with functx_code():
            zeros = [torch.zeros_like(x) for x in flat_diff]
        columns, aux = push_jvp(*zeros)
        flat_cols, out_spec = pytree.tree_flatten(columns)
        with functx_code():
            flat_cols = [c.unsqueeze(0)[:0] for c in flat_cols]
    else:
        step = total if chunk_size is None else chunk_size
        chunks = []
        for start in range(0, total, step):
            with functx_code():
                basis = identity_rows(flat_diff, start, min(start + step, total))
            # without aux, push_jvp's second output is None (out_dim None, as torch.func)
            chunks.append(vmap(push_jvp, randomness=randomness, out_dims=(0, 0 if has_aux else None))(*basis))
        columns, aux = chunks[0]
        # aux does not depend on the basis: every batch element is the same
        aux = pytree.tree_map(lambda a: a[0] if isinstance(a, torch.Tensor) else a, aux)
        flat_cols, out_spec = pytree.tree_flatten(columns)
        if len(chunks) > 1:  # (total, *out.shape) per output
            flat_cols = [torch.cat(parts) for parts in zip(*(pytree.tree_leaves(c) for c, _ in chunks))]
    per_output = []
    for col in flat_cols:
        out_shape = col.shape[1:]
        # (each step only where it changes something: under an outer transform every op here
        # is a dispatch through its levels; jacfwd(jacfwd) of a vector input needs none)
        pieces = col.split([x.numel() for x in flat_diff]) if len(flat_diff) > 1 else (col,)
        leaves = []
        for p, x in zip(pieces, flat_diff):
            if x.dim() != 1:
                p = p.reshape((*x.shape, *out_shape))
            if x.dim() and out_shape:
                p = p.movedim(tuple(range(x.dim())), tuple(range(len(out_shape), len(out_shape) + x.dim())))
            leaves.append(p)
        per_output.append(pytree.tree_unflatten(diff_spec, leaves))
    jacobian = pytree.tree_unflatten(out_spec, per_output)
    return (jacobian, aux) if has_aux else jacobian


def hessian(func: Function, argnums: Argnums = 0, *, chunk_size: Optional[int] = None) -> Function:
    """The Hessian of a scalar-valued `func` with respect to its `argnums` arguments.

    `hessian(func)` is the Jacobian of the gradient: functx computes it as
    `jacrev(jacrev(func))` (reverse over reverse; see the differences below). Other
    compositions give the same matrix: `jacfwd(jacrev(func))` (torch.func's),
    `jacfwd(jacfwd(func))`. For a Hessian-vector product without the whole matrix, use
    `jvp(grad(func), (x,), (v,))`.

    How it behaves:

    - **Shapes**: for a scalar output and one tensor argument, `input.shape + input.shape`
      (`H[i, j] = d² func / d input[i] d input[j]`). A non-scalar output is allowed: the
      result is `output.shape + input.shape + input.shape` (one Hessian per output
      element).
    - **Several arguments**: a tuple `argnums` gives nested tuples of blocks: `H[i][j]` is
      the block of arguments `argnums[i]` and `argnums[j]`, of shape
      `x_i.shape + x_j.shape`. Pytree arguments nest the same way (a dict of dicts for a
      dict).
    - **`chunk_size`** bounds memory: both Jacobians compute at most that many rows at a
      time; the result is the same.
    - **Composition**: `vmap(hessian(f))` gives one Hessian per example.
    - Random ops and `torch.no_grad()` inside `func` behave as under `jacrev` (`func` runs
      once; values computed under `torch.no_grad()` are constants).

    Args:
        func (Callable): a function returning a tensor, usually a scalar (no
            dimensions).
        argnums (int | tuple[int, ...], default 0): the positional arguments to
            differentiate (a tuple gives the blocks `[i][j]`); the others, and keyword
            arguments, are passed through.
        chunk_size (int | None, default None): compute at most this many rows at a time
            (bounds memory).

    Returns:
        Callable: a function of `func`'s arguments returning the Hessian, of shape
        `input.shape + input.shape` (blocks for several arguments).

    Raises:
        ValueError: `chunk_size` < 1; a differentiated argument that is not a tensor.
        RuntimeError: as `grad` and `jacrev`: bad `argnums`, an integer input, a
            non-tensor or complex output
            ([error catalogue](../errors.md#grad-grad_and_value-vjp-jacrev-hessian)).

    Examples:
        A function R^N -> R gives an N x N Hessian, here against closed forms:

        >>> import torch, functx
        >>> x = torch.randn(5)
        >>> torch.allclose(functx.hessian(lambda v: v.sin().sum())(x), torch.diag(-x.sin()))
        True
        >>> torch.allclose(functx.hessian(lambda v: (v ** 3).sum())(x), torch.diag(6 * x))
        True

        A quadratic form `v @ A @ v` has the Hessian `A + A.T`, whatever `chunk_size`;
        `torch.autograd.functional.hessian` agrees:

        >>> import torch, functx
        >>> A = torch.randn(4, 4)
        >>> quadratic = lambda v: v @ A @ v
        >>> v = torch.randn(4)
        >>> torch.allclose(functx.hessian(quadratic)(v), A + A.T)
        True
        >>> torch.allclose(functx.hessian(quadratic, chunk_size=1)(v), torch.autograd.functional.hessian(quadratic, v))
        True

        Blocks for several arguments (`a * a * b`: d²/da² = 2b, d²/da db = 2a,
        d²/db² = 0):

        >>> import torch, functx
        >>> a, b = torch.tensor(1.0), torch.tensor(2.0)
        >>> blocks = functx.hessian(lambda a, b: a * a * b, argnums=(0, 1))(a, b)
        >>> [[h.item() for h in row] for row in blocks]
        [[4.0, 2.0], [2.0, 0.0]]

        One Hessian per example under `vmap`, and the same matrix as `jacfwd(jacrev)`:

        >>> import torch, functx
        >>> f = lambda v: (v.exp() * v.roll(1)).sum()
        >>> xs = torch.randn(8, 3)
        >>> hessians = functx.vmap(functx.hessian(f))(xs)
        >>> hessians.shape
        torch.Size([8, 3, 3])
        >>> torch.allclose(hessians, functx.vmap(functx.jacfwd(functx.jacrev(f)))(xs))
        True

    Differences from torch.func:
        torch.func computes `jacfwd(jacrev(func))`; functx computes `jacrev(jacrev(func))`:
        the same matrix (a Hessian is symmetric), here about 1.6x faster, since forward
        formulas of the backward ops add more dispatches than a second backward pass
        (benchmarks/HISTORY.md). So `hessian` needs no forward-mode formula, and random
        ops inside `func` work (torch.func runs `func` under `vmap` and refuses them).
        `chunk_size` is functx's.
    """
    from .reverse import jacrev

    return jacrev(jacrev(func, argnums, chunk_size=chunk_size), argnums, chunk_size=chunk_size)
