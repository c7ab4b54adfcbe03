"""The torch functions that make new tensors from nothing (or copy one), as torch function
modes see them: what the AD levels lift into themselves as constants when a transformed
function makes its own buffers (ad/lifting.py, vmap/randomness.py)."""

import torch

FACTORIES = frozenset(
    [
        torch.zeros, torch.ones, torch.empty, torch.full, torch.eye, torch.arange, torch.range,
        torch.linspace, torch.logspace, torch.tensor, torch.as_tensor, torch.asarray, torch.from_numpy,
        torch.scalar_tensor, torch.empty_strided, torch.zeros_like, torch.ones_like, torch.empty_like,
        torch.full_like, torch.rand, torch.randn, torch.randint, torch.randperm, torch.rand_like,
        torch.randn_like, torch.randint_like, torch.normal, torch.clone,
        torch.Tensor.new_zeros, torch.Tensor.new_ones, torch.Tensor.new_empty, torch.Tensor.new_full,
        torch.Tensor.new_tensor, torch.Tensor.new_empty_strided, torch.Tensor.clone,
    ]
)  # fmt: skip
