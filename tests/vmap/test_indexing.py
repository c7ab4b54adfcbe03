"""Batching rules for indexing and scatter ops (functx/vmap/rules/indexing.py).

Every check compares `functx.vmap` with a per-sample loop, for every way of batching the
tensor arguments (each alone, every combination, batch at dim 0 and at the last dim), and
runs under `vmap_fallback("error")` so that a per-sample loop inside vmap would fail.
"""

import itertools

import pytest
import torch
import torch.nn.functional as F

import functx
from functx import vmap

aten = torch.ops.aten
B = 3


# -- harness -------------------------------------------------------------------------------
def _stack(samples, in_dim):
    stacked = torch.stack(samples)
    return stacked.movedim(0, in_dim) if stacked.dim() > 1 else stacked


def check_batchings(f, *makers, batchable=None, require=(), in_dim_choices=(0, -1), atol=None, rtol=None):
    """`makers[i]()` draws one logical sample of argument i (a fresh draw per batch element).
    For each non-empty subset of the `batchable` arguments that holds the `require`d ones
    (in-place ops need a batched self) and each in_dim, compare vmap with the loop."""
    batchable = range(len(makers)) if batchable is None else batchable
    subsets = [s for r in range(1, len(batchable) + 1) for s in itertools.combinations(batchable, r)]
    subsets = [s for s in subsets if set(require) <= set(s)]
    for subset, in_dim in itertools.product(subsets, in_dim_choices):
        samples = [[m() for _ in range(B)] if i in subset else m() for i, m in enumerate(makers)]
        expected = torch.stack([f(*(s[b] if i in subset else s for i, s in enumerate(samples))) for b in range(B)])
        args = [_stack(s, in_dim) if i in subset else s for i, s in enumerate(samples)]
        in_dims = tuple(in_dim if i in subset else None for i in range(len(makers)))
        with functx.vmap_fallback("error"):
            out = vmap(f, in_dims=in_dims)(*args)
        torch.testing.assert_close(out, expected, atol=atol, rtol=rtol, msg=lambda m: f"{subset=} {in_dim=}: {m}")


def check_nested(f, *makers):
    """vmap(vmap(f)) over every argument batched at two levels (B x 2) against two loops."""
    samples = [[[m() for _ in range(2)] for _ in range(B)] for m in makers]
    expected = torch.stack(
        [torch.stack([f(*(s[b][c] for s in samples)) for c in range(2)]) for b in range(B)]
    )
    args = [torch.stack([torch.stack(row) for row in s]) for s in samples]
    with functx.vmap_fallback("error"):
        out = vmap(vmap(f))(*args)
    torch.testing.assert_close(out, expected)


def randn(*shape):
    return lambda: torch.randn(shape)


def randint(low, high, *shape):
    return lambda: torch.randint(low, high, shape)


def distinct(n, k, *lead):
    """k distinct indices in [0, n) (per leading position): deterministic scatter/put."""
    return lambda: torch.rand(*lead, n).argsort(-1)[..., :k]


def mask(*shape):
    return lambda: torch.rand(*shape) > 0.5


# -- advanced indexing: x[idx] -> aten.index.Tensor ------------------------------------------
INDEX_CASES = {
    "leading": (lambda x, i: x[i], randn(5, 6), randint(-5, 5, 2, 3)),
    "second": (lambda x, i: x[:, i], randn(5, 6), randint(-6, 6, 4)),
    "ellipsis": (lambda x, i: x[..., i], randn(2, 5, 6), randint(0, 6, 3)),
    "adjacent_leading": (lambda x, i, j: x[i, j], randn(5, 6, 2), randint(0, 5, 2, 1), randint(0, 6, 3)),
    "adjacent_middle": (lambda x, i, j: x[:, i, j], randn(2, 5, 6, 3), randint(0, 5, 4), randint(0, 6, 4)),
    "non_adjacent": (lambda x, i, j: x[i, :, j], randn(4, 5, 6), randint(0, 4, 2, 3), randint(0, 6, 3)),
    "non_adjacent_late": (lambda x, i, j: x[:, i, :, j], randn(2, 4, 5, 6), randint(0, 4, 3), randint(0, 6, 3)),
    # A 0-dim integer index goes through aten.index directly: torch's Python front end
    # turns `x[t]` with a 0-dim t into `select(t.item())`, data-dependent under vmap.
    "mixed_rank": (lambda x, i, j: aten.index.Tensor(x, [i, j]), randn(5, 6), randint(0, 5, 2, 3), randint(0, 6)),
    "zero_dim_index": (lambda x, i: aten.index.Tensor(x, [None, i]), randn(5, 6), randint(0, 6)),
    "int32": (lambda x, i: x[:, i], randn(5, 6), lambda: torch.randint(0, 6, (4,), dtype=torch.int32)),
}


