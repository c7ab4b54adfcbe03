"""`torch.autograd.grad` called by user code inside `vmap(grad(f))`.

There, `grad` runs on plain autograd over vmap's physical tensors (ad/physical_level.py):
the tensors user code holds are BatchedTensor wrappers that autograd does not track
themselves; their physical values are. torch.func users call `torch.autograd.grad` on
the inputs of a function under `grad` (a gradient penalty written by hand, an inner
derivative), so vmap's TorchFunctionMode (randomness.py) sends the call here, and it
runs on the physical values: the batch elements are independent, so the gradient of the
summed outputs with respect to a physical input is every element's own gradient.

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
        and t._value.requires_grad
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
    """Run a `torch.autograd.grad` call on `interp`'s physical values when its outputs are
    tracked there (inside a physical grad level); otherwise hand it on unchanged."""
    if interp.physical_grad is None:
        return func(*args, **kwargs)
    return _physical_grad(interp, func, args, kwargs)


def _physical_grad(interp, func, args, kwargs):
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
        return outputs, inputs, grad_outputs, retain_graph, create_graph, allow_unused, is_grads_batched, materialize_grads

    outputs, inputs, grad_outputs, retain_graph, create_graph, allow_unused, is_grads_batched, materialize_grads = parse(
        *args, **kwargs
    )
    outputs, inputs = _as_tuple(outputs), _as_tuple(inputs)
    if not any(_tracked_physically(interp, o) for o in outputs):
        return func(*args, **kwargs)
    if is_grads_batched:
        raise NotImplementedError(
            "torch.autograd.grad(..., is_grads_batched=True) inside functx.vmap(functx.grad(f)) is "
            "not supported: use functx.vmap over a functx.vjp instead."
        )
    # An unbatched input that autograd tracks makes the wrapper level record too (the
    # outputs' wrappers then require grad and the call is not routed here), so the inputs
    # that reach here as plain tensors do not reach the outputs physically.
    physical_inputs = [x._value if type(x) is BatchedTensor and x._interp is interp else x for x in inputs]
    if grad_outputs is None:
        grad_outputs = (None,) * len(outputs)
    else:
        grad_outputs = _as_tuple(grad_outputs)
    physical_outputs, physical_grad_outputs = [], []
    for out, g in zip(outputs, grad_outputs):
        physical = out._value if type(out) is BatchedTensor and out._interp is interp else out
        if g is None:
            if out.numel() != 1:
                raise RuntimeError("grad can be implicitly created only for scalar outputs")
            g = torch.ones_like(physical)
        elif type(g) is BatchedTensor and g._interp is interp:
            g = g._value
        elif physical is not out:  # an unbatched cotangent for a batched output
            g = g.expand(physical.shape)
        physical_outputs.append(physical)
        physical_grad_outputs.append(g)
    level = interp.physical_grad
    was_in_backward, level.in_backward = level.in_backward, True  # `detach` inside f holds here too
    try:
        grads = torch.autograd.grad(
            physical_outputs,
            physical_inputs,
            physical_grad_outputs,
            retain_graph=retain_graph,
            create_graph=create_graph,
            allow_unused=allow_unused,
            materialize_grads=materialize_grads,
        )
    finally:
        level.in_backward = was_in_backward
    return tuple(None if g is None else BatchedTensor(g, interp) for g in grads)
