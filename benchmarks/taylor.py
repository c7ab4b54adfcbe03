"""Laplacians by Taylor mode (issue 31): functx's collapsed `laplacian` against torch.func's
Hessian trace and `vmap(jvp(grad))` over the basis, functx's own nested and per-direction
versions, `functx.jit`, and (where installed: `pip install jax folx`) JAX's
`jax.experimental.jet` and folx's forward Laplacian, jit-compiled.

The network is the torch-jet benchmark's tanh MLP, D -> 768 -> 768 -> 512 -> 512 -> 1, over a
batch of points (float32, 1 thread, the process pinned to one core: XLA's CPU runtime ignores
its thread flags). Contenders alternate in
one process; ratios are paired medians against functx.laplacian. `--memory` measures each
contender's peak resident memory in a fresh process instead (peak RSS during one call minus
the RSS before it). `--train` times one PINN training step (Poisson residual loss through
the Laplacian, and its gradient in the weights) instead; `--transformer` the Laplacian of a
small (one-layer) transformer in its input, against the Hessian traces.

    python benchmarks/taylor.py                    # D = 10, 50, 100, batch 64, 5 rounds
    python benchmarks/taylor.py --batch 256 --dims 50
    python benchmarks/taylor.py --memory --dims 50
    python benchmarks/taylor.py --train
    python benchmarks/taylor.py --transformer --dims 16 64 --batch 16
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy  # noqa: E402
import torch  # noqa: E402
import torch.func  # noqa: E402

import functx  # noqa: E402
from _harness import environment, interleaved  # noqa: E402

WIDTHS = (768, 768, 512, 512)


def make_mlp(dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    sizes = (dim, *WIDTHS, 1)
    weights = [torch.randn(a, b, generator=g) / a**0.5 for a, b in zip(sizes[:-1], sizes[1:])]
    biases = [torch.randn(b, generator=g) * 0.1 for b in sizes[1:]]
    return weights, biases


def mlp(weights, biases, x):
    h = x
    for i, (w, b) in enumerate(zip(weights, biases)):
        h = h @ w + b
        if i < len(weights) - 1:
            h = torch.tanh(h)
    return h.squeeze(-1)


def make_transformer(dim: int, width: int = 64, seed: int = 0):
    """A one-layer pre-LN transformer over the input read as dim // 8 tokens of 8 features
    (attention with 4 heads, an MLP of 4x width), summed to a scalar: a small transformer's
    Laplacian in its input."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=g) / shape[0] ** 0.5

    params = dict(embed=w(8, width), qkv=w(width, 3 * width), out=w(width, width), up=w(width, 4 * width),
                  down=w(4 * width, width), head=w(width, 1))

    def f(x):
        tokens = x.reshape(dim // 8, 8) @ params["embed"]
        h = torch.nn.functional.layer_norm(tokens, (width,))
        q, k, v = (h @ params["qkv"]).reshape(-1, 3, 4, width // 4).permute(1, 2, 0, 3)
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        tokens = tokens + attended.permute(1, 0, 2).reshape(-1, width) @ params["out"]
        h = torch.nn.functional.layer_norm(tokens, (width,))
        tokens = tokens + torch.nn.functional.gelu(h @ params["up"]) @ params["down"]
        return (tokens @ params["head"]).sum()

    return f


def transformer_contenders(dim: int, points: torch.Tensor) -> dict:
    f = make_transformer(dim)
    return {
        "functx.laplacian": lambda: functx.vmap(functx.laplacian(f))(points),
        "torch.func hessian trace": lambda: torch.func.vmap(lambda x: torch.func.hessian(f)(x).diagonal().sum())(points),
        "functx hessian trace": lambda: functx.vmap(lambda x: functx.hessian(f)(x).diagonal().sum())(points),
    }


def torch_contenders(dim: int, points: torch.Tensor, jit: bool = True) -> dict:
    weights, biases = make_mlp(dim)

    def f(x):
        return mlp(weights, biases, x)

    basis = torch.eye(dim)
    contenders = {
        "functx.laplacian": lambda: functx.vmap(functx.laplacian(f))(points),
        "torch.func hessian trace": lambda: torch.func.vmap(lambda x: torch.func.hessian(f)(x).diagonal().sum())(points),
        "torch.func vmap(jvp(grad))": lambda: torch.func.vmap(
            lambda x: torch.func.vmap(lambda e: torch.func.jvp(torch.func.grad(f), (x,), (e,))[1] @ e)(basis).sum()
        )(points),
        "functx hessian trace": lambda: functx.vmap(lambda x: functx.hessian(f)(x).diagonal().sum())(points),
        "functx jet per direction": lambda: functx.vmap(
            lambda x: functx.vmap(lambda e: functx.jet(f, (x,), ([e, torch.zeros_like(e)],))[1][1])(basis).sum()
        )(points),
    }
    if jit:
        jitted = functx.jit(functx.vmap(functx.laplacian(f)))
        contenders["functx.jit(laplacian)"] = lambda: jitted(points)
    return contenders


def jax_contenders(dim: int, points: torch.Tensor) -> dict:
    """JAX's jet and folx's forward Laplacian on the same weights, jit-compiled; {} where JAX
    is not installed."""
    try:
        import jax
        import jax.numpy as jnp
        from jax.experimental import jet as jax_jet
    except ImportError:
        return {}
    weights, biases = make_mlp(dim)
    jw = [jnp.asarray(w.numpy()) for w in weights]
    jb = [jnp.asarray(b.numpy()) for b in biases]
    xs = jnp.asarray(points.numpy())

    def f(x):
        h = x
        for i, (w, b) in enumerate(zip(jw, jb)):
            h = h @ w + b
            if i < len(jw) - 1:
                h = jnp.tanh(h)
        return h.squeeze(-1)

    basis = jnp.eye(dim)

    def jet_laplacian(x):
        def along(e):
            _, (_, second) = jax_jet.jet(f, (x,), ((e, jnp.zeros_like(e)),))
            return second

        return jax.vmap(along)(basis).sum()

    contenders = {}
    jet_fn = jax.jit(jax.vmap(jet_laplacian))
    contenders["jax jet (jit)"] = lambda: jet_fn(xs).block_until_ready()
    try:
        import folx

        folx_fn = jax.jit(jax.vmap(lambda x: folx.forward_laplacian(f)(x).laplacian))
        contenders["folx forward_laplacian (jit)"] = lambda: folx_fn(xs).block_until_ready()
    except Exception as error:  # folx missing or incompatible with the installed jax
        print(f"(folx not run: {type(error).__name__}: {error})", file=sys.stderr)
    return contenders


def check_agreement(contenders: dict) -> float:
    """The largest relative difference of each contender's Laplacians from functx's."""
    reference = torch.as_tensor(contenders["functx.laplacian"]())
    worst = 0.0
    for name, run in contenders.items():
        out = torch.tensor(numpy.asarray(run())) if name.startswith(("jax", "folx")) else run()
        worst = max(worst, ((out - reference).abs().max() / reference.abs().max()).item())
    return worst


def _timed_table(contenders, reference, rounds, warmup_calls):
    """Time `contenders` alternately and print each one's median and the paired ratio of
    `reference`'s time to its own."""
    timings = interleaved(contenders, rounds=rounds, block_seconds=0.0, warmup_calls=warmup_calls)
    print(f"| contender | median ms | {reference} / it (paired) |")
    print("|---|---|---|")
    for name in contenders:
        print(f"| {name} | {timings.median(name) * 1e3:.1f} | {timings.paired_ratio(reference, name):.2f}x |")
    print(flush=True)


def _per_dimension(dims, batch, rounds, make, warmup_calls):
    for dim in dims:
        points = torch.randn(batch, dim, generator=torch.Generator().manual_seed(1))
        contenders = make(dim, points)
        print(f"D = {dim} (largest relative difference between contenders: {check_agreement(contenders):.1e})")
        print()
        _timed_table(contenders, "functx.laplacian", rounds, warmup_calls)


def speed(dims, batch, rounds):
    print(f"Laplacian of a tanh MLP D -> {' -> '.join(map(str, WIDTHS))} -> 1, batch {batch}, float32, 1 thread")
    print()
    _per_dimension(dims, batch, rounds, lambda dim, points: {**torch_contenders(dim, points), **jax_contenders(dim, points)}, 2)


def transformer_speed(dims, batch, rounds):
    print(f"Laplacian of a one-layer transformer (D // 8 tokens of 8 features, width 64, 4 heads), batch {batch}")
    print()
    _per_dimension(dims, batch, rounds, transformer_contenders, 1)


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)


def memory_child(dim, batch, name):
    points = torch.randn(batch, dim, generator=torch.Generator().manual_seed(1))
    contenders = {**torch_contenders(dim, points, jit=False), **jax_contenders(dim, points)}
    small = torch.randn(2, dim)
    {**torch_contenders(dim, small, jit=False), **jax_contenders(dim, small)}[name]()  # imports, first-call set-up
    if name.startswith(("jax", "folx")):
        contenders[name]()  # compile at this size first: the measured call is the run
    before = _rss_kib()
    high_water = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    contenders[name]()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_mib": (peak - before) / 1024, "high_water_before_mib": (high_water - before) / 1024}))


def memory(dims, batch):
    print(f"Peak resident memory of one call above the resident memory before it (MiB), batch {batch}, fresh process each")
    print()
    for dim in dims:
        names = list(torch_contenders(dim, torch.zeros(1, dim), jit=False)) + list(jax_contenders(dim, torch.zeros(1, dim)))
        print(f"D = {dim}")
        print()
        print("| contender | peak MiB | / functx.laplacian |")
        print("|---|---|---|")
        results = {}
        for name in names:
            out = subprocess.run(
                [sys.executable, __file__, "--memory-child", name, "--dims", str(dim), "--batch", str(batch)],
                capture_output=True, text=True, check=True,
            )
            results[name] = json.loads(out.stdout.strip().splitlines()[-1])["peak_mib"]
        for name, mib in results.items():
            print(f"| {name} | {mib:.0f} | {mib / max(results['functx.laplacian'], 1e-9):.2f}x |")
        print(flush=True)


def train(dim, batch, rounds):
    """One PINN step: the Poisson residual (laplacian(u) + 1)^2 over the batch, and its
    gradient in the weights, by functx.laplacian and by torch.func's Hessian trace."""
    weights, biases = make_mlp(dim)
    params = weights + biases
    points = torch.randn(batch, dim, generator=torch.Generator().manual_seed(1))
    n = len(weights)

    def u(p, x):
        return mlp(p[:n], p[n:], x)

    def loss_functx(p):
        return ((functx.vmap(functx.laplacian(lambda x: u(p, x)))(points) + 1) ** 2).mean()

    def loss_torch_func(p):
        laps = torch.func.vmap(lambda x: torch.func.hessian(lambda x: u(p, x))(x).diagonal().sum())(points)
        return ((laps + 1) ** 2).mean()

    leaves = [p.clone().requires_grad_() for p in params]
    contenders = {
        "functx.laplacian + torch.autograd": lambda: torch.autograd.grad(loss_functx(leaves), leaves, allow_unused=True),
        "torch.func hessian + torch.autograd": lambda: torch.autograd.grad(loss_torch_func(leaves), leaves, allow_unused=True),
        "functx.grad(functx.laplacian)": lambda: functx.grad(loss_functx)(params),
    }
    print(f"PINN training step (loss and its gradient in the weights), D = {dim}, batch {batch}")
    print()
    _timed_table(contenders, "functx.laplacian + torch.autograd", rounds, 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dims", type=int, nargs="+", default=[10, 50, 100])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--train", action="store_true")
    parser.add_argument("--transformer", action="store_true")
    parser.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    # one core for the whole process: XLA's CPU runtime ignores its thread flags and ran
    # folx on both cores (146 ms of CPU time in 78 ms of wall time, measured)
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    if args.memory_child:
        return memory_child(args.dims[0], args.batch, args.memory_child)
    for key, value in environment().items():
        print(f"- {key}: {value}")
    print()
    if args.memory:
        memory(args.dims, args.batch)
    elif args.transformer:
        transformer_speed(args.dims, args.batch, args.rounds)
    elif args.train:
        train(args.dims[0] if len(args.dims) == 1 else 50, args.batch, args.rounds)
    else:
        speed(args.dims, args.batch, args.rounds)


if __name__ == "__main__":
    main()
