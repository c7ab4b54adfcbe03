"""torch.compile of functx transforms vs torch.compile of the same torch.func code.

Workloads: the MAML step of `ad_maml.py` (second-order meta-gradient, tasks under vmap) and
the per-sample gradients of `ad_per_sample_grads.py`'s MLP (batch 64). Each is compiled with
`torch.compile(..., backend=BACKEND, fullgraph=True)` for functx (dynamo stages every
transform call, `functx/staging/`) and for torch.func; the first call (trace + compile) is
timed once per contender, then the compiled calls alternate (paired ratios, as every
benchmark here). Eager torch.func runs alongside for scale.

Contenders, alternating in one process:
    functx        torch.compile of the functx code
    torch.func    torch.compile of the torch.func code
    eager         torch.func uncompiled

Run:  .venv/bin/python benchmarks/staging_compile.py [--quick] [--threads N] [--backend inductor|aot_eager]
(each inductor compilation takes ~25 s on this host: ~2 minutes in all.)
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.func

import ad_maml
import ad_per_sample_grads
import functx
from _harness import interleaved, markdown_table, standard_arguments, threads
from ad_common import assert_all_close


def _maml(lib):
    params, data = ad_maml.init_params(), ad_maml.sine_tasks()
    step = ad_maml.meta_gradient(lib)
    return step, (params, *data)


def _per_sample(lib):
    torch.manual_seed(1)
    x, y = torch.randn(64, ad_per_sample_grads.MLP_SIZES[0]), torch.randint(0, 10, (64,))
    loss = ad_per_sample_grads.sample_loss(ad_per_sample_grads.mlp)
    step = lambda params, x, y: lib.vmap(lib.grad(loss), in_dims=(None, 0, 0))(params, x, y)
    return step, (ad_per_sample_grads.mlp_params(), x, y)


WORKLOADS = {"MAML step (ad_maml.py)": _maml, "MLP per-sample grads, batch 64": _per_sample}


def _compiled(make, lib, backend):
    fn, args = make(lib)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    start = time.perf_counter()
    compiled(*args)
    return (lambda: compiled(*args)), time.perf_counter() - start


def run(quick=False, n_threads=1, backend="inductor"):
    rows = []
    with threads(n_threads):
        for label, make in WORKLOADS.items():
            eager_fn, eager_args = make(torch.func)
            ours, ours_first = _compiled(make, functx, backend)
            theirs, theirs_first = _compiled(make, torch.func, backend)
            contenders = {"functx": ours, "torch.func": theirs, "eager": lambda: eager_fn(*eager_args)}
            assert_all_close({name: fn() for name, fn in contenders.items()})
            timings = interleaved(contenders, rounds=8 if quick else 40)
            ratio = timings.paired_median(lambda a, b: a / b, "functx", "torch.func")
            rows.append(
                [
                    label,
                    f"{timings.median('functx') * 1e3:.3f}",
                    f"{timings.median('torch.func') * 1e3:.3f}",
                    f"{timings.median('eager') * 1e3:.3f}",
                    f"{ratio:.2f}x",
                    f"{ours_first:.1f} s / {theirs_first:.1f} s",
                ]
            )
    header = ["workload", "functx compiled ms", "torch.func compiled ms", "torch.func eager ms", "functx/torch.func (compiled, paired median)", "first call functx / torch.func"]
    return markdown_table(header, rows)


if __name__ == "__main__":
    parser = standard_arguments(__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--backend", default="inductor")
    arguments = parser.parse_args()
    print(f"## torch.compile (backend={arguments.backend}), {arguments.threads} thread(s)\n")
    print(run(arguments.quick, arguments.threads, arguments.backend))
