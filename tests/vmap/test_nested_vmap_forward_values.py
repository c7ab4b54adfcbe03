"""Values of forward-mode AD and solves under two (or three) nested vmaps (issue 26, items 7
and 8), against float64 per-sample loops of plain torch: forward AD
(`torch.autograd.forward_ad`) for tangents, `torch.autograd.grad(create_graph=True)` for
Hessian-vector products. Both bugs returned wrong numbers without an error.

- Item 7: `linalg.lu_solve` under `vmap(vmap(jvp))` with an inner batch of size 1 was off
  by up to ~94. torch's lu_solve kernels step through the batch by `LU.stride(-3)` (and
  `pivots.stride(-2)`) times the flattened batch index, and their contiguity checks ignore
  size-1 dims: the LU that the jvp's batched copy of an unbatched primal makes, (2, 1, n, n)
  with strides (n*n, n, 1, n), was solved with the wrong matrices (plain torch computes the
  same wrong values from that layout). The broadcast rule (functx/vmap/rules/linalg.py)
  now gives size-1 lead dims dense strides.
- Item 8: Hessian-vector products through `F.layer_norm` by `jvp` of `vjp`/`grad` under two
  vmaps were off by ~3: the rule of `native_layer_norm_backward` under a direct jvp level
  recomputes the statistics so that they carry tangents, and the eps that makes them equal
  the saved ones was taken from values stripped of the jvp's tangents one level down only;
  under two vmaps the tangents ride on the plain tensor under both, so eps kept minus the
  variance's tangent and rstd's tangent cancelled (functx/vmap/rules/nn_norm.py).
"""

import itertools

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F

import functx
from functx import vmap

f64 = torch.float64


def per_sample(fn, *args, dims=2):
    """`fn` over the leading `dims` dims of every arg, results stacked back."""
    if dims == 0:
        return fn(*args)
    return torch.stack([per_sample(fn, *(a[i] for a in args), dims=dims - 1) for i in range(args[0].shape[0])])


def plain_jvp(fn, primals, tangents):
    """Tangent of `fn` by plain torch forward AD (one sample, float64)."""
    with fwAD.dual_level():
        out = fn(*(fwAD.make_dual(p, t) for p, t in zip(primals, tangents)))
        return fwAD.unpack_dual(out).tangent


def plain_hvp(f, x, tangent, cotangent):
    """d/dx (J(x)^T cotangent) . tangent by double backward (one sample, float64)."""
    x = x.detach().requires_grad_()
    (g,) = torch.autograd.grad(f(x), x, cotangent, create_graph=True)
    return torch.autograd.grad(g, x, tangent)[0]


# -- item 7: lu_solve -----------------------------------------------------------------------------
def _lu_solve_case(lu_kind, outer, inner, left):
    """Inputs as the issue's repro: the primal LU of a jvp under two vmaps ("shared":
    unbatched; "batched": one factorization per element; "expanded": one LU expanded to
    the batch, which the jvp copies per element), B and both tangents expanded to
    (outer, inner, ...)."""
    n, k = 3, 4
    b_shape = (n, k) if left else (k, n)
    if lu_kind == "batched":
        LU, piv = torch.linalg.lu_factor(torch.randn(outer, inner, n, n, dtype=f64))
    else:
        LU, piv = torch.linalg.lu_factor(torch.randn(n, n, dtype=f64))
        if lu_kind == "expanded":
            LU, piv = LU.expand(outer, inner, n, n), piv.expand(outer, inner, n)
    B, tLU, tB = torch.randn(b_shape, dtype=f64), torch.randn(n, n, dtype=f64), torch.randn(b_shape, dtype=f64)
    others = tuple(t.expand(outer, inner, *t.shape) for t in (B, tLU, tB))
    return LU, piv, others


