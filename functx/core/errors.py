"""Errors and warnings that functx raises, in one place so messages stay consistent."""

import functools
import os
import warnings
from types import FrameType
from typing import Optional

# Where functx's messages send users to report a missing rule or a bug (pyproject.toml's
# [project.urls] Issues: tests/test_project.py keeps the two equal)
ISSUES = "https://github.com/functx/functx/issues"


class PerformanceWarning(UserWarning):
    """The warning functx gives where it computes a result through a slow path: vmap runs
    an op without a batching rule, an old-style autograd.Function, or a function that reads
    a sample's Python value (`if x > 0`, `.item()`) once per batch element; `jvp` computes
    an op's JVP from two reverse passes; `jet` runs an op without a Taylor rule through
    nested derivatives. The result is right, only slower. A subclass of `UserWarning`.

    vmap's loop over an op warns once per op and process, an old-style Function once per
    Function, jet once per op; a function that runs per sample and the double-VJP warn at
    each call (Python's `warnings` filters then decide what shows). The warning names the
    user's line. `functx.set_vmap_fallback("silent")` silences vmap's for ops and
    functions (not old-style Functions), `"error"` raises there instead of running per
    sample; `warnings` filters take it as any warning class. Each message, its cause and
    what to do: [error catalogue: warnings](../errors.md#warnings).

    Examples:
        >>> import warnings, torch, functx
        >>> issubclass(functx.PerformanceWarning, UserWarning)
        True

        A Python `if` on a sample's value: vmap runs the function once per sample, and
        warns:

        >>> f = functx.vmap(lambda x: x if x.sum() > 0 else -x)
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     y = f(torch.tensor([[1.0, 2.0], [-1.0, -2.0]]))
        >>> [w.category is functx.PerformanceWarning for w in caught], y.tolist()
        ([True], [[1.0, 2.0], [1.0, 2.0]])

        Made an error, to find the slow paths:

        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("error", functx.PerformanceWarning)
        ...     try:
        ...         f(torch.ones(2, 2))
        ...     except functx.PerformanceWarning as warning:
        ...         print(str(warning).split(":")[0])
        vmap(<lambda>) runs <lambda> once per sample (2 samples)

    Differences from torch.func:
        torch.func has no such warning class: it raises where functx's vmap runs a function
        once per sample, refuses old-style Functions, and for an op without a batching rule
        runs its own loop with a message from C++ ("There is a performance drop because we
        have not yet implemented the batching rule for <op>") that Python's `warnings`
        filters do not see.
    """


class NeedsPerSampleValues(RuntimeError):
    """Inside vmap, an op needs each sample's own Python value or output shape (`.item()`,
    `bool(x)`, `.tolist()`, a `nonzero` whose per-sample shapes differ), which one batched
    call cannot give. The vmap call of the level `interp` catches it and runs the function
    once per sample (`functx.set_vmap_fallback("error")`: it raises instead).

    Example:
        >>> issubclass(NeedsPerSampleValues, RuntimeError)
        True
    """

    def __init__(self, message: str, interp=None, what: str = "", samples=None):
        super().__init__(message)
        self.interp = interp
        self.what = what or message  # in short, for the fallback's warning
        # the tensor whose value was asked for, one sample per row (the level's physical
        # value, a tensor of the levels below): what a control-flow operator reduces over
        # the samples (core/control_flow.py: a while_loop runs while any sample goes on)
        self.samples = samples


class PrimalDtypeError(ValueError, RuntimeError):
    """An integer or boolean primal given to a forward transform (`jvp`, `jacfwd`,
    `linearize`): a ValueError, as torch.func raises, and a RuntimeError, as functx raised
    before it mirrored that."""


class DeadLevelError(RuntimeError):
    """A value from a transform that has already returned was used where a live one is needed."""


