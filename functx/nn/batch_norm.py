"""Batch norm under transforms: make modules keep no running statistics."""

from __future__ import annotations

import torch.nn as nn

from .functional_call import require_module


def replace_all_batch_norm_modules_(root: nn.Module) -> nn.Module:
    """Make every batch-norm module in `root` (in place) use batch statistics only:
    `running_mean`, `running_var` and `num_batches_tracked` become None and
    `track_running_stats` False. Under vmap, training-mode batch norm then has no
    unbatched running statistics to update. Returns `root`.

    Example:
        >>> import torch, functx
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
        >>> _ = functx.nn.replace_all_batch_norm_modules_(net)
        >>> net[1].running_mean is None, net[1].track_running_stats
        (True, False)
    """
    require_module(root, "replace_all_batch_norm_modules_")
    for module in root.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats:
            module.running_mean = None
            module.running_var = None
            module.num_batches_tracked = None
            module.track_running_stats = False
    return root
