"""vmap of every op in torch's op database (`op_db`), checked against a per-sample loop.

For each OpInfo with float32 CPU samples, `opdb_support.check_op` batches B=3 samples and
compares `functx.vmap` with a loop of the op: batch at dim 0, batch at a trailing dim,
and each of the first tensor arguments unbatched in turn; the same for the op's in-place
variant (`x.add_(y)`), where an unbatched `self` with batched arguments must raise. It
runs under `functx.vmap_fallback("error")` first, so "passing" means correct AND vectorized (no
per-sample loop); see opdb_support's docstring for how batches are built and how random
and data-dependent ops are judged.

Commands (from the repository root; times on the shared 2-core machine):
    CI subset, the first sample of every op and in-place variant (run by default, 20-30 s):
        .venv/bin/python -m pytest tests/vmap/test_op_db.py -n 2
    Full sweep, up to FULL_SAMPLES samples of every op and in-place variant (35-45 s):
        .venv/bin/python -m pytest tests/vmap/test_op_db.py -m slow -n 2
    Coverage table and measured fractions (docs/coverage.md):
        .venv/bin/python scripts/coverage_table.py --jobs 2

Known failures are listed below, each with its reason, and marked xfail (strict in the
full sweep, so an op that starts working must be taken off its list). Nothing is skipped
silently: ops without a CPU float32 sample are reported as skipped with that reason.
"""

from __future__ import annotations

import pytest
import torch

import functx
from functx import vmap

from .opdb_support import CORRECT_AND_VECTORIZED, check_op, family_of, float32_ops, op_id

CI_SAMPLES = 1
FULL_SAMPLES = 16

# op id -> why vmap of it fails (wrong values or an unexpected error).
EXPECTED_FAILURES = {
    "sparse.sampled_addmm": "sparse inputs: BatchedTensor wraps strided tensors only (torch.func has no sparse vmap either)",
    "sparse.mm.reduce": "sparse inputs: BatchedTensor wraps strided tensors only (torch.func has no sparse vmap either)",
    "tensor_split": (
        "with a *batched* tensor of split indices, torch's C++ composite reads the indices' data "
        "directly (no .item() dispatch reaches vmap), which fails on the storage-less wrapper; "
        "the split points would differ per element anyway (data-dependent, torch.func refuses too)"
    ),
}

# op id -> why it is correct but not vectorized (some aten op runs the per-sample loop).
NOT_VECTORIZED = {
    "histogram": (
        "aten::histogram.bin_ct: counts must match torch bit for bit at bin edges, which come from "
        "torch.linspace's float32 arithmetic between per-element data ranges; no batched linspace"
    ),
    "histogramdd": "aten::_histogramdd_bin_edges / _histogramdd_from_bin_tensors: as histogram",
    "to_sparse": "aten::_to_sparse: sparse output (BatchedTensor wraps strided tensors only)",
    "_segment_reduce.lengths": "aten::segment_reduce: no batching rule yet (rarely used)",
    "_segment_reduce.offsets": "aten::segment_reduce: no batching rule yet (rarely used)",
    "nn.functional.embedding_bag": "indexing: aten::_embedding_bag_forward_only has no rule yet",
}
# Output shape from values: run once per element, stacked when the shapes agree (as torch.func).
_PER_SAMPLE = "data-dependent output shape: runs per sample, stacked where the shapes agree"
NOT_VECTORIZED.update(
    {
        "nonzero": f"aten::nonzero: {_PER_SAMPLE}",
        "argwhere": f"aten::nonzero: {_PER_SAMPLE}",
        "unique": f"aten::_unique2: {_PER_SAMPLE}",
        "unique_consecutive": f"aten::unique_consecutive: {_PER_SAMPLE}",
        "masked_select": f"aten::masked_select with a batched mask: {_PER_SAMPLE}",
        "repeat_interleave": f"aten::repeat_interleave.Tensor: {_PER_SAMPLE}",
    }
)

