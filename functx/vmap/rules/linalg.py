"""Linear algebra: matrix products, decompositions, solves and matrix functions.

What reaches us: `torch.matmul`, `@`, `F.linear`, `torch.einsum`, `tensordot`, `inner`,
`outer`, `kron`, `multi_dot`, `matrix_power` and the matrix norms are composite and
arrive decomposed into `mm`/`bmm`/`mv`/`dot`/`addmm`, views and pointwise ops; the
`torch.linalg` functions arrive as their structured kernels (`_linalg_svd`,
`_linalg_solve_ex`, `linalg_lu_factor_ex`, ...).

Three shapes of rule:
- products (`mm`, `addmm`, ...): the vmap batch becomes a batch dim of one
  `matmul`/`bmm`/`baddbmm`/`addmm` call — or, where only the left matrix is batched,
  is folded into its rows so that one plain GEMM runs;
- one-matrix kernels (`linalg_qr`, `_linalg_eigh`, `tril`, ...): every LAPACK-style
  kernel maps over leading dims, so the batch dim in front is all they need
  (`batch_all_rule`);
- several-operand kernels whose leading dims broadcast (`linalg_lu_solve`,
  `cholesky_solve`, `_cdist_forward`, ...): each operand is given the batch dim and
  padded so that the leading (batch) dims of all operands line up. `solve` and `lstsq`
  with an unbatched A instead fold the batch into B's columns: A is factored once.
"""

import torch

from ...core.custom_function import apply_original as _apply_original
from ...core.level_tensor import LevelTensor, is_physical
from ..batched_tensor import UNDER_DIRECT_GRAD, VMAP_RULES
from ..templates import batch_all_rule, materialize, pad_to_rank, raise_unbatched_inplace

aten = torch.ops.aten
Tensor = torch.Tensor


# -- helpers ----------------------------------------------------------------------------
def _expect_dims(op_label, **tensors):
    """Raise torch's error for a logical rank the op does not accept: the physical call
    would otherwise broadcast the extra batch dim and silently compute something else.
    `tensors`: name -> (tensor, expected rank)."""
    for name, (t, rank) in tensors.items():
        if t.dim() != rank:
            raise RuntimeError(f"{op_label}: {name} must be a {rank}D tensor, but got a {t.dim()}D tensor")


def _phys(interp, x):
    """Physical value of a batched tensor (batch dim 0); an unbatched tensor as is, which
    broadcasts from the right against the batched values it meets."""
    return x._value if interp.is_batched(x) else x


def _phys_at_rank(interp, x, rank):
    """`_phys`, with size-1 dims after the batch dim of a batched value so that it
    broadcasts like its logical self against logical rank `rank`."""
    if interp.is_batched(x):
        return pad_to_rank(x._value, x.dim(), rank)
    return x


def _dense_unit_dims(value):
    """`value` as a view whose size-1 dims have the strides of a dense tensor of its shape
    (C order if contiguous, F order in the last two dims if `mT` is): the same elements,
    since a size-1 dim is only ever indexed at 0. Needed because torch's `lu_solve` (and
    `ldl_solve`) kernels step through the batch by `LU.stride(-3)` and `pivots.stride(-2)`
    times the flattened batch index, while their contiguity checks ignore size-1 dims: an LU of
    shape (2, 1, n, n) with strides (n*n, n, 1, n) (`unsqueeze(1)` of a factored batch, or
    a copy of an expanded LU, as a `jvp` inside two vmaps makes) is taken as is and solved
    with the wrong matrices (plain torch gives the same wrong values). A value of any
    other layout is copied by those kernels anyway and returned as is."""
    if not is_physical(value) or 1 not in value.shape:
        return value
    if value.is_contiguous():
        return value.view(value.shape)  # view recomputes the strides from the shape
    if value.dim() >= 2 and value.mT.is_contiguous():
        return value.mT.view(value.mT.shape).mT
    return value


def _with_batch(interp, value):
    """A result computed only from unbatched values gets the batch dim (a fresh tensor,
    as an op result would be)."""
    return value.expand(interp.batch_size, *value.shape).contiguous()


def _aligned(interp, x, core, lead):
    """`x` with the batch dim in front (unbatched tensors expanded: a view) and padded to
    `lead` leading dims before its `core` trailing (matrix/vector) dims."""
    return pad_to_rank(materialize(interp, x), x.dim(), lead + core)


