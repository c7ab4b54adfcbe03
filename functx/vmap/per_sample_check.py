"""Per-sample input checks: under vmap, an op validates each sample as it validates one input.

A batching rule runs the op once on physical values that carry the batch dim, so the
op's own checks see one dim more than user code does: `linalg.det` of 1-d samples
would pass as 2-d, `t()` of 3-d samples would not complain, `cholesky` of a bad rank
reaches an ATen internal assert. Rather than teach every rule the checks of its op,
the rules of the vmap table are guarded once: before a rule runs, the op runs on meta
tensors of the *logical* (per-sample) shapes, which runs the op's own shape, rank and
dtype checks — exactly those one sample would meet in plain PyTorch — without touching
data. A passing signature (op, shapes, dtypes, other arguments) is cached, so a
workload pays the meta call once per distinct call site, and a dict lookup after.

Not guarded: pointwise ops (their checks do not depend on rank: broadcasting of the
physical values is broadcasting of the samples), the per-sample loop fallback (it runs
the op on real samples), and ops whose meta kernel cannot decide (data-dependent
outputs, ops reading values: `NotImplementedError`, or an error about meta tensors) —
for those the rule's own behaviour stands.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..core.errors import op_name
from ..core.op_facts import mutated_argument

Tensor = torch.Tensor
_META = torch.device("meta")
_CACHE_LIMIT = 1 << 14

# Errors of a meta kernel that say "meta cannot decide this", not "this sample is invalid".
_UNDECIDABLE = (
    "meta tensor",
    "meta backend",
    "'meta'",
    "meta device",
    "data-dependent",
    "data dependent",
    "data pointer",
    "doesn't have storage",
    "item()",
    "fake impl",  # a torch.library custom op without a fake (meta) implementation
)


def _signature(args) -> tuple:
    """Cache key of one call's positional arguments (the hot path: flat, no recursion for
    tensors and plain values)."""
    key = []
    for a in args:
        if isinstance(a, Tensor):
            key.append(a.shape)
            key.append(a.dtype)
        elif type(a) is list or type(a) is tuple:
            key.append(_key_of(a))
        else:
            key.append(a)
    return tuple(key)


def _key_of(x):
    if isinstance(x, Tensor):
        return (x.shape, x.dtype)
    if type(x) is list or type(x) is tuple:
        return tuple(_key_of(e) for e in x)
    return x


def meta_like(x):
    """`x` with each tensor (in lists too) replaced by a meta tensor of its logical shape and
    dtype; `_Undecidable` for sparse or nested layouts."""
    if isinstance(x, Tensor):
        if x.layout is not torch.strided:
            raise _Undecidable
        return torch.empty(x.shape, dtype=x.dtype, device=_META)
    if type(x) is list or type(x) is tuple:
        return type(x)(meta_like(e) for e in x)
    return x


class _Undecidable(Exception):
    """The sample cannot be checked on meta tensors (sparse or nested layouts)."""


def _meta_error(op, args, kwargs):
    """The error `op` raises on meta tensors of the logical shapes, or None. Outside any
    dispatch mode: under make_fx or torch.compile the check is not part of the program."""
    with _disable_current_modes():
        return _meta_error_here(op, args, kwargs)


def _meta_error_here(op, args, kwargs):
    try:
        meta_args = meta_like(args)
        meta_kwargs = {k: meta_like(v) for k, v in kwargs.items()}
    except _Undecidable:
        return None
    try:
        op(*meta_args, **meta_kwargs)
    except NotImplementedError:
        return None
    except (RuntimeError, IndexError, ValueError, TypeError, AssertionError) as error:
        if any(text in str(error).lower() for text in _UNDECIDABLE):
            return None
        return error
    return None


def _raise_invalid_sample(error, op, rule, interp, args, kwargs):
    """One sample is invalid for `op`. The error the user sees: the rule's own, if it raises
    one (rules raise the CPU kernel's message and type where they check, and a meta kernel's
    may differ: RuntimeError for IndexError), else the meta kernel's. The rule is not run
    for in-place ops (the write must not happen) and never the op on a real sample: some
    ATen kernels crash on invalid input (native_batch_norm in eval mode without stats)."""
    if mutated_argument(op) is None:
        try:
            rule(interp, *args, **kwargs)
        except Exception as rule_error:
            if "INTERNAL ASSERT" not in str(rule_error):
                raise
    raise _per_sample_error(error, op, args) from None


def _per_sample_error(error, op, args):
    shapes = [list(a.shape) for a in args if isinstance(a, Tensor)]
    note = (
        f"\n(vmap checks {op_name(op)} for each batch element, as plain PyTorch checks one input: "
        f"the batch dim is not a data dim; per-sample tensor shapes here: {shapes})"
    )
    if isinstance(error, AssertionError):  # some meta functions assert; torch raises RuntimeError
        return RuntimeError(f"{error}{note}")
    try:
        return type(error)(f"{error}{note}")
    except Exception:  # an exception type with another constructor
        return RuntimeError(f"{error}{note}")


def per_sample_checked(op, rule):
    """`rule` guarded by the per-sample check of `op` (cached per call signature); pointwise
    ops keep `rule` as it is."""
    if torch.Tag.pointwise in op.tags:
        return rule
    passed: dict = {}

    def checked(interp, *args, **kwargs):
        key = _signature(args)
        if kwargs:
            key = (key, tuple((k, _key_of(v)) for k, v in kwargs.items()))
        try:
            known = key in passed
        except TypeError:  # an unhashable argument: check every call
            known = False
            key = None
        if not known:
            error = _meta_error(op, args, kwargs)
            if error is not None:
                _raise_invalid_sample(error, op, rule, interp, args, kwargs)
            if key is not None:
                if len(passed) >= _CACHE_LIMIT:
                    passed.clear()
                passed[key] = None
        return rule(interp, *args, **kwargs)

    checked.__name__ = getattr(rule, "__name__", "rule")
    checked.__wrapped__ = rule
    return checked
