"""Module state as data (functx.nn): functx vs torch.func vs a plain loop over models / samples.

Two workloads from the performance issue, both written the way the torch.func tutorials
write them, with `functional_call` on a real `torch.nn.Module`:

    ensembling   16 MLPs 784-128-10 (ReLU) on one batch of 64:
                 params, buffers = stack_module_state(models)
                 vmap(fmodel, in_dims=(0, 0, None))(params, buffers, x)
                 with fmodel = functional_call(base, (params, buffers), (x,)), base on "meta"
    per-sample   TransformerEncoderLayer(d_model 64, nhead 4, dim_feedforward 128, dropout 0,
    gradients    batch_first=True), batch 32 of sequences of 32 tokens, MSE against a target:
                 vmap(grad(loss), in_dims=(None, None, 0, 0))(params, buffers, x, target)

Contenders, alternating in one process (`_harness.interleaved` via `ad_common.measure`):
    functx      functx.stack_module_state / functional_call / vmap / grad
    torch.func  the torch.func functions of the same names, same code otherwise
    loop        ensembling: each model called on the batch, outputs stacked;
                per-sample gradients: torch.autograd.grad of each sample's loss, stacked

Target (issue): functx/torch.func <= 1.3x (paired median) on both.

Run:  .venv/bin/python benchmarks/nn_module_state.py [--quick] [--threads N] [--rounds N]
"""

from __future__ import annotations

import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.func
import torch.nn as nn
import torch.nn.functional as F

import functx
import ad_common
from ad_common import measure, standalone, table

TARGET_RATIO = 1.3

ENSEMBLE_MODELS = 16
ENSEMBLE_SIZES = (784, 128, 10)
ENSEMBLE_BATCH = 64

TRANSFORMER = dict(d_model=64, nhead=4, dim_feedforward=128, dropout=0.0, batch_first=True)
TRANSFORMER_BATCH = 32
TRANSFORMER_SEQ = 32


# --- ensembling -----------------------------------------------------------------------


def make_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(ENSEMBLE_SIZES[0], ENSEMBLE_SIZES[1]), nn.ReLU(), nn.Linear(ENSEMBLE_SIZES[1], ENSEMBLE_SIZES[2])
    )


def ensemble_contenders() -> dict:
    torch.manual_seed(0)
    models = [make_mlp() for _ in range(ENSEMBLE_MODELS)]
    x = torch.randn(ENSEMBLE_BATCH, ENSEMBLE_SIZES[0])

    def vmapped(lib):
        """The torch.func tutorial's ensembling code with `lib` in place of torch.func."""
        params, buffers = lib.stack_module_state(models)
        # A stateless copy of one member: functional_call swaps the stacked tensors in.
        base = copy.deepcopy(models[0]).to("meta")

        def fmodel(params, buffers, x):
            return lib.functional_call(base, (params, buffers), (x,))

        ensemble = lib.vmap(fmodel, in_dims=(0, 0, None))
        return lambda: ensemble(params, buffers, x)

    def loop():
        with torch.no_grad():  # stack_module_state detaches; results are compared without grad
            return torch.stack([model(x) for model in models])

    return {"functx": vmapped(functx), "torch.func": vmapped(torch.func), "loop": loop}


# --- per-sample gradients of a transformer layer --------------------------------------


def transformer_contenders() -> dict:
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(**TRANSFORMER)
    model.train()  # dropout is 0; train mode keeps torch off its inference fast path
    x = torch.randn(TRANSFORMER_BATCH, TRANSFORMER_SEQ, TRANSFORMER["d_model"])
    target = torch.randn(TRANSFORMER_BATCH, TRANSFORMER_SEQ, TRANSFORMER["d_model"])
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}

    def sample_loss(lib):
        """Loss of ONE sample (no batch dim): what vmap(grad(.)) maps over."""

        def loss(params, buffers, x, target):
            out = lib.functional_call(model, (params, buffers), (x.unsqueeze(0),))
            return F.mse_loss(out, target.unsqueeze(0))

        return loss

    def vmapped(lib):
        per_sample = lib.vmap(lib.grad(sample_loss(lib)), in_dims=(None, None, 0, 0))
        return lambda: per_sample(params, buffers, x, target)

    def loop():
        """What one writes without transforms: a backward pass per sample, stacked."""
        names = list(dict(model.named_parameters()))
        weights = list(model.parameters())
        per_sample = [
            torch.autograd.grad(F.mse_loss(model(x[i : i + 1]), target[i : i + 1]), weights)
            for i in range(TRANSFORMER_BATCH)
        ]
        return {name: torch.stack([g[j] for g in per_sample]) for j, name in enumerate(names)}

    return {"functx": vmapped(functx), "torch.func": vmapped(torch.func), "loop": loop}


TRANSFORMER_BLOCK_NOTE = """A call here takes 9-25 ms. With the default 20 ms blocks functx got one call per
block and torch.func two; 0.1 s blocks give every contender several calls per block.
The ratio also depends on glibc malloc's dynamic mmap threshold: until some large buffer
has been freed (the ensembling benchmark, run first, frees several MB), each call's
multi-MB temporaries are mmapped and page-faulted afresh, which costs torch.func (~1400
minor faults a call) more than functx (~400) and pulls the ratio down to ~1.2-1.27x.
With the threshold raised (the state of any process that has freed a large tensor, or
MALLOC_MMAP_THRESHOLD_=33554432) it is ~1.4-1.5x; ensembling runs first so the reported
number is the steady-state one."""


# --- report ---------------------------------------------------------------------------


def _with_target(result: dict) -> dict:
    """`ad_common.measure` judges against the AD target (1.5x); this suite's is 1.3x."""
    result["target"] = TARGET_RATIO
    result["ratio_met"] = result["ratio"] <= TARGET_RATIO
    return result


def notes(results: list[dict]) -> str:
    return ad_common.notes(results) + (
        " (torch.func itself has no batching rule for aten::_scaled_dot_product_flash_attention_for_cpu "
        "and its backward and runs them per sample, with a UserWarning.)"
    )


def run(quick: bool = False, rounds: int | None = None, n_threads: int = 1) -> dict:
    configs = [
        (
            f"ensembling: {ENSEMBLE_MODELS} MLPs {'-'.join(map(str, ENSEMBLE_SIZES))}, batch {ENSEMBLE_BATCH}",
            ensemble_contenders,
            rounds or (8 if quick else 60),
            0.02,
        ),
        (
            f"per-sample grads: TransformerEncoderLayer d64 h4 ff128, batch {TRANSFORMER_BATCH} x seq {TRANSFORMER_SEQ}",
            transformer_contenders,
            rounds or (3 if quick else 15),
            0.1,  # several calls per block: see TRANSFORMER_BLOCK_NOTE
        ),
    ]
    results = [
        _with_target(measure(label, make, rounds=r, n_threads=n_threads, block_seconds=block))
        for label, make, r, block in configs
    ]
    return {
        "title": "Module state (functx.nn): ensembling and per-sample gradients via functional_call",
        "results": results,
        "table": table(results),
        "notes": notes(results),
    }


if __name__ == "__main__":
    standalone(run, __doc__.splitlines()[0])
