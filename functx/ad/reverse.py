"""Reverse mode: `vjp`, `grad`, `grad_and_value`, `jacrev` (torch.func signatures)."""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from ..core import pytree
from ..core.errors import user_facing
from ..core.type_aliases import Argnums, Function
from ..core.interpreter import functx_code, interpreting
from ..vmap import vmap
from .arguments import (
    check_argnums,
    check_aux,
    check_outputs,
    export,
    identity_rows,
    make_differentiable,
    own_arguments,
    replace_argnums,
    select_argnums,
)
from .choose import GRAD, JACREV, VJP, choose_level
from .direct_reverse import is_differentiated, without_own_graph
from .level import recording, unwrap_level


def _split_aux(output, has_aux: bool, api: str):
    if not has_aux:
        return output, None
    if not (isinstance(output, tuple) and len(output) == 2):
        raise RuntimeError(f"{api}: output of function f should be a tuple: (output, aux) if has_aux is True")
    check_aux(output[1], api)
    return output


def _vjp_with_argnums(func, args, kwargs, argnums, has_aux, api, needs=VJP):
    """Run `func` at a new grad level, differentiating the `argnums` arguments (all tensor
    leaves when argnums is None). Returns (output, vjp_fn, aux); `vjp_fn(cotangents)`
    returns cotangents shaped like the differentiated arguments. `needs=JACREV`: the
    caller calls `vjp_fn` only as jacrev does (see DirectGradLevel.vjp), so right inside
    vmap the level may run on vmap's physical tensors."""
    with functx_code():
        if argnums is not None:
            argnums = check_argnums(argnums, len(args), api)
        flat_args, diff_spec = pytree.tree_flatten(args if argnums is None else select_argnums(args, argnums))
        level = choose_level(needs, flat_args)
    with interpreting(level), recording():
        with functx_code():
            flat_diff = make_differentiable(flat_args, level, api)
            diff = pytree.tree_unflatten(diff_spec, flat_diff)
            call_args = diff if argnums is None else replace_argnums(own_arguments(level, args, argnums), argnums, diff)
        output, aux = _split_aux(func(*call_args, **kwargs), has_aux, api)
        with functx_code():
            flat_out, out_spec = pytree.tree_flatten(output)
            check_outputs(flat_out, output, api)
            level.seal(flat_out, flat_diff)
            result = pytree.tree_unflatten(out_spec, level.export(flat_out))
            aux = export(level, aux)

    def vjp_fn(cotangents, retain_graph=True, create_graph=None):
        with functx_code():
            flat_cot, cot_spec = pytree.tree_flatten(cotangents)
            only_for_tangents = False
            if create_graph is None:
                # torch.func's default is the grad mode; a plain level also needs something to
                # differentiate the result: the outside graph or a differentiated cotangent.
                create_graph = torch.is_grad_enabled() and (
                    level.reaches_outside or any(is_differentiated(c) for c in flat_cot)
                )
                # Over a forward-mode level always, grad mode or not (level.py: ADLevel); the
                # graph recorded only for that is the level's own and does not leave it.
                only_for_tangents = level.under_forward and not create_graph
                create_graph = create_graph or only_for_tangents
            if cot_spec != out_spec:
                raise RuntimeError(
                    f"Expected pytree structure of cotangents to be the same as pytree structure of "
                    f"outputs to the function. cotangents: {cot_spec}, primal output: {out_spec}"
                )
            for cot, out in zip(flat_cot, flat_out):
                if not isinstance(cot, torch.Tensor) or cot.shape != out.shape:
                    got = tuple(cot.shape) if isinstance(cot, torch.Tensor) else type(cot).__name__
                    raise RuntimeError(
                        f"{api}: vjp_fn got a cotangent of shape {got} for an output of shape "
                        f"{tuple(out.shape)}; cotangents must match the outputs' shapes."
                    )
        with recording() if create_graph else torch.no_grad():
            grads = level.vjp(flat_out, flat_diff, flat_cot, create_graph=create_graph, retain_graph=retain_graph)
        with functx_code():
            if only_for_tangents:
                grads = [without_own_graph(g) for g in grads]
            return pytree.tree_unflatten(diff_spec, [unwrap_level(g, level) for g in grads])

    # Which outputs do not depend on the differentiated inputs (jvp's strict mode asks).
    vjp_fn.independent_outputs = [not level.depends(out) for out in flat_out]
    vjp_fn.output_spec = out_spec
    return result, vjp_fn, aux