@pytest.mark.parametrize("case", sorted(INDEX_CASES))
def test_index(case):
    f, *makers = INDEX_CASES[case]
    check_batchings(f, *makers)


def test_index_with_unbatched_mask():
    m = torch.rand(5) > 0.5
    check_batchings(lambda x: x[m], randn(5, 6))
    m2 = torch.rand(5, 6) > 0.5
    check_batchings(lambda x, i: x[:, m2, i], randn(2, 5, 6, 4), randint(0, 4, 1))


def test_index_with_batched_mask_is_data_dependent():
    with functx.vmap_fallback("error"), pytest.raises(RuntimeError, match=r"(?s)depends on the values.*torch\.where"):
        vmap(lambda x, m: x[m])(torch.randn(B, 5), torch.rand(B, 5) > 0.5)


def test_index_too_many_indices_raises():
    with pytest.raises(IndexError, match="too many indices"):
        vmap(lambda x, i: aten.index.Tensor(x, [i, i]))(torch.randn(B, 5), torch.zeros(B, 2, dtype=torch.long))


def test_index_private_overloads():
    """Overloads that decompositions and torch internals emit batch like aten.index."""
    check_batchings(lambda x, i: aten._unsafe_index.Tensor(x, [None, i]), randn(4, 5), randint(0, 5, 3))
    check_batchings(lambda x, i: aten.index.Tensor_hacked_twin(x, [i]), randn(4, 5), randint(0, 4, 3))
    check_batchings(lambda x: x[True], randn(4, 5))


def test_index_nested():
    check_nested(lambda x, i, j: x[i, :, j], randn(4, 5, 6), randint(0, 4, 2), randint(0, 6, 2))
    check_nested(lambda x, i: x[:, i], randn(4, 5), randint(0, 5, 3))


def test_index_gradient_through_vmap():
    """Rules run with autograd on: a plain leaf batched by vmap gets the loop's gradient."""
    x = torch.randn(B, 5, 6, requires_grad=True)
    i = torch.randint(0, 6, (B, 4))
    (vmap(lambda a, b: a[:, b])(x, i) ** 2).sum().backward()
    expected = torch.autograd.grad(sum((x[k][:, i[k]] ** 2).sum() for k in range(B)), x)[0]
    torch.testing.assert_close(x.grad, expected)


# -- advanced assignment: x[idx] = v -> aten.index_put(_) ------------------------------------
def index_put(accumulate):
    return lambda x, i, v: torch.index_put(x, (i,), v, accumulate)


def index_put_inplace(accumulate):
    return lambda x, i, v: x.clone().index_put_((i,), v, accumulate)


def setitem(key):
    def f(x, *args):
        y = x.clone()
        *idx, v = args
        y[key(*idx)] = v
        return y

    return f


INDEX_PUT_CASES = {
    "put_row": (index_put(False), randn(5, 6), distinct(5, 3), randn(3, 6)),
    "put_broadcast_row": (index_put(False), randn(5, 6), distinct(5, 3), randn(6)),
    "put_scalar": (index_put(False), randn(5, 6), distinct(5, 3), randn()),
    "accumulate_duplicates": (index_put(True), randn(5, 6), randint(-5, 5, 7), randn(7, 6)),
    "inplace": (index_put_inplace(False), randn(5, 6), distinct(5, 2), randn(2, 6)),
    "inplace_accumulate": (index_put_inplace(True), randn(5, 6), randint(0, 5, 7), randn(6)),
    "setitem_second": (setitem(lambda i: (slice(None), i)), randn(4, 5), distinct(5, 2), randn(4, 2)),
    "setitem_adjacent": (
        setitem(lambda i, j: (slice(None), i, j)),
        randn(2, 5, 6, 3),
        lambda: torch.arange(4),
        distinct(6, 4),
        randn(4, 3),
    ),
    "setitem_non_adjacent": (
        setitem(lambda i, j: (i, slice(None), j)),
        randn(4, 5, 6),
        lambda: torch.arange(3),
        distinct(6, 3),
        randn(3, 5),
    ),
}


