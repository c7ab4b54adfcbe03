"""vmap of linear algebra (functx/vmap/rules/linalg.py) against per-sample loops.

Every case runs for each non-empty set of batched arguments, with the batch dim at 0
and at the last dim, under `vmap_fallback("error")`, which proves that no per-sample
loop ran. Decompositions whose outputs are unique only up to signs (qr, svd, eigh, eig)
are compared through sign-invariant quantities (reconstructions, magnitudes).
"""

import itertools
from functools import partial

import pytest
import torch
import torch.nn.functional as F

import functx
from functx import vmap
from .loop_reference import loop, stack_tree  # noqa: F401

pytestmark = pytest.mark.filterwarnings("ignore:torch.triangular_solve is deprecated")

B = 3  # batch size of every test
f64 = torch.float64


# -- inputs ------------------------------------------------------------------------------
def mat(*shape, dtype=f64):
    return lambda: torch.randn(shape, dtype=dtype)


vec = mat


def boolean(*shape):
    return lambda: torch.rand(shape) > 0.5


def well_conditioned(*shape):
    """A random matrix plus n * identity: far from singular."""
    n = shape[-1]
    return lambda: torch.randn(*shape, dtype=f64) + n * torch.eye(n, dtype=f64)


def spd(*shape):
    """Symmetric positive definite, with well separated eigenvalues."""

    def make():
        n = shape[-1]
        q, _ = torch.linalg.qr(torch.randn(*shape, dtype=f64))
        return q @ torch.diag(torch.arange(1, n + 1, dtype=f64)) @ q.mT

    return make


def real_spectrum(n):
    """A non-symmetric matrix with real, distinct eigenvalues (so eig's order is fixed
    by sorting)."""

    def make():
        p = torch.randn(n, n, dtype=f64) + n * torch.eye(n, dtype=f64)
        return p @ torch.diag(torch.arange(1, n + 1, dtype=f64)) @ torch.linalg.inv(p)

    return make


def const(value):
    return lambda: value


# -- the check -----------------------------------------------------------------------------
def batched_inputs(makers, batched, dim):
    """Args (batched ones: B samples stacked at `dim`) and their in_dims."""
    args, in_dims = [], []
    for make, is_batched in zip(makers, batched):
        if is_batched:
            args.append(torch.stack([make() for _ in range(B)], dim=dim))
            in_dims.append(dim)
        else:
            args.append(make())
            in_dims.append(None)
    return args, tuple(in_dims)


def check(fn, makers, batched, dim, **tolerance):
    args, in_dims = batched_inputs(makers, batched, dim)
    with functx.vmap_fallback("error"):
        out = vmap(fn, in_dims=in_dims)(*args)
    torch.testing.assert_close(out, loop(fn, args, in_dims), **tolerance)


def batch_patterns(n):
    """Every non-empty set of batched arguments out of n."""
    return [p for p in itertools.product((False, True), repeat=n) if any(p)]


def cases_with_patterns(cases):
    for name, fn, makers in cases:
        for pattern in batch_patterns(len(makers)):
            label = "".join("b" if p else "u" for p in pattern)
            yield pytest.param(f"{name}-{label}", fn, makers, pattern, id=f"{name}-{label}")


