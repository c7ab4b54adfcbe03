"""Kernels for batched work that a transform would otherwise materialise per sample.

`per_sample`: per-sample gradient norms and the clipped sum of per-sample gradients of a
layer, computed from what the layer saw (its input, the gradient of its output) without
the B copies of its parameter gradient that `vmap(grad)` makes. `functx.dp` builds a
DP-SGD step on them.
"""

from .per_sample import LayerGradients, layer_gradients, register_layer_gradients

__all__ = ["LayerGradients", "layer_gradients", "register_layer_gradients"]
