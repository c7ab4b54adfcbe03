"""Forward mode through operators whose autograd comes from `torch.library` (`custom_op`,
`register_autograd`): never a silently dropped tangent.

torch gives such an operator reverse mode only, and under forward AD its autograd kernel runs
the operator below autograd and returns an output with no tangent: `jvp`, `jacfwd` and
`hessian`'s forward half through it were silently zero (torch.func's still are). functx wraps
those kernels (`forward_aware`): where an input carries a tangent, an operator with a forward
rule (`register_forward_rule`: ad/collectives.py gives the linear collectives theirs)
computes its output's tangent; any other raises torch's own "Trying to use forward AD with"
error, which functx's forward transforms answer by the double-VJP identity from the
operator's registered backward (forward.py), and which torch.func users see instead of zeros.

The same wrapping shadows the autograd kernels of a few ATen operators whose own formulas
fail under transforms: forward (`register_forward_decomposition`, ad/aten_forward_rules.py)
or reverse at higher orders (`register_reverse_decomposition`, ad/aten_reverse_rules.py).

Which kernels: every operator registered after functx is imported (torch builds each such
kernel with `torch._library.autograd.make_autograd_impl`, which functx wraps here), and those
registered before (`custom_op`s, and the ones a module names through `wrap_existing`),
whose kernel is wrapped per backend where the operator's own library keeps it (it goes when
the operator does).

    >>> import torch, functx
    >>> @torch.library.custom_op("functx_doc::cube", mutates_args=())
    ... def cube(x: torch.Tensor) -> torch.Tensor:
    ...     return x.detach() ** 3
    >>> _ = cube.register_fake(torch.empty_like)
    >>> cube.register_autograd(lambda ctx, g: g * 3 * ctx.x ** 2,
    ...                        setup_context=lambda ctx, inputs, output: setattr(ctx, "x", inputs[0]))
    >>> x = torch.tensor([1.0, 2.0])
    >>> import warnings; warnings.simplefilter("ignore")  # the double-VJP's PerformanceWarning
    >>> functx.jvp(cube, (x,), (torch.ones(2),))[1]  # 3x²: torch.func gives zeros
    tensor([ 3., 12.])
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch._library.autograd as _library_autograd
import torch.autograd.forward_ad as _forward_ad
from torch._library.custom_ops import OPDEFS

from ..core.patches import kernels, patch
from .wrapped_forward import NO_FORWARD_FORMULA

_DUAL_LEVEL = 0  # functx attaches torch-level tangents at torch's one dual level
_unpack_dual = torch._VF._unpack_dual
_FORWARD_RULES: dict = {}
_FORWARD_DECOMPOSITIONS: dict = {}
_REVERSE_DECOMPOSITIONS: dict = {}  # op -> (applies(*args, **kwargs), decomposition)
_BACKEND_AUTOGRAD_KEYS = ("AutogradCPU", "AutogradCUDA", "AutogradXPU", "AutogradMPS", "AutogradMeta", "AutogradPrivateUse1")


def register_forward_rule(op: torch._ops.OpOverload, rule: Callable) -> None:
    """Give `op` (a torch.library operator) forward mode: `rule(run, primals, tangents,
    kwargs)` returns `(output, its tangent)`; `primals` are the positional arguments without
    tangents, `tangents` the same list with each tensor's tangent (None: zero) and None for
    every other argument, and `run(*args, **kwargs)` runs the operator's own autograd kernel
    (reverse mode keeps working through the output)."""
    _FORWARD_RULES[op] = rule


def register_forward_decomposition(op: torch._ops.OpOverload, decomposition: Callable) -> None:
    """Where an input of `op` carries a tangent, compute `op` as `decomposition(*args,
    **kwargs)` on the dual arguments themselves (ops whose forward formulas are right), so
    its result's tangent, and the reverse graph of both, come from those ops; without a
    tangent `op`'s own kernel runs. For ATen operators whose own forward formula fails
    (ad/aten_forward_rules.py)."""
    _FORWARD_DECOMPOSITIONS[op] = decomposition


def register_reverse_decomposition(op: torch._ops.OpOverload, applies: Callable, decomposition: Callable) -> None:
    """Where `applies(*args, **kwargs)`, compute `op` as `decomposition(*args, **kwargs)`, so
    autograd records the decomposition's ops instead of `op`'s formula (whose higher
    derivatives fail on the arguments it applies to: ad/aten_reverse_rules.py); elsewhere
    `op`'s own kernel runs. The op's autograd kernel must be wrapped (`wrap_existing`)."""
    _REVERSE_DECOMPOSITIONS[op] = (applies, decomposition)


def _unpacked(value, part: str):
    """`value`'s primal or tangent (`part`) at torch's dual level (None: no tangent; lists:
    a list of them; other arguments: themselves)."""
    if isinstance(value, torch.Tensor):
        return getattr(_unpack_dual(value, _DUAL_LEVEL), part)
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
        return [getattr(_unpack_dual(v, _DUAL_LEVEL), part) for v in value]
    return value if part == "primal" else None


def _has_tangent(tangent) -> bool:
    return tangent is not None and (not isinstance(tangent, list) or any(t is not None for t in tangent))


def _attach(out, tangent):
    if isinstance(out, torch.Tensor):
        return out if tangent is None else torch._make_dual(out, tangent, level=_DUAL_LEVEL)
    return type(out)(_attach(o, t) for o, t in zip(out, tangent))


def forward_aware(op: torch._ops.OpOverload, kernel: Callable) -> Callable:
    """`kernel` (an autograd kernel taking the dispatch keyset first) that never drops a
    tangent, and runs `op`'s reverse decomposition where one is registered and applies."""

    def autograd_kernel(keyset, *args, **kwargs):
        # (looked up per call: an operator made after functx, torch.nn's included, is wrapped
        # when made, before its module can register a rule for it)
        reverse = _REVERSE_DECOMPOSITIONS.get(op)
        if reverse is not None:
            if reverse[0](*args, **kwargs):
                return reverse[1](*args, **kwargs)
            # an ATen operator wrapped for its reverse rule only keeps torch's forward formula
            if op.namespace == "aten" and op not in _FORWARD_RULES and op not in _FORWARD_DECOMPOSITIONS:
                return kernel(keyset, *args, **kwargs)
        # no dual level open (torch's and functx's forward transforms open one through
        # forward_ad, which records it): no tangent can be here; a plain call pays ~0.1 µs
        if _forward_ad._current_level < 0 or not torch._C._is_fwd_grad_enabled():
            return kernel(keyset, *args, **kwargs)
        tangents = [_unpacked(a, "tangent") for a in args]
        keyword_tangent = any(_has_tangent(_unpacked(v, "tangent")) for v in kwargs.values())
        if not keyword_tangent and not any(_has_tangent(t) for t in tangents):
            return kernel(keyset, *args, **kwargs)
        decomposition = _FORWARD_DECOMPOSITIONS.get(op)
        if decomposition is not None:
            return decomposition(*args, **kwargs)
        rule = _FORWARD_RULES.get(op)
        if rule is None or keyword_tangent:
            raise NotImplementedError(
                f"{NO_FORWARD_FORMULA} {op} that does not support it: a torch.library operator has the reverse-mode "
                f"formula of its register_autograd only. functx's jvp, jacfwd and hessian compute its tangent from "
                f"that formula (the double-VJP identity); torch.func cannot."
            )
        run = functools.partial(kernel, keyset)
        out, tangent = rule(run, [_unpacked(a, "primal") for a in args], [t if _has_tangent(t) else None for t in tangents], kwargs)
        return _attach(out, tangent)

    autograd_kernel.__wrapped__ = kernel
    return autograd_kernel


