"""Ops whose result depends on tensor *values* in Python (`.item()`, `bool(x)`) or whose
output shape does (`nonzero`, `unique`, `masked_select`) cannot be vectorized: raise an
error that says so and points to `torch.where`."""

import torch

from ...core.errors import op_name
from ..batched_tensor import VMAP_RULES

aten = torch.ops.aten


def _data_dependent_rule(op):
    name = op_name(op)
    if op in (aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default, aten.item.default):
        what = (
            f"vmap: It looks like you're calling .item() (or bool(), int(), float()) on a batched "
            f"Tensor ({name}): that needs one Python value, but inside vmap the tensor holds one "
            f"value per batch element. Data-dependent control flow such as `if x > 0:` is not "
            f"supported under vmap; compute both branches and select with torch.where(cond, a, b)."
        )
    else:
        what = (
            f"vmap: {name} returns a tensor whose shape depends on the values of its input, so "
            f"batch elements would get different shapes and cannot be stacked. Use a fixed-shape "
            f"formulation instead, e.g. torch.where(mask, x, 0) instead of x[mask] / "
            f"masked_select / nonzero."
        )

    def rule(interp, *args, **kwargs):
        raise RuntimeError(what)

    return rule


def _is_data_dependent(op) -> bool:
    tags = op.tags
    return torch.Tag.dynamic_output_shape in tags or torch.Tag.data_dependent_output in tags


for _op in (aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default, aten.item.default):
    VMAP_RULES.set(_op, _data_dependent_rule(_op))
VMAP_RULES.add_template(_is_data_dependent, _data_dependent_rule)
