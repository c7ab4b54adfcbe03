"""Per-sample gradients over a jagged batch against the same batch padded (issue 29).

A transformer encoder layer (4 heads, feed-forward 2x, no dropout); B sequences whose
lengths are spread evenly over [L/4, L] (they vary 4x); the loss is the mean of the squared
outputs of each sequence. Contenders, alternating in one process:

    functx, jagged        functx.vmap(functx.grad(loss)) over a jagged nested tensor
                          (one call per sequence: functx/vmap/nested.py)
    functx, padded        functx.vmap(functx.grad(masked loss)) over the batch padded to L,
                          with the padding masked out of attention and the loss
    torch.func, padded    the same with torch.func

Target (issue 29): jagged faster than padded (functx, paired median ratio < 1). Gradients
checked equal between the contenders before timing.

Run:  .venv/bin/python benchmarks/vmap_jagged.py [--quick] [--threads N]
"""

from __future__ import annotations

import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.func

import functx
from _harness import interleaved, markdown_table, threads

BATCH = 16
CONFIGS = [(64, 128), (128, 192), (256, 256)]  # (model width, longest sequence)


def _problem(width: int, longest: int):
    torch.manual_seed(0)
    model = torch.nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
    params = {k: v.detach() for k, v in model.named_parameters()}
    lengths = torch.linspace(longest // 4, longest, BATCH).int()[torch.randperm(BATCH)].tolist()
    samples = [torch.randn(n, width) for n in lengths]
    jagged = torch.nested.nested_tensor(samples, layout=torch.jagged)
    padded = torch.stack([torch.nn.functional.pad(s, (0, 0, 0, longest - s.shape[0])) for s in samples])
    mask = torch.stack([torch.arange(longest) < n for n in lengths])

    def loss(p, seq, call=functx.functional_call):
        return call(model, p, (seq.unsqueeze(0),)).pow(2).mean()

    def masked_loss(p, seq, keep, call=functx.functional_call):
        out = call(model, p, (seq.unsqueeze(0),), {"src_key_padding_mask": ~keep.unsqueeze(0)})
        return (out.pow(2).mean(-1) * keep).sum() / keep.sum()

    def torch_masked_loss(p, seq, keep):
        return masked_loss(p, seq, keep, torch.func.functional_call)

    return {
        "functx, jagged": lambda: functx.vmap(functx.grad(loss), in_dims=(None, 0))(params, jagged),
        "functx, padded": lambda: functx.vmap(functx.grad(masked_loss), in_dims=(None, 0, 0))(params, padded, mask),
        "torch.func, padded": lambda: torch.func.vmap(torch.func.grad(torch_masked_loss), in_dims=(None, 0, 0))(params, padded, mask),
    }


def run(quick: bool = False, rounds: int | None = None, n_threads: int = 1) -> dict:
    rounds = rounds or (3 if quick else 8)
    rows = []
    warnings.simplefilter("ignore", functx.PerformanceWarning)
    for width, longest in CONFIGS[:1] if quick else CONFIGS:
        timed = _problem(width, longest)
        with threads(n_threads):
            results = {name: fn() for name, fn in timed.items()}
            for name, grads in results.items():
                for key, g in grads.items():
                    torch.testing.assert_close(g, results["functx, jagged"][key], atol=2e-5, rtol=1e-3, msg=f"{name} {key}")
            timings = interleaved(timed, rounds=rounds, block_seconds=0.0, warmup_calls=1)
        ratio = timings.paired_quantile(0.5, lambda a, b: a / b, "functx, jagged", "functx, padded")
        vs_torch = timings.paired_quantile(0.5, lambda a, b: a / b, "functx, jagged", "torch.func, padded")
        rows.append([
            f"width {width}, lengths {longest // 4}-{longest}",
            *(f"{timings.median(name) * 1e3:.0f}" for name in timed),
            f"{ratio:.2f}x",
            f"{vs_torch:.2f}x",
            "met" if ratio < 1 else "NOT met",
        ])
    header = [f"transformer layer, batch {BATCH}", *(f"{name} ms" for name in timed), "jagged / padded (functx)", "jagged (functx) / padded (torch.func)", "< 1x"]
    return {"title": "Per-sample gradients: jagged batch vs padded batch", "table": markdown_table(header, rows),
            "notes": f"{n_threads} intra-op thread(s), {rounds} alternating rounds, medians and the median of paired ratios."}


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    report = run(args.quick, args.rounds, args.threads)
    print(f"## {report['title']}\n\n{report['table']}\n\n{report['notes']}")