def _wrap_results(interp, out):
    """Wrap an op's results. Kernels return some outputs as empty placeholders of shape
    (0,) that do not follow the batch (`_linalg_svd` without U/Vh, `linalg_lstsq`'s
    residuals, ...); per sample they are (0,) too, so they become (batch, 0)."""
    size = interp.batch_size

    def wrap(t):
        if not isinstance(t, Tensor):
            return t
        if t.dim() == 0 or t.shape[0] != size:
            t = t.expand(size, *t.shape)
        return interp.wrap(t)

    if isinstance(out, Tensor):
        return wrap(out)
    if type(out) is tuple or type(out) is list:
        return type(out)(wrap(t) for t in out)
    return out


def _inplace(op, out_of_place_rule):
    """In-place variant of a product rule: compute out of place, then write into self."""

    def rule(interp, self, *args, **kwargs):
        if not interp.is_batched(self):
            raise_unbatched_inplace(op, self)
        out = out_of_place_rule(interp, self, *args, **kwargs)
        self._value.copy_(out._value)
        return self

    return rule


def _scale_add(interp, product, self, self_rank, beta, alpha):
    """`beta * self + alpha * product` with torch's convention that beta == 0 ignores
    self (its nan/inf do not propagate). `product` is physical or unbatched."""
    if beta == 0:
        out = product if alpha == 1 else product * alpha
    else:
        s = _phys_at_rank(interp, self, self_rank)
        if beta != 1:
            s = s * beta
        out = torch.add(s, product, alpha=alpha) if alpha != 1 else s + product
    if out.dim() == self_rank:  # nothing batched took part (only a batched self, ignored)
        out = _with_batch(interp, out)
    return out


# -- the batched matrix product under a direct grad level: a VJP override ---------------------
# Under `vmap(grad(f))` torch's autograd records the physical ops (ad/direct_reverse.py): a
# per-sample `x @ W.t()` (F.linear) is one bmm of the batched x with the batched (expanded)
# W.t(), and torch's bmm backward gives that operand's gradient as x^T @ g, laid out
# (B, in, out): after the transpose's backward the per-sample weight gradient is a
# transposed view (B, out, in). torch's `mm` backward (what torch.func's grad level runs
# per sample) instead gives each operand's gradient in that operand's own per-sample layout
# (mm_mat1_backward / mm_mat2_backward: a column-major operand gets (g^T x)^T), so the weight
# gradient comes out contiguous. `BatchedProduct` is the batched product with that backward,
# and with the product's forward and the input's gradient folded into one GEMM where the
# right operand is one matrix for every element (an expanded, unbatched weight).


def _column_major(t) -> bool:
    """torch's test in mm's backward, per batch element of a physical (B, r, c) tensor."""
    return t.stride(1) == 1 and t.stride(2) == t.shape[1]


def _batched_product(a, b):
    if b.stride(0) == 0 and a.shape[0] and _rows_fold(a):  # one matrix for every element: one GEMM
        size, n, k = a.shape
        # `_unsafe_view`: a result that is not a view (an autograd.Function's output that is
        # a view may not be written in place, and a decomposed matmul writes `squeeze_`)
        return aten._unsafe_view.default(aten.mm.default(a.reshape(size * n, k), b[0]), (size, n, b.shape[2]))
    return aten.bmm.default(a, b)


def _batched_addmm(bias, a, b):
    """bias + a @ b (bias broadcasting against the physical (B, n, m) product)."""
    if b.stride(0) == 0 and a.shape[0] and _rows_fold(a):
        shared = bias.dim() < 3 or (bias.stride(0) == 0 and bias.shape[1] == 1)
        if shared and (bias.dim() < 2 or bias.shape[-2] == 1):  # one row for every element
            size, n, k = a.shape
            row = bias.reshape(bias.shape[-1]) if bias.dim() < 3 else bias[0, 0]
            out = aten.addmm.default(row, a.reshape(size * n, k), b[0])
            return aten._unsafe_view.default(out, (size, n, b.shape[2]))
    return aten.baddbmm.default(bias, a, b)


