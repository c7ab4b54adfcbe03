"""Writes of a differentiated value, through a view, into a tensor a level does not own.

Inside `jacfwd(vmap(f))`, `h = x.clone()` of an input the jvp level does not differentiate is
a tensor of the vmap level over a plain value: the jvp level never saw it. `h[0] = y[0]` then
writes a tangent into it, and `promote_for_write` (core/level_tensor.py) lifts the value into
the jvp level first. The written tensor is a *view* (`h[0]`); lifting the view alone gave it
a wrapper of its own, and the tangent stayed there: the Jacobian came out zero where it has
ones (issue 26, item 4). The base is lifted now, and every view of it made before the write
(`v = h[:2]`, or the view a decomposition such as `repeat`'s returns) gets the same view of
the lifted value when next used (`refresh_views`).

Reference: the per-sample loop under plain `torch.autograd.functional.jacobian`, float64.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functx
from functx.core import current_stack

D = torch.float64


def _loop_jacobian(f, x, y, x_dim, y_dim, out_dim):
    """d/dy of `stack([f(x_i, y_i)], out_dim)`, by plain autograd over the per-sample loop."""

    def looped(y):
        n = x.shape[x_dim]
        return torch.stack([f(x.select(x_dim, i), y.select(y_dim, i)) for i in range(n)], out_dim)

    return torch.autograd.functional.jacobian(looped, y)


def test_issue_example_jacfwd_of_vmap_of_an_indexed_write():
    """The issue's program: a repeated reduction of x, cloned, its last column set to y[0]."""

    def f(x, y):
        h = x.amax()
        h = h.masked_fill(h.abs() < 0.3, 0.0)
        h = h.clone()
        h.unsqueeze_(0)
        h = h.repeat(2, 1)
        h = h.clone()
        h[..., 0] = y[0]
        return h

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(3, 1, 3, dtype=D, generator=g), torch.randn(3, 3, dtype=D, generator=g)
    actual = functx.jacfwd(functx.vmap(f, in_dims=(-3, -2), out_dims=2), argnums=1)(x, y)
    expected = _loop_jacobian(f, x, y, 0, 0, 2)
    assert expected.abs().sum() > 0  # ones where h[..., 0] is y[0]
    torch.testing.assert_close(actual, expected)


MAKERS = {  # the written tensor, made from x (not differentiated)
    "clone": lambda x: x.clone(),
    "clone of a slice": lambda x: x[:2].clone(),
    "product": lambda x: x * 2.0,
    "repeat": lambda x: x.sum().unsqueeze(0).repeat(3),  # its decomposition returns a view
    "expand clone": lambda x: x.sum().expand(3).clone(),
    "stack": lambda x: torch.stack([x.sum(), x.amax(), x.amin()]),
    "zeros_like": lambda x: torch.zeros_like(x),
}

WRITES = {  # the view written through
    "[0]": lambda h, v: h.__setitem__(0, v),
    "[..., 0]": lambda h, v: h.__setitem__((..., 0), v),
    "[1:2]": lambda h, v: h[1:2].copy_(v.expand(1)),
    "select add_": lambda h, v: h.select(0, 0).add_(v),
}

VIEWS_BEFORE = {  # a view of the tensor taken before the write and returned after it
    "none": None,
    "[:]": lambda h: h[:],
    "[:2]": lambda h: h[:2],
    "view(-1)": lambda h: h.view(-1),
}

TRANSFORMS = {
    "jacfwd(vmap)": lambda f: functx.jacfwd(functx.vmap(f, in_dims=(0, 1)), argnums=1),
    "jacrev(vmap)": lambda f: functx.jacrev(functx.vmap(f, in_dims=(0, 1)), argnums=1),
    "jacfwd(vmap(vmap))": lambda f: functx.jacfwd(
        functx.vmap(lambda x, y: functx.vmap(f)(x.expand(2, *x.shape), y.expand(2, *y.shape)).sum(0), in_dims=(0, 1)),
        argnums=1,
    ),
}


def _program(make, write, view_before):
    def f(x, y):
        h = make(x)
        v = view_before(h) if view_before is not None else None
        write(h, y[0] * y[1])
        return (h if v is None else v) * 1.5

    return f


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(
    make=st.sampled_from(sorted(MAKERS)),
    write=st.sampled_from(sorted(WRITES)),
    view=st.sampled_from(sorted(VIEWS_BEFORE)),
    transform=st.sampled_from(sorted(TRANSFORMS)),
)
def test_writes_through_views_into_a_tensor_of_an_undifferentiated_input(make, write, view, transform):
    """Random (maker, write, earlier view, transform) against the per-sample loop."""
    f = _program(MAKERS[make], WRITES[write], VIEWS_BEFORE[view])
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 3, dtype=D, generator=g), torch.randn(3, 4, dtype=D, generator=g)
    if transform == "jacfwd(vmap(vmap))":
        # the inner vmap runs each sample twice (expanded inputs) and sums: doubled
        expected = 2 * _loop_jacobian(f, x, y, 0, 1, 0)
    else:
        expected = _loop_jacobian(f, x, y, 0, 1, 0)
    actual = TRANSFORMS[transform](f)(x, y)
    assert current_stack() == ()
    torch.testing.assert_close(actual, expected)


@pytest.mark.parametrize("transform", ["jacfwd", "jacrev"])
def test_a_view_taken_before_the_write_sees_it(transform):
    """`v = h[:2]` before `h[0] = y[0]`: v's derivative includes the write (a view made
    before the lift is refreshed when used)."""

    def f(x, y):
        h = x.clone()
        v = h[:2]
        h[0] = y[0]
        return v * 1.0

    x, y = torch.randn(3, 3, dtype=D), torch.randn(3, 3, dtype=D)
    jac = getattr(functx, transform)(functx.vmap(f, in_dims=(0, 1)), argnums=1)(x, y)
    torch.testing.assert_close(jac, _loop_jacobian(f, x, y, 0, 1, 0))
    assert jac.abs().sum() == 3  # one per sample: d v[0] / d y[0]