@user_facing
def vjp(func: Function, *primals: Any, has_aux: bool = False) -> tuple[Any, ...]:
    """Run `func(*primals)` and return its output with a function computing
    vector-Jacobian products there (reverse mode): `(output, vjp_fn)`, or
    `(output, vjp_fn, aux)` with `has_aux=True`.

    `vjp_fn(v)` returns `v` times the Jacobian of `func` at `primals`: the derivative of
    `<v, func(x)>` with respect to each primal. `func` runs once, when `vjp` is called;
    each `vjp_fn` call is one backward pass, whatever the number of inputs, so reverse
    mode suits functions with fewer outputs than inputs. For a scalar output, the VJP of
    `torch.tensor(1.0)` is the gradient (what `grad` computes); unlike `grad`, `vjp` takes
    any number of outputs, in any pytree.

    How it behaves:

    - **Every primal is differentiated** (all tensor leaves of all of them). `func`'s
      keyword arguments cannot be passed and take their defaults: fix other values with a
      closure (`lambda x: func(x, scale=2.0)`, `functools.partial`), which also keeps them
      out of the derivative.
    - **Cotangents mirror the output**: a tensor for a tensor output, a tuple for a tuple,
      a dict with the same keys for a dict; each shaped like its output.
    - **`vjp_fn` returns a tuple** with one entry per primal (a tuple of one for one
      primal), each structured and shaped like its primal.
    - **`vjp_fn` can be called any number of times**: the recorded graph is kept until
      `vjp_fn` is dropped (`vjp_fn(v, retain_graph=False)` frees it on that call; a later
      call raises). Under `vmap`, `vmap(vjp_fn)(rows)` computes many VJPs at once: with the
      rows of an identity matrix, the whole Jacobian (what `jacrev` does).
    - **`create_graph`**, as in `torch.autograd.grad`: `vjp_fn(v, create_graph=True)`
      records the VJP itself, so that `torch.autograd` can differentiate its result. By
      default it is recorded when grad mode is on and the primals or the cotangents
      require grad.
    - **`torch.no_grad()`** inside `func` makes what it computes a constant; `vjp` (and
      `vjp_fn`) called inside `torch.no_grad()` still differentiate, as in `grad`.

    Args:
        func (Callable): a function of tensors (pytrees of them) returning tensors (pytrees
            of them), or `(output, aux)` with `has_aux=True`.
        *primals (Tensor | pytree): the point, passed to `func` positionally; every tensor
            leaf (floating-point or complex) is differentiated.
        has_aux (bool, default False): `func` returns `(output, aux)`; aux (tensors or
            pytrees of them) is returned as is, not differentiated.

    Returns:
        tuple: `(output, vjp_fn)` (`(output, vjp_fn, aux)` with `has_aux=True`).
        `vjp_fn(cotangents, retain_graph=True, create_graph=None)` takes cotangents
        shaped (and structured) like `output` and returns a tuple with one entry per
        primal, shaped like it: `cotangents` times the Jacobian.

    Raises:
        RuntimeError: `func` returns nothing or a non-tensor; an integer or boolean
            primal; with `has_aux=True`, no `(output, aux)` pair or a non-tensor in aux;
            `vjp_fn` given cotangents whose structure or shapes differ from the output's
            ([error catalogue](../errors.md#grad-grad_and_value-vjp-jacrev-hessian)).
        ValueError: a primal (or a leaf of it) that is not a tensor.

    Examples:
        With a scalar output, the VJP of `1.0` is the gradient:

        >>> import torch, functx
        >>> x = torch.tensor([1.0, 2.0])
        >>> out, vjp_fn = functx.vjp(lambda t: t.sin().sum(), x)
        >>> torch.allclose(vjp_fn(torch.tensor(1.0))[0], torch.cos(x))
        True

        Several outputs take one cotangent each, in the output's structure:

        >>> import torch, functx
        >>> x = torch.tensor([1.0, 2.0])
        >>> _, vjp_fn = functx.vjp(lambda t: (t.sin(), t.cos()), x)
        >>> torch.allclose(vjp_fn((torch.ones(2), torch.ones(2)))[0], x.cos() - x.sin())
        True
        >>> _, vjp_fn = functx.vjp(lambda t: {"first": t.sin(), "second": t.cos()}, x)
        >>> (dx,) = vjp_fn({"first": torch.ones(2), "second": torch.zeros(2)})
        >>> torch.allclose(dx, x.cos())
        True

        Several primals, one partial derivative each (here against the closed forms of
        the matrix product, `v @ y.T` and `x.T @ v`):

        >>> import torch, functx
        >>> x, y = torch.randn(5, 4), torch.randn(4, 5)
        >>> _, vjp_fn = functx.vjp(torch.matmul, x, y)
        >>> v = torch.randn(5, 5)
        >>> dx, dy = vjp_fn(v)
        >>> torch.allclose(dx, v @ y.T), torch.allclose(dy, x.T @ v)
        (True, True)

        Keyword arguments keep their defaults; a pytree primal gets a pytree back; `aux`
        is returned undifferentiated:

        >>> import torch, functx
        >>> def f(x, scale=4.0):
        ...     return x * scale
        >>> _, vjp_fn = functx.vjp(f, torch.ones(3))
        >>> vjp_fn(torch.ones(3))[0].tolist()
        [4.0, 4.0, 4.0]
        >>> params = {"w": torch.tensor(2.0), "b": torch.tensor(1.0)}
        >>> out, vjp_fn, aux = functx.vjp(lambda p: (p["w"] * 3.0 + p["b"], p["w"] > 0), params, has_aux=True)
        >>> vjp_fn(torch.tensor(1.0))[0], aux
        ({'w': tensor(3.), 'b': tensor(1.)}, tensor(True))

        The whole Jacobian, one VJP per output element under `vmap`, checked against
        `torch.autograd.functional.jacobian`:

        >>> import torch, functx
        >>> w, v = torch.randn(2, 3), torch.randn(3)
        >>> out, vjp_fn = functx.vjp(torch.mv, w, v)
        >>> dw, dv = functx.vmap(vjp_fn)(torch.eye(2))
        >>> jw, jv = torch.autograd.functional.jacobian(torch.mv, (w, v))
        >>> torch.allclose(dw, jw), torch.allclose(dv, jv), torch.allclose(dv, w)
        (True, True, True)

        `torch.no_grad()` inside `func` is respected, outside it is not:

        >>> import torch, functx
        >>> def f(x):
        ...     with torch.no_grad():
        ...         c = x ** 2
        ...     return x - c
        >>> x = torch.tensor([1.0, 2.0])
        >>> functx.vjp(f, x)[1](torch.ones(2))[0].tolist()  # c is a constant
        [1.0, 1.0]
        >>> with torch.no_grad():
        ...     functx.vjp(lambda t: t ** 2, x)[1](torch.ones(2))[0].tolist()  # 2 x
        [2.0, 4.0]

    Differences from torch.func:
        None in results (`vjp_fn` takes torch.func's `retain_graph` and `create_graph`
        keywords too). A `None` leaf of a primal passes through (its entry in the result
        is `None`) where torch.func raises. A cotangent of the wrong shape raises functx's
        message naming both shapes (torch.func's comes from autograd: "Mismatch in
        shape"); error types are torch.func's.
    """
    return _vjp_call(func, primals, has_aux)