@pytest.mark.parametrize("case", sorted(INDEX_PUT_CASES))
def test_index_put(case):
    f, *makers = INDEX_PUT_CASES[case]
    inplace = case.startswith(("inplace", "setitem"))  # writing into an unbatched self raises
    check_batchings(f, *makers, require=(0,) if inplace else ())


def test_index_put_private_overloads():
    unsafe = lambda x, i, v: aten._unsafe_index_put(x, [None, i], v, True)
    check_batchings(unsafe, randn(4, 5), randint(0, 5, 3), randn(3))
    check_batchings(lambda x, i, v: aten.index_put.hacked_twin(x, [i], v), randn(4, 5), distinct(4, 2), randn(2, 5))
    impl = lambda x, i, v: aten._index_put_impl_(x.clone(), [i], v, True, False)
    check_batchings(impl, randn(4, 5), randint(0, 4, 3), randn(5), require=(0,))
    twin = lambda x, i, v: aten.index_put_.hacked_twin(x.clone(), [i], v)
    check_batchings(twin, randn(4, 5), distinct(4, 3), randn(3, 5), require=(0,))


def test_setitem_with_unbatched_mask():
    m = torch.rand(5) > 0.5
    check_batchings(setitem(lambda: m), randn(5, 6), randn(6), require=(0,))
    check_batchings(setitem(lambda: m), randn(5, 6), randn(int(m.sum()), 6), require=(0,))  # one row each
    check_batchings(setitem(lambda: (slice(None), m)), randn(2, 5), randn(2, int(m.sum())), require=(0,))


def test_setitem_with_batched_mask_and_value_that_does_not_vary_is_where():
    """`x[x > 0] = 0` and `x[mask] = row` are fixed-shape: they batch as torch.where."""
    check_batchings(setitem(lambda m: m), randn(5, 6), mask(5, 6), randn(), require=(0,))
    check_batchings(setitem(lambda m: m), randn(5, 6), mask(5), randn(6), require=(0,))
    check_batchings(setitem(lambda m: (slice(None), m)), randn(4, 5, 6), mask(5), randn(4, 1, 6), require=(0,))
    accumulate = lambda x, m, v: torch.index_put(x, (m,), v, accumulate=True)
    check_batchings(accumulate, randn(5, 6), mask(5, 6), randn(1))


@pytest.mark.filterwarnings("ignore::functx.PerformanceWarning")
def test_setitem_with_batched_mask_and_values_per_entry_is_data_dependent():
    """Per sample it is well defined: vmap's whole-function fallback runs it so."""
    f = setitem(lambda m: m)
    x, m, v = torch.randn(B, 4), torch.ones(B, 4, dtype=torch.bool), torch.randn(B, 4)
    with functx.vmap_fallback("error"), pytest.raises(RuntimeError, match="depends on the values"):
        vmap(f)(x, m, v)
    torch.testing.assert_close(vmap(f)(x, m, v), torch.stack([f(*a) for a in zip(x, m, v)]))


def test_index_put_into_unbatched_tensor_raises():
    base = torch.zeros(5)
    with pytest.raises(RuntimeError, match="not batched at this vmap level"):
        vmap(lambda i: base.index_put_((i,), torch.tensor(1.0)))(torch.zeros(B, 2, dtype=torch.long))
    torch.testing.assert_close(base, torch.zeros(5))


