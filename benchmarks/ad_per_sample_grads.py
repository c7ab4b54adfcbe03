"""Per-sample gradients: functx vs torch.func vs a torch.autograd loop over samples.

    per_sample_grads = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)

with `params` a dict of tensors and the model a plain function of it (functx has no
functional_call yet; torch.func runs the very same function, so both pay the same Python
for the model). Workloads:

    MLP 784-512-256-10 (ReLU), cross-entropy, batch 64 and 256
    CNN on 1x28x28: conv3x3(16)-relu-maxpool2-conv3x3(32)-relu-maxpool2-linear(10), batch 64
    embedding bag-of-words classifier: nn.Embedding(1000, 64) (dense gradients) over 16
        tokens, flattened, linear(10), batch 64
    naive DP-SGD step on the MLP's per-sample gradients, batch 64: per-sample norms
        (`g.flatten(1).norm(dim=1)`), clipping factors, `einsum('b,b...->...', scale, g)`;
        once on each contender's own per-sample gradients (the step alone: it reads them
        in whatever layout they come), once end to end (gradients + step)

Contenders, alternating in one process:
    functx      functx.vmap(functx.grad(loss), in_dims=(None, 0, 0))
    torch.func  torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))
    loop        torch.autograd.grad of each sample's loss, stacked per parameter

Run:  .venv/bin/python benchmarks/ad_per_sample_grads.py [--quick] [--threads N]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.func
import torch.nn.functional as F

import functx
from ad_common import measure, notes, standalone, table

MLP_SIZES = (784, 512, 256, 10)
MLP_BATCHES = (64, 256)
CNN_BATCH = 64


def mlp_params() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(i, o) for i, o in zip(MLP_SIZES[:-1], MLP_SIZES[1:])]
    return {f"{kind}{i}": getattr(layer, kind).detach() for i, layer in enumerate(layers) for kind in ("weight", "bias")}


def mlp(params, x):
    depth = len(MLP_SIZES) - 1
    for i in range(depth):
        x = F.linear(x, params[f"weight{i}"], params[f"bias{i}"])
        if i < depth - 1:
            x = F.relu(x)
    return x


def cnn_params() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    conv1, conv2, linear = torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.Linear(32 * 7 * 7, 10)
    return {
        "conv1.weight": conv1.weight.detach(), "conv1.bias": conv1.bias.detach(),
        "conv2.weight": conv2.weight.detach(), "conv2.bias": conv2.bias.detach(),
        "linear.weight": linear.weight.detach(), "linear.bias": linear.bias.detach(),
    }  # fmt: skip


EMB_VOCAB, EMB_DIM, EMB_TOKENS, EMB_BATCH = 1000, 64, 16, 64
DP_BATCH, DP_CLIP = 64, 1.0


def embedding_params() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    table, linear = torch.nn.Embedding(EMB_VOCAB, EMB_DIM), torch.nn.Linear(EMB_TOKENS * EMB_DIM, 10)
    return {"embedding.weight": table.weight.detach(), "linear.weight": linear.weight.detach(), "linear.bias": linear.bias.detach()}


def bag_of_words(params, tokens):
    x = F.embedding(tokens, params["embedding.weight"])  # (1, tokens, dim): dense gradient
    return F.linear(x.flatten(1), params["linear.weight"], params["linear.bias"])


def dp_step(grads: dict[str, torch.Tensor], clip: float = DP_CLIP) -> dict[str, torch.Tensor]:
    """The naive DP-SGD aggregation: clip each sample's gradient to norm `clip`, sum."""
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()]).norm(dim=0)
    scale = (clip / (norms + 1e-6)).clamp(max=1.0)
    return {k: torch.einsum("b,b...->...", scale, g) for k, g in grads.items()}


def cnn(params, x):
    x = F.max_pool2d(F.relu(F.conv2d(x, params["conv1.weight"], params["conv1.bias"], padding=1)), 2)
    x = F.max_pool2d(F.relu(F.conv2d(x, params["conv2.weight"], params["conv2.bias"], padding=1)), 2)
    return F.linear(x.flatten(1), params["linear.weight"], params["linear.bias"])


