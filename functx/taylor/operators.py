"""Differential operators by collapsed Taylor mode: `laplacian`, `weighted_laplacian`,
`bilaplacian`, exact or stochastic (STDE: Shi et al., NeurIPS 2024).

Each is a weighted sum over directions v_r of the top Taylor coefficient of f along
`x + v_r t` (`sum_r w_r D^K f(x)[v_r, ..., v_r]`), computed in one pass of a collapsed jet
(taylor/collapse.py) under a vmap over the directions:

| operator | K | directions | weights |
|---|---|---|---|
| Laplacian | 2 | the basis e_i | 1 |
| weighted Laplacian tr(s s^T H) | 2 | the columns of s | 1 |
| bi-Laplacian | 4 | e_i, and e_i + e_j, e_i - e_j (i < j) | 1 - (D-1)/3, and 1/6 |
| stochastic Laplacian | 2 | S Rademacher or Gaussian v (E[v v^T] = I), or S basis vectors | 1/S, or D/S |
| stochastic bi-Laplacian | 4 | S Gaussian v | 1/(3S) (E[D^4 f[v^4]] = 3 Laplacian^2 f) |

(The bi-Laplacian's weights: D^4 f[e_i^2 e_j^2] = (D^4 f[(e_i+e_j)^4] + D^4 f[(e_i-e_j)^4]
- 2 D^4 f[e_i^4] - 2 D^4 f[e_j^4]) / 12 by polarization.)
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Union

import torch

from ..core.interpreter import functx_code, interpreting, top_interpreter
from ..vmap.api import vmap
from . import rules  # noqa: F401  (fills JET_RULES)
from .collapse import Collapse
from .level import JetLevel

_DISTRIBUTIONS = ("rademacher", "gaussian", "sparse")


def _check_argument(x, argnums, name):
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(
            f"functx.{name}: the argument at argnums={argnums} must be a floating-point tensor; got "
            f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}."
        )


def _collapsed_taylor(func, args, argnums, directions, weights, order):
    """`(f(x), first coefficients per direction (R, *out), sum_r w_r D^K f[v_r^K])` of
    `func(*args)` in argument `argnums` along `x + v_r t` (`directions`: (R, *x.shape))."""
    x = args[argnums]
    count = directions.shape[0]

    def along(v):
        collapse = Collapse(top_interpreter(), count, weights)
        with interpreting(JetLevel(order, collapse)) as level:
            with functx_code():
                moved = list(args)
                moved[argnums] = level.wrap(x, [v] + [None] * (order - 1))
            out = func(*moved)
            with functx_code():
                if not isinstance(out, torch.Tensor):
                    raise TypeError(f"functx: the function must return a tensor; it returned a {type(out).__name__}.")
                if not level.is_jet(out):
                    zero = torch.zeros_like(out)
                    return out, zero, zero
                primal, coefficients = level.unwrap(out)
                first = torch.zeros_like(primal) if coefficients[0] is None else coefficients[0]
                top = torch.zeros_like(primal) if coefficients[-1] is None else coefficients[-1]
                return primal, first, top

    value, first, top = vmap(along, out_dims=(None, 0, None))(directions)
    return value, first, top * math.factorial(order)


def _basis(x) -> torch.Tensor:
    n = x.numel()
    return torch.eye(n, dtype=x.dtype, device=x.device).reshape((n,) + tuple(x.shape))


def _gradient_from_basis(first, value, x):
    """The first coefficients along the basis, as the gradient (Jacobian: out.shape + x.shape)."""
    n = x.numel()
    return first[:n].movedim(0, -1).reshape(tuple(value.shape) + tuple(x.shape))


def _random_directions(x, samples, distribution, generator, name):
    """S random directions shaped like `x` and their weights. Drawn as part of the operator,
    not as the user's random call: once per call, shared by every element of an enclosing
    vmap (as a tensor drawn before it would be), whatever its `randomness`."""
    with functx_code():  # (vmap's randomness handlers see users' torch calls, not these)
        return _draw(x, samples, distribution, generator, name)


def _draw(x, samples, distribution, generator, name):
    if not isinstance(samples, int) or samples < 1:
        raise ValueError(f"functx.{name}: samples must be a positive int (the number of random directions); got {samples!r}.")
    if distribution not in _DISTRIBUTIONS:
        raise ValueError(f"functx.{name}: distribution must be one of {_DISTRIBUTIONS}; got {distribution!r}.")
    shape = (samples,) + tuple(x.shape)
    n = x.numel()
    if distribution == "rademacher":
        draws = torch.randint(0, 2, shape, generator=generator, device=x.device).to(x.dtype) * 2 - 1
        return draws, torch.full((samples,), 1.0 / samples, dtype=x.dtype, device=x.device)
    if distribution == "gaussian":
        draws = torch.randn(shape, generator=generator, dtype=x.dtype, device=x.device)
        return draws, torch.full((samples,), 1.0 / samples, dtype=x.dtype, device=x.device)
    if samples > n:
        raise ValueError(f"functx.{name}: distribution='sparse' draws basis vectors without replacement: samples must be <= {n}.")
    chosen = torch.randperm(n, generator=generator, device=x.device)[:samples]
    return _basis(x)[chosen], torch.full((samples,), n / samples, dtype=x.dtype, device=x.device)


def laplacian(
    func: Callable,
    argnums: int = 0,
    *,
    value_and_grad: bool = False,
    samples: Optional[int] = None,
    distribution: str = "rademacher",
    generator: Optional[torch.Generator] = None,
) -> Callable:
    """The Laplacian `sum_i d^2 f / dx_i^2` of `func` in argument `argnums`, by collapsed
    Taylor mode: one forward pass that carries the first Taylor coefficient per direction
    and the sum of the second ones (no Hessian, no backward pass; time linear in the input
    size, against D Hessian-vector products for `trace(hessian)`).

    Args:
        func (Callable): a function of tensors returning a tensor (the Laplacian of each
            element).
        argnums (int, default 0): the argument to differentiate in (the others are
            constants).
        value_and_grad (bool, default False): also return `func`'s value and its gradient
            (Jacobian: the output's shape then the argument's), from the same pass (exact
            Laplacian only).
        samples (int | None, default None): None for the exact Laplacian; an int S for the
            stochastic Taylor derivative estimator (STDE) over S random directions:
            unbiased, exact in expectation.
        distribution (str, default "rademacher"): the random directions: "rademacher" (±1
            entries) or "gaussian" (E[v v^T] = I, weight 1/S), or "sparse" (S distinct
            basis vectors, weight D/S).
        generator (torch.Generator | None, default None): the generator the directions are
            drawn from (default: torch's). They are drawn once per call: under `vmap`,
            every element shares them.

    Returns:
        Callable: a function taking `func`'s arguments and returning the Laplacian (shaped
        like `func`'s output), or `(laplacian, value, gradient)` with `value_and_grad=True`.

    Raises:
        TypeError: `argnums` is not an int, the argument is not a floating tensor, or
            `func` does not return a tensor.
        ValueError: bad `samples` or `distribution`, or `value_and_grad` with `samples`
            ([error catalogue: Taylor mode](../errors.md#taylor-mode-jet-laplacian-weighted_laplacian-bilaplacian)).

    Examples:

        >>> import torch, functx
        >>> f = lambda x: (x ** 3).sum() + x[0] * x[1]
        >>> x = torch.tensor([1.0, 2.0, 3.0])
        >>> functx.laplacian(f)(x)   # 6 (x0 + x1 + x2)
        tensor(36.)
        >>> lap, value, grad = functx.laplacian(f, value_and_grad=True)(x)
        >>> value.item(), grad.tolist()
        (38.0, [5.0, 13.0, 27.0])
        >>> g = lambda x: (x ** 3).sum()   # a diagonal Hessian: Rademacher's estimate is exact
        >>> functx.laplacian(g, samples=2, generator=torch.Generator().manual_seed(0))(x)
        tensor(36.)

    Differences from torch.func:
        torch.func has no Laplacian; its route is `torch.func.hessian` and a trace (D
        Hessian-vector products), which this beats 2.1x at D = 50 with 4.8x less memory
        (benchmarks/HISTORY.md, issue 31).
    """
    return _operator(func, argnums, value_and_grad, samples, distribution, generator, "laplacian", None)


def weighted_laplacian(
    func: Callable,
    sigma: Union[torch.Tensor, Callable],
    argnums: int = 0,
    *,
    samples: Optional[int] = None,
    distribution: str = "rademacher",
    generator: Optional[torch.Generator] = None,
) -> Callable:
    """`trace(sigma sigma^T H)` of `func` in argument `argnums` (H its Hessian): the
    diffusion term of a Kolmogorov / Fokker-Planck operator, by collapsed Taylor mode along
    the columns of `sigma` (or, with `samples`, along `sigma v` for S random v).

    Args:
        func (Callable): a function of tensors returning a tensor.
        sigma (Tensor | Callable): a (D, R) tensor (D the argument's number of elements),
            or a function of the argument returning one (a state-dependent diffusion).
        argnums (int, default 0): the argument to differentiate in, as `functx.laplacian`'s.
        samples (int | None, default None): None for the exact operator (the R columns of
            `sigma`); an int S for the estimator along `sigma v` for S random v.
        distribution (str, default "rademacher"): the random v, as `functx.laplacian`'s.
        generator (torch.Generator | None, default None): the generator of the random v.

    Returns:
        Callable: a function taking `func`'s arguments and returning
        `trace(sigma sigma^T H)`, shaped like `func`'s output.

    Raises:
        ValueError: `sigma` is not (D, R) for the argument's D elements; bad `samples`
            ([error catalogue: Taylor mode](../errors.md#taylor-mode-jet-laplacian-weighted_laplacian-bilaplacian)).
        TypeError: as `functx.laplacian`.

    Examples:

        >>> import torch, functx
        >>> f = lambda x: x[0] ** 2 * x[1]
        >>> sigma = torch.tensor([[1.0, 0.0], [1.0, 1.0]])   # H = [[2 x1, 2 x0], [2 x0, 0]]
        >>> functx.weighted_laplacian(f, sigma)(torch.tensor([1.0, 2.0]))   # 2 x1 + 4 x0
        tensor(8.)

        A state-dependent diffusion, and `sigma = I` giving the Laplacian:

        >>> x = torch.tensor([1.0, 2.0])
        >>> functx.weighted_laplacian(f, lambda x: torch.diag(x))(x)   # x0^2 H00 = 2 x0^2 x1
        tensor(4.)
        >>> torch.allclose(functx.weighted_laplacian(f, torch.eye(2))(x), functx.laplacian(f)(x))
        True

    Differences from torch.func:
        torch.func has no weighted Laplacian; its route is the Hessian and a weighted trace.
    """
    return _operator(func, argnums, False, samples, distribution, generator, "weighted_laplacian", sigma)


def bilaplacian(
    func: Callable,
    argnums: int = 0,
    *,
    value_and_grad: bool = False,
    samples: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
) -> Callable:
    """The bi-Laplacian `sum_ij d^4 f / dx_i^2 dx_j^2` of `func` in argument `argnums`, by
    collapsed Taylor mode of order 4 along D^2 directions (e_i, e_i ± e_j), or, with
    `samples`, the unbiased estimate from S Gaussian directions (E[D^4 f[v^4]] / 3).

    Args:
        func (Callable): a function of tensors returning a tensor.
        argnums (int, default 0): the argument to differentiate in.
        value_and_grad (bool, default False): also return the value and the gradient from
            the same pass (exact bi-Laplacian only).
        samples (int | None, default None): None for the exact bi-Laplacian; an int S for
            the Gaussian estimator.
        generator (torch.Generator | None, default None): the generator of the Gaussian
            directions.

    Returns:
        Callable: a function returning the bi-Laplacian (shaped like `func`'s output), or
        `(bilaplacian, value, gradient)` with `value_and_grad=True`.

    Raises:
        TypeError, ValueError: as `functx.laplacian`
            ([error catalogue: Taylor mode](../errors.md#taylor-mode-jet-laplacian-weighted_laplacian-bilaplacian)).

    Examples:

        >>> import torch, functx
        >>> f = lambda x: (x[0] * x[1]) ** 2 + x[2] ** 4
        >>> functx.bilaplacian(f)(torch.tensor([1.0, 2.0, 3.0]))   # 2 * 4 + 24
        tensor(32.)
        >>> g = lambda x: (x ** 4).sum()   # the Laplacian of the Laplacian: 24 per element
        >>> functx.bilaplacian(g)(torch.ones(3)), functx.laplacian(functx.laplacian(g))(torch.ones(3))
        (tensor(72.), tensor(72.))

    Differences from torch.func:
        torch.func has no bi-Laplacian; its route nests Hessians (fourth derivatives, D^2
        Hessians of Hessian-vector products).
    """
    return _operator(func, argnums, value_and_grad, samples, "gaussian", generator, "bilaplacian", None)


def _bilaplacian_directions(x):
    n = x.numel()
    basis = _basis(x)
    if n == 1:
        return basis, torch.ones(1, dtype=x.dtype, device=x.device)
    i, j = torch.triu_indices(n, n, offset=1, device=x.device)
    directions = torch.cat([basis, basis[i] + basis[j], basis[i] - basis[j]])
    weights = torch.cat(
        [
            torch.full((n,), 1 - (n - 1) / 3, dtype=x.dtype, device=x.device),
            torch.full((2 * i.numel(),), 1 / 6, dtype=x.dtype, device=x.device),
        ]
    )
    return directions, weights


def _operator(func, argnums, value_and_grad, samples, distribution, generator, name, sigma):
    if value_and_grad and samples is not None:
        raise ValueError(
            f"functx.{name}: value_and_grad needs the exact operator (its directions include the "
            f"basis); random directions give no gradient. Use functx.grad for it."
        )

    def operator(*args):
        if not isinstance(argnums, int):
            raise TypeError(f"functx.{name}: argnums must be an int (the argument the operator differentiates); got {argnums!r}.")
        if not -len(args) <= argnums < len(args):
            raise ValueError(f"functx.{name}: argnums={argnums} but the function was given {len(args)} arguments.")
        x = args[argnums]
        _check_argument(x, argnums, name)
        index = argnums % len(args)
        order = 4 if name == "bilaplacian" else 2
        if sigma is not None:
            matrix = sigma(x) if callable(sigma) else sigma
            if matrix.dim() != 2 or matrix.shape[0] != x.numel():
                raise ValueError(
                    f"functx.weighted_laplacian: sigma must be a (D, R) matrix with D = {x.numel()} "
                    f"(the argument's elements); got shape {tuple(matrix.shape)}."
                )
            if samples is None:
                directions, weights = matrix.T.reshape((matrix.shape[1],) + tuple(x.shape)), None
            else:
                draws, weights = _random_directions(matrix.new_zeros(matrix.shape[1]), samples, distribution, generator, name)
                directions = (draws @ matrix.T).reshape((samples,) + tuple(x.shape))
        elif name == "bilaplacian":
            if samples is None:
                directions, weights = _bilaplacian_directions(x)
            else:
                directions, weights = _random_directions(x, samples, "gaussian", generator, name)
                weights = weights / 3
        elif samples is None:
            directions, weights = _basis(x), None
        else:
            directions, weights = _random_directions(x, samples, distribution, generator, name)
        value, first, result = _collapsed_taylor(func, args, index, directions, weights, order)
        if value_and_grad:
            return result, value, _gradient_from_basis(first, value, x)
        return result

    return operator