# -- products --------------------------------------------------------------------------------
PRODUCTS = [
    ("mm", torch.mm, (mat(4, 3), mat(3, 2))),
    ("bmm", torch.bmm, (mat(2, 4, 3), mat(2, 3, 5))),
    ("mv", torch.mv, (mat(4, 3), vec(3))),
    ("dot", torch.dot, (vec(3), vec(3))),
    ("vdot_complex", torch.vdot, (vec(3, dtype=torch.complex128), vec(3, dtype=torch.complex128))),
    ("dot_int", torch.dot, (lambda: torch.randint(-5, 5, (4,)), lambda: torch.randint(-5, 5, (4,)))),
    ("matmul_vv", torch.matmul, (vec(3), vec(3))),
    ("matmul_mv", torch.matmul, (mat(4, 3), vec(3))),
    ("matmul_vm", torch.matmul, (vec(3), mat(3, 2))),
    ("matmul_3d_2d", torch.matmul, (mat(2, 4, 3), mat(3, 5))),
    ("matmul_2d_3d", torch.matmul, (mat(4, 3), mat(2, 3, 5))),
    ("matmul_3d_3d", torch.matmul, (mat(2, 4, 3), mat(2, 3, 5))),
    ("matmul_1d_3d", torch.matmul, (vec(3), mat(2, 3, 4))),
    ("matmul_3d_1d", torch.matmul, (mat(2, 4, 3), vec(3))),
    ("matmul_broadcast", torch.matmul, (mat(1, 4, 3), mat(2, 1, 3, 5))),
    ("linear", F.linear, (mat(4, 3), mat(2, 3), vec(2))),
    ("linear_1d_input", F.linear, (vec(3), mat(2, 3), vec(2))),
    ("linear_3d_input", F.linear, (mat(2, 4, 3), mat(2, 3), vec(2))),
    ("linear_no_bias", lambda x, w: F.linear(x, w), (mat(4, 3), mat(2, 3))),
    ("addmm", torch.addmm, (mat(4, 2), mat(4, 3), mat(3, 2))),
    ("addmm_row_bias", torch.addmm, (mat(1, 2), mat(4, 3), mat(3, 2))),
    ("addmm_scalar_bias", torch.addmm, (mat(), mat(4, 3), mat(3, 2))),
    ("addmm_scaled", lambda s, a, b: torch.addmm(s, a, b, beta=0.5, alpha=2.0), (vec(2), mat(4, 3), mat(3, 2))),
    ("addmm_beta0_nan", lambda s, a, b: torch.addmm(s * torch.nan, a, b, beta=0), (mat(4, 2), mat(4, 3), mat(3, 2))),
    ("addmv", torch.addmv, (vec(4), mat(4, 3), vec(3))),
    ("addmv_scalar_self", lambda s, a, v: torch.addmv(s, a, v, beta=2.0, alpha=-1.0), (mat(), mat(4, 3), vec(3))),
    ("addr", torch.addr, (mat(4, 3), vec(4), vec(3))),
    ("addr_scaled", lambda s, a, b: torch.addr(s, a, b, beta=0.5, alpha=3.0), (vec(3), vec(4), vec(3))),
    ("addr_beta0", lambda s, a, b: torch.addr(s, a, b, beta=0), (mat(4, 3), vec(4), vec(3))),
    ("addr_bool", torch.addr, (boolean(4, 3), boolean(4), boolean(3))),
    ("addbmm", torch.addbmm, (mat(4, 2), mat(5, 4, 3), mat(5, 3, 2))),
    ("addbmm_scaled", partial(torch.addbmm, beta=2.0, alpha=0.5), (vec(2), mat(5, 4, 3), mat(5, 3, 2))),
    ("baddbmm", torch.baddbmm, (mat(2, 4, 5), mat(2, 4, 3), mat(2, 3, 5))),
    ("baddbmm_scaled", partial(torch.baddbmm, beta=0.5, alpha=2.0), (vec(5), mat(2, 4, 3), mat(2, 3, 5))),
    ("baddbmm_beta0", lambda s, a, b: torch.baddbmm(s, a, b, beta=0), (vec(5), mat(2, 4, 3), mat(2, 3, 5))),
    ("einsum_mm", lambda a, b: torch.einsum("ij,jk->ik", a, b), (mat(4, 3), mat(3, 2))),
    ("einsum_batched", lambda a, b: torch.einsum("bij,bjk->bik", a, b), (mat(2, 4, 3), mat(2, 3, 5))),
    ("einsum_three", lambda a, w, b: torch.einsum("bn,anm,bm->ba", a, w, b), (mat(2, 3), mat(4, 3, 5), mat(2, 5))),
    ("einsum_trace", lambda a: torch.einsum("ii->", a), (mat(3, 3),)),
    ("einsum_outer", lambda a, b: torch.einsum("i,j->ij", a, b), (vec(3), vec(4))),
    ("tensordot", lambda a, b: torch.tensordot(a, b, dims=([1, 2], [0, 1])), (mat(2, 3, 4), mat(3, 4, 5))),
    ("inner", torch.inner, (mat(2, 3), mat(4, 3))),
    ("outer", torch.outer, (vec(3), vec(4))),
    ("kron", torch.kron, (mat(2, 3), mat(3, 2))),
    ("multi_dot", lambda a, b, c: torch.linalg.multi_dot([a, b, c]), (mat(2, 3), mat(3, 4), mat(4, 2))),
    ("vecdot", lambda a, b: torch.linalg.vecdot(a, b), (mat(2, 3), mat(2, 3))),
    ("bilinear", F.bilinear, (mat(4, 3), mat(4, 5), mat(2, 3, 5), vec(2))),
    ("bilinear_1d", F.bilinear, (vec(3), vec(5), mat(2, 3, 5), vec(2))),
    ("trace", torch.trace, (mat(3, 4),)),
    ("trace_int", torch.trace, (lambda: torch.randint(-5, 5, (3, 3), dtype=torch.int32),)),
]


