"""`choose_level` (ad/choose.py): the AD level a transform call gets, from what it needs of
the level (`Needs`) and what lies around it. The table below is the spec in short (the
module docstring gives the reasons); every row runs the transform and checks the value too."""

import pytest
import torch

import functx
from functx.ad.choose import Needs
from functx.ad.direct_forward import DirectJvpLevel
from functx.ad.direct_reverse import DirectGradLevel
from functx.ad.wrapped_forward import WrappedJvpLevel
from functx.ad.wrapped_reverse import WrappedGradLevel
from functx.core.interpreter import current_stack

seen = []


def f(x):
    """sin(x).sum(), noting the innermost level it runs under."""
    seen.append(current_stack()[-1])
    return x.sin().sum()


def g(x):
    """sin(x) (a vector), noting the level."""
    seen.append(current_stack()[-1])
    return x.sin()


def _ones(x):
    return torch.ones_like(x)


x, xs = torch.randn(3, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64)
CASES = {
    "grad": (lambda: functx.grad(f)(x), lambda: x.cos(), DirectGradLevel, 0),
    "vmap(grad)": (lambda: functx.vmap(functx.grad(f))(xs), lambda: xs.cos(), DirectGradLevel, 1),
    "vmap(vmap(grad))": (lambda: functx.vmap(functx.vmap(functx.grad(f)))(xs[None]), lambda: xs.cos()[None], DirectGradLevel, 2),
    "vmap(jacrev)": (lambda: functx.vmap(functx.jacrev(g))(xs), lambda: torch.diag_embed(xs.cos()), DirectGradLevel, 1),
    # jacrev's rows would sit over two physical batch dims
    "vmap(vmap(jacrev))": (lambda: functx.vmap(functx.vmap(functx.jacrev(g)))(xs[None]), lambda: torch.diag_embed(xs.cos())[None], WrappedGradLevel, None),
    "vjp": (lambda: functx.vjp(g, x)[1](_ones(x))[0], lambda: x.cos(), DirectGradLevel, 0),
    # the user's vjp_fn may be called later under any levels: batched inputs wrap
    "vmap(vjp)": (lambda: functx.vmap(lambda x: functx.vjp(g, x)[1](_ones(x))[0])(xs), lambda: xs.cos(), WrappedGradLevel, None),
    # shared primals inside vmap: recorded on the values
    "vmap(vjp of a shared x)": (lambda: functx.vmap(lambda t: functx.vjp(g, x)[1](t)[0])(xs), lambda: xs * x.cos(), DirectGradLevel, 0),
    "jvp": (lambda: functx.jvp(g, (x,), (_ones(x),))[1], lambda: x.cos(), DirectJvpLevel, 0),
    "vmap(jvp)": (lambda: functx.vmap(lambda x: functx.jvp(g, (x,), (_ones(x),))[1])(xs), lambda: xs.cos(), DirectJvpLevel, 1),
    # the columns would recompute the primal on the physical tensors
    "jacfwd": (lambda: functx.jacfwd(g)(x), lambda: torch.diag(x.cos()), WrappedJvpLevel, None),
    "hessian": (lambda: functx.hessian(f)(x), lambda: torch.diag(-x.sin()), DirectGradLevel, 0),
    # a jvp inside an AD level wraps
    "grad(jvp)": (
        lambda: functx.grad(lambda x: functx.jvp(f, (x,), (_ones(x),))[1])(x),
        lambda: -x.sin(),
        WrappedJvpLevel,
        None,
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_the_level_each_transform_call_gets(name):
    run, expected, kind, vmap_levels = CASES[name]
    seen.clear()
    torch.testing.assert_close(run(), expected())
    innermost = seen[-1]
    assert type(innermost) is kind
    if vmap_levels is not None:
        assert len(innermost.vmap_levels) == vmap_levels
    assert current_stack() == ()


@pytest.mark.parametrize(
    "fields", [{}, {"pullback": "once", "tangents": "given"}, {"pullback": "twice"}, {"tangents": "rows"}]
)
def test_needs_must_name_one_way_and_a_known_use(fields):
    with pytest.raises(ValueError, match="give one of pullback"):
        Needs(**fields)