def test_index_put_nested():
    non_adjacent = setitem(lambda i, j: (i, slice(None), j))
    check_nested(non_adjacent, randn(4, 5, 6), lambda: torch.arange(3), distinct(6, 3), randn(3, 5))
    check_nested(index_put(True), randn(5, 6), randint(0, 5, 7), randn(7, 6))


# -- gather / scatter ------------------------------------------------------------------------
def test_gather():
    for dim in (0, 1, -1):
        check_batchings(lambda x, i: torch.gather(x, dim, i), randn(4, 5), randint(0, 4, 3, 3))
    check_batchings(lambda x, i: torch.gather(x, 0, i), randn(), randint(0, 1, 1))
    check_batchings(lambda x, i: torch.gather(x, 0, i), randn(4), randint(0, 4))


def test_take_along_dim_is_composite_over_gather():
    check_batchings(lambda x, i: torch.take_along_dim(x, i, 1), randn(4, 5), randint(0, 5, 4, 2))
    check_batchings(lambda x, i: torch.take_along_dim(x, i), randn(4, 5), randint(0, 20, 6))


SCATTER_CASES = {
    "src": lambda x, i, s: torch.scatter(x, 1, i, s),
    "src_neg_dim": lambda x, i, s: torch.scatter(x, -1, i, s),
    "value": lambda x, i, s: torch.scatter(x, 1, i, 2.5),
    "reduce_add": lambda x, i, s: torch.scatter(x, 1, i, s, reduce="add"),
    "reduce_multiply": lambda x, i, s: torch.scatter(x, 1, i, s, reduce="multiply"),
    "value_reduce": lambda x, i, s: torch.scatter(x, 1, i, 2.0, reduce="multiply"),
    "inplace_src": lambda x, i, s: x.clone().scatter_(1, i, s),
    "inplace_value": lambda x, i, s: x.clone().scatter_(1, i, -1.0),
    "inplace_reduce": lambda x, i, s: x.clone().scatter_(1, i, s, reduce="add"),
    "add": lambda x, i, s: torch.scatter_add(x, 1, i, s),
    "add_inplace": lambda x, i, s: x.clone().scatter_add_(-1, i, s),
}


@pytest.mark.parametrize("case", sorted(SCATTER_CASES))
def test_scatter(case):
    require = (0,) if "inplace" in case else ()
    check_batchings(SCATTER_CASES[case], randn(4, 6), distinct(6, 3, 4), randn(4, 5), require=require)


@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
def test_scatter_reduce(reduce, include_self):
    f = lambda x, i, s: torch.scatter_reduce(x, 0, i, s, reduce, include_self=include_self)
    check_batchings(f, randn(4, 5), randint(0, 4, 6, 5), randn(6, 5))
    g = lambda x, i, s: x.clone().scatter_reduce_(-1, i, s, reduce, include_self=include_self)
    check_batchings(g, randn(4, 5), randint(0, 5, 4, 7), randn(4, 7), require=(0,), in_dim_choices=(0,))


def test_scatter_zero_dim():
    check_batchings(lambda x, i, s: torch.scatter(x, 0, i, s), randn(), randint(0, 1, 1), randn(1))
    check_batchings(lambda x, i, s: torch.scatter_add(x, 0, i, s), randn(4), randint(0, 4), randn())


def test_scatter_into_unbatched_tensor_raises():
    base = torch.zeros(3, 4)
    with pytest.raises(RuntimeError, match="not batched at this vmap level"):
        vmap(lambda s: base.scatter_(1, torch.zeros(3, 1, dtype=torch.long), s))(torch.randn(B, 3, 1))


def test_gather_scatter_nested():
    check_nested(lambda x, i: torch.gather(x, 1, i), randn(4, 5), randint(0, 5, 4, 2))
    check_nested(lambda x, i, s: torch.scatter_add(x, 0, i, s), randn(4, 5), randint(0, 4, 2, 5), randn(2, 5))


# -- the index_* family: a 1-D index along dim ------------------------------------------------
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_index_select(dim):
    check_batchings(lambda x, i: torch.index_select(x, dim, i), randn(4, 5), randint(0, 4, 6))


