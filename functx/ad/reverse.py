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

    Args:
        func (Callable): a function of tensors (pytrees of them) returning tensors (pytrees
            of them), or `(output, aux)` with `has_aux=True`.
        *primals (Tensor | pytree): the point; every tensor leaf is differentiated.
        has_aux (bool, default False): `func` returns `(output, aux)`; aux is returned
            as is, not differentiated.

    Returns:
        tuple: `(output, vjp_fn)` (`(output, vjp_fn, aux)` with `has_aux=True`).
        `vjp_fn(cotangents)` takes cotangents shaped (and structured) like `output` and
        returns a tuple with one entry per primal, shaped like it: `cotangents` times the
        Jacobian. It can be called any number of times, also under `vmap` (all rows of a
        Jacobian at once).

    Raises:
        RuntimeError: a primal or output that is not a tensor, or `vjp_fn` given
            cotangents whose structure or shapes differ from the output's
            ([error catalogue](../errors.md#grad-grad_and_value-vjp-jacrev-hessian)).

    Examples:
        >>> import torch, functx
        >>> x = torch.tensor([1.0, 2.0])
        >>> out, vjp_fn = functx.vjp(torch.sin, x)
        >>> torch.allclose(vjp_fn(torch.ones(2))[0], torch.cos(x))
        True

        Several primals, and the whole Jacobian by vmapping `vjp_fn` over the rows:

        >>> w, v = torch.randn(2, 3), torch.randn(3)
        >>> out, vjp_fn = functx.vjp(torch.mv, w, v)
        >>> dw, dv = functx.vmap(vjp_fn)(torch.eye(2))
        >>> torch.allclose(dv, w), dw.shape
        (True, torch.Size([2, 2, 3]))

    Differences from torch.func:
        `vjp_fn` also accepts `retain_graph` and `create_graph` keywords (as
        `torch.autograd.grad`), for callers differentiating through it by hand.
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

    Args:
        func (Callable): a function returning a scalar tensor, or `(scalar, aux)` with
            `has_aux=True`.
        argnums (int | tuple[int, ...], default 0): the positional arguments to
            differentiate (a tuple gives a tuple of gradients).
        has_aux (bool, default False): `func` returns `(output, aux)`.

    Returns:
        Callable: a function of `func`'s arguments returning `(gradient, value)` or
        `(gradient, (value, aux))`.

    Raises:
        RuntimeError: as `grad` ([error catalogue](../errors.md#grad-grad_and_value-vjp-jacrev-hessian)).

    Examples:
        >>> import torch, functx
        >>> g, v = functx.grad_and_value(lambda x: (x ** 2).sum())(torch.tensor([1.0, 3.0]))
        >>> g.tolist(), v.item()
        ([2.0, 6.0], 10.0)
        >>> g, (v, aux) = functx.grad_and_value(lambda x: ((x ** 2).sum(), x.argmax()), has_aux=True)(torch.tensor([1.0, 3.0]))
        >>> v.item(), aux.item()
        (10.0, 1)

    Differences from torch.func: none.
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

    Args:
        func (Callable): a function returning a scalar tensor (one element), or
            `(scalar, aux)` with `has_aux=True`. Its arguments may be pytrees of tensors.
        argnums (int | tuple[int, ...], default 0): which positional arguments to
            differentiate. An int gives that argument's gradient; a tuple gives a tuple of
            gradients, one per position.
        has_aux (bool, default False): `func` returns `(output, aux)`; the gradient is of
            `output`, and `aux` (any pytree, not differentiated) is returned beside it.

    Returns:
        Callable: a function of the same arguments as `func`, returning the gradient
        (shaped like the differentiated argument, a pytree like it for a pytree), a tuple
        of them for tuple `argnums`, and `(gradient, aux)` with `has_aux=True`.

    Raises:
        RuntimeError: `func`'s output is not a scalar tensor, or `argnums` is out of range
            or not an int or tuple of ints
            ([error catalogue: grad, vjp, jacrev](../errors.md#grad-grad_and_value-vjp-jacrev-hessian)).
        RuntimeError: with `has_aux=True`, `func` does not return a pair.

    Examples:
        >>> import torch, functx
        >>> x = torch.tensor(0.5)
        >>> torch.allclose(functx.grad(torch.sin)(x), torch.cos(x))
        True
        >>> torch.allclose(functx.grad(functx.grad(torch.sin))(x), -torch.sin(x))
        True

        Several arguments, pytrees and an auxiliary output:

        >>> def loss(params, x):
        ...     out = params["w"] * x + params["b"]
        ...     return (out ** 2).sum(), out
        >>> params = {"w": torch.tensor(2.0), "b": torch.tensor(1.0)}
        >>> grads, out = functx.grad(loss, has_aux=True)(params, torch.tensor([1.0, 2.0]))
        >>> {k: round(v.item(), 4) for k, v in grads.items()}, out.tolist()
        ({'w': 26.0, 'b': 16.0}, [3.0, 5.0])
        >>> dw, dx = functx.grad(lambda w, x: (w * x).sum(), argnums=(0, 1))(torch.tensor(3.0), torch.ones(2))
        >>> dw.item(), dx.tolist()
        (2.0, [3.0, 3.0])

        Per-sample gradients:

        >>> w, xs = torch.randn(3), torch.randn(8, 3)
        >>> functx.vmap(functx.grad(lambda w, x: (w @ x).tanh()), in_dims=(None, 0))(w, xs).shape
        torch.Size([8, 3])

    Differences from torch.func:
        None in results. functx picks, per call, a level on torch's autograd right inside
        `vmap` (per-sample gradients without per-op wrappers) or a wrapped level elsewhere.
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
    one_vjp = lambda *cot: vjp_fn(pytree.tree_unflatten(out_spec, list(cot)))
    flat_in, in_spec = None, None
    if total == 0:  # no rows: one VJP of the (empty) outputs gives the inputs' shapes
        with functx_code():
            zeros = [torch.zeros_like(o) for o in flat_out]
        rows, in_spec = pytree.tree_flatten(one_vjp(*zeros))
        with functx_code():
            flat_in = [r.unsqueeze(0)[:0] for r in rows]
    for start in range(0, total, step):
        stop = min(start + step, total)
        with functx_code():
            basis = identity_rows(flat_out, start, stop)
        if stop - start == 1:  # one row (a scalar output): no need to vectorize
            rows, spec = pytree.tree_flatten(one_vjp(*(b[0] for b in basis)))
            rows = [r.unsqueeze(0) for r in rows]
        else:
            rows, spec = pytree.tree_flatten(vmap(one_vjp)(*basis))
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

    Args:
        func (Callable): a function of tensors (pytrees of them) returning tensors (pytrees
            of them), or `(output, aux)` with `has_aux=True`.
        argnums (int | tuple[int, ...], default 0): the positional arguments to
            differentiate.
        has_aux (bool, default False): `func` returns `(output, aux)`; the result is
            `(jacobian, aux)`.
        chunk_size (int | None, default None): compute at most this many Jacobian rows
            at a time (bounds memory; 1 is a loop of vjps).

    Returns:
        Callable: a function of `func`'s arguments returning the Jacobian. Its structure
        nests as torch.func's: the output's structure outside, the differentiated
        arguments' inside (a tuple for tuple `argnums`); each leaf has shape
        `output.shape + input.shape`.

    Raises:
        ValueError: `chunk_size` < 1.
        RuntimeError: bad `argnums`, a non-tensor output
            ([error catalogue](../errors.md#grad-grad_and_value-vjp-jacrev-hessian)).

    Examples:
        >>> import torch, functx
        >>> x = torch.randn(3)
        >>> torch.allclose(functx.jacrev(torch.sin)(x), torch.diag(torch.cos(x)))
        True

        Two arguments, and a batch of Jacobians:

        >>> w, v = torch.randn(2, 3), torch.randn(3)
        >>> jw, jv = functx.jacrev(torch.mv, argnums=(0, 1))(w, v)
        >>> jw.shape, torch.allclose(jv, w)
        (torch.Size([2, 2, 3]), True)
        >>> functx.vmap(functx.jacrev(torch.sin))(torch.randn(5, 3)).shape
        torch.Size([5, 3, 3])

    Differences from torch.func: none (`_preallocate_and_copy` is accepted and ignored).
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
