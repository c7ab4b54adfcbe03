"""Check functx's AD transforms on one op_db OpInfo against independent references.

Used by tests/ad/test_op_db_ad.py. For one OpInfo, a *case* is one float64 sample
(`op.sample_inputs(..., requires_grad=True)`) turned into a function of its
differentiable tensors: the floating tensors that the sample marks `requires_grad`;
everything else (integer indices, dims, scalars, tensors the op is not differentiated
in) is closed over. The function is called through the OpInfo's `gradcheck_wrapper`
(e.g. it symmetrizes the input of `linalg.eigh`, so finite differences and autograd
describe the same function) and its outputs go through the sample's
`output_process_fn_grad` (gauge-invariant parts of `svd`, `eig`...); its results are the
floating and complex tensors among the outputs.

The function reseeds torch's generator on every call, so random ops (dropout, rrelu)
draw the same numbers in every evaluation — functx's and the reference's — and their
derivatives can be compared like any other op's.

The four checks, each against a reference that does not go through functx:
  vjp       `functx.vjp(f, *x)[1](u)`                 vs `torch.autograd.grad(f(x), x, u)`;
  jvp       `functx.jvp(f, x, t)`                      vs forward-mode AD (`torch.autograd.forward_ad`
            dual tensors) where the OpInfo supports it, else torch's double backward
            (`torch.autograd.functional.jvp`'s trick), else central finite differences
            in float64 (see `reference_jvp`);
  vmap_vjp  `functx.vmap(vjp_fn)` over 3 cotangents    vs a loop of `vjp_fn` calls, run with
            `functx.vmap_fallback("error")` first; when the per-sample fallback is needed,
            the aten op is recorded and the check runs again with the fallback allowed;
  vjp_vjp   `functx.vjp` of `(x, u) -> vjp(f, x)[1](u)` vs torch's double backward
            (`torch.autograd.grad(..., create_graph=True)` differentiated again).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import signal
import warnings
import zlib

import optree
import torch
import torch.autograd.forward_ad as fwAD

import functx

CHECKS = ("vjp", "jvp", "vmap_vjp", "vjp_vjp")
MAX_SAMPLES = 3
VMAP_BATCH = 3
CALL_SEED = 1234  # what f reseeds torch with on every call (random ops)
COTANGENT_SEED = 7
SAMPLE_SEED = 0
FD_EPS = 1e-6
CHECK_TIMEOUT_S = 120  # one check of one op; guards the sweep against a hang

# (rtol, atol): transforms vs torch's own formulas, and vs finite differences.
TOLERANCE = {torch.float64: (1e-5, 1e-6), torch.float32: (1e-3, 1e-4)}
FD_TOLERANCE = (1e-4, 1e-5)

_FALLBACK_MESSAGE = re.compile(r"no batching rule for (\S+) and the per-sample fallback is switched off")


class NotApplicable(Exception):
    """The check cannot run on this op (no differentiable input, no floating output...)."""


class ReferenceFailed(RuntimeError):
    """torch itself could not compute the reference (e.g. a double backward that the
    OpInfo claims but torch does not implement): not a functx failure."""


@contextlib.contextmanager
def reference(what):
    try:
        yield
    except RuntimeError as e:  # NotImplementedError is a RuntimeError too
        raise ReferenceFailed(f"torch's own {what} failed: {type(e).__name__}: {e}") from e


def op_id(op) -> str:
    """Readable, unique id of an OpInfo: name plus variant (`div.floor_rounding`)."""
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def in_default_subset(identifier: str) -> bool:
    """The deterministic quarter of the ops that the default (CI) run checks: a stable hash
    of the op id, so the subset does not depend on op_db's order or on the Python run."""
    return zlib.crc32(identifier.encode()) % 4 == 0


@functools.lru_cache(maxsize=1)
def autograd_ops():
    """Every op_db OpInfo that torch differentiates and that has float32 CPU samples."""
    from torch.testing._internal.common_methods_invocations import op_db

    return tuple(op for op in op_db if op.supports_autograd and torch.float32 in op.supported_dtypes("cpu"))


def find_op(identifier: str):
    return next(op for op in autograd_ops() if op_id(op) == identifier)


def numeric_dtype(op):
    """float64 where the op supports it (numerics), float32 otherwise."""
    return torch.float64 if torch.float64 in op.supported_dtypes("cpu") else torch.float32


# -- cases -------------------------------------------------------------------------------
def _is_float(x) -> bool:
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


@dataclasses.dataclass
class Case:
    """One sample as a function of its differentiable tensors."""

    op: object
    sample: object
    leaves: list  # flattened (input, args, kwargs)
    spec: object
    diff_at: list  # positions of the differentiable tensors in `leaves`

    @property
    def primals(self):
        return [self.leaves[i].detach() for i in self.diff_at]

    @property
    def dtype(self):
        return self.leaves[self.diff_at[0]].dtype

    def f(self, *diff):
        """The op on these differentiable tensors; a tuple of its floating outputs."""
        leaves = list(self.leaves)
        for i, x in zip(self.diff_at, diff):
            leaves[i] = x
        inp, args, kwargs = optree.tree_unflatten(self.spec, leaves)
        torch.manual_seed(CALL_SEED)
        out = self.op.gradcheck_wrapper(self.op.get_op(), inp, *args, **kwargs)
        out = self.sample.output_process_fn_grad(out)
        return tuple(t for t in optree.tree_leaves(out) if _is_float(t))

    def __str__(self):
        shapes = [tuple(self.leaves[i].shape) for i in self.diff_at]
        return f"{op_id(self.op)} sample {self.sample.name!r} (differentiable shapes {shapes})"


