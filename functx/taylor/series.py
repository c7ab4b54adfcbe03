"""Arithmetic on truncated Taylor series: the recurrences every jet rule is built from.

A series here is a list `[x0, x1, ..., xK]` of *normalized* Taylor coefficients of a path
`x(t) = x0 + x1 t + x2 t^2 + ... + xK t^K` (the k-th derivative divided by k!: products of
series are then plain Cauchy products). `None` stands for a zero coefficient (most inputs
of a Laplacian have `x2 = 0`; a constant has nothing but `x0`), and no rule computes with
it. The public `functx.jet` takes and returns derivative coefficients (JAX's convention);
the level converts at its boundary (`to_normalized`, `to_derivatives`).

Every function computes with the tensors it is given, in torch ops: inside a jet rule those
are the values one level down, so the ops dispatch through the lower levels (a vmap below,
torch's autograd recording for a `grad` around the jet).

The recurrences (Griewank and Walther, *Evaluating Derivatives*, ch. 13): for `y = f(x)`
with `y' = g(x) x'`, `k y_k = sum_{j=1..k} j x_j g_{k-j}` (`integral`), where `g`'s series
is known to order k-1 before `y_k` is needed (exp: g = y; tanh: g = 1 - y^2; log: g = 1/x).

    >>> import torch
    >>> x = [torch.tensor(0.5), torch.tensor(1.0), None]   # x(t) = 0.5 + t
    >>> [round(c.item(), 4) for c in exp(x)]                # exp(0.5) (1, 1, 1/2)
    [1.6487, 1.6487, 0.8244]
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch

Series = list  # [x0, x1, ..., xK], tensors or None (zero) from x1 on


def order(series: Sequence) -> int:
    return len(series) - 1


def to_normalized(derivatives: Sequence) -> list:
    """Derivative coefficients (x^(k)) to normalized ones (x^(k) / k!)."""
    return [None if d is None else (d if k < 2 else d / math.factorial(k)) for k, d in enumerate(derivatives)]


def to_derivatives(normalized: Sequence) -> list:
    """Normalized coefficients back to derivative coefficients."""
    return [None if c is None else (c if k < 2 else c * math.factorial(k)) for k, c in enumerate(normalized)]


def add_terms(terms) -> Optional[torch.Tensor]:
    """The sum of the terms that are not None (None when all are)."""
    total = None
    for term in terms:
        if term is not None:
            total = term if total is None else total + term
    return total


def scaled(term, factor) -> Optional[torch.Tensor]:
    return None if term is None else term * factor


def cauchy(a: Sequence, b: Sequence, k: int, product: Callable = torch.mul, start: int = 0) -> Optional[torch.Tensor]:
    """`sum_{i=start..k-start} product(a_i, b_{k-i})`, skipping zero coefficients."""
    return add_terms(
        product(a[i], b[k - i]) for i in range(start, k - start + 1) if a[i] is not None and b[k - i] is not None
    )


def product(a: Sequence, b: Sequence, op: Callable = torch.mul) -> list:
    """The series of `op(a(t), b(t))` for an `op` bilinear in its two arguments."""
    return [cauchy(a, b, k, op) for k in range(len(a))]


def quotient(a: Sequence, b: Sequence) -> list:
    """The series of `a(t) / b(t)`: `c_k = (a_k - sum_{j=1..k} b_j c_{k-j}) / b_0`."""
    c = [a[0] / b[0]]
    for k in range(1, len(a)):
        rest = add_terms(b[j] * c[k - j] for j in range(1, k + 1) if b[j] is not None and c[k - j] is not None)
        numerator = a[k] if rest is None else (-rest if a[k] is None else a[k] - rest)
        c.append(None if numerator is None else numerator / b[0])
    return c


def _integral_term(x: Sequence, g: Sequence, k: int) -> Optional[torch.Tensor]:
    """`y_k` of `y' = g x'`: `(1/k) sum_{j=1..k} j x_j g_{k-j}`."""
    total = add_terms(
        x[j] * g[k - j] * (j / k) if j != k else x[j] * g[0]
        for j in range(1, k + 1)
        if x[j] is not None and g[k - j] is not None
    )
    return total


def integral(y0: torch.Tensor, x: Sequence, g: Sequence) -> list:
    """The series of `y` with `y(0) = y0` and `y' = g(x) x'`, `g`'s series given in full."""
    return [y0] + [_integral_term(x, g, k) for k in range(1, len(x))]


def integral_of_self(y0: torch.Tensor, x: Sequence, g_of: Callable[[list, int], Optional[torch.Tensor]]) -> list:
    """As `integral`, where `g` depends on `y` itself: `g_of(y, m)` is `g_m` from `y_0..y_m`
    (exp: `g = y`; tanh: `g = 1 - y^2`), computed order by order."""
    y = [y0]
    g = [g_of(y, 0)]
    for k in range(1, len(x)):
        y.append(_integral_term(x, g, k))
        if k < len(x) - 1:
            g.append(g_of(y, k))
    return y


def square_term(y: Sequence, m: int) -> Optional[torch.Tensor]:
    """The m-th coefficient of `y(t)^2`."""
    return cauchy(y, y, m)


def exp(x: Sequence) -> list:
    return integral_of_self(torch.exp(x[0]), x, lambda y, m: y[m])


