"""Ops whose result depends on tensor *values* in Python (`.item()`, `bool(x)`) cannot run
under vmap: raise `NeedsPerSampleValues`, which the vmap call of the level catches to run
the function once per sample (vmap/api.py), or, with the fallback mode "error", the user
gets: its message says so and points to `torch.where`.

Ops whose output *shape* depends on the values (`nonzero`, `bincount`, `unique`,
`masked_select` with a batched mask) cannot be vectorized, but each batch element's result
is well defined: run them once per element and stack the results when their shapes agree
(torch.func does the same); when they differ, the per-sample loop raises an error saying so.
"""

import math

import torch

from ...core.errors import NeedsPerSampleValues, op_name
from ...core.op_facts import writes_any
from ..batched_tensor import VMAP_RULES
from ..fallback import loop_fallback
from ..templates import pad_to_rank

aten = torch.ops.aten


def _data_dependent_rule(op, error=NeedsPerSampleValues):
    name = op_name(op)
    short = f"{name} needs one Python value of each sample (.item(), bool(), int(), float(), if)"
    if op in (aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default, aten.item.default):
        what = (
            f"vmap: It looks like you're calling .item() (or bool(), int(), float()) on a batched "
            f"Tensor ({name}): that needs one Python value, but inside vmap the tensor holds one "
            f"value per batch element. Data-dependent control flow such as `if x > 0:` is not "
            f"supported under vmap; compute both branches and select with torch.where(cond, a, b)."
        )
    else:
        short = f"{name} returns a tensor whose shape depends on each sample's values"
        what = (
            f"vmap: {name} returns a tensor whose shape depends on the values of its input, so "
            f"batch elements would get different shapes and cannot be stacked. Use a fixed-shape "
            f"formulation instead, e.g. torch.where(mask, x, 0) instead of x[mask] / "
            f"masked_select / nonzero."
        )

    def rule(interp, *args, **kwargs):
        if error is not NeedsPerSampleValues:
            raise error(what)
        read = args[0] if len(args) == 1 and interp.is_batched(args[0]) else None
        raise error(what, interp, short, samples=None if read is None else read._value)

    return rule


def _per_sample_rule(op):
    """A dynamic-output-shape op: the per-sample loop, which stacks equal shapes and
    raises for different ones. Its out= variant (one buffer for all elements) raises, and not
    for vmap's whole-function fallback: each sample would write into the one buffer."""
    if writes_any(op):
        return _data_dependent_rule(op, RuntimeError)
    return loop_fallback(
        op,
        warning=(
            f"functx.vmap: the output shape of {op_name(op)} depends on the values of its input, "
            f"so it runs once per batch element (slow) and the results are stacked when their "
            f"shapes agree. A fixed-shape formulation (torch.where, nonzero_static, "
            f"bincount(minlength=...)) vectorizes."
        ),
    )


for _op in (aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default, aten.item.default):
    VMAP_RULES.set(_op, _data_dependent_rule(_op))
VMAP_RULES.add_template(lambda op: torch.Tag.data_dependent_output in op.tags, _data_dependent_rule)
VMAP_RULES.add_template(lambda op: torch.Tag.dynamic_output_shape in op.tags, _per_sample_rule)


def _masked_select(interp, x, mask):
    """With an unbatched mask every element selects the same positions, so the result has
    one shape (torch.combinations builds such a mask): one boolean index over dims 1..n."""
    if interp.is_batched(mask):
        return _masked_select_per_sample(interp, x, mask)
    shape = torch.broadcast_shapes(x.shape, mask.shape)
    value = pad_to_rank(x._value, x.dim(), len(shape)).expand(interp.batch_size, *shape)
    return interp.wrap(value[:, mask.expand(shape)])


_masked_select_per_sample = _per_sample_rule(aten.masked_select.default)
VMAP_RULES.set(aten.masked_select.default, _masked_select)


@VMAP_RULES.register(aten.nonzero_static.default)
def _nonzero_static(interp, x, *, size, fill_value=-1):
    """nonzero padded/truncated to `size` rows has one shape for every element: a stable
    sort puts each element's nonzero positions first, in order; rows past its count are
    `fill_value`."""
    batch, shape = interp.batch_size, x.shape
    if math.prod(shape) == 0:  # no positions at all (unravelling would divide by a 0 extent)
        return interp.wrap(x._value.new_full((batch, size, len(shape)), fill_value, dtype=torch.long))
    nonzero = (x._value != 0).reshape(batch, math.prod(shape))
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
