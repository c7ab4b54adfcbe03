"""Process-wide switches.

`fallback` decides what vmap does for an op without a batching rule or decomposition:
"warn" (default) runs a per-sample loop and emits one `functx.PerformanceWarning` per op,
"silent" runs the loop quietly, "error" raises `NotImplementedError` naming the op. The same
switch governs the whole-function fallback of a vmap call whose function needs each sample's
Python value (`if x > 0`, `.item()`): "warn" runs the function once per sample with one
`PerformanceWarning` per call, "silent" without it, "error" raises torch.func's error (vmap
over a nested tensor runs per sample under every mode: there is nothing else it can do).

`ragged` decides what that per-sample run does with an output whose shape differs between
samples: "error" (default) raises saying so, "nested" returns it as a nested tensor (jagged
where the shapes differ in one dim, strided otherwise; its out_dim must be 0).
"""

import contextlib

_FALLBACK_MODES = ("warn", "silent", "error")
_RAGGED_MODES = ("error", "nested")
fallback = "warn"
ragged = "error"


def set_vmap_fallback(mode: str, *, ragged: str | None = None) -> None:
    """Choose what vmap does for an op that has neither a rule nor a decomposition, and for
    a function that needs each sample's Python value (`.item()`, a Python `if` on a value).

    Args:
        mode (str): "warn" (the default: run once per sample, with one
            `functx.PerformanceWarning` per op), "silent" (the same, without the warning) or
            "error" (raise, as torch.func does for a function that needs a sample's value).
        ragged (str | None, default None): what the per-sample run returns for an output
            whose shape differs between samples: "error" or "nested" (a nested tensor);
            None keeps the current choice.

    Returns:
        None. The choice holds for the process (`functx.vmap_fallback` scopes it).

    Raises:
        ValueError: a mode or ragged value not among the choices
            ([error catalogue: configuration](../errors.md#configuration-and-extension)).

    Examples:
        >>> import functx, torch
        >>> functx.set_vmap_fallback("error")
        >>> try:
        ...     functx.vmap(lambda x: x * 2 if x.sum() > 0 else x)(torch.ones(2, 2))
        ... except RuntimeError as error:  # names the op or the value read, and how to vectorize
        ...     print(isinstance(error, RuntimeError))
        True
        >>> functx.set_vmap_fallback("warn")  # back to the default

    Differences from torch.func:
        torch.func has no fallback to choose: it raises where functx, by default, runs a
        function per sample, and always loops over an op without a batching rule.
    """
    global fallback
    if mode not in _FALLBACK_MODES:
        raise ValueError(f"vmap fallback mode must be one of {_FALLBACK_MODES}, got {mode!r}")
    if ragged is not None and ragged not in _RAGGED_MODES:
        raise ValueError(f"vmap fallback's ragged outputs must be one of {_RAGGED_MODES}, got {ragged!r}")
    fallback = mode
    if ragged is not None:
        globals()["ragged"] = ragged


@contextlib.contextmanager
def vmap_fallback(mode: str, *, ragged: str | None = None):
    """Context manager form of `set_vmap_fallback`: inside the `with` block vmap uses
    `mode` (and `ragged`) for ops without a rule and for functions that need each sample's
    Python value; on exit the previous choices come back.

    Args:
        mode (str): "warn" (run once per sample, with a `functx.PerformanceWarning`: one
            per op, or one per call of a function that runs per sample), "silent" (the
            same, without the warning) or "error" (raise: `NotImplementedError` naming the
            op; for a function, torch.func's `RuntimeError`).
        ragged (str | None, default None): what the per-sample run returns for an output
            whose shape differs between samples: "error" or "nested" (a nested tensor);
            None keeps the current choice.

    Returns:
        contextlib.AbstractContextManager[None]: the context manager (`as` binds None).
        On exit, also when the block raises, it restores the mode and `ragged` that held
        on entry, undoing `set_vmap_fallback` calls made inside the block. The choice is
        the process's, not the thread's: other threads see it while the block runs.

    Raises:
        ValueError: a mode or ragged value not among the choices, on entering the `with`
            block, not at the call
            ([error catalogue: configuration](../errors.md#configuration-and-extension)).

    Examples:
        >>> import functx, torch
        >>> with functx.vmap_fallback("error"):
        ...     functx.vmap(torch.sin)(torch.ones(2, 3)).shape
        torch.Size([2, 3])
        >>> x = torch.tensor([[1.0, -2.0, 3.0], [-1.0, 5.0, -6.0]])
        >>> with functx.vmap_fallback("silent", ragged="nested"):
        ...     positive = functx.vmap(lambda v: v[v > 0])(x)
        >>> [t.tolist() for t in positive.unbind()]
        [[1.0, 3.0], [5.0]]

        "error" refuses a function that needs each sample's value:

        >>> f = functx.vmap(lambda v: v if v.sum() > 0 else -v)
        >>> with functx.vmap_fallback("error"):
        ...     try:
        ...         f(x)
        ...     except RuntimeError:
        ...         print("refused")
        refused
        >>> try:
        ...     with functx.vmap_fallback("loud"):
        ...         pass
        ... except ValueError as error:
        ...     print(error)
        vmap fallback mode must be one of ('warn', 'silent', 'error'), got 'loud'

    Differences from torch.func:
        torch.func has no fallback to choose: for a function that needs a sample's value
        (a Python `if` on it) it raises, and for an op without a batching rule it runs its
        own loop, with a warning printed from C++, which only a private function switches
        off (`torch._C._functorch._set_vmap_fallback_enabled(False)`).
    """
    previous = fallback, globals()["ragged"]
    set_vmap_fallback(mode, ragged=ragged)
    try:
        yield
    finally:
        set_vmap_fallback(previous[0], ragged=previous[1])
