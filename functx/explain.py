"""`functx.explain(f)(*args)`: how each op of one call ran, with the user's source lines.

A transformed function's speed is decided op by op: at a vmap level an op runs by its
batching rule, a template, a decomposition into other ops, or a loop over the samples; a
whole vmapped function may run once per sample (Python read a sample's value); a jvp level
uses its own rule or torch's formula. `explain` runs the call once, as usual, and records
for every op that reached a level which way it went and the line of your code that called
it. It returns an `Explanation`: the call's output, the rows (level, op, how, where,
count), the whole-function fallbacks (their warnings' text), and `vectorized` (no loop over
samples anywhere); `print()` it for a table. The warnings the call would give are part of the
report instead of being issued.

    >>> import torch, functx
    >>> def f(x):
    ...     if x.sum() > 0:          # Python reads a sample's value: vmap runs f per sample
    ...         return x.sin()
    ...     return x * 2
    >>> report = functx.explain(functx.vmap(f))(torch.randn(4, 3))
    >>> report.vectorized, len(report.fallbacks)
    (False, 1)
    >>> functx.explain(functx.vmap(torch.sin))(torch.randn(4, 3)).vectorized
    True

Recording wraps the levels' one entry point (`Interpreter.process`) for the call, on the
calling thread only; ops other threads run meanwhile pass through unrecorded.
"""

from __future__ import annotations

import dataclasses
import linecache
import sys
import threading
import warnings
from collections import Counter
from types import FrameType
from typing import Any, Callable, Optional

from .core import config
from .core.errors import NeedsPerSampleValues, PerformanceWarning, internal_dirs, op_name
from .core.interpreter import Interpreter
from .vmap import fallback as _fallback

_KINDS = {"VmapInterpreter": "vmap", "WrappedJvpLevel": "jvp", "WrappedGradLevel": "grad", "FunctionalizeInterpreter": "functionalize"}


@dataclasses.dataclass(frozen=True)
class ExplainedOp:
    """One op at one kind of level, from one line: how it ran and how many times."""

    level: str  # "vmap", "jvp", "grad", "functionalize"
    op: str  # aten::name.overload
    how: str  # "rule", "template", "default", "decomposition", "per-sample loop", ...
    where: str  # "file:line  source" of the user's call (or "" when none)
    count: int


@dataclasses.dataclass
class Explanation:
    """What `explain(f)(*args)` found (see the module docstring)."""

    output: Any
    rows: list
    fallbacks: list

    @property
    def vectorized(self) -> bool:
        """No per-sample loop of an op and no whole-function fallback."""
        return not self.fallbacks and not any(row.how == "per-sample loop" for row in self.rows)

    def __str__(self) -> str:
        loops = sum(row.count for row in self.rows if row.how == "per-sample loop")
        total = sum(row.count for row in self.rows)
        verdict = "vectorized" if self.vectorized else "NOT vectorized"
        lines = [
            f"functx.explain: {total} ops at functx levels, {loops} run per sample, "
            f"{len(self.fallbacks)} whole-function fallbacks: {verdict}"
        ]
        lines += [f"  fallback: {text}" for text in self.fallbacks]
        width = max([len(row.op) for row in self.rows] + [2])
        for row in self.rows:
            lines.append(f"  {row.level:<6} {row.op:<{width}} {row.how:<16} x{row.count:<4} {row.where}")
        return "\n".join(lines)