@pytest.mark.parametrize("inner", [1, 2])
@pytest.mark.parametrize("outer", [1, 2])
@pytest.mark.parametrize("lu_kind", ["shared", "batched", "expanded"])
@pytest.mark.parametrize("left,adjoint", list(itertools.product([True, False], [True, False])))
def test_lu_solve_jvp_under_two_vmaps(left, adjoint, lu_kind, outer, inner):
    """Item 7: `vmap(vmap(jvp(lu_solve)))`, the LU a primal of the jvp (shared or batched,
    pivots following it), with an inner batch of size 1: the tangent was off by up to
    ~94 (the LU copy the jvp makes has a size-1 lead dim with stride n, which torch's
    kernel reads as the batch stride)."""
    LU, piv, (Bs, tLUs, tBs) = _lu_solve_case(lu_kind, outer, inner, left)
    batched_lu = lu_kind != "shared"

    def solve(lu, p, b):
        return torch.linalg.lu_solve(lu, p, b, left=left, adjoint=adjoint)

    def tangent(lu, p, b, tlu, tb):
        return functx.jvp(lambda lu, b: solve(lu, p, b), (lu, b), (tlu, tb))[1]

    lu_dim = 0 if batched_lu else None
    in_dims = (lu_dim, lu_dim, 0, 0, 0)
    out = vmap(vmap(tangent, in_dims=in_dims), in_dims=in_dims)(LU, piv, Bs, tLUs, tBs)

    def reference(lu, p, b, tlu, tb):
        return plain_jvp(lambda lu, b: solve(lu, p, b), (lu, b), (tlu, tb))

    if batched_lu:
        ref = per_sample(reference, LU, piv, Bs, tLUs, tBs)
    else:
        ref = per_sample(lambda b, tlu, tb: reference(LU, piv, b, tlu, tb), Bs, tLUs, tBs)
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("left,adjoint", list(itertools.product([True, False], [True, False])))
def test_lu_solve_size_one_dim_with_odd_stride_under_two_vmaps(left, adjoint):
    """Item 7 without AD: factors of shape (2, 1, n, n) with strides (n*n, n, 1, n), which
    `unsqueeze(1)` of a factored batch gives, passed to `vmap(vmap(lu_solve))`, were solved
    with the wrong matrices (torch's own lu_solve of those tensors is wrong the same way)."""
    LU, piv = torch.linalg.lu_factor(torch.randn(2, 3, 3, dtype=f64))
    LU, piv = LU.unsqueeze(1), piv.unsqueeze(1)
    assert LU.stride() == (9, 3, 1, 3)
    B = torch.randn(2, 1, *((3, 4) if left else (4, 3)), dtype=f64)
    solve = lambda lu, p, b: torch.linalg.lu_solve(lu, p, b, left=left, adjoint=adjoint)
    out = vmap(vmap(solve))(LU, piv, B)
    # the reference solves each sample from contiguous copies of its own factors
    ref = per_sample(lambda lu, p, b: solve(lu.contiguous(), p.contiguous(), b), LU, piv, B)
    torch.testing.assert_close(out, ref)


def test_ldl_solve_size_one_dim_with_odd_stride_under_two_vmaps():
    """The same layout for `ldl_solve` (same broadcast rule): the values must be each
    sample's own solve."""
    A = torch.randn(2, 3, 3, dtype=f64)
    A = A @ A.mT + 3 * torch.eye(3, dtype=f64)
    LD, piv = torch.linalg.ldl_factor(A)
    LD, piv = LD.unsqueeze(1), piv.unsqueeze(1)
    B = torch.randn(2, 1, 3, 4, dtype=f64)
    out = vmap(vmap(torch.linalg.ldl_solve))(LD, piv, B)
    ref = per_sample(lambda ld, p, b: torch.linalg.ldl_solve(ld.contiguous(), p.contiguous(), b), LD, piv, B)
    torch.testing.assert_close(out, ref)


# -- item 8: layer-norm Hessian-vector products -----------------------------------------------------
def _layer_norm(affine, normalized_ndim, shape):
    normalized = shape[len(shape) - normalized_ndim :]
    w = torch.randn(normalized, dtype=f64) if affine else None
    b = torch.randn(normalized, dtype=f64) if affine else None
    return lambda x: F.layer_norm(x, normalized, w, b)


def _case_id(affine, ndim, shape, sizes):
    return f"{'affine' if affine else 'plain'}-nd{ndim}-{'x'.join(map(str, shape))}-{sizes[0]}x{sizes[1]}"


