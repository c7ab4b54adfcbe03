"""Batch norm under transforms: make modules keep no running statistics."""

from __future__ import annotations

import torch.nn as nn

from .functional_call import require_module


def replace_all_batch_norm_modules_(root: nn.Module) -> nn.Module:
    """Make every batch-norm module in `root` use batch statistics only, in place: their
    `running_mean`, `running_var` and `num_batches_tracked` become None and
    `track_running_stats` False, so under `vmap` training-mode batch norm has no unbatched
    running statistics to update.

    This changes the model for good: it keeps no running statistics, its `state_dict()`
    loses their keys, and in eval mode too it normalises with each batch's own statistics.
    Every subclass of `torch.nn.modules.batchnorm._BatchNorm` (`BatchNorm1d/2d/3d`,
    `SyncBatchNorm`, the lazy ones) is changed; `InstanceNorm` and modules that already
    track no statistics are left alone.

    Args:
        root (torch.nn.Module): the model (or a single batch-norm module) to change.

    Returns:
        torch.nn.Module: `root` itself, changed in place.

    Raises:
        TypeError: `root` is not an `nn.Module` ("replace_all_batch_norm_modules_: expected
            a torch.nn.Module, got list (...)"); the error is also an `AttributeError`, as
            torch.func raises there
            ([error catalogue: modules](../errors.md#modules-functional_call-stack_module_state-make_functional-ensemble)).

    Examples:
        >>> import torch, functx
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
        >>> functx.replace_all_batch_norm_modules_(net) is net
        True
        >>> net[1].running_mean is None, net[1].track_running_stats, list(net.state_dict())
        (True, False, ['0.weight', '0.bias', '1.weight', '1.bias'])

        `vmap` over groups of samples through training-mode batch norm (without the
        replacement it raises "vmap: batch norm in training mode got a tensor batched at
        this vmap level ..."); each group is normalised with its own statistics:

        >>> _ = torch.manual_seed(0)
        >>> net = functx.replace_all_batch_norm_modules_(
        ...     torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)))
        >>> x = torch.randn(8, 5, 3)                 # 8 groups of 5 samples
        >>> out = functx.vmap(net)(x)
        >>> out.shape, torch.allclose(out[2], net(x[2]), atol=1e-6)
        (torch.Size([8, 5, 4]), True)

        Per-group gradients of the parameters:

        >>> params = {k: v.detach() for k, v in net.named_parameters()}
        >>> def loss(params, xb):
        ...     return functx.functional_call(net, params, (xb,)).pow(2).sum()
        >>> grads = functx.vmap(functx.grad(loss), in_dims=(None, 0))(params, x)
        >>> grads["1.weight"].shape
        torch.Size([8, 4])

    Differences from torch.func:
        The same change as `torch.func.replace_all_batch_norm_modules_`. For a `root` that
        is not a module, torch.func fails with "'list' object has no attribute 'modules'";
        functx raises a TypeError that says what it expected (an `AttributeError` too, so
        code catching torch.func's keeps working).
    """
    require_module(root, "replace_all_batch_norm_modules_")
    for module in root.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats:
            module.running_mean = None
            module.running_var = None
            module.num_batches_tracked = None
            module.track_running_stats = False
    return root
