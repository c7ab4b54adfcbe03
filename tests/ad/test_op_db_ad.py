"""functx's AD transforms on every op torch differentiates, driven by torch's op database.

For each OpInfo of `op_db` with `supports_autograd` and float32 CPU samples, and each of
torch's 14 `autograd_function_db` OpInfos (torch.autograd.Function subclasses), on its
first 3 float64 samples (see tests/ad/opdb_ad_support.py for how a sample becomes a
function and for each check's reference):
  vjp       functx.vjp vs torch.autograd.grad;
  jvp       functx.jvp vs torch.autograd.forward_ad; where the OpInfo has no forward AD,
            vs torch's double backward, else finite differences in float64;
  vmap_vjp  functx.vmap(vjp_fn) over 3 cotangents vs a loop of vjp_fn (the aten ops that
            needed vmap's per-sample fallback are recorded as the `vmap_fallback` property);
  vjp_vjp   vjp of the vjp (second order, w.r.t. primals and cotangents) vs torch's double
            backward, where the OpInfo has `supports_gradgrad`;
and the compositions of torch's test/functorch/test_ops.py, over 3 distinct samples where
they vmap, each vs a loop of references that do not use functx:
  jvp_vjp       forward over reverse vs torch's forward AD over its backward (else its
                double backward);
  vjp_vmap      vjp of vmap(f) vs a loop of torch.autograd.grad;
  vmap_jvp      vmap of jvp, primals and tangents batched / primals unbatched, vs a loop
                of the jvp check's reference;
  vmap_vjp_vjp  vmap of the vjp of the vjp vs a loop of torch's double backward;
  vmap_jvp_vjp  vmap of the jvp of the vjp vs a loop of jvp_vjp's reference;
  vjp_inplace, jvp_inplace  vjp / jvp of the OpInfo's in-place variant, written into a
                view of a clone of the input, vs the out-of-place op's references.
Test ids read `<op>[.<variant>]-<check>`, e.g. `test_ad_matches_reference[div.floor_rounding-jvp]`.

Known failures are listed below per op and check with their cause (strict xfails: a fix
makes the test fail until its entry is removed).

Commands:
  default (CI) run (`in_default_subset`): every autograd_function_db entry; the first four
  checks on a stable-hash quarter of op_db's ops, the others on an eighth (within it):
      .venv/bin/python -m pytest tests/ad/test_op_db_ad.py -n 2 -q
  the rest of op_db (the `slow` marker):
      .venv/bin/python -m pytest tests/ad/test_op_db_ad.py -m slow -n 2 -q
  full sweep (every op), with the per-test properties (`reference`, `vmap_fallback`)
  in a JUnit XML file:
      .venv/bin/python -m pytest tests/ad/test_op_db_ad.py -m "slow or not slow" -n 2 -q -rfE \\
          --junitxml=/tmp/op_db_ad.xml > /tmp/op_db_ad.log 2>&1
  one op, every check:
      .venv/bin/python -m pytest tests/ad/test_op_db_ad.py -m "slow or not slow" -k "linalg.svd-"
"""

from __future__ import annotations

import copy
import dataclasses

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

