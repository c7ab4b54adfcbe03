"""vmap over nested tensors (`torch.nested`, jagged or strided layout): one sample at a time.

A nested tensor at in_dim 0 is a batch of samples whose shapes differ, so no BatchedTensor
can hold it: a level tensor's per-sample shape is one shape, and torch's autograd formulas
read it (a `sum`'s backward expands its gradient to the saved shape). vmap therefore runs the
function once per component, each on a vmap level of batch size 1 (so `randomness`, writes
into unbatched tensors and every rule keep their meaning, and any transform inside or around
composes as it does on dense inputs), with one `functx.PerformanceWarning` per call. Dense
inputs are sliced the same way; the per-sample outputs are joined by `join_samples`: stacked
where every sample's output has the same shape (per-sample gradients, losses, pooled
features), a nested tensor otherwise (jagged where the inputs were and the shapes differ in
one dim, strided else). torch.func batches strided nested tensors through a per-op
fallback; functx goes beyond it where that refuses (jagged inputs, `x.shape` inside, nested
and dense inputs mapped at different dims, `vmap(vmap(f))`).

    >>> import torch, functx, warnings
    >>> x = torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3)], layout=torch.jagged)
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore", functx.PerformanceWarning)
    ...     functx.vmap(lambda s: s.sum(0))(x)
    tensor([[2., 2., 2.],
            [4., 4., 4.]])
"""

from __future__ import annotations

import warnings

import torch

from ..core.errors import PerformanceWarning, user_stacklevel

__all__ = ["nested_batch_size", "samples_of", "warn_per_sample", "join_samples"]

_ONLY_DIM_0 = "Nested tensors can only be vmapped over dim=0"  # torch.func's words, which users' code matches


def nested_batch_size(func_name: str, in_dims, where: str, x: torch.Tensor, dim) -> int:
    """The number of components of nested tensor `x`, checking that `dim` (its in_dim) is 0
    (RuntimeError, as torch.func's)."""
    if dim % x.dim() != 0:
        raise RuntimeError(
            f"vmap({func_name}, in_dims={in_dims}, ...)(<inputs>): {where} is a nested tensor "
            f"with in_dim={dim}. {_ONLY_DIM_0} (its components, whose shapes differ): give it "
            f"in_dim 0, or None to pass it to the function whole."
        )
    return x.size(0)


def samples_of(x, dim: int):
    """`x` cut into batches of one sample along `dim`: a nested tensor's components (each
    with a leading dim of 1), a tensor's or container's slices."""
    from .containers import chunks_of

    if isinstance(x, torch.Tensor) and x.is_nested:
        return [component.unsqueeze(0) for component in x.unbind(0)]
    return chunks_of(x, 1, dim)


def warn_per_sample(func_name: str, batch_size: int):
    warnings.warn(
        f"vmap({func_name}) over a nested tensor runs {func_name} once per sample ({batch_size} "
        f"samples): nested tensors' samples have different shapes, which one batched call cannot "
        f"hold. To vectorize, pad the samples to one length (with a mask) and vmap over the padded "
        f"tensor.",
        PerformanceWarning,
        stacklevel=user_stacklevel(),
    )


def join_samples(func_name: str, out_dims, index: int, pieces: list, out_dim: int, layout):
    """Output `index` of the per-sample calls (`pieces`, each batched at `out_dim` with one
    sample) as one value: concatenated where their shapes agree, else a nested tensor of
    `layout` (torch.jagged, or torch.strided) that holds each sample's output."""
    first = pieces[0]
    if not all(isinstance(p, torch.Tensor) and not p.is_nested for p in pieces):
        return torch.cat(pieces, dim=out_dim)  # containers: their own cat (which refuses ragged ones)
    if all(p.shape == first.shape for p in pieces):
        return torch.cat(pieces, dim=out_dim)
    shapes = ", ".join(str(tuple(p.shape[1:])) for p in pieces[:3]) + (", ..." if len(pieces) > 3 else "")
    if out_dim % first.dim() != 0:
        raise RuntimeError(
            f"vmap({func_name}, ..., out_dims={out_dims}): output {index} has different shapes per "
            f"sample ({shapes}), so it comes back as a nested tensor, and {_ONLY_DIM_0}: give it "
            f"out_dim 0."
        )
    if any(p.dim() != first.dim() for p in pieces):
        raise ValueError(
            f"vmap({func_name}, ...): output {index} has a different number of dims per sample "
            f"({shapes}); a nested tensor needs components of one rank."
        )
    components = [p.select(0, 0) for p in pieces]
    if layout is torch.jagged and first.dim() > 1:
        try:
            return torch.nested.as_nested_tensor(components, layout=torch.jagged)
        except (RuntimeError, ValueError):  # ragged in more than one dim: jagged holds one
            pass
    return torch.nested.as_nested_tensor(components, layout=torch.strided)
