"""DP-SGD on several processes with torch.distributed: data parallel, clipped per sample.

When one machine is not enough, DP-SGD is trained as ordinary data parallelism: every
process (rank) holds the same model and gets its own slice of each batch. What changes
for differential privacy is what the ranks exchange: not gradients of their mean loss, but
the sums of their samples' CLIPPED gradients, and the Gaussian noise must be added once to
the total, not once per rank.

What you learn:

1. `functx.distributed.clipped_grad`: each rank clips the per-sample gradients of its own
   samples (functx.dp's kernels: no per-sample gradient is materialised), ONE all-reduce
   adds the clipped sums of all ranks (every gradient flattened into one buffer), and the
   noise N(0, (sigma C)^2) is drawn once, by rank 0, and added before the all-reduce: every
   rank ends with the same gradient, so an ordinary SGD step keeps the parameters identical
   on all ranks (checked here at every step, bit for bit);
2. the result is the one-process DP-SGD step on the concatenated batch: rank 0 trains a
   second copy of the model with `functx.dp.clipped_grad` on the whole batch, with the same
   noise seed, and the two stay equal (to float rounding);
3. how the same script runs on GPUs with NCCL (below).

Run:  torchrun --nproc-per-node 2 tutorials/distributed_dp_sgd.py            (~10 s on 2 CPU cores)
      torchrun --nproc-per-node 2 tutorials/distributed_dp_sgd.py --quick    (a few seconds, for CI)
      python tutorials/distributed_dp_sgd.py [--quick]   (starts the 2 processes itself, gloo on 127.0.0.1)
The figure goes to tutorials/out/distributed_dp_sgd/ (or --out DIR).

On GPUs with NCCL, the same code: `torchrun --nproc-per-node <GPUs per machine> ...` (with
`--nnodes`, `--rdzv-backend c10d --rdzv-endpoint HOST:PORT` across machines). `setup()` below
picks NCCL when every local rank has its own GPU: `init_process_group("nccl")`,
`torch.cuda.set_device(LOCAL_RANK)`, and the model, the data and the noise generator on
`cuda:LOCAL_RANK`. Nothing else changes: functx.distributed's collectives run on the tensors'
device. Gloo on CPUs, as here, is the fallback.
"""

# %% [markdown]
# ## Setup
#
# `torchrun` starts one process per rank and tells each its place through the environment
# (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); `init_process_group()` reads it.
# Run without torchrun, the script starts the 2 processes itself (`main` at the bottom).

# %%
from __future__ import annotations

import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import functx
import functx.distributed
from _common import parse_args, plt, save

NAME = "distributed_dp_sgd"


def setup() -> torch.device:
    """Join the process group: NCCL with one GPU per local rank when there are enough GPUs,
    else gloo on the CPU. Returns this rank's device."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world:
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")
        return torch.device("cuda", local_rank)
    dist.init_process_group("gloo")
    return torch.device("cpu")


# %% [markdown]
# ## Data and model
#
# A synthetic 4-class problem: Gaussian blobs in 16 dimensions, generated from a fixed seed
# on every rank (real code would give each rank its own shard of a dataset; here every rank
# can also rebuild the whole batch, which rank 0 uses for the one-process reference). Every
# step draws a global batch of 64 indices from a generator seeded the same on all ranks;
# rank r takes its slice of it.


# %%
def make_data(n: int, device):
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(4, 16, generator=g) * 0.6
    labels = torch.randint(0, 4, (n,), generator=g)
    points = centers[labels] + torch.randn(n, 16, generator=g)
    return points.to(device), labels.to(device)


def make_model(device) -> nn.Module:
    torch.manual_seed(1)  # the same initial parameters on every rank
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(device)


def per_sample_loss(out, y):
    return F.cross_entropy(out, y, reduction="none")  # one loss per sample: DP-SGD clips each


# %% [markdown]
# ## The distributed DP-SGD step
#
# `functx.distributed.clipped_grad(model, loss, x_local, y_local, max_norm=C,
# noise_multiplier=sigma, generator=g)` returns the clipped, summed, noised gradient of the
# WHOLE batch (every rank's samples), identical on every rank. The noise generator is seeded
# per step with the same seed everywhere; only rank 0 draws from it. Dividing by the global
# batch size and stepping with plain SGD keeps the parameters identical on all ranks without
# ever broadcasting them.

# %%
MAX_NORM, SIGMA, LR, BATCH = 1.0, 1.0, 0.25, 64


def noise_generator(step: int, device) -> torch.Generator:
    return torch.Generator(device).manual_seed(10_000 + step)


def sgd_step(model: nn.Module, grads: dict, batch_size: int) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.sub_(grads[name], alpha=LR / batch_size)


def flat_parameters(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def identical_on_all_ranks(model: nn.Module) -> bool:
    """Gather every rank's parameters and compare them bit for bit."""
    mine = flat_parameters(model)
    everyone = mine.new_empty(dist.get_world_size() * mine.numel())
    dist.all_gather_single(everyone, mine)
    everyone = everyone.view(dist.get_world_size(), -1)
    return bool((everyone == everyone[0]).all())


