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
