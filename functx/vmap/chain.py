"""A value under several vmap levels: a chain of BatchedTensors over a plain tensor.

The direct AD levels (ad/direct_reverse.py, ad/direct_forward.py) run torch's autograd on
the plain ("physical") tensor under the wrappers of the vmap levels below them; its dims
are the batch dims of those levels, outermost level first, then the logical dims.
"""

from __future__ import annotations


from .batched_tensor import BatchedTensor


def peel(vmap_levels, x):
    """The tensor under `x`'s wrappers of `vmap_levels`."""
    while type(x) is BatchedTensor and x._interp in vmap_levels:
        x = x._value
    return x


def batched_everywhere(vmap_levels, x):
    """The plain tensor of `x` batched at every level (batch dims outermost level first):
    a level where `x` is not batched gets its batch dim by an expand, made through the
    levels below so it is a view of what they hold."""
    for level in reversed(vmap_levels):
        if type(x) is BatchedTensor and x._interp is level:
            x = x._value
        else:
            x = x.expand(level.batch_size, *x.shape)
    return x


def is_batched_everywhere(vmap_levels, x) -> bool:
    """Whether `x` is batched at every one of `vmap_levels` (its wrappers, innermost first)."""
    for level in reversed(vmap_levels):
        if type(x) is not BatchedTensor or x._interp is not level:
            return False
        x = x._value
    return True


def batched_copy(vmap_levels, x):
    """A copy of plain `x` batched at every level, each element with its own memory."""
    return wrap_chain(vmap_levels, batched_everywhere(vmap_levels, x).clone())


def wrap_chain(vmap_levels, physical):
    """`physical` (batched at every level) as the innermost level's tensor."""
    for level in vmap_levels:
        physical = BatchedTensor(physical, level)
    return physical


def rewrap_like(like, vmap_levels, physical):
    """`physical` under the same chain of `vmap_levels`' wrappers as `like` has."""
    chain = []
    while type(like) is BatchedTensor and like._interp in vmap_levels:
        chain.append(like._interp)
        like = like._value
    for level in reversed(chain):
        physical = BatchedTensor(physical, level)
    return physical
