"""Levels opened inside a jvp level on values (core/dual_values.py): the outer tangents flow
through the values, never through the inner levels' wrappers. Each case against torch.func
and central finite differences of the same composition (float64)."""

from __future__ import annotations

import pytest
import torch
import torch.func as tf

import functx
from functx.ad.direct_forward import DirectJvpLevel
from functx.core.interpreter import current_stack
from tests.autograd_functions import Cube, NumpyTanh

D = torch.float64
EPS = 1e-6


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, dtype=D, generator=g) for _ in range(3)] + [torch.randn(2, 3, dtype=D, generator=g)]


def _mixed(y, x):
    return y * (1 + 0.5 * torch.sin(x))


# name -> (L, x, t2, X) -> function of x; written once for functx and torch.func
CASES = {
    "vmap_stack": lambda L, t2, X: lambda x: L.vmap(lambda r: torch.stack([r * x, r]))(X),
    "vmap_of_jvp": lambda L, t2, X: lambda x: L.vmap(
        lambda r: torch.stack(L.jvp(lambda z: torch.sin(torch.sin(z)), (_mixed(r, x),), (t2,)))
    )(X),
    "jacrev_of_jvp_closing_over": lambda L, t2, X: lambda x: L.jacrev(
        lambda y: (lambda w: L.jvp(lambda z: z * w, (w,), (t2,))[1])(y * x)
    )(x),
    "jacfwd_of_jvp": lambda L, t2, X: lambda x: L.jacfwd(
        lambda y: torch.stack(L.jvp(lambda z: torch.sin(z) * y, (y,), (t2,)))
    )(x),
    "jacfwd_of_a_write": lambda L, t2, X: lambda x: L.jacfwd(lambda y: (lambda w: w.sin_())((y * 2).clone()))(x),
    "vmap_of_vjp": lambda L, t2, X: lambda x: L.vmap(lambda c: L.vjp(lambda z: torch.sin(z * x) * c, x)[1](t2)[0])(X),
    "vmap_of_grad": lambda L, t2, X: lambda x: L.vmap(lambda r: L.grad(lambda z: (torch.sin(z * x) * r).sum())(r))(X),
    "grad_of_jvp": lambda L, t2, X: lambda x: L.grad(lambda y: L.jvp(lambda z: torch.sin(z * y), (y,), (t2,))[1].sum())(x),
}


@pytest.mark.parametrize("name", list(CASES))
def test_jvp_on_values_over_inner_levels(name):
    x, t, t2, X = _data()
    ours, theirs = CASES[name](functx, t2, X), CASES[name](tf, t2, X)
    primal, tangent = functx.jvp(ours, (x,), (t,))
    torch.testing.assert_close(primal, theirs(x))
    torch.testing.assert_close(tangent, tf.jvp(theirs, (x,), (t,))[1])
    fd = (theirs(x + EPS * t) - theirs(x - EPS * t)) / (2 * EPS)
    torch.testing.assert_close(tangent, fd, rtol=1e-5, atol=1e-6)
    assert current_stack() == ()


def test_the_outer_jvp_is_on_values():
    """The cases above run under the strategy they test (choose.py)."""
    seen = []
    x, t, t2, X = _data()
    functx.jvp(lambda x: seen.append(current_stack()[0]) or x.sin(), (x,), (t,))
    assert type(seen[0]) is DirectJvpLevel and seen[0].dual_values


@pytest.mark.parametrize("function", [Cube, NumpyTanh])
@pytest.mark.parametrize("stack", ["jvp_vmap_jvp", "jvp_jacfwd", "jvp_jvp"])
def test_autograd_functions_inside_levels_over_values(function, stack):
    """An autograd.Function applied at a level opened inside a jvp on values (its rule makes
    the level's carriers itself: the levels' modes leave it alone): against the same ops
    written out (torch.func on the Functions themselves loses save_for_forward's tangent)."""
    x, t, t2, X = _data(1)
    f = (lambda y: Cube.apply(y, 0.5)) if function is Cube else NumpyTanh.apply
    g = (lambda y: y**3 * 0.5) if function is Cube else torch.tanh
    stacks = {
        "jvp_vmap_jvp": lambda L, f: lambda x: L.vmap(lambda r: L.jvp(f, (r * x,), (t2,))[1])(X),
        "jvp_jacfwd": lambda L, f: lambda x: L.jacfwd(f)(x),
        "jvp_jvp": lambda L, f: lambda x: L.jvp(f, (x,), (t2,))[1],
    }
    got = functx.jvp(stacks[stack](functx, f), (x,), (t,))[1]
    torch.testing.assert_close(got, tf.jvp(stacks[stack](tf, g), (x,), (t,))[1])
