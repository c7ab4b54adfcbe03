"""`.backward()` called by user code inside an AD transform: a clear error.

Inside `functx.grad(f)` (or vjp, jacrev, hessian, jvp...) the derivative is what the
transform returns; `loss.backward()` in `f` would run a backward of the level's graph
before the transform does (ending in torch's misleading "Trying to backward through the
graph a second time ... retain_graph=True") or accumulate into the `.grad` of tensors from
outside. torch.func refuses it too. Importing functx wraps `torch.autograd.backward` (which
`Tensor.backward` calls after torch-function handling, so vmap's routing of `.backward()`,
vmap/autograd_calls.py, still sees the call first): while an AD level is open on the calling
thread and no backward pass is running (torch's reentrant checkpointing calls backward from
inside one), it raises, saying what to use instead; otherwise it is torch's own. Inside
`vmap` alone `.backward()` keeps working.

    >>> import torch, functx
    >>> def f(x):
    ...     loss = (x ** 2).sum()
    ...     loss.backward()
    ...     return loss
    >>> try:
    ...     functx.grad(f)(torch.ones(2))
    ... except RuntimeError as error:
    ...     print(str(error)[:56])
    functx.grad: the transformed function called .backward()
"""

from __future__ import annotations

import functools

import torch

from ..core.interpreter import current_stack
from ..core.patches import patch
from .level import ADLevel

_torch_backward = torch.autograd.backward
_graph_task_id = torch._C._current_graph_task_id


def _transform_name(level) -> str:
    name = type(level).__name__
    return "jvp" if "Jvp" in name else "grad"


@functools.wraps(_torch_backward)
def backward(*args, **kwargs):
    stack = current_stack()
    if stack and _graph_task_id() == -1:
        for level in reversed(stack):
            if isinstance(level, ADLevel):
                transform = _transform_name(level)
                raise RuntimeError(
                    f"functx.{transform}: the transformed function called .backward(). Inside "
                    f"a transform the derivative is what the transform returns: return the loss "
                    f"from the function and take `functx.grad(f)(params)` (or vjp, jacrev), or, "
                    f"for a derivative inside the function, `torch.autograd.grad(loss, inputs, "
                    f"create_graph=True)`. `.backward()` belongs outside every transform."
                )
    return _torch_backward(*args, **kwargs)


backward.__module__ = __name__  # (functools.wraps copied torch's)
patch(
    torch.autograd,
    "backward",
    backward,
    ".backward() inside an AD transform raises a clear error (it used to end in torch's "
    "'backward through the graph a second time')",
)
