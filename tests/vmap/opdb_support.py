"""Check `functx.vmap` of one op_db OpInfo against a per-sample loop of the op.

Shared by tests/vmap/test_op_db.py and scripts/coverage_table.py, so the test suite and
the generated coverage table measure exactly the same thing.

How a batch is built: `op.sample_inputs` is called B=3 times, each time after seeding
torch with a different seed. The generators are deterministic in structure and random in
values, so the i-th sample of each call has the same shapes and non-tensor arguments but
different values, and each one satisfies the op's own input constraints (positive
definite matrices, indices in range, sorted boundaries...). Stacking them gives a batch
whose elements really differ, so a rule that mixes up batch elements is caught. When the
three samples do not line up (a generator that draws shapes at random), the batch is the
sample plus positively scaled copies of its floating tensors (scaling keeps signs,
orders, symmetry and definiteness).

For every sample, three ways of batching are checked against the loop:
  dim0       every tensor argument batched at a new dim 0;
  dim-1      every tensor batched at a new trailing dim (`in_dims=-1`; the physical
             layout really has the batch innermost, so stride handling is exercised);
  unbatched  one tensor argument passed unbatched (`in_dims=None`), the others batched
             (each of the first few tensor arguments in turn).

Each call runs under `functx.vmap_fallback("error")` first: if the per-sample fallback
was needed, the op is "not vectorized", the aten op that needed it is recorded, and the
call is repeated with the fallback allowed (its result must still be right).

Random ops (the reference loop gives different values for different seeds) are checked
structurally under randomness="different" and "same"; ops whose result depends on data in
Python (`.item()`, output shape from values) must raise vmap's RuntimeError.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import random as pyrandom
import re
import time
import warnings

import optree
import torch

import functx
from functx.core.errors import op_name
from functx.vmap import VMAP_RULES

BATCH = 3
SEEDS = (0, 1, 2)
SCALES = (1.0, 0.75, 0.5)
MAX_UNBATCHED_VARIANTS = 3
RTOL = 1e-4
ATOL = 1e-4

_FALLBACK_MESSAGE = re.compile(r"no batching rule for (\S+) and the per-sample fallback is switched off")
# An op that updates an argument in place (batch norm's running stats) must refuse when
# that argument is unbatched and the value written is batched.
_INPLACE_UNBATCHED = re.compile(r"in place.*not batched|not batched.*in place", re.DOTALL)
_RANDOM_ERROR = "called random operation while in randomness error mode"
_DATA_DEPENDENT_MESSAGE = re.compile(
    r"vmap: .*(shape depends on the values|calling \.item\(\)|data-dependent)", re.DOTALL
)


def op_id(op) -> str:
    """Readable, unique id of an OpInfo: name plus variant (`div.floor_rounding`)."""
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


@functools.lru_cache(maxsize=1)
def float32_ops():
    """Every op_db OpInfo that supports float32 on CPU, in op_db order."""
    from torch.testing._internal.common_methods_invocations import op_db

    return tuple(op for op in op_db if torch.float32 in op.supported_dtypes("cpu"))


def find_op(identifier: str):
    return next(op for op in float32_ops() if op_id(op) == identifier)


# -- results ---------------------------------------------------------------------------
CORRECT_AND_VECTORIZED = ("vectorized", "data_dependent", "random", "factory")
CORRECT = (*CORRECT_AND_VECTORIZED, "fallback", "random_fallback")


@dataclasses.dataclass
class OpResult:
    """What happened to one OpInfo.

    status:
      vectorized      every check matched the loop and no per-sample fallback ran;
      fallback        every check matched, but some aten op needed the per-sample loop;
      data_dependent  vmap raised its clear RuntimeError (.item(), value-dependent shape);
      random          random op: right shapes under randomness="different"/"same", no loop;
      random_fallback random op, right shapes, but the per-sample loop ran;
      fail            a result differs from the loop;
      error           vmap raised something it should not have;
      unsupported     sparse inputs (vmap batches strided tensors only);
      factory         no sample has a tensor argument (arange, zeros, windows): the op,
                      called inside vmap on an unrelated batched input, gives its
                      usual result (random ones: its usual shape);
      no_samples      no float32 sample on CPU.
    """

    op: str
    status: str = "vectorized"
    messages: list = dataclasses.field(default_factory=list)
    fallback_ops: set = dataclasses.field(default_factory=set)
    aten_ops: dict = dataclasses.field(default_factory=dict)  # aten name -> VMAP_RULES.how
    checks: int = 0
    batched_checks: int = 0
    seconds: float = 0.0

    @property
    def correct(self) -> bool:
        return self.status in CORRECT

    @property
    def vectorized(self) -> bool:
        return self.status in CORRECT_AND_VECTORIZED

    def note(self, status, message=None):
        """Record one check's outcome; the worst outcome is the op's status."""
        if _RANK[status] > _RANK[self.status]:
            self.status = status
        if message and len(self.messages) < 6:
            self.messages.append(message)


_RANK = {
    "no_samples": -1, "vectorized": 0, "factory": 0, "random": 1, "data_dependent": 1,
    "fallback": 2, "random_fallback": 2, "unsupported": 3, "fail": 3, "error": 3,
}


# -- recording which aten ops reached vmap ------------------------------------------------
class record_vmap_ops:
    """Record every aten op that reached a vmap level (including ops of decompositions),
    by shadowing `VMAP_RULES.lookup` (how a vmap level finds its handlers) and
    `VMAP_RULES.handler` (how templates find a functional op's) for the duration of the
    block: vmap levels made inside it see every op through the recorder.

        >>> import torch, functx
        >>> from functx.vmap.batched_tensor import VMAP_RULES
        >>> seen = {}
        >>> with record_vmap_ops(seen):
        ...     _ = functx.vmap(torch.sin)(torch.ones(2, 3))
        >>> seen[torch.ops.aten.sin.default] == VMAP_RULES.how(torch.ops.aten.sin.default)
        True
    """

    def __init__(self, into: dict):
        self.into = into

    def _record(self, op):
        if op not in self.into:
            self.into[op] = VMAP_RULES.how(op)

    def __enter__(self):
        lookup, handler = VMAP_RULES.lookup, VMAP_RULES.handler

        def recording_lookup(*args, **kwargs):
            inner = lookup(*args, **kwargs)

            def recording(op):
                self._record(op)
                return inner(op)

            return recording

        def recording_handler(op):
            self._record(op)
            return handler(op)

        VMAP_RULES.lookup, VMAP_RULES.handler = recording_lookup, recording_handler
        return self

    def __exit__(self, *exc):
        del VMAP_RULES.lookup, VMAP_RULES.handler  # the class's methods show through again


# -- samples ---------------------------------------------------------------------------
@dataclasses.dataclass
class Sample:
    """One sample, flattened: `leaves` of (input, args, kwargs), with tensors at `tensor_at`."""

    leaves: list
    spec: object
    tensor_at: list
    name: str
    broadcasts_input: bool = False

    @classmethod
    def of(cls, sample):
        leaves, spec = optree.tree_flatten((sample.input, sample.args, sample.kwargs), none_is_leaf=True)
        tensor_at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        return cls(leaves, spec, tensor_at, sample.name or "", bool(sample.broadcasts_input))

    def tensors(self):
        return [self.leaves[i] for i in self.tensor_at]

    def rebuild(self, tensors):
        leaves = list(self.leaves)
        for i, t in zip(self.tensor_at, tensors):
            leaves[i] = t
        return optree.tree_unflatten(self.spec, leaves)

    def signature(self):
        return (
            self.spec,
            tuple(repr(leaf) for i, leaf in enumerate(self.leaves) if i not in self.tensor_at),
            tuple((tuple(t.shape), t.dtype, t.layout) for t in self.tensors()),
        )


def _seed(seed):
    """Seed torch's CPU generator and Python's `random` (cheaper than torch.manual_seed,
    which also records a stack trace for lazy CUDA seeding)."""
    torch.random.default_generator.manual_seed(seed)
    pyrandom.seed(seed)


def _samples(op, seed, limit):
    """The first `limit` samples, drawn after seeding with `seed`. Calls the OpInfo's
    generator directly: `op.sample_inputs` would re-seed with a fixed seed before every
    sample (making all three batch elements identical) and crawl the call stack."""
    _seed(seed)
    generator = op.sample_inputs_func(op, "cpu", torch.float32, False)
    return [Sample.of(s) for s in itertools.islice(generator, limit)]


def batches(op, max_samples):
    """For each of the first `max_samples` samples: B per-element lists of tensor arguments
    (plus the Sample used to rebuild the call)."""
    runs = [_samples(op, seed, max_samples) for seed in SEEDS]
    for i, first in enumerate(runs[0]):
        others = [run[i] for run in runs[1:] if i < len(run)]
        if len(others) == BATCH - 1 and all(o.signature() == first.signature() for o in others):
            yield first, [first.tensors()] + [o.tensors() for o in others]
        else:
            yield first, [[_scaled(t, s) for t in first.tensors()] for s in SCALES]


def _scaled(t, scale):
    if scale == 1.0 or not (t.is_floating_point() or t.is_complex()):
        return t.clone()
    return t * scale


# -- running ---------------------------------------------------------------------------
def _tensor_leaves(out):
    leaves = optree.tree_leaves(out, none_is_leaf=True)
    return [leaf for leaf in leaves if leaf is not None]


def _call(fn, sample, tensors):
    inp, args, kwargs = sample.rebuild(tensors)
    return fn(inp, *args, **kwargs)


def reference(fn, sample, per_element):
    """Loop of `fn` over the batch; stacked tensor outputs (None if non-tensor output)."""
    outs = [_tensor_leaves(_call(fn, sample, tensors)) for tensors in per_element]
    if any(not isinstance(o, torch.Tensor) for o in outs[0]):
        return None
    return [torch.stack([out[k] for out in outs]) for k in range(len(outs[0]))]


def is_random(fn, sample, tensors) -> bool:
    """`fn` gives different values for the same inputs under different seeds."""
    outs = []
    for seed in (123, 456):
        _seed(seed)
        outs.append(_tensor_leaves(_call(fn, sample, [t.clone() for t in tensors])))
    for a, b in zip(*outs):
        if isinstance(a, torch.Tensor) and a.shape == b.shape and not torch.equal(a, b):
            if not (a.is_floating_point() and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())):
                return True
    return False


# Random or uninitialized outputs (no value comparison possible), besides those OpInfo flags.
RANDOM_OPS = {
    "bernoulli", "cauchy", "exponential", "geometric", "log_normal", "normal", "uniform",
    "multinomial", "rand_like", "randn_like", "randint_like", "randn", "randint",
    "nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d",
    "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout",
    "nn.functional.rrelu", "nn.functional.fractional_max_pool2d",
    "nn.functional.fractional_max_pool3d", "svd_lowrank", "pca_lowrank",
}


# Ops that read raw memory (storage offsets, strides): their per-sample result depends on
# the batched tensor's memory layout (in the loop, an element of a trailing-batched tensor
# interleaves with the others), so only the batch-outermost layouts are compared.
LAYOUT_DEPENDENT = {
    "as_strided", "as_strided.partial_views", "as_strided_copy", "as_strided_scatter",
    "resize_", "resize_as_",  # resize_ of a strided tensor reinterprets its memory as contiguous
}


def run_vmap(fn, sample, batched, in_dims, randomness="error"):
    """vmap of `fn`: returns (outputs, fallback op name or None). Raises what vmap raises."""

    def f(*tensors):
        inp, args, kwargs = sample.rebuild(tensors)
        return tuple(_tensor_leaves(fn(inp, *args, **kwargs)))

    try:
        with functx.vmap_fallback("error"):
            return functx.vmap(f, in_dims=tuple(in_dims), randomness=randomness)(*batched), None
    except NotImplementedError as e:
        match = _FALLBACK_MESSAGE.search(str(e))
        if match is None:
            raise
        fallback = match.group(1)
    with functx.vmap_fallback("silent"):
        return functx.vmap(f, in_dims=tuple(in_dims), randomness=randomness)(*batched), fallback


def batching_modes(per_element, layout_dependent=False):
    """(label, make batched inputs, in_dims, make per-element inputs of the reference loop).

    The makers build fresh tensors on every call, so ops that write into their inputs
    cannot leak from one run into the next. The reference of "dim-1" runs on views
    `x.select(-1, b)` of the trailing-batched tensors: they have the same strides as the
    logical tensors inside vmap, so a stride-sensitive op (`view`, `view_as_complex`)
    fails or succeeds in the loop exactly as it should inside vmap.
    """
    n = len(per_element[0])

    def stacked():
        return [torch.stack([element[j] for element in per_element]) for j in range(n)]

    def clones():
        return [[t.clone() for t in element] for element in per_element]

    def trailing():
        return [s.movedim(0, -1).contiguous() for s in stacked()]

    def trailing_views():
        batched = trailing()
        return [[t.select(-1, b) for t in batched] for b in range(len(per_element))]

    yield "dim0", stacked, [0] * n, clones
    if not layout_dependent:
        yield "dim-1", trailing, [-1] * n, trailing_views
    for j in range(min(n, MAX_UNBATCHED_VARIANTS) if n > 1 else 0):

        def batched(j=j):
            tensors = stacked()
            tensors[j] = per_element[0][j].clone()
            return tensors

        def ref(j=j):
            elements = clones()
            for element in elements:
                element[j] = per_element[0][j].clone()
            return elements

        yield f"arg{j}-unbatched", batched, [None if k == j else 0 for k in range(n)], ref


def _compare(result, label, actual, expected, tolerance):
    if len(actual) != len(expected):
        result.note("fail", f"{label}: {len(actual)} outputs, loop gives {len(expected)}")
        return
    rtol, atol = tolerance
    for k, (a, e) in enumerate(zip(actual, expected)):
        try:
            torch.testing.assert_close(a, e, rtol=rtol, atol=atol, equal_nan=True, check_device=False)
        except AssertionError as err:
            first = str(err).strip().splitlines()
            result.note("fail", f"{label}: output {k}: {' '.join(first[:3])}")


def _structure(result, label, actual, expected):
    shapes = [(tuple(t.shape), t.dtype) for t in actual]
    wanted = [(tuple(t.shape), t.dtype) for t in expected]
    if shapes != wanted:
        result.note("fail", f"{label}: got {shapes}, loop gives {wanted}")


def _describe(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}"


def _raises_for_contiguous_copies(fn, sample, per_element) -> bool:
    try:
        reference(fn, sample, [[t.contiguous() if isinstance(t, torch.Tensor) else t for t in ts] for ts in per_element])
    except Exception:  # noqa: BLE001 - any error
        return True
    return False


def _run_one(result, fn, sample, label, make_batched, in_dims, make_reference, random, tolerance):
    try:
        expected = reference(fn, sample, make_reference())
    except Exception as e:  # the sample is not valid in this layout (e.g. `view` of a strided input)
        per_element = make_reference()
        if not _raises_for_contiguous_copies(fn, sample, per_element):
            # a kernel's stride requirement (aten.native_group_norm wants contiguous input):
            # vmap may run it, as the public op (which makes it contiguous) would
            if len(result.messages) < 6:
                result.messages.append(f"{label}: reference raised {_describe(e)} on strided samples only; skipped")
            return
        # then vmap must reject it too: the batch dim is never a data dim (issue 12)
        result.checks += 1
        try:
            run_vmap(fn, sample, make_batched(), in_dims, "different" if random else "error")
        except Exception:  # noqa: BLE001 - any error: one sample raised in plain torch
            if len(result.messages) < 6:
                result.messages.append(f"{label}: reference raised {_describe(e)}; vmap raised too")
            return
        result.note("fail", f"{label}: one sample raises {_describe(e)} in plain torch, but vmap returned a value")
        return
    modes = ["different", "same"] if random else ["error"]
    for randomness in modes:
        result.checks += 1
        result.batched_checks += 1
        try:
            actual, fallback = run_vmap(fn, sample, make_batched(), in_dims, randomness)
        except RuntimeError as e:
            text = str(e)
            if _DATA_DEPENDENT_MESSAGE.search(text):
                result.note("data_dependent", f"{label}: {_describe(e)}")
            elif randomness == "error" and _RANDOM_ERROR in text:
                # random only for some arguments (dropout_p > 0), and seeded inside the
                # sample's function, so the loop looked deterministic: check it as random
                random = True
                modes.extend(["different", "same"])
            elif randomness == "same" and "randomness='same' is not supported" in text:
                pass
            elif "unbatched" in label and _INPLACE_UNBATCHED.search(text):
                pass  # the op updates that argument in place (running stats): must refuse
            else:
                result.note("error", f"{label}: {_describe(e)}")
            continue
        except Exception as e:
            result.note("error", f"{label}: {_describe(e)}")
            continue
        if fallback is not None:
            result.fallback_ops.add(fallback)
            result.note("random_fallback" if random else "fallback")
        elif random:
            result.note("random")
        if expected is None:
            result.note("fail", f"{label}: the op returns non-tensor values but vmap did not raise")
        elif random:
            _structure(result, f"{label}/{randomness}", list(actual), expected)
        else:
            _compare(result, label, list(actual), expected, tolerance)


def _run_factory(result, fn, sample, known_random):
    """A sample without tensor arguments: call the op inside vmap over an unrelated batched
    input (randomness="same"); its result does not depend on the batch, so it comes out
    unbatched (out_dims=None) and must equal the op's usual result (random ops: shapes)."""
    inp, args, kwargs = sample.rebuild([])
    result.checks += 1
    try:
        random = known_random or is_random(fn, sample, [])
        expected = _tensor_leaves(fn(inp, *args, **kwargs))
        with functx.vmap_fallback("error"):
            actual = functx.vmap(
                lambda _: tuple(_tensor_leaves(fn(inp, *args, **kwargs))), out_dims=None, randomness="same"
            )(torch.zeros(BATCH))
    except Exception as e:
        result.note("error", f"factory: {_describe(e)}")
        return
    tensors = [(a, e) for a, e in zip(actual, expected) if isinstance(e, torch.Tensor)]
    if [a for a, e in zip(actual, expected) if not isinstance(e, torch.Tensor)] != [
        e for e in expected if not isinstance(e, torch.Tensor)
    ]:
        result.note("fail", f"factory: non-tensor outputs {actual} != {expected}")
    elif random:
        _structure(result, "factory", [a for a, _ in tensors], [e for _, e in tensors])
    else:
        _compare(result, "factory", [a for a, _ in tensors], [e for _, e in tensors], (RTOL, ATOL))


def check_op(op, max_samples=4, tolerance=(RTOL, ATOL), inplace=False) -> OpResult:
    """Run every check on the first `max_samples` float32 samples of `op` (of its in-place
    variant `op_` with `inplace=True`: samples whose input would need broadcasting are
    left out, and an unbatched `self` with batched arguments must raise)."""
    fn = op.inplace_variant if inplace else op.op
    result = OpResult(op_id(op) + ("_" if inplace else ""), status="no_samples")
    if fn is None:
        return result
    known_random = op.has_nondeterministic_output or op.name in RANDOM_OPS
    start = time.perf_counter()
    seen: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            samples = list(batches(op, max_samples))
        except Exception as e:
            result.note("error", f"sample_inputs raised {_describe(e)}")
            samples = []
        with record_vmap_ops(seen):
            for sample, per_element in samples:
                if inplace and (sample.broadcasts_input or 0 not in sample.tensor_at):
                    continue
                if not sample.tensor_at:
                    _run_factory(result, fn, sample, known_random)
                    continue
                if any(t.layout != torch.strided for t in sample.tensors()):
                    result.note("unsupported", "sparse inputs: vmap batches strided tensors only")
                    continue
                try:
                    random = known_random or is_random(fn, sample, per_element[0])
                except Exception:
                    random = False
                modes = batching_modes(per_element, op_id(op) in LAYOUT_DEPENDENT)
                for label, batched, in_dims, ref in modes:
                    label = f"sample {sample.name!r} {label}" if sample.name else label
                    _run_one(result, fn, sample, label, batched, in_dims, ref, random, tolerance)
    if result.status == "no_samples" and result.checks:
        result.status = "vectorized" if result.batched_checks else "factory"
    result.aten_ops = {op_name(o): how for o, how in seen.items()}
    result.seconds = time.perf_counter() - start
    return result


# -- families (for the per-family summary) --------------------------------------------------
# First matching pattern wins; patterns are matched against the op id.
_FAMILY_PATTERNS = (
    ("sparse", r"^sparse\.|^to_sparse$"),
    ("spectral", r"^fft\.|^stft$|^istft$"),
    ("linalg", r"^linalg\.|^(add)?(b)?mm|^(add)?mv$|^addr$|^addbmm$|^baddbmm$|^bmm|^dot$|^vdot$|^inner$|^outer$|"
     r"^matmul$|^__rmatmul__$|^einsum$|^tensordot$|^kron$|^chain_matmul$|^cholesky|^lu|^qr$|^svd|^pca_lowrank$|"
     r"^geqrf$|^ormqr$|^triangular_solve$|^pinverse$|^matrix_exp$|^logdet$|^det$|^inverse$|^trace$|^tril$|^triu$|"
     r"^cdist$|^cross$|^corrcoef$|^cov$|^nn\.functional\.pdist$|^nn\.functional\.linear$|^nn\.functional\.bilinear$"),
    ("nn_conv", r"^nn\.functional\.conv"),
    ("nn_pooling", r"pool|^nn\.functional\.(pad|unfold|fold|interpolate|upsample|grid_sample|pixel|channel_shuffle)|"
     r"^_upsample|^constant_pad_nd$|^grid_sampler|^max_pool"),
    ("nn_norm", r"^nn\.functional\.(batch|layer|group|instance|rms|local_response)_norm$|^native_(batch|layer|group)_norm$|"
     r"^_native_batch_norm|^_batch_norm"),
    ("nn_losses", r"loss|cross_entropy|^nn\.functional\.kl_div$|^nn\.functional\.nll"),
    ("random", r"^(bernoulli|cauchy|exponential|geometric|log_normal|normal|uniform|multinomial|rand|randn|randint)"
     r"(_like)?(\.|$)|dropout"),
    ("views", r"^(select|slice|diagonal|as_strided)_scatter$"),
    ("indexing", r"index|gather|scatter|^take|^put$|^masked_scatter$|^masked_select$|^__getitem__$|embedding|"
     r"^nonzero|^argwhere$|^_segment_reduce"),
    ("nn_misc", r"^nn\.functional\.|^_softmax_backward_data$|^torch\.ops\.aten\._safe_softmax"),
    ("factory", r"^(arange|linspace|logspace|ones|zeros|full|empty|eye|scalar_tensor|new_|signal\.windows)|_like$|"
     r"^broadcast_shapes$|^jiterator"),
    ("reductions", r"^(sum|nansum|mean|nanmean|prod|amax|amin|aminmax|argmax|argmin|max\.reduction|min\.reduction|"
     r"std|var|median|nanmedian|mode|kthvalue|all|any|count_nonzero|logsumexp|norm|dist|renorm|softmax|log_softmax|"
     r"cum|logcumsumexp|sort|argsort|msort|topk|unique|histc|histogram|bucketize|searchsorted|isin$|quantile|"
     r"nanquantile|hash_tensor|masked\.|diff|gradient|trapz|trapezoid|cumulative_trapezoid|_chunk_cat|sum_to_size)"),
    ("views", r"^(view|reshape|as_strided|expand|broadcast_to|broadcast_tensors|squeeze|unsqueeze|flatten|unflatten|ravel|"
     r"permute|transpose|movedim|t$|t_copy|T$|H$|mT$|mH$|narrow|select|slice|split|chunk|unsafe_|tensor_split|hsplit|"
     r"vsplit|dsplit|unbind|diag|diagonal|alias_copy|flip|rot90|roll|repeat|tile|cat|stack|hstack|vstack|dstack|"
     r"column_stack|block_diag|cartesian_prod|combinations|meshgrid|atleast|resize|contiguous|clone|unfold|"
     r"real$|imag$|view_as|conj|resolve|positive$|to$|bfloat16|bool|byte|char|double|float$|half|int$|long|short|"
     r"cdouble|cfloat|chalf|fill$|zero_$|triu_indices|tril_indices)"),
)


def family_of(identifier: str) -> str:
    """The op family an op_db op belongs to (pointwise unless a pattern says otherwise)."""
    for family, pattern in _FAMILY_PATTERNS:
        if re.search(pattern, identifier):
            return family
    return "pointwise"