def _vjp_call(func, primals, has_aux):
    """`vjp(func, *primals, has_aux=...)`."""
    result, vjp_fn, aux = _vjp_with_argnums(func, primals, {}, None, has_aux, "vjp(f, *primals)")

    @user_facing
    def wrapper(cotangents, retain_graph=True, create_graph=None):
        return vjp_fn(cotangents, retain_graph=retain_graph, create_graph=create_graph)

    return (result, wrapper, aux) if has_aux else (result, wrapper)


def grad_and_value(func: Function, argnums: Argnums = 0, has_aux: bool = False) -> Function:
    """Like `grad`, but the transformed function returns the value too, from the same pass:
    `(gradient, value)`, or `(gradient, (value, aux))` with `has_aux=True`.

    `func` runs once: the value is the output of the forward pass the gradient is taken
    through, so a training step gets its loss for logging at no extra cost. Everything
    else (which arguments are differentiated, pytrees, nesting, `torch.no_grad()`) is as
    in `grad`.

    Args:
        func (Callable): a function returning a scalar tensor (no dimensions), or
            `(scalar, aux)` with `has_aux=True`.
        argnums (int | tuple[int, ...], default 0): the positional arguments to
            differentiate (a tuple gives a tuple of gradients).
        has_aux (bool, default False): `func` returns `(output, aux)`.

    Returns:
        Callable: a function of `func`'s arguments returning `(gradient, value)`, where
        `gradient` is what `grad(func, argnums)` returns (a tuple for tuple `argnums`) and
        `value` is `func`'s output; with `has_aux=True`, `(gradient, (value, aux))`.

    Raises:
        RuntimeError: as `grad` ([error catalogue](../errors.md#grad-grad_and_value-vjp-jacrev-hessian)).
        ValueError: a differentiated argument (or a leaf of it) is not a tensor.

    Examples:
        >>> import torch, functx
        >>> g, v = functx.grad_and_value(lambda x: (x ** 2).sum())(torch.tensor([1.0, 3.0]))
        >>> g.tolist(), v.item()  # 2 x, sum(x ** 2)
        ([2.0, 6.0], 10.0)
        >>> g, (v, aux) = functx.grad_and_value(lambda x: ((x ** 2).sum(), x.argmax()), has_aux=True)(torch.tensor([1.0, 3.0]))
        >>> v.item(), aux.item()
        (10.0, 1)

        Two arguments, and the value of a module's loss, checked against
        `torch.autograd.grad`:

        >>> import torch, functx
        >>> (dw, dx), v = functx.grad_and_value(lambda w, x: (w * x).sum(), argnums=(0, 1))(torch.tensor(3.0), torch.ones(2))
        >>> dw.item(), dx.tolist(), v.item()
        (2.0, [3.0, 3.0], 6.0)
        >>> model, x = torch.nn.Linear(3, 1), torch.randn(5, 3)
        >>> def loss(params, x):
        ...     return functx.functional_call(model, params, (x,)).pow(2).mean()
        >>> params = {k: v.detach() for k, v in model.named_parameters()}
        >>> grads, value = functx.grad_and_value(loss)(params, x)
        >>> expected = model(x).pow(2).mean()
        >>> reference = torch.autograd.grad(expected, list(model.parameters()))
        >>> torch.allclose(value, expected), all(torch.allclose(grads[k], r) for k, r in zip(params, reference))
        (True, True)

    Differences from torch.func:
        As `grad`'s: none in results; a `None` leaf of a differentiated pytree passes
        through (its gradient is `None`) where torch.func raises; some error messages say
        more.
    """
    @user_facing
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        return _grad_and_value_call(func, argnums, has_aux, args, kwargs)

    return wrapper


