"""`functx.jet`: Taylor-mode automatic differentiation (JAX's `jax.experimental.jet`)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ..core import pytree
from ..core.errors import user_facing
from ..core.interpreter import functx_code, interpreting
from . import rules  # noqa: F401  (fills JET_RULES)
from .level import JetLevel
from .series import to_derivatives, to_normalized


@user_facing
def jet(fun: Callable, primals: Sequence, series: Sequence) -> tuple[Any, Any]:
    """Taylor-mode AD: the Taylor coefficients of `fun`'s output along a path through its input.

    The input path is `x(t) = x0 + x1 t + x2 t^2/2! + ... + xK t^K/K!`, given as `primals`
    (the x0 of each argument) and `series` (for each argument, the list `[x1, ..., xK]` of its
    derivative coefficients, shaped like it). Returns `(primals_out, series_out)`: `fun(x0)`,
    and for each output the list `[y1, ..., yK]` of the derivatives of `fun(x(t))` at t = 0 of
    orders 1..K, computed in one pass (each op's coefficients by its rule's recurrence:
    about K^2 work per op instead of nesting K forward passes). Semantics as JAX's
    `jax.experimental.jet.jet`; composes with `vmap` (batches of points or of directions),
    with `grad`/`vjp` and torch's autograd around it (train through a Laplacian), and with
    the other transforms inside it.

    Args:
        fun (Callable): a function of tensors (pytrees of them) returning tensors (pytrees
            of them).
        primals (Sequence): a tuple with one entry per positional argument of `fun`.
        series (Sequence): a tuple with one entry per primal: a list of K coefficients, each
            shaped like that primal (pytrees: like the primal's structure). All entries have
            the same K.

    Returns:
        tuple: `(primals_out, series_out)`: `fun(*primals)`, and the output's structure
        with a list of K tensors at each leaf (zeros where the output does not move along
        the path).

    Raises:
        TypeError: `primals` or `series` is not a tuple or list, or a leaf is not a floating
            tensor.
        ValueError: `primals` and `series` differ in length, the entries of `series` differ in
            K, or a coefficient's shape differs from its primal's.
        RuntimeError: `fun` writes in place into a tensor with values on the path
            ([error catalogue: Taylor mode](../errors.md#taylor-mode-jet-laplacian-weighted_laplacian-bilaplacian)).

    Examples:
        The derivatives of sin along x(t) = x + t are sin's derivatives at x:

        >>> import torch, functx
        >>> x = torch.tensor(0.5, dtype=torch.float64)
        >>> y, (y1, y2, y3) = functx.jet(torch.sin, (x,), ([torch.ones_like(x), torch.zeros_like(x), torch.zeros_like(x)],))
        >>> torch.allclose(torch.stack([y1, y2, y3]), torch.stack([x.cos(), -x.sin(), -x.cos()]))
        True

        A second coefficient of the input (a curved path) enters as the chain rule says:
        `d^2/dt^2 f(x(t)) = f''(x) x1^2 + f'(x) x2`.

        >>> f = lambda x: x ** 3
        >>> _, (y1, y2) = functx.jet(f, (torch.tensor(2.0),), ([torch.tensor(1.0), torch.tensor(3.0)],))
        >>> y1.item(), y2.item()   # 3 x^2 x1, 6 x x1^2 + 3 x^2 x2
        (12.0, 48.0)

    Differences from torch.func:
        torch.func has no Taylor mode; functx.jet has the semantics of JAX's
        `jax.experimental.jet.jet`, as an interpreter level that composes with functx's
        other transforms.
    """
    if not isinstance(primals, (tuple, list)) or not isinstance(series, (tuple, list)):
        raise TypeError(
            f"functx.jet: primals and series must be tuples (or lists), one entry per argument of "
            f"fun; got {type(primals).__name__} and {type(series).__name__}. For one argument "
            f"write jet(f, (x,), ([x1, x2],))."
        )
    if len(primals) != len(series):
        raise ValueError(
            f"functx.jet: primals has {len(primals)} entries and series {len(series)}; give one "
            f"list of coefficients per primal."
        )
    if not all(isinstance(terms, (tuple, list)) for terms in series):
        raise TypeError("functx.jet: each entry of series must be a list [x1, ..., xK] of coefficients.")
    orders = {len(terms) for terms in series}
    if len(orders) > 1:
        raise ValueError(
            f"functx.jet: the entries of series have different numbers of coefficients "
            f"({sorted(orders)}); give every argument the same order K (zeros where it does not move)."
        )
    order = orders.pop() if orders else 0
    flat_primals, primals_spec = pytree.tree_flatten(tuple(primals))
    flat_terms = [_terms_like(p, terms, i) for i, (p, terms) in enumerate(zip(primals, series))]
    flat_terms = [leaf_terms for per_primal in flat_terms for leaf_terms in per_primal]
    for leaf, terms in zip(flat_primals, flat_terms):
        _check_leaf(leaf, terms)

    level = JetLevel(order)
    with interpreting(level):
        with functx_code():
            inputs = [level.wrap(p, to_normalized([None, *terms])[1:]) for p, terms in zip(flat_primals, flat_terms)]
        out = fun(*pytree.tree_unflatten(primals_spec, inputs))
        with functx_code():
            flat_out, out_spec = pytree.tree_flatten(out)
            primals_out, series_out = [], []
            for leaf in flat_out:
                if not isinstance(leaf, torch.Tensor):
                    raise TypeError(
                        f"functx.jet: fun must return tensors (or pytrees of them); it returned a "
                        f"{type(leaf).__name__}."
                    )
                if level.is_jet(leaf):
                    primal, coefficients = level.unwrap(leaf)
                else:
                    primal, coefficients = leaf, [None] * order
                primals_out.append(primal)
                series_out.append(
                    [torch.zeros_like(primal) if c is None else c for c in to_derivatives([None, *coefficients])[1:]]
                )
    return pytree.tree_unflatten(out_spec, primals_out), pytree.tree_unflatten(out_spec, series_out)


def _terms_like(primal, terms, index) -> list:
    """The coefficients of each leaf of `primal`: a list per leaf."""
    leaves, spec = pytree.tree_flatten(primal)
    per_leaf: list[list] = [[] for _ in leaves]
    for k, term in enumerate(terms):
        term_leaves, term_spec = pytree.tree_flatten(term)
        if term_spec != spec:
            raise ValueError(
                f"functx.jet: coefficient {k + 1} of argument {index} has structure "
                f"{pytree.describe(term)}, but the primal has {pytree.describe(primal)}."
            )
        for leaf_terms, t in zip(per_leaf, term_leaves):
            leaf_terms.append(t)
    return per_leaf


def _check_leaf(primal, terms) -> None:
    if not isinstance(primal, torch.Tensor) or not (primal.is_floating_point() or primal.is_complex()):
        raise TypeError(
            f"functx.jet: every primal must be a floating-point tensor; got "
            f"{primal.dtype if isinstance(primal, torch.Tensor) else type(primal).__name__}."
        )
    for k, term in enumerate(terms, start=1):
        if not isinstance(term, torch.Tensor):
            raise TypeError(f"functx.jet: coefficient {k} is a {type(term).__name__}, not a tensor.")
        if term.shape != primal.shape:
            raise ValueError(
                f"functx.jet: coefficient {k} has shape {tuple(term.shape)} but its primal "
                f"{tuple(primal.shape)}; each coefficient is shaped like its primal."
            )
