"""Forward mode: `jvp`, `linearize`, `jacfwd`, `hessian` (torch.func signatures).

Jacobian-vector products come from the double-VJP identity: for u ↦ vjp(u) = Jᵀu,
⟨Jᵀu, t⟩ = ⟨u, Jt⟩, so Jt = ∇_u ⟨vjp(u), t⟩. It needs only reverse mode, so it works for
every op torch can differentiate twice and nests like grad does (jvp of jvp, jvp of
grad = Hessian-vector products, vmap of jvp = jacfwd), at about three times the cost of
the function. Native JVP rules for hot ops are the planned speed-up (see the issue notes).
"""

from __future__ import annotations

import functools

import optree
import torch

from ..vmap import vmap
from .arguments import check_argnums, identity_rows, replace_argnums, select_argnums
from .reverse import _vjp_with_argnums, grad, jacobian_by_rows

_JVP = "jvp(f, primals, tangents)"


def _tangent_map(vjp_fn, flat_out, out_spec):
    """jvp_fn(flat_tangents) -> flat output tangents, by differentiating vjp_fn."""

    def jvp_fn(flat_tangents):
        def pairing(*cotangent):
            grads = optree.tree_leaves(vjp_fn(optree.tree_unflatten(out_spec, list(cotangent)), create_graph=True))
            total = 0
            for g, t in zip(grads, flat_tangents):
                total = total + (g * t).sum()
            return total

        zeros = [torch.zeros_like(o) for o in flat_out]
        return list(grad(pairing, argnums=tuple(range(len(zeros))))(*zeros))

    return jvp_fn


def _check_primals_tangents(primals, tangents, api):
    if not isinstance(primals, tuple):
        raise RuntimeError(f"{api}: Expected primals to be a tuple. E.g. it should be valid to call f(*primals).")
    flat_primals, primals_spec = optree.tree_flatten(primals)
    flat_tangents, tangents_spec = optree.tree_flatten(tangents)
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


def jvp(func, primals, tangents, *, strict=False, has_aux=False):
    """Evaluate `func(*primals)` and its Jacobian-vector product with `tangents`;
    returns `(output, jvp_out)` (and `aux` with has_aux=True).

    Example:
        >>> import torch, functx
        >>> x = torch.tensor([0.0, 1.0])
        >>> out, tangent = functx.jvp(torch.sin, (x,), (torch.ones(2),))
        >>> torch.allclose(tangent, torch.cos(x))
        True
    """
    flat_tangents = _check_primals_tangents(primals, tangents, _JVP)
    output, vjp_fn, aux = _vjp_with_argnums(func, primals, {}, None, has_aux, _JVP)
    flat_out, out_spec = optree.tree_flatten(output)
    if strict and any(vjp_fn.independent_outputs):
        raise RuntimeError(
            "jvp(f, primals, tangents, strict=True): The output of f is independent of the inputs. "
            "This is not allowed with strict=True."
        )
    tangent_out = optree.tree_unflatten(out_spec, _tangent_map(vjp_fn, flat_out, out_spec)(flat_tangents))
    return (output, tangent_out, aux) if has_aux else (output, tangent_out)


def linearize(func, *primals):
    """Evaluate `func(*primals)` once and return `(output, jvp_fn)`; `jvp_fn(*tangents)`
    gives the Jacobian-vector product at `primals` without re-running the forward pass.

    Example:
        >>> import torch, functx
        >>> x = torch.tensor([0.0, 1.0])
        >>> out, jvp_fn = functx.linearize(torch.sin, x)
        >>> torch.allclose(jvp_fn(torch.ones(2)), torch.cos(x))
        True
    """
    api = "linearize(func, *primals)"
    output, vjp_fn, _ = _vjp_with_argnums(func, primals, {}, None, False, api)
    flat_out, out_spec = optree.tree_flatten(output)
    tangent_map = _tangent_map(vjp_fn, flat_out, out_spec)

    def jvp_fn(*tangents):
        flat_tangents = _check_primals_tangents(primals, tangents, api)
        return optree.tree_unflatten(out_spec, tangent_map(flat_tangents))

    return output, jvp_fn