def test_index_select_edge_ranks():
    check_batchings(lambda x, i: torch.index_select(x, 1, i), randn(4, 5), randint(0, 5))
    check_batchings(lambda x, i: torch.index_select(x, 0, i), randn(), randint(0, 1, 1))
    int32 = lambda: torch.randint(0, 5, (4,), dtype=torch.int32)
    check_batchings(lambda x, i: torch.index_select(x, 2, i), randn(2, 3, 5), int32)


@pytest.mark.parametrize("dim", [0, -1])
def test_index_add(dim):
    source = randn(6, 4) if dim == 0 else randn(4, 6)
    check_batchings(lambda x, i, s: torch.index_add(x, dim, i, s), randn(4, 4), randint(0, 4, 6), source)
    check_batchings(lambda x, i, s: torch.index_add(x, dim, i, s, alpha=-2), randn(4, 4), randint(0, 4, 6), source)
    inplace = lambda x, i, s: x.clone().index_add_(dim, i, s, alpha=3)
    check_batchings(inplace, randn(4, 4), randint(0, 4, 2), randn(2, 4) if dim == 0 else randn(4, 2), require=(0,))


def test_index_add_zero_dim_index():
    check_batchings(lambda x, i, s: torch.index_add(x, 1, i, s), randn(3, 4), randint(0, 4), randn(3, 1))


@pytest.mark.parametrize("dim", [1, -2])
def test_index_copy(dim):
    check_batchings(lambda x, i, s: torch.index_copy(x, dim, i, s), randn(2, 5, 3), distinct(5, 3), randn(2, 3, 3))
    inplace = lambda x, i, s: x.clone().index_copy_(dim, i, s)
    check_batchings(inplace, randn(2, 5, 3), distinct(5, 3), randn(2, 3, 3), require=(0,))