def train(args) -> None:
    torch.set_num_threads(1)  # 2 ranks on 2 cores
    device = setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    steps = 30 if args.quick else 200
    points, labels = make_data(4096, device)
    model = make_model(device)
    reference = make_model(device) if rank == 0 else None  # one process, the whole batch
    shuffle = torch.Generator().manual_seed(2)  # the same batches on every rank
    bounds = [BATCH * r // world for r in range(world + 1)]
    history = {"loss": [], "reference_loss": [], "accuracy": []}
    start = time.perf_counter()
    for step in range(steps):
        index = torch.randint(0, len(points), (BATCH,), generator=shuffle).to(device)
        x, y = points[index], labels[index]
        mine = slice(bounds[rank], bounds[rank + 1])  # this rank's slice of the batch
        grads, norms = functx.distributed.clipped_grad(
            model, per_sample_loss, x[mine], y[mine],
            max_norm=MAX_NORM, noise_multiplier=SIGMA, generator=noise_generator(step, device),
        )
        sgd_step(model, grads, BATCH)
        if rank == 0:
            ref_grads, _ = functx.dp.clipped_grad(
                reference, per_sample_loss, x, y,
                max_norm=MAX_NORM, noise_multiplier=SIGMA, generator=noise_generator(step, device),
            )
            sgd_step(reference, ref_grads, BATCH)
            with torch.no_grad():
                history["loss"].append(F.cross_entropy(model(points), labels).item())
                history["reference_loss"].append(F.cross_entropy(reference(points), labels).item())
                history["accuracy"].append((model(points).argmax(1) == labels).float().mean().item())
        if not identical_on_all_ranks(model):  # a collective: every rank calls it
            raise RuntimeError(f"step {step}: the ranks' parameters differ")
        if rank == 0 and (step % max(1, steps // 6) == 0 or step == steps - 1):
            print(
                f"step {step:4d}  loss {history['loss'][-1]:.4f} (one process: {history['reference_loss'][-1]:.4f})"
                f"  accuracy {history['accuracy'][-1]:.3f}  clipped {(norms > MAX_NORM).float().mean().item():.0%} of rank 0's samples"
            )
    if rank == 0:
        drift = (flat_parameters(model) - flat_parameters(reference)).abs().max().item()
        print(f"{steps} DP-SGD steps on {world} ranks ({dist.get_backend()}) in {time.perf_counter() - start:.1f} s")
        print(f"parameters identical on all {world} ranks after every step")
        print(f"largest difference from one process on the whole batch: {drift:.2e} (float rounding)")
        assert drift < 1e-4, drift
        assert history["accuracy"][-1] > (0.6 if args.quick else 0.8), history["accuracy"][-1]
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
        left.plot(history["loss"], label=f"{world} ranks, functx.distributed.clipped_grad")
        left.plot(history["reference_loss"], "--", label="1 process, functx.dp.clipped_grad")
        left.set(xlabel="step", ylabel="training loss", title="DP-SGD: distributed = one process")
        left.legend()
        right.plot(history["accuracy"])
        right.set(xlabel="step", ylabel="accuracy", title=f"accuracy (sigma={SIGMA}, C={MAX_NORM})")
        save(fig, args.out, "distributed_dp_sgd.png",
             "the two loss curves on top of each other (the ranks together take the one-process step), "
             "the accuracy rising despite the noise")  # fmt: skip
    dist.barrier()  # every rank leaves together (one exiting early can abort the others' transport)
    dist.destroy_process_group()


# %% [markdown]
# ## Starting the processes
#
# Under torchrun the environment is set and `train` runs directly. Without it, the script
# plays torchrun on this machine: it picks a free port on 127.0.0.1 and spawns 2 processes.


# %%
def _spawned(rank: int, world: int, port: int, args) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    train(args)
    # Leave without Python's interpreter teardown: gloo's C++ threads can still hold tensors
    # then and, rarely, abort the finished process (pytorch/pytorch#179291 describes it).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    args = parse_args(NAME, __doc__.splitlines()[0])
    if "RANK" in os.environ:  # started by torchrun
        train(args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.start_processes(_spawned, args=(2, port, args), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