def _make_forward_aware_autograd_impl(op, info):
    _forward_aware_ops.add(op)
    return forward_aware(op, _torch_make_autograd_impl(op, info))


def wrap_existing(op: torch._ops.OpOverload, library=None) -> None:
    """Wrap the autograd kernel torch.library gave `op` before functx was imported, per
    backend key (they take precedence over the `Autograd` alias it was registered at).
    `library`: where the wrappers live (the operator's own, so they go with it)."""
    if op in _forward_aware_ops:
        return
    if library is None:
        library = _namespace_library(op.namespace)
    kinds = {  # dispatch key -> how its kernel got there ("autograd kernel]": the Autograd alias's)
        line.split(":", 1)[0]: line.rsplit("[", 1)[-1]
        for line in torch._C._dispatch_dump_table(op.name()).splitlines()
        if ": registered at " in line
    }
    for key in _BACKEND_AUTOGRAD_KEYS:
        library.impl(op, forward_aware(op, _shadowed_kernel(op, key, kinds)), key, with_keyset=True)
    _forward_aware_ops.add(op)


def _namespace_library(namespace: str):
    """functx's library of forward-aware kernels for operators of `namespace` (registered in
    core/patches.py; undone, its operators are wrapped again when next asked)."""

    def forget():
        _forward_aware_ops.difference_update({op for op in _forward_aware_ops if op.namespace == namespace})

    return kernels(
        f"forward-aware autograd kernels of {namespace} operators",
        lambda: torch.library.Library(namespace, "IMPL"),
        "the operator's tangent under forward mode instead of torch's silent zero (ad/library_ops.py); "
        "for aten: the forward formulas torch gets wrong (ad/aten_forward_rules.py)",
        reset=forget,
    )


