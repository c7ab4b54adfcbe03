"""Check functx's AD transforms on one OpInfo against independent references.

Used by tests/ad/test_op_db_ad.py, for the OpInfos of torch's `op_db` and of its
`autograd_function_db` (torch.autograd.Function subclasses). For one OpInfo, a *case* is
one float64 sample (`op.sample_inputs(..., requires_grad=True)`) turned into a function of
its differentiable tensors: the floating tensors that the sample marks `requires_grad`;
everything else (integer indices, dims, scalars, tensors the op is not differentiated
in) is closed over. The function is called through the OpInfo's `gradcheck_wrapper`
(e.g. it symmetrizes the input of `linalg.eigh`, so finite differences and autograd
describe the same function; autograd_function_db's OpInfos are called directly) and its
outputs go through the sample's `output_process_fn_grad` (gauge-invariant parts of `svd`,
`eig`...); its results are the floating and complex tensors among the outputs.

The function reseeds torch's generator on every call, so random ops (dropout, rrelu)
draw the same numbers in every evaluation — functx's and the reference's — and their
derivatives can be compared like any other op's (vmaps run with randomness="same", which
matches a loop that reseeds for every sample).

The checks, each against a reference that does not go through functx:
  vjp       `functx.vjp(f, *x)[1](u)`                 vs `torch.autograd.grad(f(x), x, u)`;
  jvp       `functx.jvp(f, x, t)`                      vs forward-mode AD (`torch.autograd.forward_ad`
            dual tensors) where the OpInfo supports it, else torch's double backward
            (`torch.autograd.functional.jvp`'s trick), else central finite differences
            in float64 (see `reference_jvp`);
  vmap_vjp  `functx.vmap(vjp_fn)` over 3 cotangents    vs a loop of `vjp_fn` calls, run with
            `functx.vmap_fallback("error")` first; when the per-sample fallback is needed,
            the aten op is recorded and the check runs again with the fallback allowed
            (as in every check below that vmaps);
  vjp_vjp   `functx.vjp` of `(x, u) -> vjp(f, x)[1](u)` vs torch's double backward
            (`torch.autograd.grad(..., create_graph=True)` differentiated again).
The compositions of torch's test/functorch/test_ops.py (NEW_CHECKS). Their vmaps run over
VMAP_BATCH distinct samples: the sample itself and copies plus BATCH_NOISE-sized noise.
  jvp_vjp       (jvpvjp) `functx.jvp` of `(x, u) -> vjp(f, x)[1](u)` in a direction (tx, tu)
                vs torch's forward AD over its backward (`supports_fwgrad_bwgrad`), else its
                double backward (see `reference_jvp_vjp`);
  vjp_vmap      (vjpvmap) `functx.vjp(functx.vmap(f))` vs a loop of torch.autograd.grad;
  vmap_jvp      (vmapjvpall) `functx.vmap` of `functx.jvp(f)` with primals and tangents
                batched, and with unbatched primals (in_dims None) and batched tangents,
                vs a loop of the jvp check's reference;
  vmap_vjp_vjp  (vmapvjpvjp) `functx.vmap` of vjp_vjp's function, everything batched, vs a
                loop of torch's double backward;
  vmap_jvp_vjp  (vmapjvpvjp) `functx.vmap` of jvp_vjp's function, everything batched, vs a
                loop of jvp_vjp's reference;
  vjp_inplace, jvp_inplace  (test_ops' in-place variants) `functx.vjp` / `functx.jvp` of
                the OpInfo's in-place variant written into a view of a clone of the input
                (`Case.f_inplace`), vs the vjp / jvp references of the out-of-place op; on
                the samples where plain torch runs the in-place variant.
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

# the compositions of torch's test/functorch/test_ops.py (see the module docstring)
NEW_CHECKS = ("jvp_vjp", "vjp_vmap", "vmap_jvp", "vmap_vjp_vjp", "vmap_jvp_vjp", "vjp_inplace", "jvp_inplace")
CHECKS = ("vjp", "jvp", "vmap_vjp", "vjp_vjp", *NEW_CHECKS)
MAX_SAMPLES = 3
VMAP_BATCH = 3
BATCH_NOISE = 1e-3  # scale of the noise that makes a batch's samples distinct (see _batch_of)
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


class _SkipCase(Exception):
    """This check does not apply to this one sample (e.g. an in-place variant that would
    broadcast its input); the check runs on the op's other samples."""


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


