"""In-place pointwise ops that read their own target (`v.mul_(v)`, `v *= v`,
`v.addcmul_(v, v)`, `v.hypot_(v)`, through a view of it) under every AD transform
(ad/aliased_writes.py). Plain torch's forward AD and torch.func give wrong tangents there
(the formula reads the operand after the write) and torch's autograd refuses them; the
reference is the same program written out of place, differentiated by plain torch's autograd
(float64), checked once against central finite differences."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functx
from functx.ad.aliased_writes import function_twin, out_of_place_twin

D = torch.float64
aten = torch.ops.aten

# name: (in place, out of place)
WRITES = {
    "mul_": (lambda w: w.mul_(w), lambda w: w * w),
    "imul": (lambda w: w.__imul__(w), lambda w: w * w),
    "itruediv": (lambda w: w.__itruediv__(w.view_as(w)), lambda w: w / w),
    "div_exp": (lambda w: w.div_(w.exp()), lambda w: w / w.exp()),  # no alias: torch's own path
    "addcmul_": (lambda w: w.addcmul_(w, w), lambda w: w + w * w),
    "addcdiv_": (lambda w: w.addcdiv_(w, w + 3), lambda w: w + w / (w + 3)),
    "pow_": (lambda w: w.pow_(w), lambda w: w.pow(w)),
    "atan2_": (lambda w: w.atan2_(w * 0.5), lambda w: torch.atan2(w, w * 0.5)),
    "hypot_": (lambda w: w.hypot_(w), lambda w: torch.hypot(w, w)),
    # (an `end` computed from w, `w.sin()`, would save w for its own backward before the
    # write: torch's autograd refuses that whatever the write reads)
    "lerp_": (lambda w: w.lerp_(torch.ones_like(w), w), lambda w: w + w * (1 - w)),
    "mul_view": (lambda w: w.mul_(w.view_as(w)), lambda w: w * w),
    "mul_slice": (lambda w: w[1:].mul_(w[1:]), None),  # a write into part of w
}


def _program(name, in_place):
    write, pure = WRITES[name]

    def f(x):
        w = x * 1 + 3  # positive: pow_ of itself
        if in_place:
            write(w)
            return w.sin() * x
        if pure is None:  # mul_slice
            return torch.cat([w[:1], w[1:] * w[1:]]).sin() * x
        return pure(w).sin() * x

    return f


x0 = torch.linspace(-0.8, 0.9, 4, dtype=D)
t0 = torch.linspace(0.3, -0.5, 4, dtype=D)


def _jacobian(f, x):
    return torch.autograd.functional.jacobian(f, x)


def _hessian_of_sum(f, x):
    return torch.autograd.functional.hessian(lambda v: f(v).sum(), x)


TRANSFORMS = {
    "jvp": (lambda f, x: functx.jvp(f, (x,), (t0,))[1], lambda f, x: _jacobian(f, x) @ t0),
    "jacfwd": (lambda f, x: functx.jacfwd(f)(x), _jacobian),
    "jacrev": (lambda f, x: functx.jacrev(f)(x), _jacobian),
    "vjp": (lambda f, x: functx.vjp(f, x)[1](t0)[0], lambda f, x: t0 @ _jacobian(f, x)),
    "vmap(jvp)": (
        lambda f, x: functx.vmap(lambda v: functx.jvp(f, (v,), (t0,))[1])(torch.stack([x, x * 0.5])),
        lambda f, x: torch.stack([_jacobian(f, x) @ t0, _jacobian(f, x * 0.5) @ t0]),
    ),
    "vmap(vjp)": (  # a wrapped grad level
        lambda f, x: functx.vmap(lambda v: functx.vjp(f, v)[1](t0)[0])(torch.stack([x, x * 0.5])),
        lambda f, x: torch.stack([t0 @ _jacobian(f, x), t0 @ _jacobian(f, x * 0.5)]),
    ),
    "vmap(grad)": (  # a direct grad level on vmap's physical tensors
        lambda f, x: functx.vmap(functx.grad(lambda v: f(v).sum()))(torch.stack([x, x * 0.5])),
        lambda f, x: torch.stack([_jacobian(f, x).sum(0), _jacobian(f, x * 0.5).sum(0)]),
    ),
    "jvp(jvp)": (
        lambda f, x: functx.jvp(lambda v: functx.jvp(f, (v,), (t0,))[1].sum(), (x,), (t0.flip(0),))[1],
        lambda f, x: t0 @ _hessian_of_sum(f, x) @ t0.flip(0),
    ),
    "hessian": (lambda f, x: functx.hessian(lambda v: f(v).sum())(x), _hessian_of_sum),
    "jacfwd(jacfwd)": (lambda f, x: functx.jacfwd(functx.jacfwd(lambda v: f(v).sum()))(x), _hessian_of_sum),
    "jvp(grad)": (
        lambda f, x: functx.jvp(functx.grad(lambda v: f(v).sum()), (x,), (t0,))[1],
        lambda f, x: _hessian_of_sum(f, x) @ t0,
    ),
}


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(WRITES)), transform=st.sampled_from(sorted(TRANSFORMS)))
def test_a_write_that_reads_its_target_differentiates_as_written_out_of_place(name, transform):
    run, reference = TRANSFORMS[transform]
    got = run(_program(name, True), x0)
    torch.testing.assert_close(got, reference(_program(name, False), x0))


@pytest.mark.parametrize("name", sorted(WRITES))
def test_the_out_of_place_reference_is_the_finite_difference(name):
    f, h = _program(name, False), 1e-6
    fd = torch.stack([(f(x0 + h * e) - f(x0 - h * e)) / (2 * h) for e in torch.eye(4, dtype=D)], -1)
    torch.testing.assert_close(_jacobian(f, x0), fd, rtol=1e-6, atol=1e-6)
    # and the in-place program computes the same values
    torch.testing.assert_close(_program(name, True)(x0), f(x0))


def test_the_callers_tangent_is_left_as_it_was():
    t = t0.clone()
    functx.jvp(lambda v: functx.jvp(_program("mul_", True), (v,), (t,))[1], (x0,), (t0,))
    assert torch.equal(t, t0)


def test_twins():
    assert out_of_place_twin(aten.pow_.Tensor) is aten.pow.Tensor_Tensor
    assert out_of_place_twin(aten.mul_.Tensor) is aten.mul.Tensor
    assert out_of_place_twin(aten.index_add_.default) is None  # not pointwise
    assert function_twin(torch.Tensor.__imul__) is torch.Tensor.mul
    assert function_twin(torch.Tensor.index_add_) is None and function_twin(torch.Tensor.copy_) is None
