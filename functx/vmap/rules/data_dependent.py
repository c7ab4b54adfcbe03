"""Ops whose result depends on tensor *values* in Python (`.item()`, `bool(x)`) or whose
output shape does (`nonzero`, `unique`, `masked_select`) cannot be vectorized: raise an
error that says so and points to `torch.where`."""

import torch

from ...core.errors import op_name
from ..batched_tensor import VMAP_RULES
from ..templates import pad_to_rank

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


def _masked_select(interp, x, mask):
    """With an unbatched mask every element selects the same positions, so the result has
    one shape (torch.combinations builds such a mask): one boolean index over dims 1..n."""
    if interp.is_batched(mask):
        return _data_dependent_rule(aten.masked_select.default)(interp, x, mask)
    shape = torch.broadcast_shapes(x.shape, mask.shape)
    value = pad_to_rank(x._value, x.dim(), len(shape)).expand(interp.batch_size, *shape)
    return interp.wrap(value[:, mask.expand(shape)])


VMAP_RULES.set(aten.masked_select.default, _masked_select)


@VMAP_RULES.register(aten.nonzero_static.default)
def _nonzero_static(interp, x, *, size, fill_value=-1):
    """nonzero padded/truncated to `size` rows has one shape for every element: a stable
    sort puts each element's nonzero positions first, in order; rows past its count are
    `fill_value`."""
    batch, shape = interp.batch_size, x.shape
    nonzero = (x._value != 0).reshape(batch, -1)
    order = torch.argsort((~nonzero).to(torch.int8), dim=1, stable=True)[:, :size]
    if order.shape[1] < size:
        order = torch.cat([order, order.new_zeros(batch, size - order.shape[1])], dim=1)
    coords, rest = [], order
    for extent in reversed(shape):  # unravel the flat positions, last dim first
        coords.append(rest % extent)
        rest = rest // extent
    coords = torch.stack(coords[::-1], dim=-1) if coords else order.new_zeros(batch, size, 0)
    valid = torch.arange(size, device=order.device) < nonzero.sum(1, keepdim=True)
    return interp.wrap(torch.where(valid[..., None], coords, fill_value))