# Ops that must raise vmap's clear data-dependent RuntimeError for some samples (Python
# values or output shapes that depend on tensor values); anything else raising it fails.
DATA_DEPENDENT = {
    "item": "returns a Python number",
    "equal": "returns a Python bool",
    "allclose": "returns a Python bool",
    "masked_select": "with a batched mask, output size = number of True entries (unbatched masks work)",
    "nonzero": "output size = number of nonzero entries",
    "argwhere": "output size = number of nonzero entries",
    "unique": "output size = number of distinct values",
    "unique_consecutive": "output size = number of runs",
    "repeat_interleave": "with a tensor of repeats, output size = their sum",
    "cov": "checks that fweights are integral with torch.equal (a Python bool)",
    "narrow": "with a tensor `start`, the start is read as a Python int",
    "nn.functional.ctc_loss": (
        "batched target lengths whose maximum differs between elements: log_alpha's width "
        "(2 * max target length + 1) differs per sample (unbatched or equal-max lengths fold into N)"
    ),
    "nn.functional.gaussian_nll_loss": "validates `var` with Python control flow on values",
}

# op_db entries with no float32 sample on CPU (CUDA-only jiterator ops).
NO_CPU_SAMPLES = {
    "jiterator_unary", "jiterator_binary", "jiterator_4inputs_with_extra_args",
    "jiterator_binary_return_by_ref", "jiterator_2inputs_2outputs",
}


class NotVectorized(AssertionError):
    """Correct results, but the per-sample fallback ran for some aten op."""


def _params(strict: bool):
    params = []
    for op in float32_ops():
        identifier = op_id(op)
        marks = []
        if identifier in EXPECTED_FAILURES:
            marks.append(pytest.mark.xfail(reason=EXPECTED_FAILURES[identifier], strict=strict))
        elif identifier in NOT_VECTORIZED:
            marks.append(pytest.mark.xfail(reason=NOT_VECTORIZED[identifier], strict=strict, raises=NotVectorized))
        params.append(pytest.param(op, id=identifier, marks=marks))
    return params


def _explain(result) -> str:
    lines = [f"{result.op}: {result.status} ({result.checks} checks)"]
    if result.fallback_ops:
        lines.append(f"  per-sample fallback ran for: {', '.join(sorted(result.fallback_ops))}")
    lines += [f"  {m}" for m in result.messages]
    not_ruled = {k: v for k, v in result.aten_ops.items() if v not in ("rule", "template")}
    if not_ruled:
        lines.append(f"  aten ops without a rule: {not_ruled}")
    return "\n".join(lines)


def check(op, max_samples):
    identifier = op_id(op)
    if identifier in NO_CPU_SAMPLES:
        pytest.skip("no float32 sample on CPU (CUDA-only op)")
    result = check_op(op, max_samples)
    if result.status == "no_samples":
        pytest.fail(f"{identifier} gave no float32 sample: add it to NO_CPU_SAMPLES if that is expected")
    if result.status == "data_dependent" and identifier not in DATA_DEPENDENT:
        pytest.fail("unexpectedly data-dependent (add to DATA_DEPENDENT only if torch.func refuses too):\n" + _explain(result))
    if result.status in ("fallback", "random_fallback"):
        raise NotVectorized(_explain(result))
    assert result.status in CORRECT_AND_VECTORIZED, _explain(result)