def _case(op, sample):
    originals, spec = optree.tree_flatten((sample.input, sample.args, sample.kwargs), none_is_leaf=True)
    diff_at = [
        i for i, x in enumerate(originals)
        if isinstance(x, torch.Tensor) and x.requires_grad and x.is_floating_point()
    ]
    leaves = [x.detach() if isinstance(x, torch.Tensor) else x for x in originals]
    return Case(op, sample, leaves, spec, diff_at)


def cases(op, max_samples=MAX_SAMPLES):
    """The first `max_samples` samples of `op` that have a differentiable tensor."""
    torch.manual_seed(SAMPLE_SEED)
    samples = op.sample_inputs("cpu", numeric_dtype(op), requires_grad=True)
    found = [c for c in (_case(op, s) for s in samples) if c.diff_at]
    found = found[:max_samples]
    if not found:
        raise NotApplicable("no sample has a differentiable floating tensor")
    for case in found:
        if any(isinstance(x, torch.Tensor) and x.layout != torch.strided for x in case.leaves):
            raise NotImplementedError("sparse sample: functx transforms strided tensors only")
    return found


# -- references ----------------------------------------------------------------------------
def _random_like(tensors, seed):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(t.shape, dtype=t.dtype, generator=g) for t in tensors)


def _torch_grad(outputs, inputs, grad_outputs, create_graph=False):
    """torch.autograd.grad with torch.func's conventions: outputs that do not require grad
    contribute nothing, inputs that do not reach an output get zeros."""
    pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad]
    if not pairs:
        return tuple(torch.zeros_like(x) for x in inputs)
    outs, gouts = zip(*pairs)
    grads = torch.autograd.grad(outs, inputs, gouts, allow_unused=True, create_graph=create_graph)
    return tuple(torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs))


def _leaves(primals):
    return [p.detach().requires_grad_() for p in primals]


def forward_ad_jvp(case, primals, tangents):
    with fwAD.dual_level():
        duals = [fwAD.make_dual(p, t) for p, t in zip(primals, tangents)]
        outs = case.f(*duals)
        result = []
        for o in outs:
            primal, tangent = fwAD.unpack_dual(o)
            result.append(torch.zeros_like(primal) if tangent is None else tangent.clone())
        return tuple(result)


def finite_difference_jvp(case, primals, tangents, eps=FD_EPS):
    ahead = case.f(*[p + eps * t for p, t in zip(primals, tangents)])
    behind = case.f(*[p - eps * t for p, t in zip(primals, tangents)])
    return tuple((a - b) / (2 * eps) for a, b in zip(ahead, behind))


def double_backward_jvp(case, primals, tangents):
    """J t = d/du <J^T u, t> by torch's double backward (torch.autograd.functional.jvp's trick)."""
    xs = _leaves(primals)
    outs = case.f(*xs)
    us = _leaves([torch.zeros_like(o) for o in outs])
    grads = _torch_grad(outs, xs, us, create_graph=True)
    pairing = sum(((g * t).sum() for g, t in zip(grads, tangents) if g.requires_grad), torch.zeros((), dtype=xs[0].dtype))
    if not pairing.requires_grad:
        return tuple(torch.zeros_like(o) for o in outs)
    return tuple(torch.zeros_like(u) if g is None else g for g, u in zip(torch.autograd.grad(pairing, us, allow_unused=True), us))


def reference_jvp(case, primals, tangents):
    """(expected tangents, tolerance, name of the reference). Forward-mode AD where the
    OpInfo has it; else torch's double backward, which follows torch's derivative
    conventions where they are not the calculus one (`normal` gives no gradient to std,
    a cast to bfloat16 passes the tangent through) — finite differences would not; else,
    where torch cannot differentiate the op twice, finite differences in float64."""
    if case.op.supports_forward_ad:
        return forward_ad_jvp(case, primals, tangents), TOLERANCE[case.dtype], "forward_ad"
    if case.op.supports_gradgrad:
        try:
            return double_backward_jvp(case, primals, tangents), TOLERANCE[case.dtype], "torch double backward"
        except RuntimeError:
            pass  # the OpInfo claims double backward, torch fails it: finite differences
    return finite_difference_jvp(case, primals, tangents), FD_TOLERANCE, "finite differences"


# -- checks --------------------------------------------------------------------------------
@dataclasses.dataclass
class Outcome:
    """What one check of one op did, besides passing or raising."""

    reference: str = ""
    fallback_ops: set = dataclasses.field(default_factory=set)
    cases: int = 0