class BatchedProduct(torch.autograd.Function):
    """a @ b (+ bias) for physical (B, n, k) and (B, k, m): each operand's gradient laid out
    per batch element like the operand (see above). Its backward is made of differentiable
    ops, so a gradient built with create_graph=True differentiates through it."""

    # forward(ctx, ...) without setup_context: torch binds a setup_context Function's
    # arguments with inspect.signature on every apply (~20 µs)
    @staticmethod
    def forward(ctx, a, b, bias=None):
        ctx.save_for_backward(a, b)
        if bias is None:
            ctx.bias_shape = None
            return _batched_product(a, b)
        ctx.bias_shape = bias.shape
        return _batched_addmm(bias, a, b)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        grad_bias = None
        if ctx.bias_shape is not None and ctx.needs_input_grad[2]:
            grad_bias = g.sum_to_size(ctx.bias_shape)
        # Recorded (create_graph=True): the products again as BatchedProducts, whose
        # backward gives each element its own gradient; `_batched_product`'s one-GEMM fold
        # reads the shared matrix through element 0 only, which differentiates as element 0.
        # A cotangent batched at a vmap level opened over this backward (jacrev's rows):
        # plain bmm, through that level's rule, which torch records on the physical tensors;
        # a Function applied to its wrappers would record on them, and the graph would not
        # leave the level (vmap(jacrev(f)) of an outer product lost the caller's graph).
        if not torch.is_grad_enabled():
            product = _batched_product
        elif isinstance(g, LevelTensor):
            product = aten.bmm.default
        else:
            product = _product_node
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            if _column_major(a):
                grad_a = product(b, g.mT).mT
            else:
                grad_a = product(g, b.mT)
        if ctx.needs_input_grad[1]:
            if _column_major(b):
                grad_b = product(g.mT, a).mT
            else:
                grad_b = product(a.mT, g)
        return grad_a, grad_b, grad_bias


def _product_node(a, b, bias=None):
    return _apply_original(BatchedProduct, a, b, bias)


def records_products(direct, a, b) -> bool:
    """Whether a direct grad level `direct` has torch's autograd record the physical
    product a @ b (batched operands) as a `BatchedProduct` (plain real tensors, one of them
    differentiated). Not where the level's inputs stay connected to the graph of an outer
    functx transform (MAML's inner steps under the meta-gradient's grad): that transform
    differentiates the gradient again, and the double backward would run this Function's
    Python backward per product (MAML step 0.92x -> 1.17x torch.func); tiny per-task
    weights gain nothing from a layout. Inputs connected only because the caller's tensors
    require grad (`dict(model.named_parameters())` passed as is) do take it: per-sample
    gradients must not depend on whether the caller's parameters require grad (they
    differed by up to 7e-7 in float32, and in layout; dattri compares them with allclose's
    defaults)."""
    return (
        not (direct.connected and direct.under_ad)
        and is_physical(a)
        and is_physical(b)
        and (a.requires_grad or b.requires_grad)
        and torch.is_grad_enabled()
        and a.dtype.is_floating_point
        and b.dtype.is_floating_point
    )


# -- products: mm, bmm, mv, dot, vdot -----------------------------------------------------
@VMAP_RULES.register(aten.mm.default)
def _mm(interp, a, b):
    # One side batched: one GEMM, the batch folded into the rows (a batched: (B, n, k) as
    # (B*n, k)) or the columns (b batched: (k, B*m)) of the batched side. Otherwise the
    # unbatched side is expanded (a view) into one bmm. The result stays contiguous, which
    # the `_unsafe_view`s that follow a decomposed matmul rely on.
    _expect_dims("mm", self=(a, 2), mat2=(b, 2))
    # aten ops, not torch.matmul: matmul is composite and would re-decompose into views,
    # expands and bmm at every level below (the MAML benchmark spends ~9% there).
    if interp.is_batched(a) and not interp.is_batched(b):
        value = a._value
        size, n, k = value.shape
        m = b.shape[1]
        if _rows_fold(value) or _worth_a_copy(n, n, k, m):
            return interp.wrap(aten.mm.default(value.reshape(size * n, k), b).view(size, n, m))
        # small rows that do not fold without a copy (a transposed batch of matrices: the
        # tangent of `grad.t() @ x` in a weight's backward): bmm reads them as they lie
        return interp.wrap(aten.bmm.default(value, b.expand(size, *b.shape)))
    if interp.is_batched(b) and not interp.is_batched(a) and _worth_a_copy(b.shape[1], *a.shape, b.shape[1]):
        value = b._value
        size, k, m = value.shape
        columns = aten.mm.default(a, value.transpose(0, 1).reshape(k, size * m))
        return interp.wrap(columns.view(a.shape[0], size, m).transpose(0, 1).contiguous())
    return interp.wrap(aten.bmm.default(materialize(interp, a), materialize(interp, b)))


