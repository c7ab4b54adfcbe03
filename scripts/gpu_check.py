"""The project's GPU check: what only a CUDA machine can tell, in one script of a few minutes.

1. environment: torch, CUDA device, Triton, and that functx imports;
2. the Triton kernels compiled for the GPU (tests/kernels/triton_cases.py, the cases the CPU
   suite runs in Triton's interpreter, plus shapes of many tiles), against plain-torch
   references in float64;
3. timings on the GPU, functx against torch.func in one process, alternating, medians and
   the median of paired ratios (CUDA synchronised after every call): DP-SGD steps
   (`functx.dp.clipped_grad` against vmap(grad) + clip) on benchmarks/dp_sgd.py's four
   models, per-sample gradients of an MLP, and the same compiled (functx.jit with inductor
   against torch.compile of torch.func's); values checked against torch.func first;
4. the test suite with CUDA as torch's default device (FUNCTX_TEST_DEVICE=cuda: every tensor a
   test makes without naming a device is on the GPU, references included), bounded by time;
5. the same suite on the machine's CPU, to tell a CUDA failure from one of that machine's
   torch version.

Each part reports and the next one runs whatever the last one did. Output: a markdown
report on stdout and in OUT/gpu_check.md, the test logs beside it.

Run:  python scripts/gpu_check.py [--out DIR] [--suite-seconds 200] [--skip-suite] [--device cpu: a smoke run]
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

import torch  # noqa: E402

report: list[str] = []

# functx needs torch >= 2.13; a lent GPU machine may carry an older torch (2.11 in November
# 2026). Its one missing name that functx imports is torch.overrides.redispatch_function
# (2.13), which is torch._C._skip_one_hop_torch_function: given to this process and to the
# test suite's (a sitecustomize on PYTHONPATH), so that the rest can be checked there. Every
# other difference of the older torch shows in the CPU pass of the suite (part 5); on
# torch 2.11 most of the suite does not import (November 2026), so pass --skip-suite there.
COMPAT = """
import torch.overrides as _overrides
if not hasattr(_overrides, "redispatch_function"):
    import torch as _torch
    def redispatch_function(func, types, args, kwargs):
        skip = getattr(_torch._C, "_skip_one_hop_torch_function", None)
        if skip is not None:
            return skip(func, types, args, kwargs)
        # 2.11 has no one-hop skip: the call with torch functions off (modes under functx's
        # own don't see its inner ops; none of this script's workloads needs them to)
        with _torch._C.DisableTorchFunction():
            return func(*args, **(kwargs or {}))
    _overrides.redispatch_function = redispatch_function
