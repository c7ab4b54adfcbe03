"""einops-style tensor rearrangement (`functx.rearrange`, as `torch.func.rearrange`)."""

from .rearrange import rearrange

__all__ = ["rearrange"]