def _worth_a_copy(folded: int, n: int, k: int, m: int) -> bool:
    """Whether an (n, k) @ (k, m) product per batch element pays for copying the batched
    operand (and the result) into one GEMM, against a bmm of B GEMMs: where each element's
    GEMM is skinny in the dim the fold multiplies by B (`folded`: n for a batched left
    operand, m for a batched right one) and large enough overall. Measured (1 thread,
    float32 and float64, B = 16): (16, 256) @ (256, 784) and (256, 784) @ (784, 16) per
    element, influence functions' Hessian-vector products, 1.2-1.8x faster folded; products
    under ~2^20 multiply-adds, or with that dim 128 or more (a Hessian @ matrix of a
    256-wide MLP: (128, 256) @ (256, 256)), are faster as a bmm."""
    return folded <= 32 and n * k * m >= 1 << 20


@UNDER_DIRECT_GRAD.register(aten.mm.default)
def _mm_recorded(direct, interp, a, b):
    """mm of batched operands (not the one-GEMM fold) as a `BatchedProduct`, where the direct
    grad level differentiates them (`records_products`)."""
    if interp.is_batched(a) and not interp.is_batched(b):
        return NotImplemented
    _expect_dims("mm", self=(a, 2), mat2=(b, 2))
    left, right = materialize(interp, a), materialize(interp, b)
    if not records_products(direct, left, right):
        return NotImplemented
    return interp.wrap(_product_node(left, right))


def _rows_fold(value) -> bool:
    """Whether a physical (B, n, k) batch of matrices folds into (B*n, k) rows as a view."""
    size, n, _ = value.shape
    return size == 1 or n == 1 or value.stride(0) == n * value.stride(1)


@VMAP_RULES.register(aten.bmm.default)
def _bmm(interp, a, b):
    _expect_dims("bmm", self=(a, 3), mat2=(b, 3))
    return interp.wrap(torch.matmul(_phys(interp, a), _phys(interp, b)))


@VMAP_RULES.register(aten.mv.default)
def _mv(interp, a, v):
    _expect_dims("mv", self=(a, 2), vec=(v, 1))
    if not interp.is_batched(a):  # rows of v against a: (B, k) @ (k, n), one GEMM
        return interp.wrap(torch.matmul(v._value, a.mT))
    return interp.wrap(torch.matmul(a._value, _phys(interp, v).unsqueeze(-1)).squeeze(-1))


def _dot_physical(interp, a, b):
    if interp.is_batched(a) and interp.is_batched(b):
        return torch.matmul(a._value.unsqueeze(-2), b._value.unsqueeze(-1)).flatten()
    if interp.is_batched(a):
        return torch.matmul(a._value, b)
    return torch.matmul(b._value, a)


@VMAP_RULES.register(aten.dot.default)
def _dot(interp, a, b):
    _expect_dims("dot", self=(a, 1), tensor=(b, 1))
    return interp.wrap(_dot_physical(interp, a, b))


@VMAP_RULES.register(aten.vdot.default)
def _vdot(interp, a, b):
    _expect_dims("vdot", self=(a, 1), other=(b, 1))
    # conj_physical: a lazy conjugate bit made inside a rule would not be honoured by the
    # kernels called here (the Conjugate dispatch key is off inside __torch_dispatch__).
    return interp.wrap(_dot_physical(interp, a.conj_physical(), b))


# -- products with an added term: addmm, addmv, addr, addbmm, baddbmm ----------------------
def _addmm_rows_fold(interp, self, m1, m2) -> bool:
    """F.linear on a batched input: the batch joins the rows of one addmm."""
    rows_fold = not interp.is_batched(self) and (self.dim() < 2 or self.shape[0] == 1)
    return interp.is_batched(m1) and not interp.is_batched(m2) and rows_fold and _rows_fold(m1._value)