def expm1(x: Sequence) -> list:
    y0 = torch.expm1(x[0])
    return integral_of_self(y0, x, lambda y, m: y0 + 1 if m == 0 else y[m])


def power(x: Sequence, exponent: float) -> list:
    """`x(t) ** exponent` for a constant exponent: `x y' = r y x'`, so
    `y_k = 1/(k x0) sum_{j=1..k} ((r + 1) j - k) x_j y_{k-j}` (also sqrt, rsqrt, reciprocal)."""
    y = [torch.pow(x[0], exponent)]
    for k in range(1, len(x)):
        total = add_terms(
            x[j] * y[k - j] * (((exponent + 1) * j - k) / k)
            for j in range(1, k + 1)
            if x[j] is not None and y[k - j] is not None
        )
        y.append(None if total is None else total / x[0])
    return y


def integer_power(x: Sequence, exponent: int) -> list:
    """`x(t) ** n` for a natural n by repeated products (right where x0 = 0, unlike `power`)."""
    result = None
    base = list(x)
    n = exponent
    while n:
        if n & 1:
            result = base if result is None else product(result, base)
        n >>= 1
        if n:
            base = product(base, base)
    if result is None:
        return [torch.ones_like(x[0])] + [None] * order(x)
    return result


def reciprocal(x: Sequence) -> list:
    one = [torch.ones_like(x[0])] + [None] * order(x)
    return quotient(one, x)


def log(x: Sequence) -> list:
    return integral(torch.log(x[0]), x, reciprocal(x))


def sin_cos(x: Sequence) -> tuple[list, list]:
    """The series of sin(x(t)) and cos(x(t)) together: s' = c x', c' = -s x'."""
    s, c = [torch.sin(x[0])], [torch.cos(x[0])]
    for k in range(1, len(x)):
        s.append(_integral_term(x, c, k))
        minus = _integral_term(x, s[:k] + [None], k)
        c.append(None if minus is None else -minus)
    return s, c


def sinh_cosh(x: Sequence) -> tuple[list, list]:
    """sinh and cosh together: s' = c x', c' = s x'."""
    s, c = [torch.sinh(x[0])], [torch.cosh(x[0])]
    for k in range(1, len(x)):
        s.append(_integral_term(x, c, k))
        c.append(_integral_term(x, s[:k] + [None], k))
    return s, c


def tanh(x: Sequence) -> list:
    """y' = (1 - y^2) x'."""

    def g(y, m):
        square = square_term(y, m)
        if m == 0:
            return 1 - square
        return None if square is None else -square

    return integral_of_self(torch.tanh(x[0]), x, g)


def tan(x: Sequence) -> list:
    """y' = (1 + y^2) x'."""

    def g(y, m):
        square = square_term(y, m)
        return 1 + square if m == 0 else square

    return integral_of_self(torch.tan(x[0]), x, g)


def sigmoid(x: Sequence) -> list:
    """y' = (y - y^2) x'."""

    def g(y, m):
        square = square_term(y, m)
        if square is None:
            return y[m]
        return -square if y[m] is None else y[m] - square

    return integral_of_self(torch.sigmoid(x[0]), x, g)


def affine(x: Sequence, scale: float = 1.0, shift: float = 0.0) -> list:
    """`scale * x(t) + shift`."""
    return [x[0] * scale + shift] + [scaled(c, scale) for c in x[1:]]


def chain(y0: torch.Tensor, x: Sequence, derivative: Callable[[list], list]) -> list:
    """`y` with `y' = g(x) x'`, `g` a composition of the functions above of `x`'s series
    (`derivative(x)` is g's series): atan (1/(1+x^2)), asin ((1-x^2)^-1/2), erf, ..."""
    return integral(y0, x, derivative(list(x[:-1]) + [None]) if order(x) else [None])


def composed(x: Sequence, function: Callable[[list], list], summed: Optional[Callable] = None) -> list:
    """`function`'s series along `x`, by composing its derivatives at x0 with the path:
    `y_k = sum_{m=1..k} d_m [t^k] (x1 t + x2 t^2 + ...)^m`, `d_m = f^(m)(x0) / m!` (from
    `function` along `x0 + t`). The same numbers as `function(x)`; cheaper where the
    coefficients are much larger than the primal (one per direction under a vmap, as a
    collapsed Laplacian carries them): the recurrence then runs on the primal's size, and
    the coefficients meet only products and one multiplication by each d_m. With `summed`
    (a collapsed level's sum over directions) the top coefficient comes back summed, the sum
    taken before the multiplication by d_m (which is the same for every direction)."""
    k_max = order(x)
    d = function([x[0], torch.ones_like(x[0])] + [None] * (k_max - 1))
    y = [d[0]] + [None] * k_max
    shifted = [None] + list(x[1:])  # x(t) - x0
    power = shifted  # (x(t) - x0)^m, m = 1
    for m in range(1, k_max + 1):
        if m > 1:
            power = [None] * m + [cauchy(power, shifted, k) for k in range(m, k_max + 1)]
        for k in range(m, k_max + 1):
            if power[k] is not None and d[m] is not None:
                term = d[m] * (summed(power[k]) if summed is not None and k == k_max else power[k])
                y[k] = term if y[k] is None else y[k] + term
    return y


def erf(x: Sequence) -> list:
    scale = 2 / math.sqrt(math.pi)
    return chain(torch.erf(x[0]), x, lambda u: affine(exp(affine(integer_power(u, 2), -1.0)), scale))