def _grad_and_value_call(func, argnums, has_aux, args, kwargs):
    """`grad_and_value(func, argnums, has_aux)(*args, **kwargs)`: one entry point per
    transform, which is also where torch.compile stages the call (functx/staging)."""
    api = "grad_and_value(f)(*args)"
    with functx_code():
        checked = check_argnums(argnums, len(args), api)
        flat_args, diff_spec = pytree.tree_flatten(select_argnums(args, checked))
        level = choose_level(GRAD, flat_args)
    with interpreting(level), recording():
        with functx_code():
            flat_diff = make_differentiable(flat_args, level, api)
            diff = pytree.tree_unflatten(diff_spec, flat_diff)
            call_args = replace_argnums(own_arguments(level, args, checked), checked, diff)
        output, aux = _split_aux(func(*call_args, **kwargs), has_aux, api)
        with functx_code():
            if not isinstance(output, torch.Tensor):
                raise RuntimeError(f"{api}: Expected f(*args) to return a Tensor, got {type(output)}")
            if output.dim() != 0:
                raise RuntimeError(
                    f"{api}: Expected f(*args) to return a scalar Tensor, got tensor with "
                    f"{output.dim()} dims. Maybe you wanted to use the vjp or jacrev APIs instead?"
                )
            level.seal([output], flat_diff)
        grads = level.gradient(output, flat_diff)  # the backward may run user code
        with functx_code():
            _drop_recorded_writes(level, args, checked)
            gradient = pytree.tree_unflatten(diff_spec, level.export(list(grads)))
            value = level.export(output)
            if has_aux:
                return gradient, (value, export(level, aux))
            return gradient, value


def _drop_recorded_writes(level, args, argnums) -> None:
    """After the gradient: a non-differentiated plain argument the function wrote a
    differentiated value into (`buf.copy_(x)`) keeps the written value, as under torch.func,
    but not the direct level's history (torch.func's stays on its wrapper), unless the
    caller's graph reaches it."""
    if not getattr(level, "vmap_levels", None) == () or level.reaches_outside:
        return
    differentiated = {argnums} if isinstance(argnums, int) else set(argnums)
    for i, a in enumerate(args):
        if i in differentiated:
            continue
        for x in pytree.tree_leaves(a):
            if type(x) is torch.Tensor and x.grad_fn is not None and x._base is None:
                x.detach_()