def sample_loss(model):
    """Loss of ONE sample (x without batch dim): the function that vmap(grad(.)) maps."""

    def loss(params, x, y):
        return F.cross_entropy(model(params, x.unsqueeze(0)), y.unsqueeze(0))

    return loss


def loop_per_sample_grads(loss, params, x, y):
    """What one writes without transforms: a backward pass per sample, stacked."""
    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
    names = list(leaves)
    per_sample = [torch.autograd.grad(loss(leaves, x[i], y[i]), list(leaves.values())) for i in range(x.shape[0])]
    return {k: torch.stack([g[j] for g in per_sample]) for j, k in enumerate(names)}


def workload(model, params, x_shape, batch: int):
    def make():
        torch.manual_seed(1)
        x = torch.randn(batch, *x_shape)
        y = torch.randint(0, 10, (batch,))
        loss = sample_loss(model)
        ours = functx.vmap(functx.grad(loss), in_dims=(None, 0, 0))
        theirs = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))
        return {
            "functx": lambda: ours(params, x, y),
            "torch.func": lambda: theirs(params, x, y),
            "loop": lambda: loop_per_sample_grads(loss, params, x, y),
        }

    return make


def embedding_workload(batch: int):
    def make():
        torch.manual_seed(1)
        params = embedding_params()
        x = torch.randint(0, EMB_VOCAB, (batch, EMB_TOKENS))
        y = torch.randint(0, 10, (batch,))
        loss = sample_loss(bag_of_words)
        ours = functx.vmap(functx.grad(loss), in_dims=(None, 0, 0))
        theirs = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))
        return {
            "functx": lambda: ours(params, x, y),
            "torch.func": lambda: theirs(params, x, y),
            "loop": lambda: loop_per_sample_grads(loss, params, x, y),
        }

    return make


def dp_workload(batch: int, end_to_end: bool):
    """The DP-SGD step on each contender's per-sample gradients (end_to_end: with them)."""

    def make():
        torch.manual_seed(1)
        params = mlp_params()
        x = torch.randn(batch, MLP_SIZES[0])
        y = torch.randint(0, 10, (batch,))
        loss = sample_loss(mlp)
        grads = {
            "functx": lambda: functx.vmap(functx.grad(loss), in_dims=(None, 0, 0))(params, x, y),
            "torch.func": lambda: torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, y),
            "loop": lambda: loop_per_sample_grads(loss, params, x, y),
        }
        if end_to_end:
            return {name: (lambda g=g: dp_step(g())) for name, g in grads.items()}
        computed = {name: g() for name, g in grads.items()}
        return {name: (lambda g=g: dp_step(g)) for name, g in computed.items()}

    return make


def run(quick: bool = False, rounds: int | None = None, n_threads: int = 1) -> dict:
    rounds = rounds or (2 if quick else 12)
    configs = [
        *((f"MLP per-sample grads, batch {b}", workload(mlp, mlp_params(), (MLP_SIZES[0],), b)) for b in MLP_BATCHES),
        (f"CNN per-sample grads, batch {CNN_BATCH}", workload(cnn, cnn_params(), (1, 28, 28), CNN_BATCH)),
        (
            f"embedding (dense) per-sample grads, vocab {EMB_VOCAB} x {EMB_DIM}, batch {EMB_BATCH}",
            embedding_workload(EMB_BATCH),
        ),
        (f"naive DP-SGD step on the MLP's per-sample grads (step only), batch {DP_BATCH}", dp_workload(DP_BATCH, False)),
        (f"naive DP-SGD step, MLP, per-sample grads + step, batch {DP_BATCH}", dp_workload(DP_BATCH, True)),
    ]
    results = [measure(label, make, rounds=rounds, n_threads=n_threads) for label, make in configs]
    return {
        "title": "Per-sample gradients: vmap(grad(loss))",
        "results": results,
        "table": table(results),
        "notes": notes(results),
    }


if __name__ == "__main__":
    standalone(run, __doc__.splitlines()[0])
