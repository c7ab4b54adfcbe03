"""Process-wide switches.

`fallback` decides what vmap does for an op without a batching rule or decomposition:
"warn" (default) runs a per-sample loop and emits one `functx.PerformanceWarning` per op,
"silent" runs the loop quietly, "error" raises `NotImplementedError` naming the op. The same
switch governs the whole-function fallback of a vmap call whose function needs each sample's
Python value (`if x > 0`, `.item()`): "warn" runs the function once per sample with one
`PerformanceWarning` per call, "silent" without it, "error" raises torch.func's error (vmap
over a nested tensor runs per sample under every mode: there is nothing else it can do).
"""

import contextlib

_FALLBACK_MODES = ("warn", "silent", "error")
fallback = "warn"


def set_vmap_fallback(mode: str) -> None:
    """Choose what vmap does for an op that has neither a rule nor a decomposition.

    Example:
        >>> import functx
        >>> functx.set_vmap_fallback("error"); functx.set_vmap_fallback("warn")
    """
    global fallback
    if mode not in _FALLBACK_MODES:
        raise ValueError(f"vmap fallback mode must be one of {_FALLBACK_MODES}, got {mode!r}")
    fallback = mode


@contextlib.contextmanager
def vmap_fallback(mode: str):
    """Context manager form of `set_vmap_fallback`, restoring the previous mode on exit.

    Example:
        >>> import functx, torch
        >>> with functx.vmap_fallback("error"):
        ...     functx.vmap(torch.sin)(torch.ones(2, 3)).shape
        torch.Size([2, 3])
    """
    previous = fallback
    set_vmap_fallback(mode)
    try:
        yield
    finally:
        set_vmap_fallback(previous)