def grad(func: Function, argnums: Argnums = 0, has_aux: bool = False) -> Function:
    """The gradient of a scalar-valued `func` with respect to its `argnums` arguments:
    `grad(func)(*args)` returns d func(*args) / d args[argnums].

    `func` is an ordinary function of tensors returning a scalar loss; `grad(func)` is a new
    function taking the same arguments and returning the gradient instead of the loss (one
    forward pass of `func` and one backward pass). `grad` nests and composes with the other
    transforms: `grad(grad(f))` is the second derivative, `vmap(grad(f))` gives one gradient
    per example (per-sample gradients), and with `functional_call` it differentiates a
    module's parameters.

    How it behaves:

    - **The output** must be a tensor with no dimensions (`loss.sum()`, `loss.mean()`); a
      one-element tensor of shape `(1,)` is refused, as in torch.func. For vector outputs
      use `vjp` or `jacrev`.
    - **Only `argnums` is differentiated.** The other positional arguments and all keyword
      arguments are passed through unchanged, and need not be tensors. Negative `argnums`
      count from the last positional argument.
    - **Pytree arguments** (a dict of parameters, tuples, lists) give gradients of the same
      structure. Their tensor leaves must be floating-point or complex.
    - **`torch.no_grad()` inside `func`** makes what it computes a constant. `grad` called
      inside `torch.no_grad()` still computes the gradient: a transform's result does not
      depend on the context outside `func`. `.detach()` inside `func` stops the derivative
      at every level ([detach](../semantics.md#detach-stop-gradient)).
    - **Arguments that require grad** (tensors of an outer `torch.autograd` computation)
      keep their history: the gradient is differentiable by `torch.autograd`. Detached
      arguments (`p.detach()`) give gradients without a graph, which is cheaper when the
      gradient is all you need.
    - **`.backward()` inside `func`** raises: return the loss and let `grad` differentiate it.

    Args:
        func (Callable): a function returning a scalar tensor (no dimensions), or
            `(scalar, aux)` with `has_aux=True`. Its arguments may be pytrees of tensors.
        argnums (int | tuple[int, ...], default 0): which positional arguments to
            differentiate. An int gives that argument's gradient; a tuple gives a tuple of
            gradients, one per position, in the tuple's order.
        has_aux (bool, default False): `func` returns `(output, aux)`; the gradient is of
            `output`, and `aux` (tensors or pytrees of tensors, not differentiated) is
            returned beside it.

    Returns:
        Callable: a function of the same arguments as `func`, returning the gradient
        (shaped like the differentiated argument, a pytree like it for a pytree), a tuple
        of them for tuple `argnums`, and `(gradient, aux)` with `has_aux=True`.

    Raises:
        RuntimeError: `func`'s output is not a tensor without dimensions; `argnums` is out
            of range, empty, repeated, or not an int or tuple of ints; a differentiated
            tensor has an integer or boolean dtype; with `has_aux=True`, `func` does not
            return a pair, or `aux` holds a non-tensor
            ([error catalogue: grad, vjp, jacrev](../errors.md#grad-grad_and_value-vjp-jacrev-hessian)).
        RuntimeError: `func` calls `.backward()`
            ([vmap inside the function](../errors.md#vmap-inside-the-function)).
        ValueError: a differentiated argument (or a leaf of it) is not a tensor.

    Examples:
        The derivative of sin, and higher derivatives by nesting:

        >>> import torch, functx
        >>> x = torch.tensor(0.5)
        >>> torch.allclose(functx.grad(torch.sin)(x), torch.cos(x))
        True
        >>> torch.allclose(functx.grad(functx.grad(torch.sin))(x), -torch.sin(x))
        True
        >>> torch.allclose(functx.grad(functx.grad(functx.grad(torch.sin)))(x), -torch.cos(x))
        True

        Several arguments (`argnums` a tuple) and an auxiliary output (`has_aux`), against
        the closed form d/dy = -(y_pred / 2 - y), d/dy_pred = (y_pred / 2 - y) / 2, each
        divided by n = 2 for the mean:

        >>> import torch, functx
        >>> def loss_fn(y, y_pred):
        ...     per_sample = (0.5 * y_pred - y) ** 2
        ...     return per_sample.mean(), (y_pred, per_sample)
        >>> y, y_pred = torch.tensor([1.0, 2.0]), torch.tensor([4.0, 2.0])
        >>> (dy, dy_pred), (pred, per_sample) = functx.grad(loss_fn, argnums=(0, 1), has_aux=True)(y, y_pred)
        >>> dy.tolist(), dy_pred.tolist(), per_sample.tolist()
        ([-1.0, 1.0], [0.5, -0.5], [1.0, 1.0])

        A pytree of parameters; keyword arguments are passed through, not differentiated:

        >>> import torch, functx
        >>> def loss(params, x):
        ...     out = params["w"] * x + params["b"]
        ...     return (out ** 2).sum(), out
        >>> params = {"w": torch.tensor(2.0), "b": torch.tensor(1.0)}
        >>> grads, out = functx.grad(loss, has_aux=True)(params, torch.tensor([1.0, 2.0]))
        >>> {k: v.item() for k, v in grads.items()}, out.tolist()  # 2 sum(out * x), 2 sum(out)
        ({'w': 26.0, 'b': 16.0}, [3.0, 5.0])
        >>> functx.grad(lambda w, *, scale: (scale * w ** 2).sum())(torch.tensor([1.0, 2.0]), scale=3.0).tolist()
        [6.0, 12.0]

        A module's parameters, through `functional_call`, checked against
        `torch.autograd.grad` on the module itself:

        >>> import torch, functx
        >>> model = torch.nn.Linear(3, 2)
        >>> x, t = torch.randn(4, 3), torch.randn(4, 2)
        >>> def compute_loss(params, x, t):
        ...     return torch.nn.functional.mse_loss(functx.functional_call(model, params, (x,)), t)
        >>> params = {k: v.detach() for k, v in model.named_parameters()}
        >>> grads = functx.grad(compute_loss)(params, x, t)
        >>> reference = torch.autograd.grad(torch.nn.functional.mse_loss(model(x), t), list(model.parameters()))
        >>> all(torch.allclose(grads[k], r) for k, r in zip(params, reference))
        True
        >>> grads["weight"].grad_fn is None  # detached parameters: no graph outside grad
        True

        Per-sample gradients under `vmap`, checked against a loop of `torch.autograd.grad`:

        >>> import torch, functx
        >>> def compute_loss(weights, example, target):
        ...     y = example.dot(weights).relu()
        ...     return ((y - target) ** 2).mean()
        >>> weights, examples, targets = torch.randn(5), torch.randn(3, 5), torch.randn(3)
        >>> per_example = functx.vmap(functx.grad(compute_loss), in_dims=(None, 0, 0))(weights, examples, targets)
        >>> per_example.shape
        torch.Size([3, 5])
        >>> w = weights.clone().requires_grad_()
        >>> loop = torch.stack([torch.autograd.grad(compute_loss(w, e, t), w)[0] for e, t in zip(examples, targets)])
        >>> torch.allclose(per_example, loop)
        True

        `torch.no_grad()` inside `func` is respected, outside it is not; an argument that
        requires grad gives a gradient `torch.autograd` can differentiate again:

        >>> import torch, functx
        >>> def f(x):
        ...     with torch.no_grad():
        ...         c = x ** 2
        ...     return (x - c).sum()
        >>> x = torch.tensor([1.0, 2.0])
        >>> functx.grad(f)(x).tolist()  # c is a constant: d/dx (x - c) = 1
        [1.0, 1.0]
        >>> with torch.no_grad():
        ...     functx.grad(lambda t: (t ** 2).sum())(x).tolist()  # 2 x
        [2.0, 4.0]
        >>> w = torch.tensor([1.0, 2.0], requires_grad=True)
        >>> g = functx.grad(lambda t: (t ** 3).sum())(w)  # 3 w ** 2
        >>> torch.autograd.grad(g.sum(), w)[0].tolist()  # 6 w
        [6.0, 12.0]

    Differences from torch.func:
        None in results. functx picks, per call, a level on torch's autograd right inside
        `vmap` (per-sample gradients without per-op wrappers) or a wrapped level elsewhere.
        A `None` leaf of a differentiated pytree passes through (its gradient is `None`)
        where torch.func raises. Error types are torch.func's; some messages say more (the
        call that raised, where in `aux` a non-tensor is, the fix).
    """
    gv = grad_and_value(func, argnums, has_aux)

    @user_facing
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        gradient, value = gv(*args, **kwargs)
        return (gradient, value[1]) if has_aux else gradient

    return wrapper