"""
COMPAT_DIR = os.path.join(os.environ.get("TMPDIR", "/tmp"), "functx_gpu_check_compat")


def install_compat() -> bool:
    """The shim above, here and (through PYTHONPATH) in child processes; True if it was needed."""
    import torch.overrides

    if hasattr(torch.overrides, "redispatch_function"):
        return False
    os.makedirs(COMPAT_DIR, exist_ok=True)
    with open(os.path.join(COMPAT_DIR, "sitecustomize.py"), "w") as shim:
        shim.write(COMPAT)
    exec(COMPAT, {})
    # torch.compile support (functx.staging.dynamo, installed when torch._dynamo is imported,
    # which torch.func's grad does) uses 2.13's dynamo internals: left out here, in-process
    import types

    sys.modules["functx.staging.dynamo"] = types.SimpleNamespace(install=lambda: None)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [COMPAT_DIR, ROOT, os.environ.get("PYTHONPATH")]))
    return True


def say(line: str = "") -> None:
    print(line, flush=True)
    report.append(line)


def part(title: str):
    """Run one part, report its time and any exception; never stop the script."""

    def wrap(fn):
        say(f"\n## {title}\n")
        start = time.perf_counter()
        try:
            fn()
            outcome = "done"
        except Exception:  # noqa: BLE001 (a failing part is a finding, reported whole)
            say("```\n" + traceback.format_exc()[-4000:] + "```")
            outcome = "FAILED"
        say(f"\n({outcome} in {time.perf_counter() - start:.1f} s)")
        return fn

    return wrap


def environment() -> None:
    say(f"- python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    if install_compat():
        say("- torch.overrides.redispatch_function missing (torch < 2.13): the compatibility shim is installed")
    if DEVICE == "cuda":
        say(f"- device: {torch.cuda.get_device_name()} ({torch.cuda.get_device_properties(0).multi_processor_count} SMs)")
    try:
        import triton

        say(f"- triton {triton.__version__}")
    except ImportError:
        say("- triton: not installed")
    import functx

    say(f"- functx imported from {os.path.dirname(functx.__file__)}")


def triton_kernels() -> None:
    from tests.kernels.triton_cases import check_kernels

    big = [(8, 512, 256, 512), (4, 1000, 64, 33)]
    try:
        import functx  # noqa: F401
    except ImportError as error:  # the kernels alone: their module needs only torch and triton
        say(f"- functx does not import here ({error}): the Triton kernels alone, without the operators")
        import types

        for name in ("functx", "functx.kernels"):
            stub = types.ModuleType(name)
            stub.__path__ = [os.path.join(ROOT, *name.split("."))]
            sys.modules[name] = stub
        say(f"- {check_kernels(DEVICE, big, with_operators=False)} comparisons passed (float32 rtol 1e-4, float64 1e-10)")
        return
    say(f"- {check_kernels(DEVICE, extra_linear_shapes=big)} comparisons passed (float32 rtol 1e-4, float64 1e-10)")


DEVICE = "cuda"  # --device cpu: a smoke run of this script on a machine without a GPU


def synchronised(fn):
    def call():
        fn()
        if DEVICE == "cuda":
            torch.cuda.synchronize()

    return call


def dp_row(dp_sgd, interleaved, name, rounds):
    """One DP-SGD workload: values checked against torch.func, then timed."""
    import torch.func

    import functx

    model, x, y = dp_sgd.make(name)
    model, x, y = model.to(DEVICE), x.to(DEVICE), y.to(DEVICE)
    steps = {"functx.dp": dp_sgd.functx_step, "vmap functx": dp_sgd.vmap_step(functx),
             "vmap torch.func": dp_sgd.vmap_step(torch.func)}  # fmt: skip
    dp_sgd.check(name, model, x, y, steps)
    t = interleaved({k: synchronised(lambda s=s: s(model, x, y)) for k, s in steps.items()}, rounds=rounds, block_seconds=0.05)
    return [f"DP-SGD step, {name}, batch {dp_sgd.BATCH}", *(f"{t.median(k) * 1e3:.2f}" for k in steps),
                 f"{t.paired_ratio('vmap torch.func', 'functx.dp'):.1f}x",
                 f"{t.paired_ratio('vmap functx', 'vmap torch.func'):.2f}"]  # fmt: skip


def jit_row(mlp, params, x, y, interleaved, rounds):
    """Per-sample gradients compiled: functx.jit (inductor) against torch.compile of
    torch.func's, both warmed up (compiled) before timing, values checked first."""
    import torch.func

    import functx

    def step(T):
        def one(p, x_b, y_b):
            return torch.nn.functional.cross_entropy(T.functional_call(mlp, p, (x_b[None],)), y_b[None])

        return lambda p, x, y: T.vmap(T.grad(one), in_dims=(None, 0, 0))(p, x, y)

    ours = functx.jit(step(functx), backend="inductor")
    theirs = torch.compile(step(torch.func))
    for key, value in theirs(params, x, y).items():
        torch.testing.assert_close(ours(params, x, y)[key], value, rtol=1e-4, atol=1e-6)
    t = interleaved({"functx.jit": synchronised(lambda: ours(params, x, y)),
                     "torch.compile": synchronised(lambda: theirs(params, x, y))}, rounds=rounds, block_seconds=0.05)  # fmt: skip
    return [f"per-sample grads compiled (functx.jit inductor / torch.compile), batch {len(x)}",
            f"{t.median('functx.jit') * 1e3:.2f}", "", f"{t.median('torch.compile') * 1e3:.2f}", "",
            f"{t.paired_ratio('functx.jit', 'torch.compile'):.2f}"]  # fmt: skip


