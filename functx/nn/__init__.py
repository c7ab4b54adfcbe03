"""Module state as data: helpers that let transforms work with `torch.nn.Module`s."""

from .batch_norm import replace_all_batch_norm_modules_

__all__ = ["replace_all_batch_norm_modules_"]