def jacobian_by_rows(vjp_fn, flat_out, out_spec, chunk_size):
    """The Jacobian from a `vjp_fn`: one vectorized VJP per output element, `chunk_size`
    rows at a time, written into a preallocated result (no final concatenation copy).
    Returns, per flat output, the flat list of its Jacobian blocks (one per flat input,
    shaped `output.shape + input.shape`), and the input structure."""
    total = sum(o.numel() for o in flat_out)
    step = max(total, 1) if chunk_size is None else chunk_size
    structure = []  # the gradients' structure: None leaves (an argument's None) are not rows

    def one_vjp(*cot):
        leaves, spec = pytree.tree_flatten(vjp_fn(pytree.tree_unflatten(out_spec, list(cot))))
        structure[:] = [spec]
        return leaves

    flat_in, in_spec = None, None
    if total == 0:  # no rows: one VJP of the (empty) outputs gives the inputs' shapes
        with functx_code():
            zeros = [torch.zeros_like(o) for o in flat_out]
        rows, in_spec = one_vjp(*zeros), structure[0]
        with functx_code():
            flat_in = [r.unsqueeze(0)[:0] for r in rows]
    for start in range(0, total, step):
        stop = min(start + step, total)
        with functx_code():
            basis = identity_rows(flat_out, start, stop)
        if stop - start == 1:  # one row (a scalar output): no need to vectorize
            rows, spec = [r.unsqueeze(0) for r in one_vjp(*(b[0] for b in basis))], structure[0]
        else:
            rows, spec = list(vmap(one_vjp)(*basis)), structure[0]
        with functx_code():
            if flat_in is None:
                if stop == total:
                    # laid out row-major as torch.func's Jacobians are: inside vmap the rows
                    # can come out with the row dim outermost in memory (a transposed view
                    # per element: `jac.view(b, -1)` raised); a copy only then
                    flat_in, in_spec = [r.contiguous() for r in rows], spec
                    break
                flat_in, in_spec = [r.new_empty(total, *r.shape[1:]) for r in rows], spec
            for full, chunk in zip(flat_in, rows):
                full[start:stop] = chunk
    # flat_in[j]: (total, *input_j.shape) -> per output i: (*out_i.shape, *input_j.shape)
    with functx_code():
        per_output = []
        offset = 0
        for out in flat_out:
            n = out.numel()
            per_output.append([g[offset : offset + n].view((*out.shape, *g.shape[1:])) for g in flat_in])
            offset += n
        return per_output, in_spec