def in_default_subset(identifier: str, check: str = "vjp") -> bool:
    """Whether the default (CI) run checks this op: for the first four checks the
    deterministic quarter of op_db's ops with `crc32(op id) % 4 == 0`, for the costlier
    NEW_CHECKS an eighth of them (`% 8 == 0`, a part of that quarter); every entry of
    autograd_function_db. A stable hash of the op id, so the subset does not depend on
    op_db's order or on the Python run."""
    if identifier in _autograd_function_ids():
        return True
    return zlib.crc32(identifier.encode()) % (8 if check in NEW_CHECKS else 4) == 0


@functools.lru_cache(maxsize=1)
def autograd_ops():
    """Every op_db OpInfo that torch differentiates and that has float32 CPU samples, then
    the 14 OpInfos of torch's autograd_function_db (torch.autograd.Function subclasses:
    NumPy forwards, vmap staticmethods, generate_vmap_rule...)."""
    from torch.testing._internal.autograd_function_db import autograd_function_db
    from torch.testing._internal.common_methods_invocations import op_db

    return tuple(
        op for op in (*op_db, *autograd_function_db)
        if op.supports_autograd and torch.float32 in op.supported_dtypes("cpu")
    )


@functools.lru_cache(maxsize=1)
def _autograd_function_ids():
    from torch.testing._internal.autograd_function_db import autograd_function_db

    return frozenset(op_id(op) for op in autograd_function_db)


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
        inp, args, kwargs = self._arguments(diff)
        torch.manual_seed(CALL_SEED)
        out = self._wrapper(self.op.get_op(), inp, *args, **kwargs)
        return self._results(out)

    def f_inplace(self, *diff):
        """The same function through the OpInfo's in-place variant: the input is cloned, the
        variant writes into a view of the clone (`clone[...]`) and the clone is the result,
        so the write must reach the base through the view (torch.func's test_ops does the
        same, `op.inplace_variant(inp.clone(), ...)`, without the view)."""
        inp, args, kwargs = self._arguments(diff)
        base = inp.clone()
        torch.manual_seed(CALL_SEED)
        self._wrapper(self.op.inplace_variant, base[...], *args, **kwargs)
        return self._results(base)

    def _wrapper(self, op, *args, **kwargs):
        # autograd_function_db's gradcheck_wrapper is not a wrapper of the call (NumpySort's
        # is `lambda y, ind: y`, made for torch's own gradcheck of the outputs); its OpInfos
        # are called directly, as torch's test_ops does
        if op_id(self.op) in _autograd_function_ids():
            return op(*args, **kwargs)
        return self.op.gradcheck_wrapper(op, *args, **kwargs)

    def _arguments(self, diff):
        leaves = list(self.leaves)
        for i, x in zip(self.diff_at, diff):
            leaves[i] = x
        return optree.tree_unflatten(self.spec, leaves)

    def _results(self, out):
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


def float64_cases(op, max_samples):
    """The op's first samples, for a reference by finite differences: `pytest.skip` where it
    has none (not applicable, sparse) or they are not float64 (differences too coarse)."""
    import pytest

    try:
        found = cases(op, max_samples=max_samples)
    except NotApplicable as e:
        pytest.skip(f"not applicable: {e}")
    except NotImplementedError as e:
        pytest.skip(str(e))
    if any(case.dtype != torch.float64 for case in found):
        pytest.skip("no float64 samples: differences too coarse")
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


def _vmapped(outcome, thunk):
    """`thunk()` (which calls functx.vmap) with vmap's per-sample fallback switched off; where
    an aten op needs it, the op is recorded in `outcome` and `thunk` runs again with it on."""
    try:
        with functx.vmap_fallback("error"):
            return thunk()
    except NotImplementedError as e:
        match = _FALLBACK_MESSAGE.search(str(e))
        if match is None:
            raise
        outcome.fallback_ops.add(match.group(1))
        with functx.vmap_fallback("silent"):
            return thunk()


def _stack(per_sample):
    """[(a0, b0), (a1, b1), ...] -> (stack(a), stack(b))."""
    return tuple(torch.stack(parts) for parts in zip(*per_sample))