@pytest.mark.parametrize("reduce", ["prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
def test_index_reduce(reduce, include_self):
    f = lambda x, i, s: torch.index_reduce(x, 0, i, s, reduce, include_self=include_self)
    check_batchings(f, randn(4, 3), randint(0, 4, 6), randn(6, 3))
    g = lambda x, i, s: x.clone().index_reduce_(-1, i, s, reduce, include_self=include_self)
    check_batchings(g, randn(3, 4), randint(0, 4, 6), randn(3, 6), require=(0,), in_dim_choices=(0,))


@pytest.mark.parametrize("dim", [0, -1])
def test_index_fill(dim):
    check_batchings(lambda x, i: torch.index_fill(x, dim, i, -2.0), randn(4, 5), randint(-4, 4, 3))
    check_batchings(lambda x, i, v: torch.index_fill(x, dim, i, v), randn(4, 5), randint(-4, 4, 3), randn())
    check_batchings(lambda x, i: x.clone().index_fill_(dim, i, 7.0), randn(4, 5), randint(0, 4, 2), require=(0,))
    inplace = lambda x, i, v: x.clone().index_fill_(dim, i, v)
    check_batchings(inplace, randn(4, 5), randint(0, 4, 2), randn(), require=(0,))
    check_batchings(lambda x, i: torch.index_fill(x, dim, i, 1.0), randn(4, 5), randint(0, 4))


def test_index_family_into_unbatched_tensor_raises():
    base = torch.zeros(4, 3)
    index = torch.zeros(B, 2, dtype=torch.long)
    for f in (
        lambda i: base.index_add_(0, i, torch.ones(2, 3)),
        lambda i: base.index_copy_(0, i, torch.ones(2, 3)),
        lambda i: base.index_fill_(0, i, 1.0),
    ):
        with pytest.raises(RuntimeError, match="not batched at this vmap level"):
            vmap(f)(index)


def test_index_family_nested():
    check_nested(lambda x, i: torch.index_select(x, 1, i), randn(4, 5), randint(0, 5, 3))
    check_nested(lambda x, i, s: torch.index_add(x, 0, i, s), randn(4, 5), randint(0, 4, 3), randn(3, 5))
    check_nested(lambda x, i: torch.index_fill(x, 1, i, 0.0), randn(4, 5), randint(0, 5, 3))


# -- take / put -----------------------------------------------------------------------------------
def test_take():
    check_batchings(torch.take, randn(4, 5), randint(-20, 20, 2, 3))
    check_batchings(torch.take, randn(), randint(-1, 1, 4))
    check_batchings(lambda x, i: torch.take(x.transpose(0, 1), i), randn(4, 5), randint(-20, 20, 6))


def test_take_out_of_range_raises():
    with pytest.raises((IndexError, RuntimeError)):
        vmap(torch.take)(torch.randn(B, 2, 3), torch.full((B, 1), -7))


def test_put():
    check_batchings(lambda x, i, s: torch.put(x, i, s), randn(4, 5), distinct(20, 6), randn(2, 3))
    check_batchings(lambda x, i, s: torch.put(x, i - 20, s, accumulate=True), randn(4, 5), randint(0, 20, 8), randn(8))
    check_batchings(lambda x, i, s: x.clone().put_(i, s), randn(4, 5), distinct(20, 3), randn(3), require=(0,))
    inplace = lambda x, i, s: x.clone().put_(i, s, accumulate=True)
    check_batchings(inplace, randn(4, 5), randint(0, 20, 9), randn(3, 3), require=(0,))
    check_batchings(lambda x, i, s: torch.put(x, i, s), randn(), randint(0, 1, 1), randn(1))


def test_take_put_nested():
    check_nested(torch.take, randn(4, 5), randint(-20, 20, 3))
    check_nested(lambda x, i, s: torch.put(x, i, s, accumulate=True), randn(4, 5), randint(0, 20, 3), randn(3))


# -- masked_scatter ---------------------------------------------------------------------------------
def test_masked_scatter():
    check_batchings(torch.masked_scatter, randn(4, 5), mask(4, 5), randn(20))
    check_batchings(torch.masked_scatter, randn(4, 5), mask(5), randn(3, 7))
    check_batchings(torch.masked_scatter, randn(5), mask(4, 5), randn(20))
    check_batchings(lambda x, m, s: x.clone().masked_scatter_(m, s), randn(4, 5), mask(5), randn(21), require=(0,))


def test_masked_scatter_backward():
    f = lambda g, m: aten.masked_scatter_backward(g, m, [3, 7])
    check_batchings(f, randn(4, 5), mask(4, 5))


def test_masked_scatter_gradient_through_vmap():
    x, s = torch.randn(B, 4, 5, requires_grad=True), torch.randn(B, 20, requires_grad=True)
    m = torch.rand(B, 4, 5) > 0.5
    (vmap(torch.masked_scatter)(x, m, s) ** 2).sum().backward()
    loss = sum((torch.masked_scatter(x[k], m[k], s[k]) ** 2).sum() for k in range(B))
    gx, gs = torch.autograd.grad(loss, (x, s))
    torch.testing.assert_close(x.grad, gx)
    torch.testing.assert_close(s.grad, gs)


def test_masked_scatter_nested():
    check_nested(torch.masked_scatter, randn(4, 5), mask(4, 5), randn(20))


# -- embedding -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("padding_idx", [None, 2, -1])
def test_embedding(padding_idx):
    f = lambda w, i: F.embedding(i, w, padding_idx=padding_idx)
    check_batchings(f, randn(6, 4), randint(0, 6, 2, 3))
    check_batchings(f, randn(6, 4), randint(0, 6))


@pytest.mark.parametrize("padding_idx", [None, 2])
@pytest.mark.parametrize("batched", ["weight", "indices", "both"])
def test_embedding_gradient_through_vmap_keeps_padding_and_freq(padding_idx, batched):
    """An ensemble of tables (batched weight): the padding row gets no gradient and
    scale_grad_by_freq counts per batch element, as in the per-sample loop."""
    weight = torch.randn(B, 6, 4) if batched != "indices" else torch.randn(6, 4)
    weight.requires_grad_()
    indices = torch.randint(0, 6, (B, 5)) if batched != "weight" else torch.randint(0, 6, (5,))
    indices[..., 0] = 2
    w_dim, i_dim = (0 if batched != "indices" else None), (0 if batched != "weight" else None)

    def f(w, i):
        return F.embedding(i, w, padding_idx=padding_idx, scale_grad_by_freq=True)

    out = vmap(f, in_dims=(w_dim, i_dim))(weight, indices)
    grad = torch.autograd.grad((out * torch.arange(4.0)).sum(), weight)[0]
    loss = sum(
        (f(weight[k] if w_dim == 0 else weight, indices[k] if i_dim == 0 else indices) * torch.arange(4.0)).sum()
        for k in range(B)
    )
    torch.testing.assert_close(grad, torch.autograd.grad(loss, weight)[0])


@pytest.mark.parametrize("padding_idx", [-1, 0, 3])
@pytest.mark.parametrize("scale_grad_by_freq", [False, True])
def test_embedding_dense_backward(padding_idx, scale_grad_by_freq):
    f = lambda g, i: aten.embedding_dense_backward(g, i, 6, padding_idx, scale_grad_by_freq)
    check_batchings(f, randn(2, 5, 4), randint(0, 6, 2, 5))


def test_embedding_max_norm_renormalizes_each_table():
    def f(w, i):
        return F.embedding(i, w.clone(), max_norm=1.0)

    check_batchings(f, lambda: torch.randn(6, 4) * 2, randint(0, 6, 5), require=(0,))


def test_embedding_max_norm_on_a_shared_table_renormalizes_the_union_of_rows():
    """What the per-sample loop leaves: every row some element looked up is rescaled once."""
    weight, indices = torch.randn(8, 4) * 2, torch.randint(0, 8, (B, 3))
    looped = weight.clone()
    expected = torch.stack([F.embedding(indices[k], looped, max_norm=1.0) for k in range(B)])
    shared = weight.clone()
    with functx.vmap_fallback("error"):
        out = vmap(lambda i: F.embedding(i, shared, max_norm=1.0))(indices)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(shared, looped)


def test_embedding_nested():
    check_nested(lambda w, i: F.embedding(i, w), randn(6, 4), randint(0, 6, 3))


# -- indices and self batched at different levels ----------------------------------------------
MIXED_LEVEL_CASES = {
    "index": lambda a, b: a[b],
    "index_put": lambda a, b: torch.index_put(a, (b,), torch.tensor(1.0), True),
    "index_select": lambda a, b: torch.index_select(a, 0, b),
    "gather": lambda a, b: torch.gather(a, 0, b[:, None].expand(2, 6)),
    "index_add": lambda a, b: torch.index_add(a, 0, b, torch.ones(2, 6)),
    "take": torch.take,
    "put": lambda a, b: torch.put(a, b, torch.ones(2), accumulate=True),
    "embedding": lambda w, b: F.embedding(b, w, padding_idx=1),
}


@pytest.mark.parametrize("case", sorted(MIXED_LEVEL_CASES))
def test_self_and_index_batched_at_different_levels(case):
    """Inside a rule, an argument of another vmap level is a plain value to this level."""
    f = MIXED_LEVEL_CASES[case]
    x, i = torch.randn(3, 5, 6), torch.randint(0, 5, (4, 2))
    with functx.vmap_fallback("error"):
        inner_self = vmap(vmap(f, in_dims=(0, None)), in_dims=(None, 0))(x, i)
        inner_index = vmap(vmap(f, in_dims=(None, 0)), in_dims=(0, None))(x, i)
    expected = torch.stack([torch.stack([f(x[a], i[b]) for b in range(4)]) for a in range(3)])
    torch.testing.assert_close(inner_self, expected.transpose(0, 1))
    torch.testing.assert_close(inner_index, expected)


def test_mask_assignment_with_mask_batched_at_the_outer_level():
    x, m = torch.randn(3, 5, 6), torch.rand(4, 5, 6) > 0.5
    f = lambda a, mm, v: torch.index_put(a, (mm,), v)  # (x is not batched at m's level)
    with functx.vmap_fallback("error"):
        out = vmap(vmap(f, in_dims=(0, None, None)), in_dims=(None, 0, None))(x, m, torch.tensor(0.0))
    expected = torch.stack([torch.stack([f(x[a], m[b], torch.tensor(0.0)) for a in range(3)]) for b in range(4)])
    torch.testing.assert_close(out, expected)