@pytest.mark.parametrize("dim", [0, -1])
@pytest.mark.parametrize("case, fn, makers, batched", list(cases_with_patterns(PRODUCTS)))
def test_products(case, fn, makers, batched, dim):
    check(fn, makers, batched, dim)


INPLACE_PRODUCTS = [
    ("addmm_", lambda s, a, b: s.clone().addmm_(a, b, beta=0.5), (mat(4, 2), mat(4, 3), mat(3, 2))),
    ("addmv_", lambda s, a, v: s.clone().addmv_(a, v, alpha=2), (vec(4), mat(4, 3), vec(3))),
    ("addr_", lambda s, a, b: s.clone().addr_(a, b), (mat(4, 3), vec(4), vec(3))),
    ("addbmm_", lambda s, a, b: s.clone().addbmm_(a, b), (mat(4, 2), mat(5, 4, 3), mat(5, 3, 2))),
    ("baddbmm_", lambda s, a, b: s.clone().baddbmm_(a, b), (mat(2, 4, 5), mat(2, 4, 3), mat(2, 3, 5))),
]


@pytest.mark.parametrize("dim", [0, -1])
@pytest.mark.parametrize(
    "case, fn, makers, batched",
    [p for p in cases_with_patterns(INPLACE_PRODUCTS) if p.values[3][0]],  # self batched
)
def test_inplace_products(case, fn, makers, batched, dim):
    check(fn, makers, batched, dim)


def test_inplace_product_into_unbatched_self_raises():
    s, a, b = torch.randn(4, 2), torch.randn(B, 4, 3), torch.randn(3, 2)
    with pytest.raises(RuntimeError, match="not batched"):
        vmap(lambda a: s.clone().addmm_(a, b))(a)


def test_wrong_rank_raises_instead_of_broadcasting():
    with pytest.raises(RuntimeError, match="mm"):
        vmap(torch.mm, in_dims=(0, None))(torch.randn(B, 2, 3, 4), torch.randn(4, 2))
    with pytest.raises(RuntimeError, match="dot"):
        vmap(torch.dot)(torch.randn(B, 2, 3), torch.randn(B, 2, 3))


# -- matrix functions of one operand -------------------------------------------------------------
def qr_invariants(a, mode="reduced"):
    q, r = torch.linalg.qr(a, mode=mode)
    return q @ r, r.abs(), q.abs()


def svd_invariants(a):
    u, s, vh = torch.linalg.svd(a, full_matrices=False)
    return (u * s.unsqueeze(-2)) @ vh, s, u.abs(), vh.abs()


def eigh_invariants(a):
    w, v = torch.linalg.eigh(a)
    return w, v.abs(), (v * w.unsqueeze(-2)) @ v.mT


def eig_invariants(a):
    w, v = torch.linalg.eig(a)
    reconstruction = (v * w.unsqueeze(-2)) @ torch.linalg.inv(v)
    return torch.sort(w.real).values, reconstruction.real


