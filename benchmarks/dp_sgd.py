"""DP-SGD steps: functx.dp's kernels vs vmap(grad) + clip, and Opacus ghost clipping.

One step = the clipped sum Σ_b min(1, C/‖g_b‖) g_b (C = 1) plus Gaussian noise (σ = 1) of a
batch of 64, on four models:

    MLP          784-512-256-10, ReLU
    CNN          conv(1->16, 3x3) relu pool, conv(16->32, 3x3) relu pool, linear(1568->10), 28x28
    transformer  2 TransformerEncoderLayers (d=128, 4 heads, ff 256, batch_first, no dropout)
                 on (64, 128, 128) inputs, mean-pooled, linear(128->10)
    embedding    Embedding(50k, 128) on 32 ids per sample, mean, linear(128->2)

Contenders (values checked against each other without noise first):
    functx.dp         functx.dp.clipped_grad (per-layer kernels, no per-sample gradients)
    vmap functx       functx.vmap(functx.grad) per-sample gradients, norms, clip, sum
    vmap torch.func   the same with torch.func
    opacus ghost      Opacus's ghost clipping (GradSampleModuleFastGradientClipping), when
                      installed (`pip install opacus`); the transformer made Opacus-compatible
                      by its ModuleValidator (DPMultiheadAttention) for every contender

Time: alternating rounds in one process, 1 thread, medians and the median of paired
ratios. Peak memory (`--memory`): each contender's step in a fresh process, the growth of
the peak resident set over one step after a warm-up step.

Targets (issue 15): functx.dp <= 0.75x Opacus ghost time on all four, peak memory no more
than Opacus ghost's, >= 10x faster than vmap(grad) + clip on the MLP and the embedding model.

Run:  .venv/bin/python benchmarks/dp_sgd.py [--quick] [--memory] [--only NAME]
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.func
import torch.nn as nn
import torch.nn.functional as F

import functx
from _harness import interleaved, markdown_table, standard_arguments, threads

try:
    import opacus  # noqa: F401
except ImportError:
    opacus = None

BATCH, MAX_NORM, SIGMA = 64, 1.0, 1.0


def per_sample_loss(out, y):
    return F.cross_entropy(out, y, reduction="none")


class Pooled(nn.Module):
    def __init__(self, body, head, dim):
        super().__init__()
        self.body, self.head, self.dim = body, head, dim

    def forward(self, x):
        return self.head(self.body(x).mean(self.dim))


def make(name):
    """(model, inputs, targets) of one workload."""
    torch.manual_seed(0)
    if name == "MLP":
        model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))
        return model, torch.randn(BATCH, 784), torch.randint(0, 10, (BATCH,))
    if name == "CNN":
        model = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(32 * 7 * 7, 10),
        )  # fmt: skip
        return model, torch.randn(BATCH, 1, 28, 28), torch.randint(0, 10, (BATCH,))
    if name == "transformer":
        layer = nn.TransformerEncoderLayer(128, 4, 256, dropout=0.0, batch_first=True)
        model = Pooled(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Linear(128, 10), 1)
        if opacus is not None:
            from opacus.validators import ModuleValidator

            model = ModuleValidator.fix(model)
        return model, torch.randn(BATCH, 128, 128), torch.randint(0, 10, (BATCH,))
    if name == "embedding":
        model = Pooled(nn.Embedding(50_000, 128), nn.Linear(128, 2), 1)
        return model, torch.randint(0, 50_000, (BATCH, 32)), torch.randint(0, 2, (BATCH,))
    raise ValueError(name)


WORKLOADS = ("MLP", "CNN", "transformer", "embedding")


def functx_step(model, x, y, noise=SIGMA):
    return functx.dp.clipped_grad(model, per_sample_loss, x, y, max_norm=MAX_NORM, noise_multiplier=noise)[0]


def vmap_step(T):
    def step(model, x, y, noise=SIGMA):
        params = {n: p.detach() for n, p in model.named_parameters()}

        def one(p, x_b, y_b):
            return per_sample_loss(T.functional_call(model, p, (x_b[None],)), y_b[None]).sum()

        per = T.vmap(T.grad(one), in_dims=(None, 0, 0))(params, x, y)
        norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in per.values()))
        clip = (MAX_NORM / (norms + 1e-6)).clamp(max=1.0)
        out = {n: torch.tensordot(clip, g, dims=1) for n, g in per.items()}
        if noise:
            for g in out.values():
                g.add_(torch.randn_like(g), alpha=noise * MAX_NORM)
        return out

    return step


def opacus_step_factory(model):
    """Opacus ghost clipping: two backward passes inside `loss.backward()`; the noise is
    added by its optimizer's step (lr 0: the model does not change)."""
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    model = copy.deepcopy(model)  # Opacus hooks the modules it wraps: a copy of its own
    module = GradSampleModuleFastGradientClipping(model, max_grad_norm=MAX_NORM, use_ghost_clipping=True, loss_reduction="sum")
    optimizer = DPOptimizerFastGradientClipping(
        torch.optim.SGD(module.parameters(), lr=0.0), noise_multiplier=SIGMA, max_grad_norm=MAX_NORM,
        expected_batch_size=BATCH, loss_reduction="sum",
    )  # fmt: skip
    criterion = DPLossFastGradientClipping(module, optimizer, nn.CrossEntropyLoss(reduction="sum"), loss_reduction="sum")

    def step(_model, x, y, noise=SIGMA):
        optimizer.zero_grad()
        optimizer.noise_multiplier = noise
        criterion(module(x), y).backward()
        if not noise:  # the clipped sum, as Opacus's optimizer would see it before noising
            return {n.removeprefix("_module."): p.grad.clone() for n, p in module.named_parameters()}
        optimizer.step()
        return None

    return step


