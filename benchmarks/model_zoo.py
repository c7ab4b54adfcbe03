"""The model zoo (tests/zoo/models.py: 21 models people train, sized down) under functx,
torch.func and a plain loop, paired in one process (issue 30's speed measure).

    per-sample gradients  vmap(grad(loss), in_dims=(None, 0, 0)) over a batch of 16
    (--all adds) JVP      jvp of the batch's output in the weights
                 HVP      jvp(grad(loss)) in the weights (forward-over-reverse)
                 ensemble vmap over stack_module_state of 4 models

Contenders: functx; torch.func where it runs (else the first line of its error); the loop a
user writes without transforms (torch.autograd per sample, per model for ensembles, on the
model's reference program: Python control flow). Models in float32, 1 thread. Reports
whether functx vectorizes the per-sample gradients fully (`functx.explain`), the medians
and the paired ratios. Targets: functx <= 1.1x torch.func where torch.func runs, <= 1.2x
the loop where functx runs samples one by one.

    python benchmarks/model_zoo.py            # per-sample gradients, 15 rounds
    python benchmarks/model_zoo.py --all      # and JVP, HVP, ensembling
    python benchmarks/model_zoo.py --quick    # 5 rounds
    python benchmarks/model_zoo.py --width 64 # wider models (the tests' width 8 is overhead-bound)
    python benchmarks/model_zoo.py --jit      # per-sample gradients under functx.jit too
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.func  # noqa: E402

import functx  # noqa: E402
from _harness import environment, interleaved  # noqa: E402
from tests.zoo import models as zoo  # noqa: E402
from tests.zoo.models import NAMES, as_reference, make  # noqa: E402

BATCH, MEMBERS = 16, 4


def _float32(batch):
    return tuple(t.float() if t.is_floating_point() else t for t in batch)


def _per_sample(lib, model, params, buffers, x, y, wrap=lambda f: f):
    def loss(p, xi, yi):
        return model.loss(lib.functional_call(model.module, (p, buffers), (xi.unsqueeze(0),)), yi.unsqueeze(0))

    mapped = wrap(lib.vmap(lib.grad(loss), in_dims=(None, 0, 0)))
    return lambda: mapped(params, x, y)


def _per_sample_loop(model, x, y):
    reference = as_reference(copy.deepcopy(model.module))
    leaves = list(reference.parameters())

    def run():
        return [torch.autograd.grad(model.loss(reference(x[i : i + 1]), y[i : i + 1]), leaves, allow_unused=True) for i in range(len(x))]

    return run


def _jvp(lib, model, params, buffers, x, tangents):
    return lambda: lib.jvp(lambda p: lib.functional_call(model.module, (p, buffers), (x,)), (params,), (tangents,))


def _jvp_loop(model, x, tangents):
    """Forward mode without transforms: torch.autograd.forward_ad on the weights."""
    import torch.autograd.forward_ad as fwAD

    reference = as_reference(copy.deepcopy(model.module))

    def run():
        with fwAD.dual_level():
            duals = {k: fwAD.make_dual(p.detach(), tangents[k]) for k, p in reference.named_parameters()}
            out = torch.func.functional_call(reference, duals, (x,))  # plain torch: no transform
            return fwAD.unpack_dual(out).tangent

    return run


def _hvp(lib, model, params, buffers, x, y, tangents):
    def loss(p):
        return model.loss(lib.functional_call(model.module, (p, buffers), (x,)), y)

    return lambda: lib.jvp(lib.grad(loss), (params,), (tangents,))


def _hvp_loop(model, x, y, tangents):
    reference = as_reference(copy.deepcopy(model.module))
    leaves = list(reference.parameters())
    directions = list(tangents.values())

    def run():
        gradient = torch.autograd.grad(model.loss(reference(x), y), leaves, create_graph=True, allow_unused=True, materialize_grads=True)
        inner = sum((g * v).sum() for g, v in zip(gradient, directions))
        return torch.autograd.grad(inner, leaves, allow_unused=True)

    return run


def _ensemble(lib, members, x):
    params, buffers = lib.stack_module_state([m.module for m in members])
    base = members[0].module
    mapped = lib.vmap(lambda p, b: lib.functional_call(base, (p, b), (x,)), in_dims=(0, 0))
    return lambda: mapped(params, buffers)


def _ensemble_loop(members, x):
    references = [as_reference(copy.deepcopy(m.module)) for m in members]
    return lambda: torch.stack([r(x) for r in references])


def _runs(fn) -> str | None:
    """None where `fn()` runs, else the first line of its error."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn()
        return None
    except Exception as error:  # torch.func's refusals: reported, not timed
        return f"{type(error).__name__}: {str(error).splitlines()[0][:70]}"


