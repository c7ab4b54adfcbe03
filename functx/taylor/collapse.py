"""Collapsed Taylor mode: the sum over directions taken at every op, not at the end.

A Laplacian is the sum over directions v_r of the second coefficient of f along
`x0 + v_r t`; a weighted Laplacian or a stochastic estimate is a weighted sum of them. Run
as a jet per direction (a vmap over directions around `jet`), every op propagates K
coefficients per direction and the sum comes last. Collapsed (Dangel et al., *Collapsing
Taylor Mode Automatic Differentiation*, NeurIPS 2025), the top coefficient is summed at
every op: the output's top coefficient is `J(x0) x_K` plus a polynomial in the lower
coefficients, so its weighted sum over the directions is `J(x0)` of the inputs' summed top
coefficient plus the weighted sum of the polynomial terms, and only the coefficients below
the top are carried per direction (taylor/level.py `_collapsed_handler`).

The directions are a vmap level's batch, opened right around the jet level: a coefficient
that differs between directions is a `BatchedTensor` of that level, whose value holds the
directions at dim 0 (vmap/batched_tensor.py), so the sum is one reduction of that value.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..vmap.batched_tensor import BatchedTensor


class Collapse:
    """The directions' vmap level, their count and their weights (None: all 1)."""

    __slots__ = ("directions", "count", "weights")

    def __init__(self, directions, count: int, weights: Optional[torch.Tensor] = None):
        self.directions = directions
        self.count = count
        self.weights = weights

    def summed(self, term):
        """The (weighted) sum over the directions of `term` (a value one level down)."""
        if term is None:
            return None
        if type(term) is BatchedTensor and term._interp is self.directions:
            value = term._value
            if self.weights is not None:
                value = value * self.weights.reshape((-1,) + (1,) * (value.dim() - 1))
            return value.sum(0)
        # the same for every direction
        return term * (self.count if self.weights is None else self.weights.sum())