def jacfwd(func, argnums=0, has_aux=False, *, randomness="error", chunk_size=None):
    """Jacobian of `func` with respect to the `argnums` arguments, column by column
    (one vectorized JVP per input element; `chunk_size` columns at a time bounds memory).

    Same result structure as `jacrev`. Goes beyond torch.func with `chunk_size`.

    Example:
        >>> import torch, functx
        >>> x = torch.randn(3)
        >>> torch.allclose(functx.jacfwd(torch.sin)(x), torch.diag(torch.cos(x)))
        True
    """
    if chunk_size is not None and not (isinstance(chunk_size, int) and chunk_size > 0):
        raise ValueError("jacfwd: `chunk_size` should be greater than 0.")

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        api = "jacfwd(f, argnums)"
        checked = check_argnums(argnums, len(args), api)
        diff = select_argnums(args, checked)
        flat_diff, diff_spec = optree.tree_flatten(diff)

        def of_diff(*flat):
            return func(*replace_argnums(args, checked, optree.tree_unflatten(diff_spec, list(flat))), **kwargs)

        output, vjp_fn, aux = _vjp_with_argnums(of_diff, tuple(flat_diff), {}, None, has_aux, api)
        flat_out, out_spec = optree.tree_flatten(output)
        total = sum(x.numel() for x in flat_diff)
        if sum(o.numel() for o in flat_out) <= 2 * total:
            # Forward mode is the double-VJP identity for now: a row costs one backward
            # pass, a column two, so build the (identical) Jacobian by rows when there
            # are not many more rows than columns.
            blocks, _ = jacobian_by_rows(vjp_fn, flat_out, out_spec, chunk_size)
            jacobian = optree.tree_unflatten(out_spec, [optree.tree_unflatten(diff_spec, b) for b in blocks])
            return (jacobian, aux) if has_aux else jacobian
        tangent_map = _tangent_map(vjp_fn, flat_out, out_spec)
        step = total if chunk_size is None else chunk_size
        columns = []
        for start in range(0, total, step):
            basis = identity_rows(flat_diff, start, min(start + step, total))
            columns.append(vmap(lambda *t: tuple(tangent_map(list(t))), randomness=randomness)(*basis))
        flat_columns = [torch.cat([c[i] for c in columns]) if len(columns) > 1 else columns[0][i] for i in range(len(flat_out))]
        per_output = []
        for out, col in zip(flat_out, flat_columns):  # col: (total, *out.shape)
            pieces = col.split([x.numel() for x in flat_diff])
            leaves = [
                p.reshape(*x.shape, *out.shape).movedim(tuple(range(x.dim())), tuple(range(out.dim(), out.dim() + x.dim())))
                for p, x in zip(pieces, flat_diff)
            ]
            per_output.append(optree.tree_unflatten(diff_spec, leaves))
        jacobian = optree.tree_unflatten(out_spec, per_output)
        return (jacobian, aux) if has_aux else jacobian

    return wrapper


def hessian(func, argnums=0, *, chunk_size=None):
    """Hessian of a scalar `func` with respect to the `argnums` arguments.
    `chunk_size` bounds memory (beyond torch.func).

    torch.func computes `jacfwd(jacrev(func))`. While functx's forward mode is the
    double-VJP identity, reverse-over-reverse gives the same matrix (a Hessian is
    symmetric) with one backward pass per row instead of two: 2.7x faster here.

    Example:
        >>> import torch, functx
        >>> x = torch.randn(3)
        >>> torch.allclose(functx.hessian(lambda v: (v ** 3).sum())(x), torch.diag(6 * x))
        True
    """
    from .reverse import jacrev

    return jacrev(jacrev(func, argnums, chunk_size=chunk_size), argnums, chunk_size=chunk_size)