LAYER_NORM_CASES = [
    pytest.param(affine, ndim, shape, sizes, id=_case_id(affine, ndim, shape, sizes))
    for affine in (False, True)
    for ndim, shape in ((1, (5,)), (1, (3, 5)), (1, (2, 3, 5)), (2, (2, 3, 5)))
    for sizes in ((2, 3), (2, 1), (1, 2))
]


@pytest.mark.parametrize("affine,normalized_ndim,shape,sizes", LAYER_NORM_CASES)
def test_layer_norm_hvp_jvp_of_vjp_under_two_vmaps(affine, normalized_ndim, shape, sizes):
    """Item 8: `vmap(vmap(jvp(x -> vjp(layer_norm, x)[1](ct)[0])))` was off by ~3 (the
    recomputed rstd lost its tangent under two vmaps); one vmap was right."""
    f = _layer_norm(affine, normalized_ndim, shape)
    X, T, C = (torch.randn(*sizes, *shape, dtype=f64) for _ in range(3))

    def hvp(x, t, ct):
        return functx.jvp(lambda x: functx.vjp(f, x)[1](ct)[0], (x,), (t,))[1]

    out = vmap(vmap(hvp))(X, T, C)
    torch.testing.assert_close(out, per_sample(lambda x, t, ct: plain_hvp(f, x, t, ct), X, T, C))


@pytest.mark.parametrize("affine", [False, True])
def test_layer_norm_hvp_jvp_of_grad_under_two_vmaps(affine):
    """Item 8, the `jvp(grad(f))` form, the tangent shared by the outer vmap."""
    f = _layer_norm(affine, 1, (3, 5))
    c = torch.randn(3, 5, dtype=f64)
    loss = lambda x: (torch.tanh(f(x)) * c).sum()
    X, V = torch.randn(2, 3, 3, 5, dtype=f64), torch.randn(3, 3, 5, dtype=f64)
    out = vmap(vmap(lambda x, v: functx.jvp(functx.grad(loss), (x,), (v,))[1]), in_dims=(0, None))(X, V)
    one = torch.ones((), dtype=f64)
    ref = torch.stack([per_sample(lambda x, v: plain_hvp(loss, x, v, one), X[i], V, dims=1) for i in range(2)])
    torch.testing.assert_close(out, ref)


def test_layer_norm_hvp_under_three_vmaps_and_mixed_in_dims():
    """Item 8 at depth three, and with the primal shared by the outer vmap and the
    tangent by the inner one (eps must come from the primals under every level)."""
    f = _layer_norm(True, 1, (4, 5))

    def hvp(x, t, ct):
        return functx.jvp(lambda x: functx.vjp(f, x)[1](ct)[0], (x,), (t,))[1]

    X, T, C = (torch.randn(2, 3, 2, 4, 5, dtype=f64) for _ in range(3))
    out = vmap(vmap(vmap(hvp)))(X, T, C)
    torch.testing.assert_close(out, per_sample(lambda x, t, ct: plain_hvp(f, x, t, ct), X, T, C, dims=3))

    X2, T2, C2 = torch.randn(3, 4, 5, dtype=f64), torch.randn(2, 4, 5, dtype=f64), torch.randn(2, 3, 4, 5, dtype=f64)
    out = vmap(vmap(hvp, in_dims=(0, None, 0)), in_dims=(None, 0, 0))(X2, T2, C2)
    ref = torch.stack([torch.stack([plain_hvp(f, X2[j], T2[i], C2[i, j]) for j in range(3)]) for i in range(2)])
    torch.testing.assert_close(out, ref)


def test_layer_norm_hessian_under_two_vmaps():
    """Once docs/status.md's known gap: `vmap(vmap(hessian(f)))` through layer norm raised
    (torch's double-backward formula wrote a value batched at the outer vmap in place into a
    temporary batched only at the inner one). Under two AD levels layer norm runs as its
    formula in ops (ad/norms_in_ops.py): equal to plain autograd per sample."""
    f = lambda x: torch.tanh(F.layer_norm(x, (5,))).sum()
    x = torch.randn(2, 2, 3, 5, dtype=f64)
    out = vmap(vmap(functx.hessian(f)))(x)
    ref = torch.stack([torch.stack([torch.autograd.functional.hessian(f, x[i, j]) for j in range(2)]) for i in range(2)])
    torch.testing.assert_close(out, ref)
    assert functx.core.current_stack() == ()