# causes of the failures of NEW_CHECKS (the test_ops.py compositions)
SCATTER_REDUCE_PROD_FORWARD = (
    "torch's forward AD of scatter_reduce(reduce='prod') drops or refuses tangents: the jvp "
    "of the vjp is wrong in functx and torch.func alike (torch's double backward agrees with "
    "finite differences), and the in-place variant's jvp raises 'Expected a proper Tensor "
    "but got None' in both"
)
STORAGE_DEPENDENT = (
    "as_strided with partial views reads storage outside its input's view, so its value is "
    "not a function of the input's values: under vmap the storage around each sample is the "
    "batch's; torch.func gives the same values as functx, the per-sample loop differs"
)
NOT_COMPOSABLE_JVP = (
    "the autograd.Function has no jvp staticmethod: functx's forward-mode transforms refuse "
    "it, as torch.func's do (by design)"
)
NOT_COMPOSABLE_VMAP = (
    "the autograd.Function has neither a vmap staticmethod nor generate_vmap_rule: functx.vmap "
    "refuses it, as torch.func.vmap does (by design)"
)
BATCH_NORM_UNBATCHED_RUNNING_STATS = (
    "vmap over training-mode batch norm whose running stats (updated in place) are not "
    "batched: functx refuses with a how-to-fix error; torch.func has no batching rule either"
)
DATA_DEPENDENT_CHECK = (
    "the op (or its backward) reads its input's values in Python (gaussian_nll_loss: "
    "`torch.any(var < 0)`; cov: torch.equal; scatter_reduce.prod's and index_reduce.prod's "
    "backward): functx.vmap "
    "refuses the .item() on a batched tensor, as torch.func.vmap does"
)
RANDOMNESS_SAME_BATCHED = (
    "vmap(randomness='same') over a random op with a batched tensor argument (normal's "
    "mean/std, bernoulli's p): functx refuses, as torch.func does"
)
NO_TORCH_INPLACE_DERIVATIVE = (
    "torch has no derivative for the in-place variant ('the derivative for inplace version "
    "of asinh is not implemented'; acosh, atanh too): functx.vjp/jvp raise it, as torch.func "
    "does; no reference"
)
TORCH_AS_STRIDED_SCATTER_0D = (
    "reference wrong: torch's backward of as_strided_scatter with a 0-dim view (size=(), "
    "stride=()) gives the input the cotangent, where finite differences give 0 (the element "
    "is overwritten); functx.grad repeats torch's value, but under vmap the view is not "
    "0-dim and functx's vjp(vmap(f)) gets the finite-difference value 0, so it differs from "
    "the loop of torch.autograd.grad (torch.func.vmap has no batching rule)"
)
TO_SPARSE = (
    "to_sparse returns a sparse tensor: functx's transforms wrap strided tensors only "
    "(vmap(f) returns it as sparse inside a strided batch, the jvp of the vjp reaches "
    "_sparse_mask_projection, which has no derivative); torch.func fails too"
)
CHUNKED_NONE_BACKWARD = (
    "the op's backward (an autograd.Function) uses out= ops (div(out=)) and writes in place "
    "(mul_) into a buffer it allocates: functx's second-order and vmapped forward-mode "
    "transforms refuse it (torch.func refuses the op altogether)"
)

CHUNKED_REFERENCE_WRONG = (
    "reference wrong: torch's double backward of the chunked op drops the second derivative "
    "(its backward scales gradients precomputed and detached in the forward; torch documents "
    "gradgrad as unsupported), so the reference is 0 in the input's direction; functx computes "
    "the op as cross_entropy(linear(x)) where a backward is differentiated and matches that "
    "formula under torch.autograd (tests/ad/test_torch_nn_rules.py)"
)

INDEX_REDUCE_PROD_FORWARD = (
    "torch has no forward-mode formula for index_reduce ('Trying to use forward AD with "
    "index_reduce that does not support it'), and its backward reads values in Python, so "
    "under vmap functx's double-VJP fallback cannot run either: functx raises torch's error"
)