ONE_MATRIX = [
    ("inv", torch.linalg.inv, well_conditioned(3, 3)),
    ("inv_ex", torch.linalg.inv_ex, well_conditioned(3, 3)),
    ("inv_leading", torch.linalg.inv, well_conditioned(2, 3, 3)),
    ("det", torch.linalg.det, well_conditioned(3, 3)),
    ("det_leading", torch.linalg.det, well_conditioned(2, 3, 3)),
    ("slogdet", torch.linalg.slogdet, well_conditioned(3, 3)),
    ("logdet", torch.logdet, spd(3, 3)),
    ("cholesky", torch.linalg.cholesky, spd(3, 3)),
    ("cholesky_upper", lambda a: torch.linalg.cholesky(a, upper=True), spd(2, 3, 3)),
    ("cholesky_ex", torch.linalg.cholesky_ex, spd(3, 3)),
    ("cholesky_inverse", lambda a: torch.cholesky_inverse(torch.linalg.cholesky(a)), spd(3, 3)),
    ("qr", qr_invariants, mat(4, 3)),
    ("qr_complete", lambda a: qr_invariants(a, "complete")[:2], mat(3, 3)),
    ("qr_r", lambda a: torch.linalg.qr(a, mode="r")[1].abs(), mat(4, 3)),
    ("svd", svd_invariants, mat(4, 3)),
    ("svd_wide", svd_invariants, mat(2, 3, 4)),
    ("svdvals", torch.linalg.svdvals, mat(4, 3)),
    ("torch_svd", lambda a: torch.svd(a).S, mat(4, 3)),
    ("eigh", eigh_invariants, spd(3, 3)),
    ("eigvalsh", torch.linalg.eigvalsh, spd(3, 3)),
    ("eig", eig_invariants, real_spectrum(3)),
    ("eigvals", lambda a: torch.sort(torch.linalg.eigvals(a).real).values, real_spectrum(3)),
    ("lu_factor", torch.linalg.lu_factor, mat(3, 3)),
    ("lu_factor_ex", torch.linalg.lu_factor_ex, mat(4, 3)),
    ("lu", torch.linalg.lu, mat(3, 4)),
    ("lu_unpack", lambda a: torch.lu_unpack(*torch.linalg.lu_factor(a)), mat(3, 3)),
    ("ldl_factor", torch.linalg.ldl_factor, spd(3, 3)),
    ("geqrf_householder", lambda a: torch.linalg.householder_product(*torch.geqrf(a)).abs(), mat(4, 3)),
    ("matrix_exp", torch.linalg.matrix_exp, mat(3, 3)),
    ("matrix_exp_leading", torch.linalg.matrix_exp, mat(2, 3, 3)),
    ("matrix_power", lambda a: torch.linalg.matrix_power(a, 3), mat(3, 3)),
    ("matrix_power_negative", lambda a: torch.linalg.matrix_power(a, -2), well_conditioned(3, 3)),
    ("pinv", torch.linalg.pinv, mat(4, 3)),
    ("pinv_hermitian", lambda a: torch.linalg.pinv(a, hermitian=True), spd(3, 3)),
    ("pinv_rtol", lambda a: torch.linalg.pinv(a, rtol=0.1), mat(2, 4, 3)),
    ("matrix_norm_fro", torch.linalg.matrix_norm, mat(4, 3)),
    ("matrix_norm_nuc", lambda a: torch.linalg.matrix_norm(a, "nuc"), mat(4, 3)),
    ("matrix_norm_2", lambda a: torch.linalg.matrix_norm(a, 2), mat(4, 3)),
    ("matrix_norm_-2", lambda a: torch.linalg.matrix_norm(a, -2), mat(4, 3)),
    ("matrix_norm_1", lambda a: torch.linalg.matrix_norm(a, 1), mat(4, 3)),
    ("matrix_norm_inf_dims", lambda a: torch.linalg.matrix_norm(a, float("inf"), dim=(0, 2)), mat(4, 2, 3)),
    ("norm_default", torch.linalg.norm, mat(4, 3)),
    ("cond", torch.linalg.cond, well_conditioned(3, 3)),
    ("tril", lambda a: torch.tril(a, 1), mat(4, 3)),
    ("triu", lambda a: torch.triu(a, -1), mat(2, 3, 4)),
    ("tril_", lambda a: a.clone().tril_(-1), mat(4, 3)),
    ("diag_of_matrix", lambda a: torch.diag(a, 1), mat(3, 4)),
    ("diag_of_vector", lambda a: torch.diag(a, -1), vec(3)),
]


@pytest.mark.parametrize("dim", [0, -1])
@pytest.mark.parametrize("fn, make", [pytest.param(fn, make, id=name) for name, fn, make in ONE_MATRIX])
def test_one_matrix(fn, make, dim):
    check(fn, (make,), (True,), dim)


# -- several operands ------------------------------------------------------------------------------
def lu_solve(a, b, **kwargs):
    return torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b, **kwargs)


def ldl_solve(a, b):
    return torch.linalg.ldl_solve(*torch.linalg.ldl_factor(a), b)


def cholesky_solve(a, b):
    return torch.cholesky_solve(b, torch.linalg.cholesky(a))


def ormqr(a, c):
    return torch.ormqr(*torch.geqrf(a), c)