def _addmm(interp, self, m1, m2, *, beta=1, alpha=1):
    _expect_dims("addmm", mat1=(m1, 2), mat2=(m2, 2))
    if _addmm_rows_fold(interp, self, m1, m2):
        size = interp.batch_size
        flat = m1._value.reshape(size * m1.shape[0], m1.shape[1])
        out = torch.addmm(self, flat, m2, beta=beta, alpha=alpha)
        return interp.wrap(out.view(size, m1.shape[0], m2.shape[1]))
    if interp.is_batched(m1) or interp.is_batched(m2):
        left, right = materialize(interp, m1), materialize(interp, m2)
        out = torch.baddbmm(_phys_at_rank(interp, self, 2), left, right, beta=beta, alpha=alpha)
        return interp.wrap(out)
    return interp.wrap(_scale_add(interp, torch.mm(m1, m2), self, 2, beta, alpha))


@UNDER_DIRECT_GRAD.register(aten.addmm.default)
def _addmm_recorded(direct, interp, self, m1, m2, *, beta=1, alpha=1):
    """F.linear under vmap(grad): addmm of batched factors (not the one-addmm fold) as a
    `BatchedProduct` with its bias, where the level differentiates them (`records_products`)."""
    _expect_dims("addmm", mat1=(m1, 2), mat2=(m2, 2))
    if not (interp.is_batched(m1) or interp.is_batched(m2)) or _addmm_rows_fold(interp, self, m1, m2):
        return NotImplemented
    left, right = materialize(interp, m1), materialize(interp, m2)
    if not records_products(direct, left, right):
        return NotImplemented
    if beta == 1 and alpha == 1:
        bias = _phys_at_rank(interp, self, 2)
        if is_physical(bias) and bias.dtype == left.dtype:
            return interp.wrap(_product_node(left, right, bias))
    return interp.wrap(_scale_add(interp, _product_node(left, right), self, 2, beta, alpha))


def _addmv(interp, self, mat, vec, *, beta=1, alpha=1):
    _expect_dims("addmv", mat=(mat, 2), vec=(vec, 1))
    self_p = _phys_at_rank(interp, self, 1)
    if not interp.is_batched(mat):
        if not interp.is_batched(vec):  # only self batched
            return interp.wrap(_scale_add(interp, torch.mv(mat, vec), self, 1, beta, alpha))
        # rows of vec against mat: one addmm, self broadcast over the batch rows
        return interp.wrap(torch.addmm(self_p, vec._value, mat.mT, beta=beta, alpha=alpha))
    column = materialize(interp, vec).unsqueeze(-1)
    out = torch.baddbmm(self_p.unsqueeze(-1), mat._value, column, beta=beta, alpha=alpha)
    return interp.wrap(out.squeeze(-1))


def _addr(interp, self, vec1, vec2, *, beta=1, alpha=1):
    # Elementwise (as torch's own decomposition): a k=1 GEMM would waste the BLAS call,
    # and addr also accepts integer and bool tensors.
    _expect_dims("addr", vec1=(vec1, 1), vec2=(vec2, 1))
    outer = _phys(interp, vec1).unsqueeze(-1) * _phys(interp, vec2).unsqueeze(-2)
    if outer.dtype is torch.bool:
        out = outer if alpha else torch.zeros_like(outer)
        if beta:
            out = out | _phys_at_rank(interp, self, 2)
        if out.dim() == 2:
            out = _with_batch(interp, out)
        return interp.wrap(out)
    return interp.wrap(_scale_add(interp, outer, self, 2, beta, alpha))


def _addbmm(interp, self, batch1, batch2, *, beta=1, alpha=1):
    # sum_i batch1[i] @ batch2[i] is one matrix product over the joint (i, k) index:
    # (n, N*k) @ (N*k, m). The reshapes are logical ops on this level's tensors.
    _expect_dims("addbmm", batch1=(batch1, 3), batch2=(batch2, 3))
    n_mats, rows, inner = batch1.shape
    left = batch1.transpose(0, 1).reshape(rows, n_mats * inner)
    right = batch2.reshape(n_mats * inner, batch2.shape[2])
    return _addmm(interp, self, left, right, beta=beta, alpha=alpha)


def _baddbmm(interp, self, batch1, batch2, *, beta=1, alpha=1):
    _expect_dims("baddbmm", batch1=(batch1, 3), batch2=(batch2, 3))
    if interp.is_batched(batch1) or interp.is_batched(batch2):
        product = torch.matmul(_phys(interp, batch1), _phys(interp, batch2))
    else:
        product = torch.bmm(batch1, batch2)
    return interp.wrap(_scale_add(interp, product, self, 3, beta, alpha))