def timings(rounds: int) -> None:
    import dp_sgd
    import torch.func
    from _harness import interleaved, markdown_table

    import functx

    rows = []
    for name in dp_sgd.WORKLOADS:
        try:
            rows.append(dp_row(dp_sgd, interleaved, name, rounds))
        except Exception as error:  # noqa: BLE001 (one workload's failure is reported, the rest run)
            rows.append([f"DP-SGD step, {name}: FAILED, {type(error).__name__}: {str(error)[:200]}", "", "", "", "", ""])
    for batch in (64, 1024):
        torch.manual_seed(0)
        mlp = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256),
                                  torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(DEVICE)  # fmt: skip
        x, y = torch.randn(batch, 784, device=DEVICE), torch.randint(0, 10, (batch,), device=DEVICE)
        params = {n: p.detach() for n, p in mlp.named_parameters()}

        def per_sample(T):
            def one(p, x_b, y_b):
                return torch.nn.functional.cross_entropy(T.functional_call(mlp, p, (x_b[None],)), y_b[None])

            return lambda: T.vmap(T.grad(one), in_dims=(None, 0, 0))(params, x, y)

        ours, theirs = per_sample(functx), per_sample(torch.func)
        for key, value in theirs().items():
            torch.testing.assert_close(ours()[key], value, rtol=1e-4, atol=1e-6)
        t = interleaved({"functx": synchronised(ours), "torch.func": synchronised(theirs)}, rounds=rounds, block_seconds=0.05)
        rows.append([f"per-sample grads, MLP 784-512-256-10, batch {batch}", f"{t.median('functx') * 1e3:.2f}", "",
                     f"{t.median('torch.func') * 1e3:.2f}", "", f"{t.paired_ratio('functx', 'torch.func'):.2f}"])  # fmt: skip
        if batch == 1024:
            try:
                rows.append(jit_row(mlp, params, x, y, interleaved, rounds))
            except Exception as error:  # noqa: BLE001 (reported; the rest runs)
                rows.append([f"jit vs torch.compile: FAILED, {type(error).__name__}: {str(error)[:200]}", "", "", "", "", ""])
    header = ["workload", "functx.dp / functx (ms)", "vmap functx (ms)", "vmap torch.func (ms)",
              "vmap torch.func / functx.dp", "functx / torch.func (paired)"]  # fmt: skip
    say(markdown_table(header, rows))


def suite(out: str, label: str, seconds: int, device: str | None) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if device:
        env["FUNCTX_TEST_DEVICE"] = device
    log = os.path.join(out, f"suite_{label}.log")
    workers = str(max(2, min(12, (os.cpu_count() or 2) - 2)))
    command = [sys.executable, "-m", "pytest", "-q", "-n", workers, "-p", "no:cacheprovider", "-rfE", "--tb=line",
               f"--junitxml={os.path.join(out, f'suite_{label}.xml')}"]  # fmt: skip
    with open(log, "w") as sink:
        try:
            done = subprocess.run(command, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=seconds)
            ended = f"exit {done.returncode}"
        except subprocess.TimeoutExpired:
            ended = f"stopped at {seconds} s (incomplete)"
    with open(log) as written:
        lines = written.read().splitlines()
    summary = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    say(f"- {ended}; last line: `{lines[-1] if lines else ''}`")
    say(f"- {len(summary)} failing tests" + (", first 40:" if summary else ""))
    for line in summary[:40]:
        say(f"  - `{line[:300]}`")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--suite-seconds", type=int, default=200)
    parser.add_argument("--skip-suite", action="store_true")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    os.makedirs(args.out, exist_ok=True)
    say(f"# functx GPU check ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})")
    part("Environment")(environment)
    part("Triton kernels on CUDA against float64 references")(triton_kernels)
    part(f"Timings on the GPU ({args.rounds} alternating rounds, medians)")(lambda: timings(args.rounds))
    if not args.skip_suite:
        part("Test suite, CUDA as the default device")(lambda: suite(args.out, "cuda", args.suite_seconds, DEVICE))
        part("Test suite on this machine's CPU (a torch-version baseline)")(lambda: suite(args.out, "cpu", args.suite_seconds, None))
    with open(os.path.join(args.out, "gpu_check.md"), "w") as written:
        written.write("\n".join(report) + "\n")


if __name__ == "__main__":
    main()
