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
    a function that needs each sample's Python value (`mode`); `ragged` ("error" or
    "nested"; None keeps the current choice): what the per-sample run returns for an output
    whose shape differs between samples.

    Example:
        >>> import functx
        >>> functx.set_vmap_fallback("error"); functx.set_vmap_fallback("warn")
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
    """Context manager form of `set_vmap_fallback`, restoring the previous choices on exit.

    Example:
        >>> import functx, torch
        >>> with functx.vmap_fallback("error"):
        ...     functx.vmap(torch.sin)(torch.ones(2, 3)).shape
        torch.Size([2, 3])
        >>> x = torch.tensor([[1.0, -2.0, 3.0], [-1.0, 5.0, -6.0]])
        >>> with functx.vmap_fallback("silent", ragged="nested"):
        ...     positive = functx.vmap(lambda v: v[v > 0])(x)
        >>> [t.tolist() for t in positive.unbind()]
        [[1.0, 3.0], [5.0]]
    """
    previous = fallback, globals()["ragged"]
    set_vmap_fallback(mode, ragged=ragged)
    try:
        yield
    finally:
        set_vmap_fallback(previous[0], ragged=previous[1])
