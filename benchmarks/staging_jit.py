"""functx.jit vs eager torch.func, torch.compile of torch.func, and jax.jit.

Workloads (the suite's, same shapes): MLP per-sample gradients (batch 64, ad_per_sample_grads.py),
CNN per-sample gradients (batch 64), jacrev and jacfwd of the R^256 tanh MLP and the
Hessian of the R^128 one (ad_jacobians.py), per-sample Jacobians `vmap(jacrev)` of that MLP
(batch 8), an ensemble of 8 MLPs through stack_module_state + vmap(functional_call), the
MAML step (ad_maml.py) and a tiny vmap(grad) (8x8 weights, 4 samples): the micro workload
where per-call overhead is all there is.

Contenders, alternating in one process (values checked equal first):
    jit             functx.jit(f)                        (the traced graph, replayed)
    jit+inductor    functx.jit(f, backend="inductor")
    compile(tf)     torch.compile(torch.func version, backend="inductor")
    torch.func      the torch.func version, eager
    jax.jit         the same computation in JAX (optional: `pip install "jax[cpu]"`; on the
                    same data, converted), where written (not CNN, ensemble)

With --cpp-wrapper, two more contenders: jit+inductor and compile(tf) with inductor's
`cpp_wrapper` option (the replay in C++, no Python call per kernel), reported in a second
table (ratios to jax.jit and to compile(tf) with the same option; first calls).

First calls (trace + compile) are timed once per contender. Issue 14's targets:
jit+inductor <= 1.0x jax.jit on MAML and hessian, <= 2x on the micro workload, faster than
compile(tf) on every workload; first-call time no worse than compile(tf)'s.

Run:  .venv/bin/python benchmarks/staging_jit.py [--quick] [--threads N] [--only SUBSTRING] [--cpp-wrapper]
      .venv/bin/python benchmarks/staging_jit.py --cold-first-calls [--only SUBSTRING]
      (first calls only, each contender in a fresh process with an empty inductor cache)
(inductor compiles take 5-25 s each on this host: ~5 minutes in all.)
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np
import torch
import torch.func

import ad_jacobians
import ad_maml
import ad_per_sample_grads as psg
import functx
from _harness import interleaved, markdown_table, standard_arguments, threads

try:  # optional
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_platforms", "cpu")
except ImportError:  # pragma: no cover - depends on the environment
    jax = None


def _np(tree):
    return torch.utils._pytree.tree_map(lambda t: jnp.asarray(t.detach().numpy()) if isinstance(t, torch.Tensor) else t, tree)


# -- workloads: make(lib) -> (fn, args); jax_make() -> (fn, args) or None ----------------------
def _per_sample(model, params, x_shape, batch=64):
    def make(lib):
        torch.manual_seed(1)
        x, y = torch.randn(batch, *x_shape), torch.randint(0, 10, (batch,))
        return lib.vmap(lib.grad(psg.sample_loss(model)), in_dims=(None, 0, 0)), (params, x, y)

    return make


def _jax_mlp(params, x):
    for i in range(len(psg.MLP_SIZES) - 1):
        x = x @ params[f"weight{i}"].T + params[f"bias{i}"]
        if i < len(psg.MLP_SIZES) - 2:
            x = jax.nn.relu(x)
    return x


def _jax_mlp_per_sample():
    fn, (params, x, y) = _per_sample(psg.mlp, psg.mlp_params(), (psg.MLP_SIZES[0],))(torch.func)

    def loss(p, x, y):
        logits = _jax_mlp(p, x[None])
        return -jax.nn.log_softmax(logits)[0, y]

    return jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))), _np((params, x, y))


def _tanh_params(sizes, seed):
    return ad_jacobians.linear_params(sizes, seed)


def _jacobian(transform):
    def make(lib):
        f = ad_jacobians.tanh_mlp(_tanh_params((ad_jacobians.JAC_SIZE,) * 3, 0))
        torch.manual_seed(3)
        return getattr(lib, transform)(f), (torch.randn(ad_jacobians.JAC_SIZE),)

    return make


def _jax_tanh(params):
    def f(x):
        for w, b in params:
            x = jnp.tanh(x @ w.T + b)
        return x

    return f


def _jax_jacobian(transform):
    def make():
        params = _np(_tanh_params((ad_jacobians.JAC_SIZE,) * 3, 0))
        torch.manual_seed(3)
        x = _np(torch.randn(ad_jacobians.JAC_SIZE))
        return jax.jit(getattr(jax, transform)(_jax_tanh(params))), (x,)

    return make


def _hessian(lib):
    mlp = ad_jacobians.tanh_mlp(_tanh_params((ad_jacobians.HESSIAN_IN, ad_jacobians.HESSIAN_HIDDEN, ad_jacobians.HESSIAN_HIDDEN), 2))
    torch.manual_seed(4)
    return lib.hessian(lambda x: mlp(x).sum()), (torch.randn(ad_jacobians.HESSIAN_IN),)


def _jax_hessian():
    f = _jax_tanh(_np(_tanh_params((ad_jacobians.HESSIAN_IN, ad_jacobians.HESSIAN_HIDDEN, ad_jacobians.HESSIAN_HIDDEN), 2)))
    torch.manual_seed(4)
    return jax.jit(jax.hessian(lambda x: f(x).sum())), (_np(torch.randn(ad_jacobians.HESSIAN_IN)),)


def _vmap_jacrev(lib):
    f = ad_jacobians.tanh_mlp(_tanh_params((64, 64, 64), 5))
    torch.manual_seed(5)
    return lib.vmap(lib.jacrev(f)), (torch.randn(8, 64),)


def _jax_vmap_jacrev():
    f = _jax_tanh(_np(_tanh_params((64, 64, 64), 5)))
    torch.manual_seed(5)
    return jax.jit(jax.vmap(jax.jacrev(f))), (_np(torch.randn(8, 64)),)


def _ensemble(lib):
    torch.manual_seed(6)
    models = [torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)) for _ in range(8)]
    params, buffers = lib.stack_module_state(models)
    base = models[0]
    x = torch.randn(128, 32)
    return (lambda p, b, x: lib.vmap(lambda p, b: lib.functional_call(base, (p, b), (x,)))(p, b)), (params, buffers, x)


def _maml(lib):
    return ad_maml.meta_gradient(lib), (ad_maml.init_params(), *ad_maml.sine_tasks())


def _jax_maml():
    params, data = ad_maml.init_params(), ad_maml.sine_tasks()

    def net(p, x):
        depth = len(ad_maml.SIZES) - 1
        for i in range(depth):
            x = x @ p[f"weight{i}"].T + p[f"bias{i}"]
            if i < depth - 1:
                x = jax.nn.relu(x)
        return x

    def mse(p, x, y):
        return jnp.mean((net(p, x) - y) ** 2)

    def task_loss(p, xs, ys, xq, yq):
        for _ in range(ad_maml.INNER_STEPS):
            g = jax.grad(mse)(p, xs, ys)
            p = {k: p[k] - ad_maml.INNER_LR * g[k] for k in p}
        return mse(p, xq, yq)

    def meta_loss(p, xs, ys, xq, yq):
        return jax.vmap(task_loss, in_axes=(None, 0, 0, 0, 0))(p, xs, ys, xq, yq).sum()

    return jax.jit(jax.grad(meta_loss)), _np((params, *data))


def _micro(lib):
    torch.manual_seed(7)
    w, xs = torch.randn(8, 8), torch.randn(4, 8)
    return lib.vmap(lib.grad(lambda w, x: torch.tanh(w @ x).sum()), in_dims=(None, 0)), (w, xs)


def _jax_micro():
    torch.manual_seed(7)
    w, xs = torch.randn(8, 8), torch.randn(4, 8)
    return jax.jit(jax.vmap(jax.grad(lambda w, x: jnp.tanh(w @ x).sum()), in_axes=(None, 0))), _np((w, xs))


WORKLOADS = {
    "MLP per-sample grads, batch 64": (_per_sample(psg.mlp, psg.mlp_params(), (psg.MLP_SIZES[0],)), _jax_mlp_per_sample),
    "CNN per-sample grads, batch 64": (_per_sample(psg.cnn, psg.cnn_params(), (1, 28, 28)), None),
    "jacrev, MLP R^256": (_jacobian("jacrev"), _jax_jacobian("jacrev")),
    "jacfwd, MLP R^256": (_jacobian("jacfwd"), _jax_jacobian("jacfwd")),
    "vmap(jacrev), MLP R^64, batch 8": (_vmap_jacrev, _jax_vmap_jacrev),
    "hessian, tanh MLP R^128": (_hessian, _jax_hessian),
    "ensemble of 8 MLPs, stack_module_state + vmap(functional_call)": (_ensemble, None),
    "MAML step (ad_maml.py)": (_maml, _jax_maml),
    "tiny vmap(grad), 8x8, 4 samples": (_micro, _jax_micro),
}


def _first_call(fn, args):
    start = time.perf_counter()
    out = fn(*args)
    if jax is not None and not isinstance(out, torch.Tensor) and not isinstance(out, (dict, tuple, list)):
        jax.block_until_ready(out)
    return out, time.perf_counter() - start


def _leaves(tree):
    """Arrays of a result, dicts in sorted key order (JAX flattens dicts sorted, torch in
    insertion order)."""
    if isinstance(tree, dict):
        return [leaf for k in sorted(tree) for leaf in _leaves(tree[k])]
    if isinstance(tree, (tuple, list)):
        return [leaf for item in tree for leaf in _leaves(item)]
    return [np.asarray(tree.detach() if isinstance(tree, torch.Tensor) else tree)]


def _close(a, b):
    flat_a, flat_b = _leaves(a), _leaves(b)
    assert len(flat_a) == len(flat_b), (len(flat_a), len(flat_b))
    for x, y in zip(flat_a, flat_b):
        np.testing.assert_allclose(x, y, rtol=2e-3, atol=2e-4)


def _warm_up():
    """Pay the one-time costs (imports, inductor's code cache and workers) before any timed
    first call, so that no contender's first call carries them."""
    x = torch.randn(3)
    torch.compile(lambda x: x.sin() + 1, backend="inductor")(x)
    functx.jit(functx.grad(lambda x: x.sin().sum()))(x)
    functx.jit(functx.grad(lambda x: x.cos().sum()), backend="inductor")(x)


CPP = {"cpp_wrapper": True}


def run(quick=False, n_threads=1, only=None, cpp_wrapper=False):
    rows, cpp_rows = [], []
    _warm_up()
    with threads(n_threads):
        for label, (make, jax_make) in WORKLOADS.items():
            if only is not None and only not in label:
                continue
            ours, ours_args = make(functx)
            theirs, theirs_args = make(torch.func)
            torch._dynamo.reset()
            contenders = {
                "jit": (functx.jit(ours), ours_args),
                "jit+inductor": (functx.jit(ours, backend="inductor"), ours_args),
                "compile(tf)": (torch.compile(theirs, backend="inductor"), theirs_args),
                "torch.func": (theirs, theirs_args),
            }
            if cpp_wrapper:
                contenders["jit+inductor cpp"] = (functx.jit(ours, backend="inductor", options=CPP), ours_args)
                contenders["compile(tf) cpp"] = (torch.compile(theirs, backend="inductor", options=CPP), theirs_args)
            if jax is not None and jax_make is not None:
                contenders["jax.jit"] = jax_make()
            reference = theirs(*theirs_args)
            firsts = {}
            for name, (fn, args) in contenders.items():
                out, firsts[name] = _first_call(fn, args)
                _close(out, reference)
            calls = {name: (lambda fn=fn, args=args: _block(fn(*args))) for name, (fn, args) in contenders.items()}
            timings = interleaved(calls, rounds=6 if quick else 30)
            med = {name: timings.median(name) for name in calls}
            ratio = lambda a, b: timings.paired_median(lambda x, y: x / y, a, b)
            has_jax = "jax.jit" in calls
            rows.append(
                [
                    label,
                    *(f"{med[n] * 1e3:.3f}" if n in med else "—" for n in ("jit", "jit+inductor", "compile(tf)", "torch.func", "jax.jit")),
                    f"{ratio('jit+inductor', 'compile(tf)'):.2f}x",
                    f"{ratio('jit+inductor', 'jax.jit'):.2f}x" if has_jax else "—",
                    f"{ratio('jit', 'torch.func'):.2f}x",
                    f"{firsts['jit+inductor']:.1f} / {firsts['compile(tf)']:.1f}" + (f" / {firsts['jax.jit']:.2f}" if has_jax else ""),
                ]
            )
            if cpp_wrapper:
                cpp_rows.append(
                    [
                        label,
                        *(f"{med[n] * 1e3:.3f}" if n in med else "—" for n in ("jit+inductor cpp", "compile(tf) cpp", "jax.jit")),
                        f"{ratio('jit+inductor cpp', 'compile(tf) cpp'):.2f}x",
                        f"{ratio('jit+inductor cpp', 'jax.jit'):.2f}x" if has_jax else "—",
                        f"{ratio('jit+inductor cpp', 'jit+inductor'):.2f}x",
                        f"{firsts['jit+inductor cpp']:.1f} / {firsts['compile(tf) cpp']:.1f}",
                    ]
                )
    header = [
        "workload", "jit ms", "jit+inductor ms", "compile(tf) ms", "torch.func ms", "jax.jit ms",
        "jit+inductor / compile(tf)", "jit+inductor / jax.jit", "jit / torch.func eager",
        "first call s: jit+inductor / compile(tf) / jax.jit",
    ]  # fmt: skip
    table = markdown_table(header, rows)
    if cpp_wrapper:
        cpp_header = [
            "workload", "jit+inductor cpp ms", "compile(tf) cpp ms", "jax.jit ms", "jit+inductor cpp / compile(tf) cpp",
            "jit+inductor cpp / jax.jit", "cpp / default (jit+inductor)", "first call s: jit+inductor cpp / compile(tf) cpp",
        ]  # fmt: skip
        table += "\n\nWith inductor's cpp_wrapper option:\n\n" + markdown_table(cpp_header, cpp_rows)
    return table


_COLD_FIRST_CALL = """
import os, sys, time, warnings
warnings.simplefilter("ignore")
sys.path.insert(0, sys.argv[3])
import torch, functx
torch.set_num_threads(int(sys.argv[4]))
import staging_jit as sj
sj._warm_up()  # imports and inductor's workers, as in the main run (unrelated kernels)
make = sj.WORKLOADS[sys.argv[1]][0]
if sys.argv[2] == "jit+inductor":
    fn, args = make(functx)
    fn = functx.jit(fn, backend="inductor")
else:
    fn, args = make(torch.func)
    fn = torch.compile(fn, backend="inductor")
start = time.perf_counter()
fn(*args)
print(time.perf_counter() - start)
"""


def cold_first_calls(n_threads=1, only=None):
    """Each of jit+inductor's and compile(tf)'s first calls in a fresh process with an empty
    inductor cache of its own (TORCHINDUCTOR_CACHE_DIR; AOTAutograd's cache lives there too):
    in the main run the second contender's compile finds the first one's C++ kernels (same
    source, same hash) in the shared cache, which favours whichever runs second."""
    import subprocess
    import tempfile

    here = os.path.dirname(os.path.abspath(__file__))
    rows = []
    for label in WORKLOADS:
        if only is not None and only not in label:
            continue
        seconds = {}
        for contender in ("jit+inductor", "compile(tf)"):
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
                out = subprocess.run(
                    [sys.executable, "-c", _COLD_FIRST_CALL, label, contender, here, str(n_threads)],
                    capture_output=True, text=True, check=True, env=env,
                )  # fmt: skip
                seconds[contender] = float(out.stdout.strip().splitlines()[-1])
        ratio = seconds["jit+inductor"] / seconds["compile(tf)"]
        rows.append([label, f"{seconds['jit+inductor']:.1f}", f"{seconds['compile(tf)']:.1f}", f"{ratio:.2f}x"])
    header = ["workload", "jit+inductor first call s", "compile(tf) first call s", "jit+inductor / compile(tf)"]
    return markdown_table(header, rows)


def _block(out):
    if jax is not None:
        leaves = torch.utils._pytree.tree_leaves(out)
        if leaves and not isinstance(leaves[0], torch.Tensor):
            jax.block_until_ready(out)
    return out


if __name__ == "__main__":
    parser = standard_arguments(__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", default=None)
    parser.add_argument("--cpp-wrapper", action="store_true", help="also time inductor's cpp_wrapper option")
    parser.add_argument(
        "--cold-first-calls", action="store_true", help="only first calls, each in a fresh process with an empty cache"
    )
    arguments = parser.parse_args()
    if arguments.cold_first_calls:
        print(f"## functx.jit first calls, cold caches, {arguments.threads} thread(s)\n")
        print(cold_first_calls(arguments.threads, arguments.only))
        raise SystemExit
    print(f"## functx.jit, {arguments.threads} thread(s), jax {'%s' % jax.__version__ if jax else 'not installed'}\n")
    print(run(arguments.quick, arguments.threads, arguments.only, arguments.cpp_wrapper))