def _batch_of(case, seed):
    """VMAP_BATCH per-sample primals: the sample itself, then the sample plus small distinct
    noise (distinct samples catch a transform that mixes up or broadcasts batch entries; the
    noise is small so that inputs stay in the op's domain)."""
    primals = case.primals
    batch = [tuple(primals)]
    for b in range(1, VMAP_BATCH):
        noise = _random_like(primals, seed + b)
        batch.append(tuple(p + BATCH_NOISE * n for p, n in zip(primals, noise)))
    return batch


def check_vmap_vjp(case, outcome):
    """functx.vmap(vjp_fn) over VMAP_BATCH cotangents vs a Python loop of the same vjp_fn."""
    out, vjp_fn = functx.vjp(case.f, *case.primals)
    per_sample = [_random_like(out, COTANGENT_SEED + b) for b in range(VMAP_BATCH)]
    expected = _stack([vjp_fn(cot) for cot in per_sample])
    outcome.reference = "loop of vjp_fn"
    actual = _vmapped(outcome, lambda: functx.vmap(vjp_fn)(_stack(per_sample)))
    _assert_close("vmap(vjp_fn)", actual, expected, TOLERANCE[case.dtype], case)


def reference_vjp_vjp(case, primals, first_cotangents, second_cotangents):
    """(g, expected): g = J^T u by torch.autograd.grad, and the vjp of (x, u) -> J(x)^T u
    with cotangent v by torch's double backward (w.r.t. x, then u)."""
    xs = _leaves(primals)
    with reference("double backward"):
        outputs = case.f(*xs)
        us = _leaves(first_cotangents)
        grads = _torch_grad(outputs, xs, us, create_graph=True)
        expected = _torch_grad(grads, xs + us, second_cotangents)
    return tuple(g.detach() for g in grads), expected


def _vjp_of_f(case, n):
    """(x..., u...) -> functx.vjp(f, x)[1](u): the function the second-order checks differentiate."""

    def vjp_of_f(*primals_and_cotangents):
        _, vjp_fn = functx.vjp(case.f, *primals_and_cotangents[:n])
        return vjp_fn(tuple(primals_and_cotangents[n:]))

    return vjp_of_f


def _second_order_inputs(case, primals, seed):
    """First cotangents u (one per output of f) and second cotangents v (one per primal)."""
    first = _random_like(case.f(*primals), seed)
    return first, _random_like(primals, seed + 1)


def check_vjp_vjp(case, outcome):
    """vjp of (x, u) -> vjp(f, x)[1](u) (second order, w.r.t. primals and cotangents) vs
    torch's double backward (torch.autograd.grad(create_graph=True), differentiated again)."""
    primals = case.primals
    first_cotangents, second_cotangents = _second_order_inputs(case, primals, COTANGENT_SEED)
    grads, expected = reference_vjp_vjp(case, primals, first_cotangents, second_cotangents)
    outcome.reference = "torch double backward"
    out, vjp_fn = functx.vjp(_vjp_of_f(case, len(primals)), *primals, *first_cotangents)
    actual = vjp_fn(second_cotangents)
    tol = TOLERANCE[case.dtype]
    _assert_close("vjp", out, grads, tol, case)
    _assert_close("vjp of vjp", actual, expected, tol, case)