def _assert_close(what, actual, expected, tolerance, case):
    actual, expected = list(actual), list(expected)
    assert len(actual) == len(expected), f"{case}: {what}: {len(actual)} results, reference has {len(expected)}"
    rtol, atol = tolerance
    for k, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(
            a, e, rtol=rtol, atol=atol, equal_nan=True, check_stride=False,
            msg=lambda m, k=k: f"{case}: {what}[{k}]: {m}",
        )


# Each check computes its reference first, so that an op torch itself cannot
# differentiate that way is reported as ReferenceFailed, not as a functx failure.
def check_vjp(case, outcome):
    primals = case.primals
    xs = _leaves(primals)
    with reference("backward"):
        expected_out = case.f(*xs)
        cotangents = _random_like(expected_out, COTANGENT_SEED)
        expected = _torch_grad(expected_out, xs, cotangents)
    outcome.reference = "torch.autograd.grad"
    out, vjp_fn = functx.vjp(case.f, *primals)
    actual = vjp_fn(cotangents)
    tol = TOLERANCE[case.dtype]
    _assert_close("output", out, expected_out, tol, case)
    _assert_close("vjp", actual, expected, tol, case)


def check_jvp(case, outcome):
    primals = case.primals
    tangents = _random_like(primals, COTANGENT_SEED)
    expected, tol, outcome.reference = reference_jvp(case, primals, tangents)
    out, actual = functx.jvp(case.f, tuple(primals), tangents)
    _assert_close("output", out, case.f(*primals), TOLERANCE[case.dtype], case)
    _assert_close("jvp", actual, expected, tol, case)


def check_vmap_vjp(case, outcome):
    out, vjp_fn = functx.vjp(case.f, *case.primals)
    per_sample = [_random_like(out, COTANGENT_SEED + b) for b in range(VMAP_BATCH)]
    batched = tuple(torch.stack([cot[k] for cot in per_sample]) for k in range(len(out)))
    loop = [vjp_fn(cot) for cot in per_sample]
    expected = [torch.stack([grads[j] for grads in loop]) for j in range(len(loop[0]))]
    outcome.reference = "loop of vjp_fn"
    try:
        with functx.vmap_fallback("error"):
            actual = functx.vmap(vjp_fn)(batched)
    except NotImplementedError as e:
        match = _FALLBACK_MESSAGE.search(str(e))
        if match is None:
            raise
        outcome.fallback_ops.add(match.group(1))
        with functx.vmap_fallback("silent"):
            actual = functx.vmap(vjp_fn)(batched)
    _assert_close("vmap(vjp_fn)", actual, expected, TOLERANCE[case.dtype], case)


def check_vjp_vjp(case, outcome):
    primals = case.primals
    n = len(primals)
    xs = _leaves(primals)
    with reference("double backward"):
        outputs = case.f(*xs)
        first_cotangents = _random_like(outputs, COTANGENT_SEED)
        us = _leaves(first_cotangents)
        grads = _torch_grad(outputs, xs, us, create_graph=True)
        second_cotangents = _random_like(grads, COTANGENT_SEED + 1)
        expected = _torch_grad(grads, xs + us, second_cotangents)
    outcome.reference = "torch double backward"

    def vjp_of_f(*primals_and_cotangents):
        _, vjp_fn = functx.vjp(case.f, *primals_and_cotangents[:n])
        return vjp_fn(tuple(primals_and_cotangents[n:]))

    out, vjp_fn = functx.vjp(vjp_of_f, *primals, *first_cotangents)
    actual = vjp_fn(second_cotangents)
    tol = TOLERANCE[case.dtype]
    _assert_close("vjp", out, grads, tol, case)
    _assert_close("vjp of vjp", actual, expected, tol, case)


CHECK_FUNCTIONS = {"vjp": check_vjp, "jvp": check_jvp, "vmap_vjp": check_vmap_vjp, "vjp_vjp": check_vjp_vjp}


def applies(op, check) -> bool:
    """Whether torch differentiates `op` in the way `check` needs."""
    return op.supports_gradgrad if check == "vjp_vjp" else op.supports_autograd


@contextlib.contextmanager
def time_limit(seconds):
    """Raise TimeoutError in the main thread after `seconds` (no-op where SIGALRM is missing)."""
    if not hasattr(signal, "SIGALRM"):
        yield
        return

    def expire(signum, frame):
        raise TimeoutError(f"check took more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_check(op, check, max_samples=MAX_SAMPLES) -> Outcome:
    """Run `check` on the first `max_samples` differentiable samples of `op`; raise
    AssertionError on a mismatch, NotApplicable when the check cannot run."""
    outcome = Outcome()
    # torch's deprecation notices for op_db's old entry points (torch.qr, ...) are noise
    # here; vmap's per-sample fallback is recorded in `outcome`, not warned about.
    with time_limit(CHECK_TIMEOUT_S), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for case in cases(op, max_samples):
            if not case.f(*case.primals):
                raise NotApplicable("the op has no floating-point output")
            CHECK_FUNCTIONS[check](case, outcome)
            outcome.cases += 1
    return outcome