VMAP_CHECKS = ("vjp_vmap", "vmap_jvp", "vmap_vjp_vjp", "vmap_jvp_vjp")  # the new checks that vmap f

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
    # NEW_CHECKS
    **{("NumpyCubeNotComposableAutogradFunction", check): NOT_COMPOSABLE_JVP for check in ("jvp", "jvp_vjp")},
    **{
        ("NumpyCubeNotComposableAutogradFunction", check): NOT_COMPOSABLE_VMAP
        for check in ("vjp_vmap", "vmap_jvp", "vmap_vjp_vjp", "vmap_jvp_vjp")
    },
    **{
        (op, check): BATCH_NORM_UNBATCHED_RUNNING_STATS
        for op in (
            "_batch_norm_with_update", "_native_batch_norm_legit", "native_batch_norm", "nn.functional.batch_norm",
            "nn.functional.instance_norm",
        )
        for check in VMAP_CHECKS
    },
    **{
        (op, check): DATA_DEPENDENT_CHECK
        for op in ("nn.functional.gaussian_nll_loss", "cov")
        for check in VMAP_CHECKS
    },
    **{("index_reduce.prod", check): DATA_DEPENDENT_CHECK for check in ("vmap_vjp_vjp", "vmap_jvp_vjp")},
    ("index_reduce.prod", "vmap_jvp"): INDEX_REDUCE_PROD_FORWARD,
    **{
        (op, check): RANDOMNESS_SAME_BATCHED
        for op in ("normal", "normal.number_mean", "bernoulli", "nn.functional.rrelu")
        for check in VMAP_CHECKS
    },
    **{("as_strided.partial_views", check): STORAGE_DEPENDENT for check in VMAP_CHECKS},
    **{(op, check): NO_TORCH_INPLACE_DERIVATIVE for op in ("asinh", "acosh", "atanh") for check in ("vjp_inplace", "jvp_inplace")},
    ("as_strided_scatter", "vjp_vmap"): TORCH_AS_STRIDED_SCATTER_0D,
    **{("scatter_reduce.prod", check): SCATTER_REDUCE_PROD_FORWARD for check in ("jvp_vjp", "jvp_inplace")},
    **{("scatter_reduce.prod", check): DATA_DEPENDENT_CHECK for check in ("vmap_vjp_vjp", "vmap_jvp_vjp")},
    **{(op, "vmap_jvp"): TORCH_DROPS_TANGENT for op in ("scatter_reduce.prod", "native_layer_norm")},
    ("native_layer_norm", "vmap_vjp_vjp"): REFERENCE_RAISES + " (weight=None: undefined tensor)",
    **{
        ("nn.functional.ctc_loss", check): REFERENCE_RAISES + " (_ctc_loss_backward has no derivative)"
        for check in ("jvp_vjp", "vmap_vjp_vjp", "vmap_jvp_vjp")
    },
    **{("to_sparse", check): TO_SPARSE for check in ("jvp_vjp", "vjp_vmap", "vmap_jvp")},
    **{("sparse.mm.reduce", check): SPARSE for check in support.NEW_CHECKS},
    **{
        (op, "vmap_jvp"): NO_TORCH_JVP
        for op in (
            "cdist", "nn.functional.multi_margin_loss", "nn.functional.multilabel_margin_loss",
            "nn.functional.embedding_bag", "nn.functional.pdist", "_segment_reduce.lengths",
            "_segment_reduce.offsets", "nn.functional.ctc_loss",
        )
    },
    **{
        ("nn.functional.linear_cross_entropy.chunked_none", check): CHUNKED_NONE_BACKWARD
        for check in ("jvp_vjp", "vmap_jvp_vjp")
    },
    **{
        ("nn.functional.linear_cross_entropy.chunked", check): CHUNKED_REFERENCE_WRONG
        for check in ("vjp_vjp", "jvp_vjp", "vmap_vjp_vjp", "vmap_jvp_vjp")
    },
    ("nn.functional.linear_cross_entropy.chunked_none", "vmap_vjp_vjp"): REFERENCE_RAISES + " (out= ops)",
}

# (op id, check) -> why the result is not reproducible (non-strict xfail).
FLAKY: dict[tuple[str, str], str] = {}


def _marks(identifier, check, op):
    marks = [] if support.in_default_subset(identifier, check) else [pytest.mark.slow]
    not_applicable = support.applies(op, check)
    if not_applicable:
        marks.append(pytest.mark.skip(reason=not_applicable))
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


@pytest.mark.parametrize("identifier", ["mul", "linalg.det", "log_softmax"])
def test_jvp_vjp_references_agree_with_finite_differences(identifier):
    """jvp_vjp's two references (torch's forward AD over its backward, and the double-backward
    identity with the Hessian of <f, u>) agree with central finite differences of torch's
    vjp: a wrong reference would turn functx bugs into passes or correct code into xfails."""
    op = support.find_op(identifier)
    without_fwgrad_bwgrad = copy.copy(op)
    without_fwgrad_bwgrad.supports_fwgrad_bwgrad = False
    for case in support.cases(op):
        primals = case.primals
        u, tx, tu = support._jvp_vjp_inputs(case, primals, support.COTANGENT_SEED)
        _, forward_over_reverse, name = support.reference_jvp_vjp(case, primals, u, tx, tu)
        assert name == "torch forward AD over backward"
        case_without = dataclasses.replace(case, op=without_fwgrad_bwgrad)
        _, hessian_identity, name = support.reference_jvp_vjp(case_without, primals, u, tx, tu)
        assert name.startswith("torch double backward")

        def vjp_at(eps):
            xs = support._leaves([p + eps * t for p, t in zip(primals, tx)])
            return support._torch_grad(case.f(*xs), xs, [c + eps * t for c, t in zip(u, tu)])

        ahead, behind = vjp_at(support.FD_EPS), vjp_at(-support.FD_EPS)
        finite = [(a - b) / (2 * support.FD_EPS) for a, b in zip(ahead, behind)]
        support._assert_close("forward over reverse", forward_over_reverse, finite, support.FD_TOLERANCE, case)
        support._assert_close("Hessian identity", hessian_identity, finite, support.FD_TOLERANCE, case)
