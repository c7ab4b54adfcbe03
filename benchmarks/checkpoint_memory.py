"""Peak memory of per-sample gradients through activation checkpointing (issue 30):
`functx.vmap(functx.grad(loss), in_dims=(None, 0, 0))` over a batch, through an 8-layer
pre-LN transformer (d_model 256, 4 heads, MLP 1024, batch 8, float32, 1 thread) written as
plain torch modules and called with `functx.functional_call`. Contenders: no checkpointing;
`torch.utils.checkpoint.checkpoint` around each layer; `functx.checkpoint` around each
layer, keeping nothing (`nothing_saveable`) or the matrix products (`dots_saveable`). Cases:
the per-sample gradients of the parameters at sequence length 128 (the issue's); of the
inputs only (no per-sample parameter gradients in memory); of the parameters at length 512.
Each measurement runs in a fresh process: the peak resident memory of the call minus the
resident memory before it (parameters and inputs made, one small call run for imports and
first-call setup); the time is the fastest of three calls.

What it shows: checkpointing works under `vmap(grad)` (the layers are recomputed, their
activations not kept), but at length 128 the peak is the per-sample parameter gradients
themselves (batch x parameters, 193 MiB), all alive at the end of the backward, when the
activations are already freed: no checkpointing can lower it. Where activations weigh more
(the inputs' gradients; length 512) the peak drops.

    python benchmarks/checkpoint_memory.py            # 8 layers, batch 8 (~4 min)
    python benchmarks/checkpoint_memory.py --quick    # 4 layers, batch 4 (~2 min)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

D_MODEL, HEADS, D_MLP = 256, 4, 1024
WRT = {"parameters": 0, "inputs": 1}  # what the per-sample gradients are taken of (argnums)
# (gradients of, sequence length): the case; the same with gradients of the inputs
# only (no per-sample parameter gradients: the activations make the peak); and a longer
# sequence, whose activations outweigh the per-sample parameter gradients
CASES = (("parameters", 128), ("inputs", 128), ("parameters", 512))
CONTENDERS = ("none", "torch.utils.checkpoint", "functx.checkpoint nothing_saveable", "functx.checkpoint dots_saveable")
# glibc returns large freed blocks to the OS only above its mmap threshold, which it raises as
# blocks are freed; fixed low, a freed block leaves the resident set at once, so the peak is
# what was live at once (benchmarks/attention_forward_memory.py)
_CHILD_ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}


def _model(layers: int, contender: str):
    import torch
    import torch.nn.functional as F
    from torch import nn

    import functx

    class Block(nn.Module):
        """Pre-LN transformer layer: x + attention(LN(x)), then x + MLP(LN(x))."""

        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
            self.qkv, self.out = nn.Linear(D_MODEL, 3 * D_MODEL), nn.Linear(D_MODEL, D_MODEL)
            self.up, self.down = nn.Linear(D_MODEL, D_MLP), nn.Linear(D_MLP, D_MODEL)

        def forward(self, x):  # x: (L, d), one sample
            q, k, v = self.qkv(self.ln1(x)).unflatten(-1, (3, HEADS, -1)).permute(1, 2, 0, 3)
            attention = F.scaled_dot_product_attention(q, k, v)  # (heads, L, d / heads)
            x = x + self.out(attention.transpose(0, 1).flatten(1))
            return x + self.down(F.gelu(self.up(self.ln2(x))))

    if contender == "none":
        wrap = lambda layer: layer
    elif contender == "torch.utils.checkpoint":
        wrap = lambda layer: lambda x: torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
    else:
        policy = getattr(functx.checkpoint_policies, contender.split()[-1])
        wrap = lambda layer: functx.checkpoint(layer, policy=policy)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(layers))

        def forward(self, x):
            for block in self.blocks:
                x = wrap(block)(x)
            return x

    return Model()


def _measure(contender: str, layers: int, batch: int, wrt: str, length: int) -> dict:
    import torch

    import functx

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = _model(layers, contender)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, x, y):
        return ((functx.functional_call(model, p, (x,)) - y) ** 2).mean()

    per_sample_grads = functx.vmap(functx.grad(loss, argnums=WRT[wrt]), in_dims=(None, 0, 0))
    per_sample_grads(params, torch.randn(1, 8, D_MODEL), torch.randn(1, 8, D_MODEL))  # imports, setup
    x, y = torch.randn(batch, length, D_MODEL), torch.randn(batch, length, D_MODEL)
    # ru_maxrss is a high-water mark, of the whole process: the measured call, the first of
    # this size, must set a new one (the setup call's, of one sample's gradients, is lower);
    # the growth is counted from the resident memory now, not from the setup's high-water mark
    before = _resident_kib()
    high_water = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    grads = per_sample_grads(params, x, y)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if peak <= high_water:
        raise RuntimeError("the measured call set no new high-water mark: make the setup call smaller")
    del grads
    for _ in range(2):  # the time: the fastest of three calls (the first one's memory is measured)
        start = time.perf_counter()
        grads = per_sample_grads(params, x, y)
        seconds = min(seconds, time.perf_counter() - start)
    grads_mib = sum(g.numel() * g.element_size() for g in torch.utils._pytree.tree_leaves(grads)) / 2**20
    return {"peak_growth_mib": (peak - before) / 1024, "seconds": seconds, "grads_mib": grads_mib}


def _resident_kib() -> float:
    """The process's resident memory now, in KiB (ru_maxrss's unit on Linux)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", nargs=5)
    args = parser.parse_args()
    if args.child:
        contender, layers, batch, wrt, length = args.child
        print(json.dumps(_measure(contender, int(layers), int(batch), wrt, int(length))))
        return
    layers, batch = (4, 4) if args.quick else (8, 8)
    print(
        f"per-sample gradients, vmap(grad), {layers}-layer pre-LN transformer (d {D_MODEL}, {HEADS} heads, "
        f"MLP {D_MLP}), batch {batch}, float32, 1 thread; peak memory growth of the call (in brackets: the "
        f"per-sample gradients it returns)"
    )
    print("| gradients of | L | checkpointing per layer | peak growth | vs none | time | vs none |")
    print("|---|---|---|---|---|---|---|")
    for wrt, length in CASES:
        results = {}
        for contender in CONTENDERS:
            line = subprocess.run(
                [sys.executable, __file__, "--child", contender, str(layers), str(batch), wrt, str(length)],
                capture_output=True, text=True, check=True, env=_CHILD_ENV,
            ).stdout.strip().splitlines()[-1]  # fmt: skip
            results[contender] = json.loads(line)
        base = results["none"]
        for contender, r in results.items():
            print(
                f"| {wrt} ({r['grads_mib']:.1f} MiB) | {length} | {contender} | {r['peak_growth_mib']:.0f} MiB | "
                f"{r['peak_growth_mib'] / base['peak_growth_mib']:.2f}x | {r['seconds']:.2f} s | "
                f"{r['seconds'] / base['seconds']:.2f}x |"
            )


if __name__ == "__main__":
    main()
