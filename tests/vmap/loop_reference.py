"""The reference every batching-rule test compares with: a Python loop over the batch."""

import torch


def stack_tree(outs):
    """Stack per-sample results that are tensors or (nested) tuples/lists of tensors."""
    first = outs[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(outs)
    return type(first)(stack_tree([o[i] for o in outs]) for i in range(len(first)))


def loop(fn, args, in_dims):
    """`fn` called once per batch element (args sliced at their in_dims), results stacked."""
    size = next(a.shape[d] for a, d in zip(args, in_dims) if d is not None)
    return stack_tree([fn(*(a if d is None else a.select(d, i) for a, d in zip(args, in_dims))) for i in range(size)])


B = 3  # batch size of the batching-rule tests


def batched_inputs(makers, pattern, dim):
    """Args (batched ones: B samples stacked at `dim`) and their in_dims."""
    args = [torch.stack([make() for _ in range(B)], dim=dim) if batched else make() for make, batched in zip(makers, pattern)]
    return args, tuple(dim if batched else None for batched in pattern)


def check(fn, makers, pattern=(True,), dim=0):
    """vmap of `fn` (no per-sample fallback allowed) equals the loop."""
    import functx

    args, in_dims = batched_inputs(makers, pattern, dim)
    with functx.vmap_fallback("error"):
        out = functx.vmap(fn, in_dims=in_dims)(*args)
    torch.testing.assert_close(out, loop(fn, args, in_dims))


def with_patterns_and_dims(cases, dims=(0, -1)):
    """pytest params: every case times every non-empty set of batched arguments with the
    batch dim at 0; at the last dim, only one argument batched or all of them (enough to
    catch a rule that ignores where the batch dim was, at a fraction of the cost)."""
    import itertools

    import pytest

    for name, fn, makers in cases:
        for pattern in itertools.product((False, True), repeat=len(makers)):
            for dim in dims:
                if not any(pattern) or (dim != 0 and 1 < sum(pattern) < len(pattern)):
                    continue
                label = "".join("b" if p else "u" for p in pattern)
                where = "first" if dim == 0 else "last"
                yield pytest.param(fn, makers, pattern, dim, id=f"{name}-{label}-{where}")
