"""functx's AD transforms on every op torch differentiates, driven by torch's op database.

For each OpInfo of `op_db` with `supports_autograd` and float32 CPU samples, on its first
3 float64 samples (see tests/ad/opdb_ad_support.py for how a sample becomes a function):
  vjp       functx.vjp vs torch.autograd.grad;
  jvp       functx.jvp vs torch.autograd.forward_ad; where the OpInfo has no forward AD,
            vs torch's double backward, else finite differences in float64;
  vmap_vjp  functx.vmap(vjp_fn) over 3 cotangents vs a loop of vjp_fn (the aten ops that
            needed vmap's per-sample fallback are recorded as the `vmap_fallback` property);
  vjp_vjp   vjp of the vjp (second order, w.r.t. primals and cotangents) vs torch's double
            backward, where the OpInfo has `supports_gradgrad`.
Test ids read `<op>[.<variant>]-<check>`, e.g. `test_ad_matches_reference[div.floor_rounding-jvp]`.

Known failures are listed below per op and check with their cause (strict xfails: a fix
makes the test fail until its entry is removed).

Commands:
  default (CI) run, a stable-hash quarter of the ops (`in_default_subset`):
      .venv/bin/python -m pytest tests/ad/test_op_db_ad.py -n 2 -q
  the other three quarters (the `slow` marker; about 6 minutes with -n 2):
      .venv/bin/python -m pytest tests/ad/test_op_db_ad.py -m slow -n 2 -q
  full sweep (every op), with the per-test properties (`reference`, `vmap_fallback`)
  in a JUnit XML file:
      .venv/bin/python -m pytest tests/ad/test_op_db_ad.py -m "slow or not slow" -n 2 -q -rfE \\
          --junitxml=/tmp/op_db_ad.xml > /tmp/op_db_ad.log 2>&1
  one op, every check:
      .venv/bin/python -m pytest tests/ad/test_op_db_ad.py -m "slow or not slow" -k "linalg.svd-"
"""

from __future__ import annotations

import pytest

from tests.ad import opdb_ad_support as support

# -- known failures, by cause ---------------------------------------------------------------
SPARSE = "sparse tensors: functx's transforms wrap strided tensors only"
SPARSE_MASK_FALLBACK = (
    "vmap: aten.sparse_mask (backward of to_dense) has no batching rule; the per-sample "
    "fallback returns a sparse value inside a strided BatchedTensor, so the next to_dense "
    "is skipped and vmap(vjp_fn) returns a sparse gradient where the loop gives a dense one"
)
NO_TORCH_JVP = (
    "torch has neither a forward-mode formula nor a double backward for this op, so "
    "neither functx.jvp's forward mode nor its double-VJP fallback applies (torch.func.jvp fails too)"
)
TORCH_DROPS_TANGENT = (
    "torch's forward AD silently returns no tangent for this op (or some of its outputs) "
    "instead of raising, so functx.jvp, like torch.func.jvp, gives zeros"
)
REFERENCE_RAISES = "torch's own double backward raises (the OpInfo claims supports_gradgrad): no reference"

KNOWN_FAILURES: dict[tuple[str, str], str] = {
    **{("sparse.sampled_addmm", check): SPARSE for check in support.CHECKS},
    **{("sparse.mm.reduce", check): SPARSE for check in ("vjp", "jvp", "vmap_vjp")},
    ("to_sparse", "vmap_vjp"): SPARSE_MASK_FALLBACK,
    **{
        (op, "jvp"): NO_TORCH_JVP
        for op in (
            "cdist", "nn.functional.multi_margin_loss", "nn.functional.multilabel_margin_loss",
            "nn.functional.embedding_bag", "nn.functional.pdist", "_segment_reduce.lengths",
            "_segment_reduce.offsets",
            "nn.functional.ctc_loss",  # _ctc_loss_backward has no derivative
        )
    },
    **{
        (op, "jvp"): TORCH_DROPS_TANGENT
        for op in (
            "nn.functional.linear_cross_entropy.chunked",  # an autograd.Function without jvp
            "nn.functional.linear_cross_entropy.chunked_none",
            "scatter_reduce.prod",
            "native_layer_norm",  # no tangent for the mean and rstd outputs
        )
    },
    ("nn.functional.linear_cross_entropy.chunked_none", "vmap_vjp"):
        "the op's backward (an autograd.Function) writes in place (mul_) into a buffer it "
        "allocates unbatched; vmap must refuse (torch.func refuses the op altogether)",
    ("nn.functional.linear_cross_entropy.chunked_none", "vjp_vjp"): REFERENCE_RAISES + " (out= ops)",
    ("native_layer_norm", "vjp_vjp"): REFERENCE_RAISES + " (weight=None: undefined tensor)",
    ("nn.functional.ctc_loss", "vjp_vjp"): REFERENCE_RAISES + " (_ctc_loss_backward has no derivative)",
}

# (op id, check) -> why the result is not reproducible (non-strict xfail).
FLAKY: dict[tuple[str, str], str] = {}


def _marks(identifier, check, op):
    marks = [] if support.in_default_subset(identifier) else [pytest.mark.slow]
    if not support.applies(op, check):
        marks.append(pytest.mark.skip(reason="torch has no double backward for this op (OpInfo.supports_gradgrad=False)"))
    elif (identifier, check) in KNOWN_FAILURES:
        reason = KNOWN_FAILURES[identifier, check]
        # where torch cannot compute the reference, only that may fail the test
        raises = support.ReferenceFailed if reason.startswith(REFERENCE_RAISES) else None
        marks.append(pytest.mark.xfail(reason=reason, strict=True, raises=raises))
    elif (identifier, check) in FLAKY:
        marks.append(pytest.mark.xfail(reason=FLAKY[identifier, check], strict=False))
    return marks


def _params():
    for op in support.autograd_ops():
        identifier = support.op_id(op)
        for check in support.CHECKS:
            yield pytest.param(op, check, id=f"{identifier}-{check}", marks=_marks(identifier, check, op))


def test_known_failures_name_real_ops_and_checks():
    """A renamed op or a typo would turn an xfail entry into dead text."""
    identifiers = {support.op_id(op) for op in support.autograd_ops()}
    for identifier, check in [*KNOWN_FAILURES, *FLAKY]:
        assert identifier in identifiers, identifier
        assert check in support.CHECKS, check


@pytest.mark.parametrize("op, check", list(_params()))
def test_ad_matches_reference(op, check, record_property):
    try:
        outcome = support.run_check(op, check)
    except support.NotApplicable as e:
        pytest.skip(f"not applicable: {e}")
    record_property("reference", outcome.reference)
    record_property("samples", outcome.cases)
    if outcome.fallback_ops:
        record_property("vmap_fallback", ",".join(sorted(outcome.fallback_ops)))
