"""Every change functx makes to torch itself, in one list (the design's contract: nothing is
patched that is not named here, with where and why).

Each entry is `(owner, attribute, installed_by, why)`: `getattr(owner, attribute)` is
functx's replacement once `functx` is imported. The installing modules still hold the code
(each next to the machinery it serves); this list is what a reader, a reviewer and
`tests/core/test_patches.py` check against. Not attributes, so not in the list: the
autograd kernels `ad/library_ops.py` registers (torch.library IMPL) for operators defined
before functx's import (the functional collectives), for the same reason as its entry, and
for the ATen operators whose forward formula torch gets wrong (`ad/aten_forward_rules.py`:
`mse_loss_backward`, shadowed from the first forward transform on; without a tangent
torch's own kernel runs), and the kernels `core/lazy_bits.py` registers at torch's
Conjugate and Negative keys for a few out-of-place arithmetic ops from the first transform
on (beside a level tensor, a plain operand's lazy conjugate view goes through to the
level unresolved, and is resolved on the values below, in their autograd and forward-AD
state; otherwise what torch's fallback does) and at the ZeroTensor key for `mul`, `div`,
`linalg_cross`, `dot` and `vdot` (beside a level tensor an efficient zero's answer is the
level's tensor, not a plain one; otherwise torch's answer, checked against it by a test).

Example:
    >>> import functx
    >>> from functx.core.patches import PATCHES, installed
    >>> all(installed(entry) for entry in PATCHES)
    True
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint as _checkpoint
from torch._library import autograd as _library_autograd

PATCHES = (
    (
        torch.autograd.Function,
        "apply",
        "functx/core/custom_function.py",
        "a Function applied while a transform runs goes to the highest level among its arguments",
    ),
    (
        torch.autograd,
        "backward",
        "functx/ad/user_backward.py",
        ".backward() inside an AD transform raises a clear error (it used to end in torch's "
        "'backward through the graph a second time')",
    ),
    (
        _library_autograd,
        "make_autograd_impl",
        "functx/ad/library_ops.py",
        "torch.library operators registered later keep their tangents under forward mode",
    ),
    (
        _checkpoint,
        "_checkpoint_without_reentrant_generator",
        "functx/ad/checkpointing.py",
        "the recomputation's detach does not cut functx's wrapped levels (hessian through "
        "checkpoint was off by ~4); reentrant checkpointing is replaced under transforms "
        "through core/custom_function.replace_under_transforms",
    ),
)


def installed(entry) -> bool:
    """Whether `entry`'s replacement is in place (its function comes from functx)."""
    owner, attribute, _, _ = entry
    value = getattr(owner, attribute)
    value = getattr(value, "__func__", value)  # a classmethod's function
    return getattr(value, "__module__", "").startswith("functx.")


__all__ = ["PATCHES", "installed"]