def _shadowed_kernel(op: torch._ops.OpOverload, key: str, kinds: dict) -> Callable:
    """A call of the autograd kernel `op` has at `key`, for the wrapper that shadows it there.

    The call must let go of the GIL, as any call of an operator from Python does: torch's
    `SafeKernelFunction.call_boxed` holds it throughout, and under it a gloo collective
    deadlocked (the process group's worker thread, holding its queue's lock, waited for the
    GIL to free a finished collective's tensors; the Python thread, holding the GIL, waited
    for that lock to queue the next collective). `redispatch` lets go of it, but at `key` it
    would reach the wrapper again; the same kernel also fills `AutogradOther` when it is the
    `Autograd` alias's kernel or torch's autograd fallback, and functx leaves that key alone,
    so the kernel is reached through it."""
    if kinds.get(key) in ("autograd kernel]", "backend fallback]") and kinds.get("AutogradOther") == kinds[key]:
        return functools.partial(_through_autograd_other, op)
    return torch.library.get_kernel(op, key).call_boxed  # a kernel registered at `key` itself: the GIL stays held


_AUTOGRAD_OTHER = torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradOther)


def _through_autograd_other(op, keyset, *args, **kwargs):
    return op.redispatch((keyset & torch._C._after_autograd_keyset) | _AUTOGRAD_OTHER, *args, **kwargs)


def wrap_at_first_forward(op: torch._ops.OpOverload) -> None:
    """Wrap `op`'s autograd kernel (`wrap_existing`) when the first forward transform runs:
    until then a program that never uses forward mode keeps torch's kernel untouched."""
    if _earlier_wrapped:
        wrap_existing(op)
    else:
        _WRAP_AT_FIRST_FORWARD.append(op)


def prepare_forward_mode() -> None:
    """Called by every forward transform: the first wraps the `custom_op`s made before functx
    was imported (here, not at import: it takes ~0.1 s) and the operators named through
    `wrap_at_first_forward`. (The functional collectives' rules: forward.py loads them.)"""
    global _earlier_wrapped
    if not _earlier_wrapped:
        _earlier_wrapped = True
        for opdef in _EARLIER_OPDEFS:
            if OPDEFS.get(opdef._qualname) is opdef:  # still defined
                wrap_existing(opdef._opoverload, opdef._lib)
        for op in _WRAP_AT_FIRST_FORWARD:
            wrap_existing(op)


_forward_aware_ops: set = set()
_earlier_wrapped = False
_WRAP_AT_FIRST_FORWARD: list = []
_EARLIER_OPDEFS = list(OPDEFS.values())
_torch_make_autograd_impl = patch(  # every later registration
    _library_autograd,
    "make_autograd_impl",
    _make_forward_aware_autograd_impl,
    "torch.library operators registered later keep their tangents under forward mode",
)