def reference_jvp_vjp(case, primals, cotangents, primal_tangents, cotangent_tangents):
    """(g, jvp of g, name of the reference) for g(x, u) = J(x)^T u in the direction (tx, tu),
    without functx. Where the OpInfo has `supports_fwgrad_bwgrad`: torch's forward AD over its
    backward (dual tensors through torch.autograd.grad(create_graph=True)). Else, and where
    that fails: d/dx[J(x)^T u] tx + J(x)^T tu, the first term by torch's double backward as
    grad_x <J(x)^T u, tx> (it is the Hessian of <f(x), u> applied to tx, a symmetric matrix)."""
    if case.op.supports_fwgrad_bwgrad:
        try:
            with fwAD.dual_level():
                xs = [fwAD.make_dual(p, t).requires_grad_() for p, t in zip(primals, primal_tangents)]
                us = [fwAD.make_dual(u, t) for u, t in zip(cotangents, cotangent_tangents)]
                grads = _torch_grad(case.f(*xs), xs, us, create_graph=True)
                unpacked = [fwAD.unpack_dual(g) for g in grads]
                values = tuple(g.primal.detach().clone() for g in unpacked)
                tangents = tuple(
                    torch.zeros_like(g.primal) if g.tangent is None else g.tangent.detach().clone()
                    for g in unpacked
                )
            return values, tangents, "torch forward AD over backward"
        except RuntimeError:
            if not case.op.supports_gradgrad:
                raise
    xs = _leaves(primals)
    with reference("double backward"):
        outputs = case.f(*xs)
        grads = _torch_grad(outputs, xs, cotangents, create_graph=True)
        # create_graph keeps f's graph for the Hessian term's backward through it
        transpose_term = _torch_grad(outputs, xs, cotangent_tangents, create_graph=True)
        pairing = sum(((g * t).sum() for g, t in zip(grads, primal_tangents) if g.requires_grad), torch.zeros((), dtype=xs[0].dtype))
        hessian_term = _torch_grad((pairing,), xs, (torch.ones((), dtype=pairing.dtype),))
    tangents = tuple((a + b).detach() for a, b in zip(hessian_term, transpose_term))
    return tuple(g.detach() for g in grads), tangents, "torch double backward (Hessian of <f, u>)"


def _jvp_vjp_inputs(case, primals, seed):
    """Cotangents u, then the tangents (tx, tu) of the primals and of u."""
    cotangents = _random_like(case.f(*primals), seed)
    return cotangents, _random_like(primals, seed + 1), _random_like(cotangents, seed + 2)


def check_jvp_vjp(case, outcome):
    """Forward over reverse: functx.jvp of (x, u) -> vjp(f, x)[1](u) in the direction (tx, tu)
    vs torch's forward AD over its backward, else its double backward (`reference_jvp_vjp`)."""
    primals = case.primals
    cotangents, tx, tu = _jvp_vjp_inputs(case, primals, COTANGENT_SEED)
    grads, expected, outcome.reference = reference_jvp_vjp(case, primals, cotangents, tx, tu)
    out, actual = functx.jvp(_vjp_of_f(case, len(primals)), (*primals, *cotangents), (*tx, *tu))
    tol = TOLERANCE[case.dtype]
    _assert_close("vjp", out, grads, tol, case)
    _assert_close("jvp of vjp", actual, expected, tol, case)


def check_vjp_vmap(case, outcome):
    """vjp of functx.vmap(f) over VMAP_BATCH distinct samples (`_batch_of`) with one cotangent
    per sample vs a Python loop of torch.autograd.grad over the samples."""
    batch = _batch_of(case, SAMPLE_SEED)
    loop_outputs, loop_grads = [], []
    with reference("backward"):
        for b, primals in enumerate(batch):
            xs = _leaves(primals)
            outputs = case.f(*xs)
            cotangents = _random_like(outputs, COTANGENT_SEED + b)
            loop_outputs.append((tuple(o.detach() for o in outputs), cotangents))
            loop_grads.append(_torch_grad(outputs, xs, cotangents))
    outcome.reference = "loop of torch.autograd.grad"
    cotangents = _stack([cot for _, cot in loop_outputs])

    def vjp_of_vmap():
        # randomness="same": f reseeds torch on every call, so the loop draws the same
        # numbers for every sample too
        out, vjp_fn = functx.vjp(functx.vmap(case.f, randomness="same"), *_stack(batch))
        return out, vjp_fn(cotangents)

    out, actual = _vmapped(outcome, vjp_of_vmap)
    tol = TOLERANCE[case.dtype]
    _assert_close("vmap(f)", out, _stack([o for o, _ in loop_outputs]), tol, case)
    _assert_close("vjp of vmap(f)", actual, _stack(loop_grads), tol, case)