def contenders(name: str, transform: str, jit: bool = False) -> tuple[dict, dict]:
    """The timed calls of one model under one transform, and what did not run (with `jit`,
    per-sample gradients under functx.jit too: traced by the first call, replayed after)."""
    torch.manual_seed(0)
    model = make(name)
    model.module.float()
    x, y = _float32(model.batch(BATCH))
    params = {k: v.detach() for k, v in model.module.named_parameters()}
    buffers = dict(model.module.named_buffers())
    tangents = {k: torch.randn_like(v) for k, v in params.items()}
    if transform == "per-sample grads":
        calls = {lib.__name__: _per_sample(lib, model, params, buffers, x, y) for lib in (functx, torch.func)}
        calls["loop"] = _per_sample_loop(model, x, y)
        if jit:
            calls["functx.jit"] = _per_sample(functx, model, params, buffers, x, y, wrap=functx.jit)
    elif transform == "jvp":
        calls = {lib.__name__: _jvp(lib, model, params, buffers, x, tangents) for lib in (functx, torch.func)}
        calls["loop"] = _jvp_loop(model, x, tangents)
    elif transform == "hvp":
        calls = {lib.__name__: _hvp(lib, model, params, buffers, x, y, tangents) for lib in (functx, torch.func)}
        calls["loop"] = _hvp_loop(model, x, y, tangents)
    else:
        members = [make(name) for _ in range(MEMBERS)]
        for m in members:
            m.module.float()
        calls = {lib.__name__: _ensemble(lib, members, x) for lib in (functx, torch.func)}
        calls["loop"] = _ensemble_loop(members, x)
    failed = {who: error for who, fn in calls.items() if (error := _runs(fn)) is not None}
    return {who: fn for who, fn in calls.items() if who not in failed}, failed


def vectorized(name: str) -> bool:
    torch.manual_seed(0)
    model = make(name)
    x, y = model.batch(2)
    params = {k: v.detach() for k, v in model.module.named_parameters()}
    buffers = dict(model.module.named_buffers())

    def loss(p, xi, yi):
        return model.loss(functx.functional_call(model.module, (p, buffers), (xi.unsqueeze(0),)), yi.unsqueeze(0))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return functx.explain(functx.vmap(functx.grad(loss), in_dims=(None, 0, 0)))(params, x, y).vectorized


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 rounds")
    parser.add_argument("--all", action="store_true", help="JVP, HVP and ensembling too")
    parser.add_argument("--models", nargs="*", default=NAMES)
    parser.add_argument("--width", type=int, default=None, help="model width (the tests' is 8: overhead-bound)")
    parser.add_argument("--jit", action="store_true", help="per-sample gradients under functx.jit too")
    args = parser.parse_args()
    if args.width is not None:  # read by the zoo's modules when they are made and called
        zoo.WIDTH = args.width
    torch.set_num_threads(1)
    rounds = 5 if args.quick else 15
    transforms = ["per-sample grads"] + (["jvp", "hvp", "ensemble"] if args.all else [])
    print("environment:", environment())
    jit_header = (" functx.jit ms | functx.jit / torch.func |", "---|---|") if args.jit else ("", "")
    print("| model | transform | vectorized | functx ms | torch.func ms | loop ms | functx / torch.func | functx / loop |" + jit_header[0])
    print("|---|---|---|---|---|---|---|---|" + jit_header[1])
    for name in args.models:
        whole = "yes" if vectorized(name) else "per sample"
        for transform in transforms:
            calls, failed = contenders(name, transform, jit=args.jit)
            if "functx" not in calls:
                print(f"| {name} | {transform} | {whole} | fails: {failed['functx']} | | | | |")
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                timings = interleaved(calls, rounds=rounds, block_seconds=0.05, max_calls=200)

            def ms(who):
                return f"{timings.median(who) * 1e3:.2f}" if who in calls else f"refuses ({failed[who]})"

            def ratio(who, of="functx"):
                return f"{timings.paired_ratio(of, who):.2f}x" if who in calls and of in calls else "-"

            jitted = f" {ms('functx.jit')} | {ratio('torch.func', of='functx.jit')} |" if "functx.jit" in calls or "functx.jit" in failed else ""
            print(f"| {name} | {transform} | {whole} | {ms('functx')} | {ms('torch.func')} | {ms('loop')} | {ratio('torch.func')} | {ratio('loop')} |{jitted}", flush=True)


if __name__ == "__main__":
    main()