def lstsq(a, b, driver="gelsd"):
    return tuple(torch.linalg.lstsq(a, b, driver=driver))


SEVERAL = [
    ("solve", torch.linalg.solve, (well_conditioned(3, 3), mat(3, 2))),
    ("solve_vector", torch.linalg.solve, (well_conditioned(3, 3), vec(3))),
    ("solve_vector_leading", torch.linalg.solve, (well_conditioned(2, 3, 3), vec(2, 3))),
    ("solve_1d_vs_leading", torch.linalg.solve, (well_conditioned(2, 3, 3), vec(3))),
    ("solve_broadcast_B", torch.linalg.solve, (well_conditioned(3, 3), mat(2, 3, 4))),
    ("solve_broadcast_A", torch.linalg.solve, (well_conditioned(2, 3, 3), mat(3, 3))),
    ("solve_right", lambda a, b: torch.linalg.solve(a, b, left=False), (well_conditioned(3, 3), mat(2, 3))),
    ("solve_ex", torch.linalg.solve_ex, (well_conditioned(3, 3), mat(3, 2))),
    ("tensorsolve", torch.linalg.tensorsolve, (well_conditioned(6, 6), vec(6))),
    ("lstsq", lstsq, (mat(5, 3), mat(5, 2))),
    ("lstsq_vector", lstsq, (mat(5, 3), vec(5))),
    ("lstsq_vector_leading", lstsq, (mat(2, 5, 3), vec(2, 5))),
    ("lstsq_gelsy", lambda a, b: lstsq(a, b, "gelsy"), (mat(5, 3), mat(5, 2))),
    ("lstsq_gels", lambda a, b: lstsq(a, b, "gels"), (mat(5, 3), mat(5, 2))),
    ("lu_solve", lu_solve, (well_conditioned(3, 3), mat(3, 2))),
    ("lu_solve_adjoint_right", partial(lu_solve, left=False, adjoint=True), (well_conditioned(3, 3), mat(2, 3))),
    ("lu_solve_broadcast", lu_solve, (well_conditioned(3, 3), mat(2, 3, 2))),
    ("ldl_solve", ldl_solve, (spd(3, 3), mat(3, 2))),
    ("solve_triangular", partial(torch.linalg.solve_triangular, upper=True), (well_conditioned(3, 3), mat(3, 2))),
    (
        "solve_triangular_right",
        lambda a, b: torch.linalg.solve_triangular(a, b, upper=False, left=False, unitriangular=True),
        (well_conditioned(3, 3), mat(2, 2, 3)),
    ),
    ("triangular_solve", lambda b, a: tuple(torch.triangular_solve(b, a)), (mat(3, 2), well_conditioned(3, 3))),
    (
        "triangular_solve_broadcast",
        lambda b, a: tuple(torch.triangular_solve(b, a, upper=False)),
        (mat(3, 2), well_conditioned(2, 3, 3)),
    ),
    ("cholesky_solve", cholesky_solve, (spd(3, 3), mat(3, 2))),
    ("householder_product", torch.linalg.householder_product, (mat(4, 3), vec(2))),
    ("ormqr", ormqr, (mat(3, 3), mat(3, 2))),
    ("pinv_atol_tensor", lambda a, t: torch.linalg.pinv(a, atol=t), (mat(4, 3), lambda: torch.rand((), dtype=f64))),
    ("cross", torch.linalg.cross, (mat(4, 3), mat(4, 3))),
    ("cross_broadcast_dim0", lambda a, b: torch.cross(a, b, dim=0), (mat(3, 1), mat(3, 4))),
    ("cdist", torch.cdist, (mat(4, 3), mat(5, 3))),
    ("cdist_p1", lambda a, b: torch.cdist(a, b, p=1.0), (mat(4, 3), mat(5, 3))),
    ("cdist_leading", torch.cdist, (mat(2, 4, 3), mat(5, 3))),
    ("cdist_mm_path", torch.cdist, (mat(30, 3), mat(27, 3))),
    ("dist", lambda a, b: torch.dist(a, b), (mat(4, 3), mat(4, 3))),
    (
        "cdist_backward",
        lambda x1, x2, g: torch.ops.aten._cdist_backward(g, x1, x2, 1.0, torch.cdist(x1, x2, p=1.0)),
        (mat(4, 3), mat(5, 3), mat(4, 5)),
    ),
]