def op_name(op) -> str:
    """`aten::add.Tensor`-style name of an OpOverload; `Tensor.copy_` / `torch.relu_` for a
    torch function (what a TorchFunctionMode sees); the repr of anything else."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        name = getattr(op, "__qualname__", None)
        if not isinstance(name, str):
            return repr(op)
        if name.startswith("TensorBase."):  # methods are defined on torch._C.TensorBase
            return "Tensor." + name[len("TensorBase."):]
        if name.startswith("_VariableFunctionsClass."):  # torch.* functions written in C++
            return "torch." + name[len("_VariableFunctionsClass."):]
        module = getattr(op, "__module__", None)
        return f"{module}.{name}" if isinstance(module, str) and "." not in name else name
    overload = schema.overload_name
    return f"{schema.name}.{overload}" if overload else schema.name


def raise_unbatched_inplace(op, target):
    """vmap: an in-place op would write a batched value into a tensor that is not batched."""
    raise RuntimeError(
        f"vmap: {op_name(op)} writes in place into a tensor that is not batched at this vmap "
        f"level (shape {tuple(target.shape)}), but a value it writes is batched: each batch "
        f"element would need its own copy of that tensor. Write into a batched tensor instead, "
        f"e.g. use the out-of-place op or clone a batched tensor first "
        f"(`x = x.expand(...).clone()` / `torch.zeros_like(batched)`)."
    )


_FUNCTX_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH_DIR = None


def internal_dirs() -> tuple:
    """functx's and torch's package directories: frames there are not the user's."""
    global _TORCH_DIR
    if _TORCH_DIR is None:
        import torch

        _TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
    return (_FUNCTX_DIR, _TORCH_DIR)


def user_stacklevel() -> int:
    """The `stacklevel` that points a warning issued by the caller of this function at the first
    frame outside functx and torch: the user's line, however many wrappers (dynamo's
    `disable`, decorators) lie between.

        >>> user_stacklevel() >= 1
        True
    """
    import sys

    internal = internal_dirs()
    frame: Optional[FrameType] = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(internal):
        frame, level = frame.f_back, level + 1
    return level


def warn(message: str, category: type = UserWarning) -> None:
    """Issue a functx warning at the user's line (`user_stacklevel`), so that the warning
    names the user's file and line, not functx's or torch's, and filters keyed on the user's
    module apply.

        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn("slow path", PerformanceWarning)
        >>> caught[0].category.__name__, caught[0].filename.endswith("errors.py")
        ('PerformanceWarning', False)
    """
    warnings.warn(message, category, stacklevel=user_stacklevel())


# -- tracebacks that end at the user's code ---------------------------------------------------
SHOW_INTERNAL_FRAMES = "FUNCTX_SHOW_INTERNAL_FRAMES"  # =1: keep functx's and torch's frames


def without_internal_frames(error: BaseException) -> BaseException:
    """`error` with the frames of functx's and torch's files taken out of its traceback (the
    user's own frames, the function a transform runs included, stay), unless the environment
    sets FUNCTX_SHOW_INTERNAL_FRAMES=1 (for debugging functx itself). A transform's error then
    reads as torch.func's and plain torch's do: the user's line, then the message."""
    if os.environ.get(SHOW_INTERNAL_FRAMES, "") not in ("", "0"):
        return error
    internal = internal_dirs()
    kept = []
    tb = error.__traceback__
    while tb is not None:
        if not tb.tb_frame.f_code.co_filename.startswith(internal):
            kept.append(tb)
        tb = tb.tb_next
    for earlier, later in zip(kept, kept[1:]):
        earlier.tb_next = later
    if kept:
        kept[-1].tb_next = None
    return error.with_traceback(kept[0] if kept else None)


def user_facing(function):
    """`function` (a public functx function, or the function a transform returns) raising
    its errors with functx's and torch's frames hidden (`without_internal_frames`): what is
    left above the message is the user's call and the user's own code it ran. One frame of
    this wrapper stays (Python adds the frame that re-raises; pytest hides it).

        >>> @user_facing
        ... def checked(x):
        ...     raise ValueError("x must be positive")
        >>> try:
        ...     checked(-1)
        ... except ValueError as error:
        ...     frames = [f.name for f in __import__("traceback").extract_tb(error.__traceback__)]
        >>> frames  # the caller, the wrapper, and `checked` (the user's own code, so it stays)
        ['<module>', 'call', 'checked']
    """
    @functools.wraps(function)
    def call(*args, **kwargs):
        __tracebackhide__ = True  # noqa: F841  (pytest: hide this frame too)
        try:
            return function(*args, **kwargs)
        except Exception as error:
            raise without_internal_frames(error)  # (the same object: its cause and context stay)

    return call
