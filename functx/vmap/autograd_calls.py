"""`torch.autograd.grad` and `.backward()` called by user code inside `vmap`.

Inside vmap, user code holds BatchedTensor wrappers; when autograd tracks their physical
values instead of the wrappers themselves (an input that requires grad from outside
`vmap`, or the leaves of a direct grad level: `vmap(grad(f))`, ad/direct_reverse.py),
torch's autograd would see wrappers that do not require grad. vmap's handler of torch
calls (randomness.py, core/torch_function.py) sends such calls here, and they run on the physical values: the batch
elements are independent, so the gradient of the summed outputs with respect to a physical
input is every element's own gradient. That needs each input batched at every vmap level
its outputs are batched at (otherwise the physical gradient would add up the elements of
those levels): anything else raises. `.backward()` accumulates the sum over the batch into
the `.grad` of a tensor from outside, as a loop over the elements would; inside
`vmap(grad(f))` (any open AD level) it raises before it gets here (ad/user_backward.py).

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

from ..core.interpreter import functx_code
from .batched_tensor import BatchedTensor, wrapper_requires_grad
from .chain import batched_everywhere, rewrap_like


def _chain(t):
    """(vmap levels `t` is batched at, outermost first; the plain tensor under them), or None
    when `t` is not a chain of live BatchedTensors over a plain tensor."""
    levels = []
    while type(t) is BatchedTensor and t._interp.alive:
        levels.append(t._interp)
        t = t._value
    if not levels or type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        return None
    levels.reverse()
    return levels, t


def _tracked_physically(t) -> bool:
    if type(t) is not BatchedTensor or wrapper_requires_grad(t):
        return False
    chain = _chain(t)
    return chain is not None and chain[1].requires_grad


def _as_tuple(x):
    return (x,) if isinstance(x, torch.Tensor) else tuple(x)


def route_backward(interp, func, args, kwargs):
    """`.backward()` on a tensor tracked through its physical value."""
    output = args[0]
    if not _tracked_physically(output):
        return func(*args, **kwargs)
    gradient = args[1] if len(args) > 1 else kwargs.pop("gradient", None)
    with functx_code():
        levels, physical = _chain(output)
        cotangent = _physical_cotangent(levels, gradient, output, physical)
    torch.autograd.backward(physical, cotangent, *args[2:], **kwargs)


def route_autograd_grad(interp, func, args, kwargs):
    """`torch.autograd.grad` on outputs tracked through their physical values: run it on
    those values; otherwise on to torch, unchanged."""

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
    if not any(_tracked_physically(o) for o in outputs):
        return func(*args, **kwargs)
    if is_grads_batched:
        raise NotImplementedError(
            "torch.autograd.grad(..., is_grads_batched=True) inside functx.vmap is not supported "
            "on tensors tracked outside the vmap: use functx.vmap over a functx.vjp instead."
        )
    grad_outputs = (None,) * len(outputs) if grad_outputs is None else _as_tuple(grad_outputs)
    with functx_code():
        pairs, levels_used = [], set()
        for out, g in zip(outputs, grad_outputs):
            chain = _chain(out)
            if chain is None:
                if isinstance(out, torch.Tensor) and out.requires_grad:
                    pairs.append((out, g))
                continue
            levels, physical = chain
            levels_used.update(levels)
            pairs.append((physical, _physical_cotangent(levels, g, out, physical)))
        physical_inputs, input_levels = [], []
        for x in inputs:
            chain = _chain(x)
            levels = chain[0] if chain else []
            input_levels.append(levels)
            if not levels_used <= set(levels):
                raise NotImplementedError(
                    "torch.autograd.grad inside functx.vmap: an input is not batched at every vmap "
                    "level its outputs are batched at, so its per-element gradients would be added "
                    "up over the batch. Pass it through vmap's in_dims (batched), or take the "
                    "gradient with functx.vmap(functx.grad(...))."
                )
            physical_inputs.append(chain[1] if chain else x)
    grads = torch.autograd.grad([o for o, _ in pairs], physical_inputs, [c for _, c in pairs], **options)
    with functx_code():
        return tuple(None if g is None else rewrap_like(x, levels, g) for g, x, levels in zip(grads, inputs, input_levels))


def _physical_cotangent(levels, cotangent, out, physical):
    """The cotangent of `out` for its physical value: ones for one element per batch element
    (as torch's implicit gradient), else `cotangent` with every level's batch dim."""
    if cotangent is None:
        if out.numel() != 1:
            raise RuntimeError("grad can be implicitly created only for scalar outputs")
        return torch.ones_like(physical)
    return batched_everywhere(levels, cotangent).expand(physical.shape)