@pytest.mark.parametrize("dim", [0, -1])
@pytest.mark.parametrize("case, fn, makers, batched", list(cases_with_patterns(SEVERAL)))
def test_several_operands(case, fn, makers, batched, dim):
    check(fn, makers, batched, dim)


@pytest.mark.parametrize("dim", [0, -1])
def test_pdist(dim):
    check(torch.pdist, (mat(5, 3),), (True,), dim)
    check(lambda x: torch.pdist(x, p=1.0), (mat(5, 3),), (True,), dim)


def test_singular_matrix_error_names_the_op():
    a = torch.randn(B, 3, 3, dtype=f64)
    a[1] = 0
    with pytest.raises(torch.linalg.LinAlgError):
        vmap(torch.linalg.inv)(a)
    with pytest.raises(torch.linalg.LinAlgError):
        vmap(torch.linalg.solve, in_dims=(0, None))(a, torch.randn(3, dtype=f64))


def test_torch_autograd_through_vmapped_linalg():
    """Rules compute with torch ops on the physical values, so plain autograd records
    them: gradients through a vmapped solve/det/lstsq match the per-sample loop's."""
    a = (torch.randn(B, 3, 3, dtype=f64) + 3 * torch.eye(3, dtype=f64)).requires_grad_()
    b = torch.randn(B, 3, dtype=f64, requires_grad=True)
    for fn in (
        torch.linalg.solve,
        lambda a, b: torch.linalg.slogdet(a).logabsdet * b,
        lambda a, b: torch.linalg.lstsq(a, b).solution,
    ):
        for in_dims in ((0, None), (None, 0), (0, 0)):
            args = tuple(x if d is not None else x[0] for x, d in zip((a, b), in_dims))
            with functx.vmap_fallback("error"):
                grads = torch.autograd.grad(vmap(fn, in_dims=in_dims)(*args).sum(), (a, b))
            expected = torch.autograd.grad(loop(fn, args, in_dims).sum(), (a, b))
            torch.testing.assert_close(grads, expected)


# -- nested vmap ------------------------------------------------------------------------------------
# Each arg is batched at both levels ("both"), only the outer one, only the inner one, or none.
LEVELS = {"both": (0, 0), "outer": (0, None), "inner": (None, 0), "none": (None, None)}
B_OUTER, B_INNER = 2, 3


def nested_inputs(makers, levels):
    args, outer, inner = [], [], []
    for make, level in zip(makers, levels):
        o, i = LEVELS[level]
        shape = [n for n, d in ((B_OUTER, o), (B_INNER, i)) if d is not None]
        samples = [make() for _ in range(max(1, torch.Size(shape).numel()))]
        value = torch.stack(samples).view(*shape, *samples[0].shape) if shape else samples[0]
        args.append(value)
        outer.append(o)
        inner.append(i)
    return args, tuple(outer), tuple(inner)


def nested_loop(fn, args, outer, inner):
    def per_outer(j):
        sub = [a if o is None else a.select(0, j) for a, o in zip(args, outer)]
        return loop(fn, sub, inner)

    # the inner loop runs over B_INNER; `loop` uses the module B, which equals B_INNER
    return stack_tree([per_outer(j) for j in range(B_OUTER)])


NESTED = [
    ("mm", torch.mm, (mat(4, 3), mat(3, 2)), ("both", "inner")),
    ("mm_outer_inner", torch.mm, (mat(4, 3), mat(3, 2)), ("outer", "inner")),
    ("linear", F.linear, (mat(4, 3), mat(2, 3), vec(2)), ("inner", "outer", "both")),
    ("addmm", torch.addmm, (vec(2), mat(4, 3), mat(3, 2)), ("outer", "inner", "both")),
    ("dot", torch.dot, (vec(3), vec(3)), ("outer", "both")),
    ("einsum", lambda a, b: torch.einsum("bij,jk->bik", a, b), (mat(2, 4, 3), mat(3, 2)), ("inner", "outer")),
    ("solve_vector", torch.linalg.solve, (well_conditioned(3, 3), vec(3)), ("outer", "inner")),
    ("det", torch.linalg.det, (well_conditioned(3, 3),), ("both",)),
    ("qr", qr_invariants, (mat(4, 3),), ("both",)),
    ("lstsq_vector", lstsq, (mat(5, 3), vec(5)), ("inner", "outer")),
    ("cdist", torch.cdist, (mat(4, 3), mat(5, 3)), ("outer", "both")),
    ("trace", torch.trace, (mat(3, 3),), ("both",)),
    ("cholesky_solve", cholesky_solve, (spd(3, 3), mat(3, 2)), ("inner", "both")),
]