def contenders(model):
    steps = {"functx.dp": functx_step, "vmap functx": vmap_step(functx), "vmap torch.func": vmap_step(torch.func)}
    if opacus is not None:
        steps["opacus ghost"] = opacus_step_factory(model)
    return steps


def check(name, model, x, y, steps):
    expected = steps["vmap torch.func"](model, x, y, noise=0.0)
    for contender, step in steps.items():
        got = step(model, x, y, noise=0.0)
        for key in expected:
            torch.testing.assert_close(got[key], expected[key], rtol=1e-3, atol=1e-5, msg=f"{name}, {contender}, {key}")


def peak_memory_mib(name, contender) -> float:
    """How far one step's peak resident set rises above the resident set before it, after a
    warm-up step and with the freed heap given back (malloc_trim), in a fresh process (Linux:
    the peak is reset through /proc/self/clear_refs)."""
    code = (
        "import sys, gc, warnings; warnings.simplefilter('ignore'); sys.path.insert(0, sys.argv[3]);"
        "import torch; torch.set_num_threads(1); import dp_sgd;"
        "model, x, y = dp_sgd.make(sys.argv[1]); step = dp_sgd.contenders(model)[sys.argv[2]];"
        "step(model, x, y); gc.collect(); import ctypes; ctypes.CDLL('libc.so.6').malloc_trim(0);"
        "before = dp_sgd.status_kib('VmRSS');"
        "open('/proc/self/clear_refs', 'w').write('5');"
        "step(model, x, y); print((dp_sgd.status_kib('VmHWM') - before) / 1024)"
    )
    here = os.path.dirname(os.path.abspath(__file__))
    # glibc's mmap threshold fixed (it otherwise rises as large blocks are freed, after which
    # they stay in the heap): every tensor over 128 KiB is its own mapping, given back when
    # freed, so the resident set follows the live tensors rather than the heap's history
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024), "MALLOC_TRIM_THRESHOLD_": str(128 * 1024)}
    out = subprocess.run([sys.executable, "-c", code, name, contender, here], capture_output=True, text=True, check=True, env=env)
    return float(out.stdout.strip().splitlines()[-1])


def status_kib(field: str) -> int:
    """A field of /proc/self/status, in KiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def run(quick=False, rounds=None, memory=False, only=None):
    rows = []
    for name in WORKLOADS:
        if only is not None and only != name:
            continue
        with threads(1):
            model, x, y = make(name)
            steps = contenders(model)
            check(name, model, x, y, steps)
            calls = {c: (lambda s=s: s(model, x, y)) for c, s in steps.items()}
            heavy = name == "embedding"  # vmap's dense (64, 50k, 128) gradients: ~2 s a step
            timings = interleaved(calls, rounds=rounds or (2 if quick or heavy else 8), block_seconds=0.05, warmup_calls=1)
        med = {c: timings.median(c) * 1e3 for c in calls}
        ratio = lambda a, b: timings.paired_ratio(a, b) if b in calls else None
        mem = {c: peak_memory_mib(name, c) for c in calls} if memory else {}
        fmt = lambda v, unit="x": "—" if v is None else (f"{v:.2f}x" if unit == "x" else f"{v:.1f}")
        rows.append(
            [
                name,
                *(f"{med[c]:.1f}" if c in med else "—" for c in ("functx.dp", "vmap functx", "vmap torch.func", "opacus ghost")),
                fmt(ratio("functx.dp", "opacus ghost")),
                fmt(None if "vmap torch.func" not in calls else 1 / ratio("functx.dp", "vmap torch.func")),
                *(fmt(mem.get(c), "MiB") for c in ("functx.dp", "vmap torch.func", "opacus ghost")),
            ]
        )
    header = [
        "model", "functx.dp ms", "vmap functx ms", "vmap torch.func ms", "opacus ghost ms",
        "functx.dp / opacus", "speed-up vs vmap torch.func", "peak MiB functx.dp", "peak MiB vmap torch.func", "peak MiB opacus",
    ]  # fmt: skip
    return markdown_table(header, rows)


if __name__ == "__main__":
    parser = standard_arguments(__doc__.splitlines()[0])
    parser.add_argument("--memory", action="store_true", help="also measure peak memory (fresh processes)")
    parser.add_argument("--only", default=None, choices=WORKLOADS)
    arguments = parser.parse_args()
    import warnings

    warnings.simplefilter("ignore")  # Opacus's full-backward-hook warnings, once per step
    print(f"## DP-SGD steps, batch {BATCH}, 1 thread, opacus {'installed' if opacus else 'not installed'}\n")
    print(run(arguments.quick, arguments.rounds, arguments.memory, arguments.only))