def jacrev(
    func: Function,
    argnums: Argnums = 0,
    *,
    has_aux: bool = False,
    chunk_size: Optional[int] = None,
    _preallocate_and_copy: bool = False,
) -> Function:
    """The Jacobian of `func` with respect to its `argnums` arguments, by reverse mode: one
    vectorized vector-Jacobian product per output element. Best when the outputs are fewer
    than the inputs.

    `jacrev(func)(*args)` runs `func` once (as `vjp` does) and then computes every row of
    the Jacobian at once: `vmap(vjp_fn)` over the rows of an identity matrix the size of the
    output. The cost grows with the number of output elements, not of input elements;
    `jacfwd` is the forward-mode twin, cheaper for few inputs and many outputs. Both give
    the same matrix.

    How it behaves:

    - **Shapes**: for one tensor output and one differentiated tensor argument the result
      has shape `output.shape + input.shape` (`J[i, j] = d output[i] / d input[j]`); a
      pointwise function of a vector has a diagonal Jacobian.
    - **Structure**: for pytree outputs the result has the output's structure outside and
      the differentiated arguments' inside (a tuple for tuple `argnums`, a dict for a dict
      argument), each leaf `out_leaf.shape + in_leaf.shape`.
    - **`chunk_size`** bounds memory: None computes all rows in one vectorized call, `k`
      computes `k` rows at a time, and 1 computes them one by one with plain `vjp` calls
      and no `vmap` at all (so the backward needs no batching rules). The result is the
      same.
    - **`has_aux`**: `func` returns `(output, aux)`; `aux` is not differentiated. Returning
      the output itself as aux gives the value along with its Jacobian from one call.
    - **Composition**: `vmap(jacrev(f))` gives one Jacobian per example, and
      `jacrev(jacrev(f))` or `jacfwd(jacrev(f))` the Hessian (see `hessian`).
    - **`torch.no_grad()`** inside `func` makes what it computes a constant; `jacrev` called
      inside `torch.no_grad()` still differentiates, as `grad` does. Random ops inside
      `func` are not constrained: `func` runs once, not under `vmap`.

    Args:
        func (Callable): a function of tensors (pytrees of them) returning real tensors
            (pytrees of them), or `(output, aux)` with `has_aux=True`.
        argnums (int | tuple[int, ...], default 0): the positional arguments to
            differentiate; the others, and keyword arguments, are passed through.
        has_aux (bool, default False): `func` returns `(output, aux)`; the result is
            `(jacobian, aux)`.
        chunk_size (int | None, default None): compute at most this many Jacobian rows
            at a time (bounds memory; 1 is a loop of vjps, without vmap).

    Returns:
        Callable: a function of `func`'s arguments returning the Jacobian. Its structure
        nests as torch.func's: the output's structure outside, the differentiated
        arguments' inside (a tuple for tuple `argnums`); each leaf has shape
        `output.shape + input.shape`. With `has_aux=True`, `(jacobian, aux)`.

    Raises:
        ValueError: `chunk_size` < 1; a differentiated argument (or leaf) that is not a
            tensor.
        RuntimeError: bad `argnums`; an integer or boolean differentiated tensor; a
            non-tensor or complex output; with `has_aux=True`, no `(output, aux)` pair
            ([error catalogue](../errors.md#grad-grad_and_value-vjp-jacrev-hessian)).

    Examples:
        A pointwise function has a diagonal Jacobian:

        >>> import torch, functx
        >>> x = torch.randn(5)
        >>> torch.allclose(functx.jacrev(torch.sin)(x), torch.diag(torch.cos(x)))
        True

        The value along with the Jacobian, as aux:

        >>> import torch, functx
        >>> def g(x):
        ...     result = x.sin()
        ...     return result, result
        >>> x = torch.randn(5)
        >>> jacobian, value = functx.jacrev(g, has_aux=True)(x)
        >>> torch.allclose(value, x.sin()), torch.allclose(jacobian, torch.diag(x.cos()))
        (True, True)

        Another argument (`argnums=1`), or several (a tuple of Jacobians), against the
        closed forms of `x + y ** 2`:

        >>> import torch, functx
        >>> def f(x, y):
        ...     return x + y ** 2
        >>> x, y = torch.randn(5), torch.randn(5)
        >>> torch.allclose(functx.jacrev(f, argnums=1)(x, y), torch.diag(2 * y))
        True
        >>> jx, jy = functx.jacrev(f, argnums=(0, 1))(x, y)
        >>> torch.allclose(jx, torch.eye(5)), torch.allclose(jy, torch.diag(2 * y))
        (True, True)

        Matrix arguments and pytree outputs, checked against
        `torch.autograd.functional.jacobian`:

        >>> import torch, functx
        >>> w, v = torch.randn(2, 3), torch.randn(3)
        >>> jw, jv = functx.jacrev(torch.mv, argnums=(0, 1))(w, v)
        >>> jw.shape, torch.allclose(jv, w)
        (torch.Size([2, 2, 3]), True)
        >>> torch.allclose(jw, torch.autograd.functional.jacobian(lambda m: torch.mv(m, v), w))
        True
        >>> jac = functx.jacrev(lambda t: {"sin": t.sin(), "total": t.sum()})(v)
        >>> jac["sin"].shape, jac["total"].tolist()
        (torch.Size([3, 3]), [1.0, 1.0, 1.0])

        Batched Jacobians under `vmap`, checked against a loop:

        >>> import torch, functx
        >>> x = torch.randn(64, 5)
        >>> jacobians = functx.vmap(functx.jacrev(torch.sin))(x)
        >>> jacobians.shape
        torch.Size([64, 5, 5])
        >>> torch.allclose(jacobians, torch.stack([torch.diag(row.cos()) for row in x]))
        True

        The Hessian by composing with itself, and `chunk_size` (the same result):

        >>> import torch, functx
        >>> def f(x):
        ...     return x.sin().sum()
        >>> x = torch.randn(5)
        >>> torch.allclose(functx.jacrev(functx.jacrev(f))(x), torch.diag(-x.sin()))
        True
        >>> torch.allclose(functx.jacrev(torch.sin, chunk_size=2)(x), functx.jacrev(torch.sin)(x))
        True
        >>> torch.allclose(functx.jacrev(torch.sin, chunk_size=1)(x), torch.diag(x.cos()))
        True

        `torch.no_grad()` inside `func` is respected, outside it is not:

        >>> import torch, functx
        >>> def f(x):
        ...     with torch.no_grad():
        ...         c = x ** 2
        ...     return x - c
        >>> x = torch.tensor([1.0, 2.0])
        >>> functx.jacrev(f)(x).tolist()  # c is a constant
        [[1.0, 0.0], [0.0, 1.0]]
        >>> with torch.no_grad():
        ...     functx.jacrev(lambda t: t ** 2)(x).tolist()  # diag(2 x)
        [[2.0, 0.0], [0.0, 4.0]]

    Differences from torch.func:
        None in results (`_preallocate_and_copy` is accepted and ignored: with
        `chunk_size` the chunks are always written into one preallocated result). Error
        types are torch.func's; some messages say more (the call that raised, the fix).
    """
    if chunk_size is not None and not (isinstance(chunk_size, int) and chunk_size > 0):
        raise ValueError("jacrev: `chunk_size` should be greater than 0.")

    @user_facing
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        return _jacrev_call(func, argnums, has_aux, chunk_size, args, kwargs)

    return wrapper


def _jacrev_call(func, argnums, has_aux, chunk_size, args, kwargs):
    """`jacrev(func, argnums, has_aux=..., chunk_size=...)(*args, **kwargs)`."""
    api = "jacrev(f, argnums)"
    output, vjp_fn, aux = _vjp_with_argnums(func, args, kwargs, argnums, has_aux, api, needs=JACREV)
    flat_out, out_spec = pytree.tree_flatten(output)
    for out in flat_out:
        if out.is_complex():
            raise RuntimeError("jacrev: Expected all outputs to be real but received complex tensor")
    blocks, in_spec = jacobian_by_rows(vjp_fn, flat_out, out_spec, chunk_size)
    jacobian = pytree.tree_unflatten(out_spec, [pytree.tree_unflatten(in_spec, b) for b in blocks])
    return (jacobian, aux) if has_aux else jacobian