for _op, _inplace_op, _rule in (
    (aten.addmm.default, aten.addmm_.default, _addmm),
    (aten.addmv.default, aten.addmv_.default, _addmv),
    (aten.addr.default, aten.addr_.default, _addr),
    (aten.addbmm.default, aten.addbmm_.default, _addbmm),
    (aten.baddbmm.default, aten.baddbmm_.default, _baddbmm),
):
    VMAP_RULES.set(_op, _rule)
    VMAP_RULES.set(_inplace_op, _inplace(_inplace_op, _rule))


@VMAP_RULES.register(aten._trilinear.default)
def _trilinear(interp, i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    """F.bilinear's kernel: unsqueeze each input at its `expand` dims to a common rank,
    multiply, sum over `sumdim`. The batch is one more leading dim; an unbatched input
    gets it as one more unsqueezed dim, so it broadcasts instead of being copied."""
    total = i1.dim() + len(expand1)

    def shift(dims):
        return [d % total + 1 for d in dims]

    args, expands = [], []
    for t, expand in ((i1, expand1), (i2, expand2), (i3, expand3)):
        if interp.is_batched(t):
            args.append(t._value)
            expands.append(shift(expand))
        else:
            args.append(t)
            expands.append([0, *shift(expand)])
    out = aten._trilinear(*args, *expands, shift(sumdim), unroll_dim % total + 1)
    return interp.wrap(out)


@VMAP_RULES.register(aten.trace.default)
def _trace(interp, x):
    _expect_dims("trace", self=(x, 2))
    return interp.wrap(x._value.diagonal(0, 1, 2).sum(-1))


# -- one-matrix kernels: they all map over leading dims ------------------------------------
def _leading_dims_rule(op):
    """`batch_all_rule` (batch dim in front; dim args shifted) plus the fix-up of empty
    placeholder outputs that do not carry the batch."""
    inner = batch_all_rule(op)

    def rule(interp, *args, **kwargs):
        out = inner(interp, *args, **kwargs)
        if isinstance(out, Tensor):
            return out
        return _wrap_results(interp, tuple(o._value if interp.is_batched(o) else o for o in out))

    rule.__name__ = f"leading_dims_{op.__name__}"
    return rule


for _op in (
    aten.linalg_inv_ex.default,
    aten.linalg_cholesky_ex.default,
    aten.cholesky.default,
    aten.cholesky_inverse.default,
    aten.linalg_qr.default,
    aten._linalg_svd.default,
    aten._linalg_eigh.default,
    aten.linalg_eig.default,
    aten._linalg_eigvals.default,
    aten.linalg_lu_factor_ex.default,
    aten.linalg_lu.default,
    aten.linalg_ldl_factor_ex.default,
    aten.geqrf.default,
    aten.tril.default,
    aten.triu.default,
    aten.tril_.default,
    aten.triu_.default,
    aten.diagonal_copy.default,
    aten.linalg_cross.default,  # both operands have the same logical rank (torch checks)
):
    VMAP_RULES.set(_op, _leading_dims_rule(_op))


@VMAP_RULES.register(aten.linalg_matrix_exp.default)
def _matrix_exp(interp, x):
    # The kernel `view`s its leading dims into one, which fails for a layout such as
    # in_dims=-1 gives; reshape them into one ourselves (a copy only where needed).
    value = x._value
    flat = value.reshape(-1, *value.shape[-2:]) if x.dim() >= 2 else value
    return interp.wrap(aten.linalg_matrix_exp(flat).view(value.shape))


def _transposed_lu_safe(interp, A):
    """Physical A for kernels that factor A^T instead of A when A is contiguous and real
    (`_linalg_det`, `_linalg_slogdet`, `_linalg_solve_ex`): their backward formulas check
    the *logical* A's contiguity to know which LU they got, so the physical A must be
    contiguous exactly when the logical one is (torch.func does the same)."""
    value = materialize(interp, A)
    if A.is_contiguous() and not A.is_complex():
        value = value.contiguous()
    return value


def _det_rule(op):
    def rule(interp, A):
        return _wrap_results(interp, op(_transposed_lu_safe(interp, A)))

    rule.__name__ = f"det_{op.__name__}"
    return rule


for _op in (aten._linalg_det.default, aten._linalg_slogdet.default):
    VMAP_RULES.set(_op, _det_rule(_op))


# -- several operands whose leading dims broadcast ------------------------------------------
def _broadcast_rule(op, cores):
    """Rule for an op whose tensor arguments are (*lead, core dims) with broadcasting (or
    equal) leads. `cores`: argument name -> number of core dims. Every tensor argument
    gets the batch dim and is padded to the common lead rank, so the leads line up."""
    names = [a.name for a in op._schema.arguments]
    slots = [(names.index(name), name, core) for name, core in cores.items()]

    def rule(interp, *args, **kwargs):
        args = list(args)
        present = []
        for index, name, core in slots:
            if index < len(args):
                container, key = args, index
            elif name in kwargs:
                container, key = kwargs, name
            else:
                continue
            if isinstance(container[key], Tensor):
                present.append((container, key, core))
        lead = max(container[key].dim() - core for container, key, core in present)
        values = [_aligned(interp, container[key], core, lead) for container, key, core in present]
        # Expand the leads to their broadcast shape too (views): torch's kernels broadcast
        # them themselves, but linalg_lu_solve computes wrong results from an F-contiguous
        # LU whose size-1 lead dim has an unusual stride (as padding makes).
        lead_shape = torch.broadcast_shapes(*(v.shape[: v.dim() - core] for v, (_, _, core) in zip(values, present)))
        # The remaining size-1 lead dims get dense strides (`_dense_unit_dims`).
        for value, (container, key, core) in zip(values, present):
            container[key] = _dense_unit_dims(value.expand(*lead_shape, *value.shape[value.dim() - core :]))
        return _wrap_results(interp, op(*args, **kwargs))

    rule.__name__ = f"broadcast_{op.__name__}"
    return rule


for _op, _cores in (
    (aten.linalg_lu_solve.default, {"LU": 2, "pivots": 1, "B": 2}),
    (aten.lu_unpack.default, {"LU_data": 2, "LU_pivots": 1}),
    (aten.linalg_ldl_solve.default, {"LD": 2, "pivots": 1, "B": 2}),
    (aten.triangular_solve.default, {"self": 2, "A": 2}),
    (aten.linalg_solve_triangular.default, {"self": 2, "B": 2}),
    (aten.cholesky_solve.default, {"self": 2, "input2": 2}),
    (aten.linalg_householder_product.default, {"input": 2, "tau": 1}),
    (aten.ormqr.default, {"self": 2, "input2": 1, "input3": 2}),
    (aten.linalg_pinv.atol_rtol_tensor, {"self": 2, "atol": 0, "rtol": 0}),
    (aten._cdist_forward.default, {"x1": 2, "x2": 2}),
    (aten._cdist_backward.default, {"grad": 2, "x1": 2, "x2": 2, "cdist": 2}),
    (aten._euclidean_dist.default, {"x1": 2, "x2": 2}),
):
    VMAP_RULES.set(_op, _broadcast_rule(_op, _cores))


def _is_vector_rhs(A, B):
    """torch's rule (linalg_solve_is_vector_rhs) for B being a vector (or batch of
    vectors), decided on the logical shapes: physically the extra batch dim changes it."""
    return B.dim() == 1 or (B.dim() == A.dim() - 1 and B.shape == A.shape[:-1])


@VMAP_RULES.register(aten._linalg_solve_ex.default)
def _linalg_solve_ex(interp, A, B, *, left=True, check_errors=False):
    # The vector case is made explicit (B -> (..., n, 1)) so that the physical call is
    # always the matrix case. LU, pivots and info follow A's leads, not the broadcast.
    vector = _is_vector_rhs(A, B)
    b_core = 1 if vector else 2
    lead = max(A.dim() - 2, B.dim() - b_core)
    if left and not interp.is_batched(A):
        return _solve_shared_A(interp, A, B, vector, lead, check_errors)
    a_pad = lead - (A.dim() - 2)
    A_p = pad_to_rank(_transposed_lu_safe(interp, A), A.dim(), lead + 2)
    B_p = _aligned(interp, B, b_core, lead)
    if vector:
        B_p = B_p.unsqueeze(-1)
    result, LU, pivots, info = aten._linalg_solve_ex(A_p, B_p, left=left, check_errors=check_errors)
    if vector:
        result = result.squeeze(-1)
    if a_pad:
        LU, pivots, info = (t.flatten(0, a_pad) for t in (LU, pivots, info))
    return _wrap_results(interp, (result, LU, pivots, info))


def _solve_shared_A(interp, A, B, vector, lead, check_errors):
    """A X = B with A the same for every batch element: the batch joins B's columns, so
    A is factored once instead of once per element. LU, pivots and info depend on A
    only and are returned unbatched."""
    columns = 1 if vector else B.shape[-1]
    # At (at least) A's rank: torch would take a B of rank A.dim() - 1 for a vector.
    folded = _fold_columns(B._value, vector, lead + 2)
    result, LU, pivots, info = aten._linalg_solve_ex(A, folded, left=True, check_errors=check_errors)
    result = _unfold_columns(interp, result, columns)
    if vector:
        result = result.squeeze(-1)
    return interp.wrap(result), LU, pivots, info


@VMAP_RULES.register(aten.linalg_lstsq.default)
def _linalg_lstsq(interp, A, B, rcond=None, *, driver=None):
    if not 0 <= A.dim() - B.dim() <= 1:
        raise RuntimeError(
            "torch.linalg.lstsq: input.dim() must be greater or equal to other.dim() and "
            "(input.dim() - other.dim()) <= 1"
        )
    vector = _is_vector_rhs(A, B)
    lead = A.dim() - 2
    if not interp.is_batched(A):
        return _lstsq_shared_A(interp, A, B, vector, rcond, driver)
    A_p = materialize(interp, A)
    B_p = _aligned(interp, B, 1 if vector else 2, lead)
    if vector:  # per sample, residuals are (*, 1) in the vector case too: only X changes
        B_p = B_p.unsqueeze(-1)
    solution, residuals, rank, singular_values = aten.linalg_lstsq(A_p, B_p, rcond, driver=driver)
    if vector:
        solution = solution.squeeze(-1)
    return _wrap_results(interp, (solution, residuals, rank, singular_values))


def _fold_columns(value, vector, rank):
    """(batch, *lead, m[, k]) -> (*lead, m, k * batch) at `rank` dims: the batch joins
    the columns of a right-hand side (a vector is one column)."""
    if vector:
        value = value.unsqueeze(-1)
    folded = value.movedim(0, -1).flatten(-2)
    return folded.view(*((1,) * (rank - folded.dim())), *folded.shape)


def _unfold_columns(interp, value, columns):
    """Inverse of `_fold_columns` on a result: (..., k * batch) -> (batch, ..., k)."""
    return value.unflatten(-1, (columns, interp.batch_size)).movedim(-1, 0)


def _lstsq_shared_A(interp, A, B, vector, rcond, driver):
    """Least squares with the same A for every batch element: one factorization, the
    batch joins B's columns. rank and singular values depend on A only (unbatched)."""
    columns = 1 if vector else B.shape[-1]
    folded = _fold_columns(B._value, vector, A.dim())
    solution, residuals, rank, singular_values = aten.linalg_lstsq(A, folded, rcond, driver=driver)
    solution = _unfold_columns(interp, solution, columns)
    if vector:
        solution = solution.squeeze(-1)
    # residuals: (*, k * batch) when computed, else an empty (0,) placeholder
    residuals = _unfold_columns(interp, residuals, columns) if residuals.numel() else residuals
    solution, residuals = _wrap_results(interp, (solution, residuals))
    return solution, residuals, rank, singular_values


@VMAP_RULES.register(aten._linalg_check_errors.default)
def _linalg_check_errors(interp, info, api_name, *, is_matrix):
    # `is_matrix=True` reads info as one scalar; physically info has the batch dim.
    aten._linalg_check_errors(info._value, api_name, is_matrix=False)


@VMAP_RULES.register(aten._pdist_forward.default)
def _pdist_forward(interp, x, p=2.0):
    """pdist has no batched kernel: take the strict upper triangle (row-major, pdist's
    order) of the batched cdist, computed without the mm shortcut (exact differences,
    as pdist)."""
    _expect_dims("pdist", self=(x, 2))
    n = x.shape[0]
    full = aten._cdist_forward(x._value, x._value, p, 2)
    rows, cols = torch.triu_indices(n, n, 1, device=full.device)
    return interp.wrap(full.flatten(1).index_select(1, rows * n + cols))