def check_vmap_jvp(case, outcome):
    """functx.vmap over functx.jvp(f), (a) with primals and tangents both batched (in_dims 0,
    distinct samples from `_batch_of`) and (b) with unbatched primals (in_dims None) and
    batched tangents, vs a Python loop of `reference_jvp` (torch's forward AD, double
    backward or finite differences)."""
    n = len(case.primals)
    batch = _batch_of(case, SAMPLE_SEED)
    tangents = [_random_like(p, COTANGENT_SEED + b) for b, p in enumerate(batch)]

    def jvp_of_f(*primals_and_tangents):
        return functx.jvp(case.f, primals_and_tangents[:n], primals_and_tangents[n:])

    for what, primals_batch, in_dims in (
        ("vmap(jvp) all batched", batch, (0,) * (2 * n)),
        ("vmap(jvp) primals unbatched", [batch[0]] * VMAP_BATCH, (None,) * n + (0,) * n),
    ):
        loop_out, loop_jvp = [], []
        for primals, t in zip(primals_batch, tangents):
            expected, tol, outcome.reference = reference_jvp(case, primals, t)
            loop_out.append(case.f(*primals))
            loop_jvp.append(expected)
        args = (*(batch[0] if in_dims[0] is None else _stack(batch)), *_stack(tangents))
        out, actual = _vmapped(outcome, lambda: functx.vmap(jvp_of_f, in_dims=in_dims, randomness="same")(*args))
        _assert_close(f"{what}: output", out, _stack(loop_out), TOLERANCE[case.dtype], case)
        _assert_close(f"{what}: jvp", actual, _stack(loop_jvp), tol, case)
    outcome.reference = f"loop of {outcome.reference}"


def check_vmap_vjp_vjp(case, outcome):
    """functx.vmap over the vjp of (x, u) -> vjp(f, x)[1](u), with primals, first and second
    cotangents all batched (distinct samples), vs a Python loop of torch's double backward."""
    n = len(case.primals)
    batch = _batch_of(case, SAMPLE_SEED)
    inputs = [_second_order_inputs(case, p, COTANGENT_SEED + 10 * b) for b, p in enumerate(batch)]
    references = [reference_vjp_vjp(case, p, u, v) for p, (u, v) in zip(batch, inputs)]
    outcome.reference = "loop of torch double backward"
    vjp_of_f = _vjp_of_f(case, n)

    def vjp_of_vjp(*args):
        out, vjp_fn = functx.vjp(vjp_of_f, *args[: n + len(inputs[0][0])])
        return out, vjp_fn(tuple(args[n + len(inputs[0][0]):]))

    args = (*_stack(batch), *_stack([u for u, _ in inputs]), *_stack([v for _, v in inputs]))
    out, actual = _vmapped(outcome, lambda: functx.vmap(vjp_of_vjp, randomness="same")(*args))
    tol = TOLERANCE[case.dtype]
    _assert_close("vmap(vjp of vjp): vjp", out, _stack([g for g, _ in references]), tol, case)
    _assert_close("vmap(vjp of vjp)", actual, _stack([e for _, e in references]), tol, case)


def check_vmap_jvp_vjp(case, outcome):
    """functx.vmap over the jvp of (x, u) -> vjp(f, x)[1](u), with primals, cotangents and
    both tangents batched (distinct samples), vs a Python loop of `reference_jvp_vjp`."""
    n = len(case.primals)
    batch = _batch_of(case, SAMPLE_SEED)
    inputs = [_jvp_vjp_inputs(case, p, COTANGENT_SEED + 10 * b) for b, p in enumerate(batch)]
    references = [reference_jvp_vjp(case, p, *rest) for p, rest in zip(batch, inputs)]
    outcome.reference = f"loop of {references[0][2]}"
    m = len(inputs[0][0])
    vjp_of_f = _vjp_of_f(case, n)

    def jvp_of_vjp(*args):
        return functx.jvp(vjp_of_f, args[: n + m], args[n + m:])

    args = (
        *_stack(batch), *_stack([u for u, _, _ in inputs]),
        *_stack([tx for _, tx, _ in inputs]), *_stack([tu for _, _, tu in inputs]),
    )
    out, actual = _vmapped(outcome, lambda: functx.vmap(jvp_of_vjp, randomness="same")(*args))
    tol = TOLERANCE[case.dtype]
    _assert_close("vmap(jvp of vjp): vjp", out, _stack([r[0] for r in references]), tol, case)
    _assert_close("vmap(jvp of vjp)", actual, _stack([r[1] for r in references]), tol, case)


