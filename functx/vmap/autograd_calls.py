"""`torch.autograd.grad` and `.backward()` called by user code inside `vmap(grad(f))`.

There, `grad` runs on plain autograd over vmap's physical tensors (ad/physical_level.py):
the tensors user code holds are BatchedTensor wrappers that autograd does not track
themselves; their physical values are. torch.func users call `torch.autograd.grad` on
the inputs of a function under `grad` (a gradient penalty written by hand, an inner
derivative), so vmap's TorchFunctionMode (randomness.py) sends the call here and on to
the physical grad level, which runs it on the physical values: the batch elements are
independent, so the gradient of the summed outputs with respect to a physical input is
every element's own gradient. `.backward()` has no per-element `.grad` to fill: it
raises, naming `torch.autograd.grad`.

    >>> import torch, functx
    >>> def f(x):
    ...     (g,) = torch.autograd.grad((x ** 3).sum(), x, create_graph=True)
    ...     return g.sum()
    >>> x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    >>> functx.vmap(functx.grad(f))(x)  # d/dx sum(3 x^2) = 6 x
    tensor([[ 6., 12.],
            [18., 24.]])
"""

from __future__ import annotations

import torch

from .batched_tensor import BatchedTensor, wrapper_requires_grad


def _tracked_physically(interp, t) -> bool:
    return (
        type(t) is BatchedTensor
        and t._interp is interp
        and not wrapper_requires_grad(t)
        and interp.physical_grad.tracked(t).requires_grad
    )


def _as_tuple(x):
    return (x,) if isinstance(x, torch.Tensor) else tuple(x)


def route_backward(interp, func, args, kwargs):
    """`.backward()` on a tensor tracked through its physical value: there is no `.grad`
    to fill per element, so say what works instead (torch.func refuses too)."""
    if interp.physical_grad is not None and _tracked_physically(interp, args[0]):
        raise RuntimeError(
            "functx: .backward() inside vmap(grad(f)) is not supported (there is no per-element "
            ".grad to accumulate into); use torch.autograd.grad(output, inputs) or functx.grad."
        )
    return func(*args, **kwargs)


def route_autograd_grad(interp, func, args, kwargs):
    """Hand a `torch.autograd.grad` call to `interp`'s physical grad level when its outputs
    are tracked there; otherwise on, unchanged."""
    if interp.physical_grad is None:
        return func(*args, **kwargs)

    def parse(
        outputs,
        inputs,
        grad_outputs=None,
        retain_graph=None,
        create_graph=False,
        only_inputs=True,
        allow_unused=None,
        is_grads_batched=False,
        materialize_grads=False,
    ):
        options = {
            "retain_graph": retain_graph,
            "create_graph": create_graph,
            "allow_unused": allow_unused,
            "materialize_grads": materialize_grads,
        }
        return _as_tuple(outputs), _as_tuple(inputs), grad_outputs, is_grads_batched, options

    outputs, inputs, grad_outputs, is_grads_batched, options = parse(*args, **kwargs)
    if not any(_tracked_physically(interp, o) for o in outputs):
        return func(*args, **kwargs)
    if is_grads_batched:
        raise NotImplementedError(
            "torch.autograd.grad(..., is_grads_batched=True) inside functx.vmap(functx.grad(f)) is "
            "not supported: use functx.vmap over a functx.vjp instead."
        )
    grad_outputs = (None,) * len(outputs) if grad_outputs is None else _as_tuple(grad_outputs)
    return interp.physical_grad.user_autograd_grad(outputs, inputs, grad_outputs, **options)
