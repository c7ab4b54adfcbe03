"""functx.vmap in one page: batch a function written for one example, check it against a loop.

Run: python examples/vmap_demo.py [--quick]   (--quick: a smaller batch; CI runs it so)

The timings are medians of repeated runs on one thread: on a small, busy machine extra threads
mostly wait for each other, and a single timing says more about the neighbours than about vmap.
"""

import statistics
import sys
import time

import torch

import functx

torch.manual_seed(0)
torch.set_num_threads(1)
QUICK = "--quick" in sys.argv
REPEATS = 3 if QUICK else 11


def median_ms(run):
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def mlp(params, x):
    """A 2-layer MLP written for ONE example x of shape [784]."""
    (w1, b1), (w2, b2) = params
    return torch.relu(x @ w1.T + b1) @ w2.T + b2


params = [(torch.randn(256, 784) * 0.05, torch.zeros(256)), (torch.randn(10, 256) * 0.05, torch.zeros(10))]
batch = torch.randn(64 if QUICK else 512, 784)

# Batch over the examples (dim 0 of `batch`), share the parameters (in_dims=None).
batched_mlp = functx.vmap(mlp, in_dims=(None, 0))
start = time.perf_counter()
out = batched_mlp(params, batch)
t_first = (time.perf_counter() - start) * 1e3  # includes torch's one-time lazy imports
loop = torch.stack([mlp(params, x) for x in batch])
t_vmap = median_ms(lambda: batched_mlp(params, batch))
t_loop = median_ms(lambda: torch.stack([mlp(params, x) for x in batch]))

print(f"output shape {tuple(out.shape)}; max |vmap - loop| = {(out - loop).abs().max():.2e}")
print(
    f"{len(batch)} examples, 1 thread, median of {REPEATS}: vmap {t_vmap:.1f} ms (first call {t_first:.0f} ms) "
    f"vs per-example loop {t_loop:.1f} ms ({t_loop / t_vmap:.1f}x)"
)

# Ensembles: batch the parameters too (one model per batch element), nested vmap for pairs.
ensemble = [tuple(torch.stack([p * (1 + 0.1 * k) for k in range(4)]) for p in layer) for layer in params]
per_model = functx.vmap(mlp, in_dims=(0, None))(ensemble, batch)
print(f"4-model ensemble output {tuple(per_model.shape)}")
pairwise = functx.vmap(functx.vmap(lambda a, b: (a - b).norm(), in_dims=(None, 0)), in_dims=(0, None))
print(f"pairwise distances {tuple(pairwise(batch[:5], batch[:7]).shape)}")
assert torch.allclose(out, loop, atol=1e-5)