def _inplace_applies(case):
    """Whether plain torch runs the in-place variant on this sample (the input is a
    differentiable tensor, and the variant neither broadcasts nor casts it) with the
    out-of-place values."""
    if 0 not in case.diff_at:
        return False
    try:
        with torch.no_grad():
            inplace, out_of_place = case.f_inplace(*case.primals), case.f(*case.primals)
    except RuntimeError:
        return False
    return len(inplace) == len(out_of_place) and all(
        a.shape == b.shape and a.dtype == b.dtype for a, b in zip(inplace, out_of_place)
    )


def check_vjp_inplace(case, outcome):
    """functx.vjp of the in-place variant applied to a view of a clone of the input
    (`Case.f_inplace`) vs torch.autograd.grad of the out-of-place op."""
    if not _inplace_applies(case):
        raise _SkipCase("torch's in-place variant does not apply to this sample")
    primals = case.primals
    xs = _leaves(primals)
    with reference("backward"):
        expected_out = case.f(*xs)
        cotangents = _random_like(expected_out, COTANGENT_SEED)
        expected = _torch_grad(expected_out, xs, cotangents)
    outcome.reference = "torch.autograd.grad of the out-of-place op"
    out, vjp_fn = functx.vjp(case.f_inplace, *primals)
    tol = TOLERANCE[case.dtype]
    _assert_close("in-place output", out, expected_out, tol, case)
    _assert_close("vjp of in-place", vjp_fn(cotangents), expected, tol, case)


def check_jvp_inplace(case, outcome):
    """functx.jvp of the in-place variant applied to a view of a clone of the input vs
    `reference_jvp` of the out-of-place op."""
    if not _inplace_applies(case):
        raise _SkipCase("torch's in-place variant does not apply to this sample")
    primals = case.primals
    tangents = _random_like(primals, COTANGENT_SEED)
    expected, tol, reference_name = reference_jvp(case, primals, tangents)
    outcome.reference = f"{reference_name} of the out-of-place op"
    out, actual = functx.jvp(case.f_inplace, tuple(primals), tangents)
    _assert_close("in-place output", out, case.f(*primals), TOLERANCE[case.dtype], case)
    _assert_close("jvp of in-place", actual, expected, tol, case)


CHECK_FUNCTIONS = {
    "vjp": check_vjp,
    "jvp": check_jvp,
    "vmap_vjp": check_vmap_vjp,
    "vjp_vjp": check_vjp_vjp,
    # the compositions of torch's test/functorch/test_ops.py (jvpvjp, vjpvmap, vmapjvpall,
    # vmapvjpvjp, vmapjvpvjp, and vjp/jvp of in-place variants)
    "jvp_vjp": check_jvp_vjp,
    "vjp_vmap": check_vjp_vmap,
    "vmap_jvp": check_vmap_jvp,
    "vmap_vjp_vjp": check_vmap_vjp_vjp,
    "vmap_jvp_vjp": check_vmap_jvp_vjp,
    "vjp_inplace": check_vjp_inplace,
    "jvp_inplace": check_jvp_inplace,
}
assert tuple(CHECK_FUNCTIONS) == CHECKS


def applies(op, check) -> str | None:
    """None where torch differentiates `op` in the way `check` needs, else why not."""
    if check in ("vjp_vjp", "vmap_vjp_vjp") and not op.supports_gradgrad:
        return "torch has no double backward for this op (OpInfo.supports_gradgrad=False)"
    if check in ("jvp_vjp", "vmap_jvp_vjp") and not (op.supports_gradgrad or op.supports_fwgrad_bwgrad):
        return "torch has neither forward-over-reverse nor double backward for this op"
    if check in ("vjp_inplace", "jvp_inplace") and op.inplace_variant is None:
        return "the OpInfo has no in-place variant"
    if not op.supports_autograd:
        return "torch does not differentiate this op"
    return None


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
    skipped = []
    # torch's deprecation notices for op_db's old entry points (torch.qr, ...) are noise
    # here; vmap's per-sample fallback is recorded in `outcome`, not warned about.
    with time_limit(CHECK_TIMEOUT_S), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for case in cases(op, max_samples):
            if not case.f(*case.primals):
                raise NotApplicable("the op has no floating-point output")
            try:
                CHECK_FUNCTIONS[check](case, outcome)
            except _SkipCase as e:
                skipped.append(str(e))
                continue
            outcome.cases += 1
    if not outcome.cases:
        raise NotApplicable(f"no sample applies: {skipped[0]}")
    return outcome
