"""functx.vmap in one page: batch a function written for one example, check it against a loop.

Run: python examples/vmap_demo.py
"""

import time

import torch

import functx

torch.manual_seed(0)


def mlp(params, x):
    """A 2-layer MLP written for ONE example x of shape [784]."""
    (w1, b1), (w2, b2) = params
    return torch.relu(x @ w1.T + b1) @ w2.T + b2


params = [(torch.randn(256, 784) * 0.05, torch.zeros(256)), (torch.randn(10, 256) * 0.05, torch.zeros(10))]
batch = torch.randn(512, 784)

# Batch over the examples (dim 0 of `batch`), share the parameters (in_dims=None).
batched_mlp = functx.vmap(mlp, in_dims=(None, 0))
start = time.perf_counter()
out = batched_mlp(params, batch)
t_first = time.perf_counter() - start  # includes torch's one-time lazy imports
start = time.perf_counter()
out = batched_mlp(params, batch)
t_vmap = time.perf_counter() - start

start = time.perf_counter()
loop = torch.stack([mlp(params, x) for x in batch])
t_loop = time.perf_counter() - start

print(f"output shape {tuple(out.shape)}; max |vmap - loop| = {(out - loop).abs().max():.2e}")
print(f"vmap {t_vmap * 1e3:.1f} ms (first call {t_first * 1e3:.0f} ms) vs per-example loop {t_loop * 1e3:.1f} ms")

# Ensembles: batch the parameters too (one model per batch element), nested vmap for pairs.
ensemble = [tuple(torch.stack([p * (1 + 0.1 * k) for k in range(4)]) for p in layer) for layer in params]
per_model = functx.vmap(mlp, in_dims=(0, None))(ensemble, batch)
print(f"4-model ensemble output {tuple(per_model.shape)}")
pairwise = functx.vmap(functx.vmap(lambda a, b: (a - b).norm(), in_dims=(None, 0)), in_dims=(0, None))
print(f"pairwise distances {tuple(pairwise(batch[:5], batch[:7]).shape)}")
assert torch.allclose(out, loop, atol=1e-5)