@pytest.mark.parametrize("fn, makers, levels", [pytest.param(f, m, lv, id=n) for n, f, m, lv in NESTED])
def test_nested_vmap(fn, makers, levels):
    assert B == B_INNER
    args, outer, inner = nested_inputs(makers, levels)
    with functx.vmap_fallback("error"):
        out = vmap(vmap(fn, in_dims=inner), in_dims=outer)(*args)
    torch.testing.assert_close(out, nested_loop(fn, args, outer, inner))


# -- mm with one side batched, large enough to fold into one GEMM (linalg._worth_a_copy) ----
from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def _batched_operand(batch, rows, cols, in_dim, transposed):
    """A batch of (rows, cols) matrices with the batch at `in_dim`, laid out transposed in
    memory if asked (what a weight's backward meets: `grad.t() @ x`)."""
    base = torch.randn(batch, cols, rows, dtype=f64).mT if transposed else torch.randn(batch, rows, cols, dtype=f64)
    return base.movedim(0, in_dim)


@settings(max_examples=40, deadline=None)
@given(
    n=st.sampled_from([1, 3, 16, 64, 256]),
    k=st.sampled_from([1, 5, 130, 784]),
    m=st.sampled_from([1, 4, 16, 70, 130]),
    batch=st.integers(1, 4),
    batched_side=st.sampled_from(["left", "right"]),
    in_dim=st.integers(0, 2),
    transposed=st.booleans(),
)
@example(n=16, k=784, m=130, batch=3, batched_side="left", in_dim=0, transposed=True)  # rows folded by a copy
@example(n=256, k=784, m=16, batch=3, batched_side="right", in_dim=1, transposed=False)  # columns folded
@example(n=256, k=784, m=16, batch=2, batched_side="right", in_dim=0, transposed=True)
def test_mm_with_one_side_batched_matches_the_loop(n, k, m, batch, batched_side, in_dim, transposed):
    """Small and large products (one GEMM over the folded batch above ~2^20 multiply-adds per
    element, a bmm below), every batch position and memory layout, against torch.mm per
    element in float64."""
    if batched_side == "left":
        a, b = _batched_operand(batch, n, k, in_dim, transposed), torch.randn(k, m, dtype=f64)
        in_dims = (in_dim, None)
    else:
        a, b = torch.randn(n, k, dtype=f64), _batched_operand(batch, k, m, in_dim, transposed)
        in_dims = (None, in_dim)
    with functx.vmap_fallback("error"):
        out = vmap(torch.mm, in_dims=in_dims)(a, b)
    torch.testing.assert_close(out, loop(torch.mm, (a, b), in_dims))
    assert out.is_contiguous()


def test_hessian_vector_products_under_vmap_fold_large_products():
    """dattri's inverse-HVP pattern (vmap over the `vjp_fn` of a gradient) with products
    above the fold threshold: equal to double backward per vector, float64."""
    torch.manual_seed(0)
    x, y = torch.randn(256, 300, dtype=f64), torch.randn(256, 10, dtype=f64)  # 16 hidden: skinny per vector
    w1, w2 = torch.randn(300, 16, dtype=f64) / 20, torch.randn(16, 10, dtype=f64) / 4
    loss = lambda w1, w2: ((torch.tanh(x @ w1) @ w2 - y) ** 2).mean()
    vectors = (torch.randn(3, 300, 16, dtype=f64), torch.randn(3, 10 * 16, dtype=f64).view(3, 16, 10))
    _, vjp_fn = functx.vjp(functx.grad(loss, argnums=(0, 1)), w1, w2)
    hvps = functx.vmap(lambda v1, v2: vjp_fn((v1, v2)))(*vectors)
    p1, p2 = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    g1, g2 = torch.autograd.grad(loss(p1, p2), (p1, p2), create_graph=True)
    for i in range(3):
        expected = torch.autograd.grad((g1, g2), (p1, p2), (vectors[0][i], vectors[1][i]), retain_graph=True)
        torch.testing.assert_close(hvps[0][i], expected[0])
        torch.testing.assert_close(hvps[1][i], expected[1])