def explain(func: Callable) -> Callable[..., Explanation]:
    """`explain(f)(*args, **kwargs)` runs `f(*args, **kwargs)` once and returns an
    `Explanation` of how each op ran at functx's levels (rule, template, decomposition,
    per-sample loop) and which vmapped functions fell back to one call per sample, with
    your source lines.

    Args:
        func (Callable): the function to run, usually a transformed one
            (`functx.vmap(model)`, `functx.vmap(functx.grad(loss))`).

    Returns:
        Callable[..., Explanation]: a function of `func`'s arguments that runs it once and
        returns an `Explanation`: `output` (what `func` returned), `rows` (per level and
        op: how it ran, how often, and your source line), `fallbacks` (the vmapped
        functions that ran once per sample, and why) and `vectorized` (no loop anywhere).
        `print(report)` shows it as a table.

    Raises:
        Exception: whatever `func` raises (explain runs it as a call would); the reasons
            vmap loops are the rows of the error catalogue's
            [vmap inside the function](../errors.md#vmap-inside-the-function) section.

    Examples:
        >>> import torch, functx
        >>> report = functx.explain(functx.vmap(lambda x: x @ x))(torch.randn(3, 2))
        >>> [(row.level, row.op, row.how) for row in report.rows]
        [('vmap', 'aten::dot', 'rule')]
        >>> report.output.shape, report.vectorized
        (torch.Size([3]), True)
        >>> branchy = functx.explain(functx.vmap(lambda x: x * 2 if x.sum() > 0 else -x))(torch.randn(4, 2))
        >>> branchy.vectorized, len(branchy.fallbacks)
        (False, 1)

    Differences from torch.func:
        torch.func has no explain: where it cannot vectorize it raises.
    """

    def explained(*args, **kwargs) -> Explanation:
        recorder = _Recorder()
        original = Interpreter.process
        setattr(Interpreter, "process", recorder.process_with(original))  # (undone below)
        warned, _fallback._warned = _fallback._warned, _NeverWarned()  # each loop warns, every time
        mode = config.fallback
        if mode == "silent":  # the fallbacks' warnings are what the report reads
            config.fallback = "warn"
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                output = func(*args, **kwargs)
        finally:
            setattr(Interpreter, "process", original)
            _fallback._warned = warned
            config.fallback = mode
        fallbacks = [str(w.message) for w in caught if issubclass(w.category, PerformanceWarning) and " once per sample (" in str(w.message)]
        rows = [ExplainedOp(level, op, how, where, count) for (level, op, how, where), count in recorder.counts.items()]
        return Explanation(output, rows, fallbacks)

    return explained


class _NeverWarned(set):
    """The per-sample loop's record of ops it warned about, forgetting them (during explain)."""

    def add(self, item):
        pass


class _Recorder:
    def __init__(self):
        self.counts: Counter = Counter()
        self.thread = threading.get_ident()
        self.depth = 0

    def process_with(self, original):
        recorder = self

        def process(interp, op, args, kwargs):
            if threading.get_ident() != recorder.thread or recorder.depth:
                return original(interp, op, args, kwargs)  # other threads; ops inside a rule
            recorder.depth += 1
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    out = original(interp, op, args, kwargs)
            except NeedsPerSampleValues:  # the op that sent its vmap call to one call per sample
                recorder.record(interp, op, "needs each sample")
                raise
            finally:
                recorder.depth -= 1
            how = _how(interp, op)
            looped = how == "fallback" or any(issubclass(w.category, PerformanceWarning) for w in caught)
            recorder.record(interp, op, "per-sample loop" if looped else how)
            return out

        return process

    def record(self, interp, op, how):
        kind = _KINDS.get(type(interp).__name__, type(interp).__name__)
        self.counts[(kind, op_name(op), how, _user_line())] += 1


def _how(interp, op) -> str:
    from .ad.jvp_rules import JVP_RULES
    from .vmap.batched_tensor import VMAP_RULES

    table = {"VmapInterpreter": VMAP_RULES, "WrappedJvpLevel": JVP_RULES}.get(type(interp).__name__)
    if table is None:
        return "recorded" if type(interp).__name__ == "WrappedGradLevel" else "kernel"
    return table.how(op)


def _user_line() -> str:
    internal = internal_dirs()
    frame: Optional[FrameType] = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(internal):
        frame = frame.f_back
    if frame is None:
        return ""
    source = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    return f"{frame.f_code.co_filename}:{frame.f_lineno}  {source}"
