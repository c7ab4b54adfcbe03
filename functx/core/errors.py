"""Errors and warnings that functx raises, in one place so messages stay consistent."""


class PerformanceWarning(UserWarning):
    """An op ran through a slow path (for example vmap's per-sample loop fallback).

    Example:
        >>> import warnings, functx
        >>> issubclass(functx.PerformanceWarning, UserWarning)
        True
    """


class DeadLevelError(RuntimeError):
    """A value from a transform that has already returned was used where a live one is needed."""


def op_name(op) -> str:
    """`aten::add.Tensor`-style name of an OpOverload (or the repr of anything else)."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return repr(op)
    overload = schema.overload_name
    return f"{schema.name}.{overload}" if overload else schema.name