@pytest.mark.parametrize("op", _params(strict=False))
def test_vmap_op_db_first_sample(op):
    """CI: the first sample of every op (strict=False: a failure may need a later sample)."""
    check(op, CI_SAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("op", _params(strict=True))
def test_vmap_op_db_full(op):
    """The full sweep: up to FULL_SAMPLES samples of every op; expected failures are strict."""
    check(op, FULL_SAMPLES)


# -- in-place variants (`x.add_(y)`): self batched, or unbatched with batched args (must raise) --
INPLACE_EXPECTED_FAILURES: dict = {}


def _inplace_params(strict: bool):
    params = []
    for op in float32_ops():
        if op.inplace_variant is None:
            continue
        identifier = op_id(op) + "_"
        marks = []
        if identifier in INPLACE_EXPECTED_FAILURES:
            marks.append(pytest.mark.xfail(reason=INPLACE_EXPECTED_FAILURES[identifier], strict=strict))
        params.append(pytest.param(op, id=identifier, marks=marks))
    return params


def check_inplace(op, max_samples):
    result = check_op(op, max_samples, inplace=True)
    if result.status == "no_samples":
        pytest.skip("no sample can run in place (each one broadcasts its input or has no tensor input)")
    if result.status in ("fallback", "random_fallback"):
        raise NotVectorized(_explain(result))
    assert result.status in CORRECT_AND_VECTORIZED, _explain(result)


@pytest.mark.parametrize("op", _inplace_params(strict=False))
def test_vmap_op_db_inplace_first_sample(op):
    check_inplace(op, CI_SAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("op", _inplace_params(strict=True))
def test_vmap_op_db_inplace_full(op):
    check_inplace(op, FULL_SAMPLES)


# -- the coverage target -------------------------------------------------------------------------
def _counted_ids():
    return [op_id(op) for op in float32_ops() if op_id(op) not in NO_CPU_SAMPLES]


def test_lists_name_existing_ops():
    known = {op_id(op) for op in float32_ops()}
    for name, listing in (
        ("EXPECTED_FAILURES", EXPECTED_FAILURES), ("NOT_VECTORIZED", NOT_VECTORIZED),
        ("DATA_DEPENDENT", DATA_DEPENDENT), ("NO_CPU_SAMPLES", NO_CPU_SAMPLES),
    ):
        assert not set(listing) - known, f"{name} names ops that op_db does not have: {set(listing) - known}"
    assert not set(EXPECTED_FAILURES) & set(NOT_VECTORIZED)


def test_correct_and_vectorized_fraction_meets_target():
    """At least 95% of op_db ops (with CPU samples) are correct AND vectorized.

    Every op not listed in EXPECTED_FAILURES or NOT_VECTORIZED is required to be correct
    and vectorized by the full sweep (listed ones are strict xfails there), so the
    fraction follows from the lists; scripts/coverage_table.py measures it directly.
    """
    counted = _counted_ids()
    bad = (set(EXPECTED_FAILURES) | set(NOT_VECTORIZED)) & set(counted)
    fraction = 1 - len(bad) / len(counted)
    assert fraction >= 0.95, f"{fraction:.1%} of {len(counted)} ops correct and vectorized"
    by_family = {}
    for identifier in counted:
        by_family.setdefault(family_of(identifier), []).append(identifier not in bad)
    print({family: f"{sum(v)}/{len(v)}" for family, v in sorted(by_family.items())})


# -- regressions the sweep found in the generic rules (kept small and explicit) ------------------
def _loop(f, *xs):
    return torch.stack([f(*(x[b] for x in xs)) for b in range(xs[0].shape[0])])


def test_channels_last_copies_are_channels_last_per_element():
    x = torch.randn(3, 2, 4, 5, 6)
    for f in (
        lambda t: t.to(torch.float64, memory_format=torch.channels_last),
        lambda t: t.contiguous(memory_format=torch.channels_last),
        lambda t: torch.clone(t, memory_format=torch.channels_last),
    ):
        layouts = []

        def record_layout(t):
            out = f(t)
            layouts.append(out.is_contiguous(memory_format=torch.channels_last))
            return out

        with functx.vmap_fallback("error"):
            torch.testing.assert_close(vmap(record_layout)(x), _loop(f, x))
        assert layouts == [True]  # the logical tensor inside vmap really is channels_last


def test_conjugate_view_bit_reaches_kernels_that_ignore_it():
    """torch.fft.hfftn asks the logical tensor is_conj() before a c2r kernel."""
    x = torch.randn(5, 6, 7, 3)
    f = lambda t: torch.fft.hfftn(t, norm="ortho")
    with functx.vmap_fallback("error"):
        out = vmap(f, in_dims=-1)(x)
    torch.testing.assert_close(out, _loop(f, x.movedim(-1, 0)))


def test_zero_dim_input_to_dim_shifting_rules_keeps_op_shapes():
    x = torch.randn(4)
    for f in (lambda t: t.unfold(0, 1, 1), lambda t: torch.sort(t)[0], lambda t: t.cumsum(0), lambda t: t.topk(1)[1]):
        with functx.vmap_fallback("error"):
            torch.testing.assert_close(vmap(f)(x), _loop(f, x))


def test_masked_fill_with_batched_fill_value():
    x, mask, value = torch.randn(3, 4, 5), torch.rand(3, 5) > 0.5, torch.randn(3)
    f = lambda a, m, v: a.masked_fill(m, v)
    for dims in ((0, 0, 0), (None, 0, 0), (0, None, 0), (None, None, 0)):
        args = [a[0] if d is None else a for a, d in zip((x, mask, value), dims)]
        expected = torch.stack([f(*(a if d is None else a[b] for a, d in zip(args, dims))) for b in range(3)])
        with functx.vmap_fallback("error"):
            torch.testing.assert_close(vmap(f, in_dims=dims)(*args), expected)


def test_cat_promotes_and_skips_legacy_empty_tensors():
    a, b = torch.randn(3, 2, 4), torch.randn(2, 4, dtype=torch.float64)
    f = lambda x, y: torch.cat([x, torch.empty(0), y], dim=-2)
    with functx.vmap_fallback("error"):
        out = vmap(f, in_dims=(0, None))(a, b)
    torch.testing.assert_close(out, torch.stack([f(a[i], b) for i in range(3)]))


def test_searchsorted_with_each_side_batched():
    seq, values = torch.randn(3, 6).sort(-1).values, torch.randn(3, 2, 4)
    for dims in ((0, 0), (None, 0), (0, None)):
        args = [t[0] if d is None else t for t, d in zip((seq, values), dims)]
        expected = torch.stack([torch.searchsorted(*(t if d is None else t[b] for t, d in zip(args, dims))) for b in range(3)])
        with functx.vmap_fallback("error"):
            torch.testing.assert_close(vmap(torch.searchsorted, in_dims=dims)(*args), expected)


def test_resize_keeps_each_elements_leading_values():
    x = torch.randn(3, 4)
    with functx.vmap_fallback("error"):
        torch.testing.assert_close(vmap(lambda t: t.clone().resize_(2, 2) * 2)(x), x.view(3, 2, 2) * 2)
        shrunk = vmap(lambda t: t.clone().resize_(3))(x)
    torch.testing.assert_close(shrunk, x[:, :3])


def test_copy_of_batched_values_into_an_unbatched_shape():
    """Decompositions (linspace with tensor ends) call aten.copy(unbatched, batched)."""
    start, end = torch.randn(3), torch.randn(3)
    f = lambda s, e: torch.linspace(s, e, 1)
    with functx.vmap_fallback("error"):
        torch.testing.assert_close(vmap(f)(start, end), _loop(f, start, end))


def test_nested_vmap_over_op_db_style_sample():
    """Two vmap levels over a reduction and a pointwise op with an unbatched argument."""
    x, w = torch.randn(2, 3, 4, 5), torch.randn(5)
    f = lambda a: (a * w).logsumexp(-1)
    with functx.vmap_fallback("error"):
        out = vmap(vmap(f))(x)
    torch.testing.assert_close(out, torch.stack([torch.stack([f(x[i, j]) for j in range(3)]) for i in range(2)]))
