"""functx.distributed in 2 real processes (gloo on 127.0.0.1, started with
torch.multiprocessing's spawn, each run bounded in time), against one-process references:

- DP-SGD across 2 ranks (an MLP, a CNN, an embedding model; uneven slices of the batch; the
  "kernels" and "vmap" methods; a model the kernels refuse): the parameters after each SGD
  step are the same tensor on both ranks and equal (float64) to one process running
  `functx.dp.clipped_grad` on the concatenated batch with the same noise seed; the noise is
  drawn once (with zero gradients the result is exactly the one-process noise, std σC);
- an ensemble of 4 members sharded 2 + 2, trained with vmap(grad) (stacked state) and as a
  `functx.nn.Ensemble` with an optimizer, predictions gathered: equal to one process training
  all 4; uneven shards and gathers; gradients through `gather_predictions`;
- the batching rules of the functional collectives (all_reduce, all_gather, reduce_scatter,
  all_to_all, broadcast, coalesced forms, raw ops + wait_tensor) under vmap, grad,
  vmap(grad), grad(vmap), jacrev: against loops over the samples, torch.autograd and the
  collectives' closed forms over both ranks' inputs; no per-sample loop fallback; a
  hypothesis property over ops, shapes, batch sizes and in_dims;
- errors: no process group, bad arguments, mismatched shapes across ranks;
- the tutorial under torchrun.

Workers are module-level functions (spawn imports this module in the children), results come
back through files written with torch.save.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

import functx

WORLD = 2
DT = torch.float64
JOIN_TIMEOUT = 120  # seconds for one 2-process run, start-up included
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)
ROOT = Path(__file__).resolve().parent.parent


# -- running 2 processes ------------------------------------------------------------------
def _entry(rank: int, world_size: int, port: int, scenario: str, out: str) -> None:
    """One rank: join the group through the parent's store, run `scenario`, save its result."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]  # localhost only
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT, pg_options=options
    )
    try:
        result = SCENARIOS[scenario](rank, world_size)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    # Skip Python's interpreter teardown: gloo's C++ threads can still hold tensors then and,
    # rarely, abort a process whose work is done (seen once in CI, in the tutorial's ranks).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(scenario: str, tmp_path: Path, world_size: int = WORLD) -> list:
    """Run `scenario(rank, world_size)` in `world_size` spawned processes; their results, by rank.
    A rank's exception fails the test with its traceback; a run over JOIN_TIMEOUT is killed."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # a free port, held
    context = mp.start_processes(
        _entry, args=(world_size, store.port, scenario, str(tmp_path)), nprocs=world_size, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + JOIN_TIMEOUT
    try:
        while not context.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                pytest.fail(f"scenario {scenario!r}: the {world_size} processes did not finish in {JOIN_TIMEOUT} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join()
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def shared_run(scenario: str, tmp_path_factory) -> list:
    """`run_ranks(scenario)` once per test session: under pytest-xdist the workers share the
    result (the first to ask runs it, under a file lock), so a scenario's processes are
    started once however its tests are distributed."""
    from filelock import FileLock  # a dependency of torch

    session = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    root = tmp_path_factory.getbasetemp() if session is None else tmp_path_factory.getbasetemp().parent / session
    folder = root / f"scenario-{scenario}"
    folder.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        done = folder / "done"
        if not done.exists():
            results = run_ranks(scenario, folder)
            done.touch()
            return results
    return [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


# -- models and data ------------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self, features=6, hidden=16, classes=3):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.Tanh(), nn.Linear(hidden, classes))

    def forward(self, x):
        return self.net(x)


class CNN(nn.Module):
    def __init__(self, classes=3):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.norm = nn.GroupNorm(2, 4)
        self.head = nn.Linear(4 * 6 * 6, classes)

    def forward(self, x):
        return self.head(F.relu(self.norm(self.conv(x))).flatten(1))


class Tokens(nn.Module):
    def __init__(self, vocab=20, dim=8, classes=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, ids):
        return self.head(self.embed(ids).mean(1))


class OutsideUse(nn.Module):
    """`functx.dp.clipped_grad` refuses it: the weight is used outside its module's forward."""

    def __init__(self, features=6, classes=3):
        super().__init__()
        self.fc = nn.Linear(features, classes)

    def forward(self, x):
        return torch.tanh(x) @ self.fc.weight.t() + self.fc.bias


MODELS = {"mlp": MLP, "cnn": CNN, "tokens": Tokens, "outside": OutsideUse}
GLOBAL_BATCH = 8
SLICES = [(0, 5), (5, 8)]  # uneven: rank 0 has 5 samples, rank 1 has 3
STEPS = 3
MAX_NORMS = {"mlp": 3.0, "cnn": 5.0, "tokens": 1.5, "outside": 2.0}  # some samples clipped, some not
MAX_NORM, SIGMA, LR = 0.5, 0.7, 0.5  # MAX_NORM: the noise-only run


def make_model(name: str) -> nn.Module:
    torch.manual_seed(1)
    return MODELS[name]().to(DT)


def batch(name: str, step: int):
    """The global batch of a step (the same on every rank: each takes its slice)."""
    g = torch.Generator().manual_seed(100 + step)
    if name == "cnn":
        x = torch.randn(GLOBAL_BATCH, 1, 8, 8, generator=g, dtype=DT)
    elif name == "tokens":
        x = torch.randint(0, 20, (GLOBAL_BATCH, 5), generator=g)
    else:
        x = torch.randn(GLOBAL_BATCH, 6, generator=g, dtype=DT) * 3
    return x, torch.randint(0, 3, (GLOBAL_BATCH,), generator=g)


def per_sample_loss(out, y):
    return F.cross_entropy(out, y, reduction="none")


def noise_generator(step: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 + step)


def sgd_step(model, grads):
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.sub_(grads[name], alpha=LR / GLOBAL_BATCH)


def state_of(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# -- scenario: DP-SGD -------------------------------------------------------------------------
DP_RUNS = [("mlp", "kernels"), ("mlp", "vmap"), ("cnn", "kernels"), ("tokens", "kernels"), ("outside", "vmap")]


def _dp_sgd(rank, world_size):
    import functx.distributed

    lo, hi = SLICES[rank]
    runs = {}
    for name, method in DP_RUNS:
        model = make_model(name)
        states, norms = [], []
        for step in range(STEPS):
            x, y = batch(name, step)
            grads, local_norms = functx.distributed.clipped_grad(
                model, per_sample_loss, x[lo:hi], y[lo:hi], max_norm=MAX_NORMS[name], noise_multiplier=SIGMA,
                generator=noise_generator(step), method=method,
            )
            assert list(grads) == [n for n, _ in model.named_parameters()]
            sgd_step(model, grads)
            states.append(state_of(model))
            norms.append(local_norms)
        runs[name, method] = states, norms
    # the noise alone: zero gradients (a loss that does not depend on the parameters)
    big = nn.Linear(150, 100).to(DT)
    torch.manual_seed(2)
    x = torch.randn(GLOBAL_BATCH, 150, dtype=DT)[slice(*SLICES[rank])]
    zero_loss = lambda out, y: out.sum(1) * 0.0
    noise, _ = functx.distributed.clipped_grad(
        big, zero_loss, x, None, max_norm=MAX_NORM, noise_multiplier=SIGMA, generator=noise_generator(7)
    )
    return {"runs": runs, "noise": noise}


def _one_process_dp(name):
    """One process, the concatenated batch: functx.dp.clipped_grad (or, for the model its
    kernels refuse, a per-sample torch.autograd loop clipped and summed, with the same noise)."""
    from functx.dp import _add_noise

    model = make_model(name)
    states, norms = [], []
    for step in range(STEPS):
        x, y = batch(name, step)
        if name == "outside":
            params = dict(model.named_parameters())
            per = [torch.autograd.grad(per_sample_loss(model(x[b : b + 1]), y[b : b + 1]).sum(), list(params.values())) for b in range(len(x))]
            step_norms = torch.stack([torch.sqrt(sum(g.pow(2).sum() for g in gs)) for gs in per])
            clip = (MAX_NORMS[name] / (step_norms + 1e-6)).clamp(max=1.0)
            grads = {n: sum(clip[b] * per[b][i] for b in range(len(x))) for i, n in enumerate(params)}
            _add_noise(grads, SIGMA * MAX_NORMS[name], noise_generator(step))
        else:
            grads, step_norms = functx.dp.clipped_grad(
                model, per_sample_loss, x, y, max_norm=MAX_NORMS[name], noise_multiplier=SIGMA, generator=noise_generator(step)
            )
        sgd_step(model, grads)
        states.append(state_of(model))
        norms.append(step_norms)
    return states, norms


@pytest.fixture(scope="module")
def dp_results(tmp_path_factory):
    return shared_run("dp_sgd", tmp_path_factory)


@pytest.mark.parametrize("name,method", DP_RUNS, ids=[f"{n}-{m}" for n, m in DP_RUNS])
def test_dp_sgd_two_ranks_equals_one_process(dp_results, name, method):
    ranks = [r["runs"][name, method] for r in dp_results]
    expected_states, expected_norms = _one_process_dp(name)
    for step in range(STEPS):
        for param in expected_states[step]:
            # identical on every rank, bit for bit
            assert torch.equal(ranks[0][0][step][param], ranks[1][0][step][param]), (step, param)
            torch.testing.assert_close(ranks[0][0][step][param], expected_states[step][param], rtol=1e-10, atol=1e-12)
        local = torch.cat([ranks[r][1][step] for r in range(WORLD)])  # each rank's own norms
        torch.testing.assert_close(local, expected_norms[step], rtol=1e-10, atol=1e-12)
    all_norms = torch.cat(expected_norms)
    assert (all_norms > MAX_NORMS[name]).any() and (all_norms < MAX_NORMS[name]).any(), "the run should clip some samples, not all"


def test_dp_sgd_noise_is_added_once_with_std_sigma_c(dp_results):
    big = nn.Linear(150, 100).to(DT)
    torch.manual_seed(2)
    x = torch.randn(GLOBAL_BATCH, 150, dtype=DT)
    expected, _ = functx.dp.clipped_grad(
        big, lambda out, y: out.sum(1) * 0.0, x, None, max_norm=MAX_NORM, noise_multiplier=SIGMA, generator=noise_generator(7)
    )
    noise = [r["noise"] for r in dp_results]
    for name in expected:
        assert torch.equal(noise[0][name], noise[1][name])
        assert torch.equal(noise[0][name], expected[name])  # exactly the one-process noise: drawn once
    flat = torch.cat([g.reshape(-1) for g in noise[0].values()])
    assert abs(flat.std().item() / (SIGMA * MAX_NORM) - 1) < 0.03 and abs(flat.mean().item()) < 0.01


# -- scenario: sharded ensembles ----------------------------------------------------------------
MEMBERS = 4


def _ensemble_data():
    g = torch.Generator().manual_seed(5)
    return torch.randn(12, 6, generator=g, dtype=DT), torch.randint(0, 3, (12,), generator=g), torch.randn(7, 6, generator=g, dtype=DT)


def _stacked_members(count=MEMBERS):
    models = []
    for i in range(count):
        torch.manual_seed(10 + i)
        models.append(MLP().to(DT))
    return functx.stack_module_state(models)


def _train_stacked(params, buffers, x, y):
    template = MLP().to(DT)

    def member_loss(p, b, x, y):
        return F.cross_entropy(functx.functional_call(template, (p, b), (x,)), y)

    for _ in range(STEPS):
        grads = functx.vmap(functx.grad(member_loss), in_dims=(0, 0, None, None))(params, buffers, x, y)
        params = {n: (p - LR * grads[n]).detach() for n, p in params.items()}
    return params, lambda p, b, x: functx.vmap(lambda p, b: functx.functional_call(template, (p, b), (x,)))(p, b)


def _train_module(ensemble, x, y):
    optimizer = torch.optim.SGD(ensemble.parameters(), lr=LR)
    for _ in range(STEPS):
        optimizer.zero_grad()
        out = ensemble(x)
        sum(F.cross_entropy(o, y) for o in out).backward()
        optimizer.step()
    return ensemble


def _ensemble(rank, world_size):
    import functx.distributed as fd

    x, y, x_eval = _ensemble_data()
    params, buffers = _stacked_members()
    local_params, local_buffers = fd.shard_ensemble_state((params, buffers), rank, world_size)
    assert next(iter(local_params.values())).shape[0] == MEMBERS // world_size
    trained, predict = _train_stacked(local_params, local_buffers, x, y)
    stacked_predictions = fd.gather_predictions(predict(trained, local_buffers, x_eval))
    # as a functx.nn.Ensemble module, sharded with its default rank and world size
    full = functx.nn.Ensemble.from_state(MLP().to(DT), *_stacked_members())
    local = fd.shard_ensemble_state(full)
    assert isinstance(local, functx.nn.Ensemble) and len(local) == MEMBERS // world_size
    module_predictions = fd.gather_predictions(_train_module(local, x, y)(x_eval))
    # uneven: 3 members, 2 on rank 0 and 1 on rank 1; gathered along dim 1
    p3, b3 = _stacked_members(3)
    mine3, b3_local = fd.shard_ensemble_state((p3, b3), rank, world_size)
    trained3, predict3 = _train_stacked(mine3, b3_local, x, y)
    uneven = fd.gather_predictions(predict3(trained3, b3_local, x_eval).movedim(0, 1), dim=1)
    # gradients through the gather: of the sum over ranks of <gathered, w>
    local_leaf = predict(trained, local_buffers, x_eval).detach().requires_grad_()
    w = torch.arange(MEMBERS * 7 * 3, dtype=DT).reshape(MEMBERS, 7, 3)
    (gathered_grad,) = torch.autograd.grad((fd.gather_predictions(local_leaf) * w).sum(), local_leaf)
    # every rank must give the same shapes except along dim: both ranks refuse
    try:
        fd.gather_predictions(torch.zeros(2, 3 + rank))
        mismatch = None
    except ValueError as error:
        mismatch = str(error)
    return {
        "stacked": stacked_predictions,
        "module": module_predictions,
        "uneven": uneven,
        "gathered_grad": gathered_grad,
        "mismatch": mismatch,
    }


@pytest.fixture(scope="module")
def ensemble_results(tmp_path_factory):
    return shared_run("ensemble", tmp_path_factory)


def test_sharded_ensemble_equals_one_process(ensemble_results):
    x, y, x_eval = _ensemble_data()
    params, buffers = _stacked_members()
    trained, predict = _train_stacked(params, buffers, x, y)
    expected = predict(trained, buffers, x_eval)
    module_expected = _train_module(functx.nn.Ensemble.from_state(MLP().to(DT), *_stacked_members()), x, y)(x_eval)
    assert expected.shape == (MEMBERS, 7, 3)
    for r in ensemble_results:
        torch.testing.assert_close(r["stacked"], expected, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(r["module"], module_expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(module_expected, expected, rtol=1e-10, atol=1e-12)  # the two recipes agree


def test_uneven_shards_and_gather_along_another_dim(ensemble_results):
    x, y, x_eval = _ensemble_data()
    p3, b3 = _stacked_members(3)
    trained, predict = _train_stacked(p3, b3, x, y)
    expected = predict(trained, b3, x_eval).movedim(0, 1)
    for r in ensemble_results:
        torch.testing.assert_close(r["uneven"], expected, rtol=1e-10, atol=1e-12)


def test_gradient_through_gather_predictions(ensemble_results):
    w = torch.arange(MEMBERS * 7 * 3, dtype=DT).reshape(MEMBERS, 7, 3)
    for rank, r in enumerate(ensemble_results):  # each rank's slice of w, from both ranks' losses
        assert torch.equal(r["gathered_grad"], WORLD * w[2 * rank : 2 * rank + 2])


def test_gather_predictions_refuses_mismatched_shapes(ensemble_results):
    for r in ensemble_results:
        assert r["mismatch"] is not None and "every rank must give the same" in r["mismatch"]


def test_shard_ensemble_state_slices_in_rank_order():
    import functx.distributed as fd

    params, buffers = _stacked_members(5)
    shards = [fd.shard_ensemble_state((params, buffers), r, 3) for r in range(3)]
    assert [s[0]["net.0.weight"].shape[0] for s in shards] == [2, 2, 1]
    for name, p in params.items():
        assert torch.equal(torch.cat([s[0][name] for s in shards]), p)
        assert all(s[0][name].is_leaf and s[0][name].requires_grad for s in shards)
    shards[0][0]["net.0.weight"].data.zero_()  # copies: the full state is not written
    assert params["net.0.weight"].abs().sum() > 0


# -- scenario: the functional collectives under transforms ---------------------------------------
def _data(rank, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(50 + rank), dtype=DT)


def _loop(f, x, in_dim=0):
    return torch.stack([f(s) for s in x.unbind(in_dim)])


def _autograd_loop(loss, x):
    """Per-sample gradients by a loop of torch.autograd.grad (each sample's own collectives)."""
    rows = []
    for s in x.unbind(0):
        s = s.detach().requires_grad_()
        (g,) = torch.autograd.grad(loss(s), s)
        rows.append(g)
    return torch.stack(rows)


def _collectives(rank, world_size):
    import torch.distributed._functional_collectives as funcol
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    assert "functx.distributed" not in sys.modules  # vmap installs the rules on first use
    group = dist.group.WORLD
    ops = {
        "all_reduce": lambda t: funcol.all_reduce(t, "sum", group),
        "all_gather": lambda t: funcol.all_gather_single(t, 0, group),
        "all_gather_dim1": lambda t: funcol.all_gather_single(t, 1, group),
        "reduce_scatter": lambda t: funcol.reduce_scatter_single(t, "sum", 0, group),
        "all_to_all": lambda t: funcol.all_to_all_single(t, None, None, group),
        "broadcast": lambda t: funcol.broadcast(t, 1, group),
        "raw_all_reduce": lambda t: torch.ops._c10d_functional.wait_tensor(
            torch.ops._c10d_functional.all_reduce(t, "max", group.group_name)
        ),
        "raw_all_gather_autograd": lambda t: torch.ops._c10d_functional.wait_tensor(
            torch.ops._c10d_functional_autograd.all_gather_into_tensor(t, world_size, group.group_name)
        ),
    }
    x = _data(rank, 5, 4, 3)  # 5 samples of shape (4, 3)
    w = _data(10 + rank, 8, 3)
    result = {"x": x, "w": w, "vmap": {}, "grad": {}, "vmap_grad": {}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", functx.PerformanceWarning)
        for name, f in ops.items():
            for in_dim in (0, 1, 2):
                out = functx.vmap(f, in_dims=in_dim)(x.movedim(0, in_dim))
                torch.testing.assert_close(out, _loop(f, x), rtol=0, atol=0, msg=f"{name} in_dim={in_dim}")
            result["vmap"][name] = out
        assert "functx.vmap.rules.collectives" in sys.modules and "functx.distributed" not in sys.modules
        # grad, vmap(grad), grad(vmap), torch.autograd as the reference
        losses = {
            "all_reduce": lambda t: (funcol.all_reduce(t, "sum", group) * w[:4]).sum(),
            "all_gather": lambda t: (funcol.all_gather_single(t, 0, group) * w).sum(),
            "reduce_scatter": lambda t: (funcol.reduce_scatter_single(t, "sum", 0, group) * w[:2]).sum(),
        }
        for name, loss in losses.items():
            leaf = x[0].clone().requires_grad_()
            (expected,) = torch.autograd.grad(loss(leaf), leaf)
            got = functx.grad(loss)(x[0])
            torch.testing.assert_close(got, expected, msg=name)
            per_sample = functx.vmap(functx.grad(loss))(x)
            torch.testing.assert_close(per_sample, _autograd_loop(loss, x), msg=name)
            outer = functx.grad(lambda xs: functx.vmap(loss)(xs).sum())(x)
            torch.testing.assert_close(outer, per_sample, msg=name)
            result["grad"][name], result["vmap_grad"][name] = got, per_sample
        # jacrev: its vjps run the collectives' backward under vmap (batched cotangents)
        jac = functx.jacrev(ops["all_gather"])(x[0, :2, 0])
        rows = []
        for i in range(world_size * 2):
            leaf = x[0, :2, 0].clone().requires_grad_()
            (row,) = torch.autograd.grad(ops["all_gather"](leaf) @ torch.eye(world_size * 2, dtype=DT)[i], leaf)
            rows.append(row)
        torch.testing.assert_close(jac, torch.stack(rows))
        result["jacrev_all_gather"] = jac
        # forward mode: every rank's tangent goes through the same collective (torch gives these
        # ops reverse mode only; functx/ad/library_ops.py)
        t = _data(40 + rank, 4, 3)
        linear = ("all_reduce", "all_gather", "all_gather_dim1", "reduce_scatter", "all_to_all", "broadcast", "raw_all_gather_autograd")
        result["t"] = t
        result["jvp"] = {name: functx.jvp(ops[name], (x[0],), (t,))[1] for name in linear}
        result["jvp_sin"] = functx.jvp(lambda v: torch.sin(funcol.all_reduce(v, "sum", group)) * w[:4], (x[0],), (t,))[1]
        result["vmap_jvp"] = functx.vmap(lambda v, tv: functx.jvp(ops["all_gather"], (v,), (tv,))[1])(x, x.cos())
        result["jacfwd_all_gather"] = functx.jacfwd(ops["all_gather"])(x[0, :2, 0])
        smooth = lambda v: (torch.sin(funcol.all_reduce(v, "sum", group)) * w[:4, 0]).sum()
        result["hessian"] = functx.hessian(smooth)(x[0, :, 0])
        result["jacrev_jacrev"] = functx.jacrev(functx.jacrev(smooth))(x[0, :, 0])
        # coalesced forms: a batched and an unbatched tensor in one collective
        other = _data(20 + rank, 2, 3)
        for coalesced in (
            lambda t: funcol.all_reduce_coalesced([t, other], "sum", group),
            lambda t: funcol.all_gather_single_coalesced([t, other], group),
            lambda t: funcol.reduce_scatter_tensor_coalesced([t, other], "sum", [0, 0], group),
        ):
            got = functx.vmap(coalesced)(x[:, :2])
            expected = [[funcol.wait_tensor(t) for t in coalesced(s)] for s in x[:, :2]]
            torch.testing.assert_close(got[0], torch.stack([e[0] for e in expected]))
            torch.testing.assert_close(got[1], expected[0][1].expand(5, *expected[0][1].shape))  # unbatched: the same for all

        # a property over ops, shapes, batch sizes and in_dims (both ranks draw the same cases)
        @settings(
            max_examples=12, derandomize=True, database=None, deadline=None,
            phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck),
        )
        @given(st.data())
        def vmap_equals_loop(data):
            name = data.draw(st.sampled_from(["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"]))
            rank_count = data.draw(st.integers(1, 3))
            shape = [data.draw(st.integers(1, 3)) for _ in range(rank_count)]
            if name in ("reduce_scatter", "all_to_all"):
                shape[0] *= world_size
            size = data.draw(st.integers(1, 4))
            in_dim = data.draw(st.integers(0, rank_count))
            sample = _data(rank, size, *shape).movedim(0, in_dim)
            f = ops[name]
            torch.testing.assert_close(functx.vmap(f, in_dims=in_dim)(sample), _loop(f, sample, in_dim), rtol=0, atol=0)
            if name in ("all_reduce", "all_gather", "reduce_scatter"):
                out_shape = [{"all_reduce": shape[0], "all_gather": shape[0] * world_size}.get(name, shape[0] // world_size), *shape[1:]]
                weights = _data(30, *out_shape)
                loss = lambda t: (f(t) * weights).sum()
                torch.testing.assert_close(
                    functx.vmap(functx.grad(loss), in_dims=in_dim)(sample), _autograd_loop(loss, sample.movedim(in_dim, 0))
                )

        vmap_equals_loop()
    loops = [str(c.message) for c in caught if issubclass(c.category, functx.PerformanceWarning)]
    assert not loops, f"a collective ran once per sample: {loops[0]}"
    with warnings.catch_warnings():  # torch's double backward of a collective: vmap runs it once per sample
        warnings.simplefilter("ignore", functx.PerformanceWarning)
        smooth = lambda v: (torch.sin(funcol.all_reduce(v, "sum", group)) * w[:4, 0]).sum()
        result["vmap_grad_grad"] = functx.vmap(functx.grad(lambda v: functx.grad(smooth)(v).sum()))(x[:, :, 0])
    try:  # max is not linear, and torch refuses the backward of all_reduce(max): no tangent but an error
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", functx.PerformanceWarning)  # the double-VJP fallback's
            functx.jvp(ops["raw_all_reduce"], (x[0],), (t,))
    except RuntimeError as error:
        result["jvp_max_error"] = str(error)
    return result


@pytest.fixture(scope="module")
def collectives_results(tmp_path_factory):
    return shared_run("collectives", tmp_path_factory)


def test_collectives_under_vmap_equal_their_closed_forms(collectives_results):
    x = [r["x"] for r in collectives_results]
    for rank, r in enumerate(collectives_results):
        out = r["vmap"]
        torch.testing.assert_close(out["all_reduce"], x[0] + x[1])
        torch.testing.assert_close(out["raw_all_reduce"], torch.maximum(x[0], x[1]))
        torch.testing.assert_close(out["all_gather"], torch.cat([x[0], x[1]], 1))  # per sample, along its dim 0
        torch.testing.assert_close(out["all_gather_dim1"], torch.cat([x[0], x[1]], 2))
        torch.testing.assert_close(out["raw_all_gather_autograd"], torch.cat([x[0], x[1]], 1))
        torch.testing.assert_close(out["reduce_scatter"], (x[0] + x[1])[:, 2 * rank : 2 * rank + 2])
        torch.testing.assert_close(out["all_to_all"], torch.cat([x[0][:, 2 * rank : 2 * rank + 2], x[1][:, 2 * rank : 2 * rank + 2]], 1))
        torch.testing.assert_close(out["broadcast"], x[1])


def test_gradients_through_collectives(collectives_results):
    """The gradient of the sum over ranks of each rank's loss: all_reduce's is all_reduce of
    the cotangent, all_gather's reduce_scatter, reduce_scatter's all_gather."""
    w = [r["w"] for r in collectives_results]
    for rank, r in enumerate(collectives_results):
        expected = {
            "all_reduce": w[0][:4] + w[1][:4],
            "all_gather": (w[0] + w[1])[4 * rank : 4 * rank + 4],
            "reduce_scatter": torch.cat([w[0][:2], w[1][:2]]),
        }
        for name, g in expected.items():
            torch.testing.assert_close(r["grad"][name], g, msg=name)
            torch.testing.assert_close(r["vmap_grad"][name], g.expand(5, 4, 3), msg=name)
        jac = torch.zeros(4, 2, dtype=DT)
        jac[2 * rank : 2 * rank + 2] = torch.eye(2, dtype=DT) * WORLD
        torch.testing.assert_close(r["jacrev_all_gather"], jac)


def test_forward_mode_through_collectives(collectives_results):
    """jvp, vmap(jvp), jacfwd and hessian: this rank's output's tangent given every rank's
    tangent (the collective of the tangents), against closed forms and float64 autograd of
    the one-process function; torch registers no forward formula for these ops (its forward
    AD gives zeros)."""
    x = [r["x"][0] for r in collectives_results]
    t = [r["t"] for r in collectives_results]
    w = [r["w"] for r in collectives_results]

    def total_loss(v0, v1):  # the sum over ranks of each rank's loss, in one process
        return sum((torch.sin(v0 + v1) * w_r[:4, 0]).sum() for w_r in w)

    blocks = torch.autograd.functional.hessian(total_loss, (x[0][:, 0], x[1][:, 0]))
    for rank, r in enumerate(collectives_results):
        expected = {
            "all_reduce": t[0] + t[1],
            "all_gather": torch.cat(t),
            "all_gather_dim1": torch.cat(t, 1),
            "reduce_scatter": (t[0] + t[1])[2 * rank : 2 * rank + 2],
            "all_to_all": torch.cat([t[0][2 * rank : 2 * rank + 2], t[1][2 * rank : 2 * rank + 2]]),
            "broadcast": t[1],
            "raw_all_gather_autograd": torch.cat(t),
        }
        for name, tangent in expected.items():
            torch.testing.assert_close(r["jvp"][name], tangent, msg=name)
        torch.testing.assert_close(r["jvp_sin"], torch.cos(x[0] + x[1]) * (t[0] + t[1]) * w[rank][:4])
        xs = [c["x"] for c in collectives_results]
        torch.testing.assert_close(r["vmap_jvp"], torch.cat([xs[0].cos(), xs[1].cos()], 1))
        torch.testing.assert_close(r["jacfwd_all_gather"], torch.cat([torch.eye(2, dtype=DT)] * WORLD))
        # jacfwd puts the same basis tangent on every rank: the sum of this rank's row of blocks
        torch.testing.assert_close(r["hessian"], blocks[rank][0] + blocks[rank][1])
        # reverse over reverse: the vjps sum over ranks (the Hessian of the total is symmetric)
        torch.testing.assert_close(r["jacrev_jacrev"], blocks[0][rank] + blocks[1][rank])
        for i, row in enumerate(r["vmap_grad_grad"]):  # each sample's own collectives
            v = [c["x"][i, :, 0] for c in collectives_results]
            h = torch.autograd.functional.hessian(total_loss, (v[0], v[1]))
            torch.testing.assert_close(row, (h[0][rank] + h[1][rank]).sum(0))
        assert "only supports 'sum'" in r["jvp_max_error"], r.get("jvp_max_error")


# -- errors -------------------------------------------------------------------------------------
def test_without_a_process_group_the_error_names_the_fix():
    import functx.distributed as fd

    assert not dist.is_initialized()
    model = MLP().to(DT)
    x, y = batch("mlp", 0)
    with pytest.raises(RuntimeError, match=r"not initialised.*init_process_group\(backend='gloo'\).*functx\.dp\.clipped_grad"):
        fd.clipped_grad(model, per_sample_loss, x, y, max_norm=1.0)
    with pytest.raises(RuntimeError, match="init_process_group"):
        fd.noised_sum({"w": torch.ones(2)}, max_norm=1.0)
    with pytest.raises(RuntimeError, match="init_process_group"):
        fd.gather_predictions(torch.ones(2, 3))
    with pytest.raises(RuntimeError, match="init_process_group"):
        fd.shard_ensemble_state(_stacked_members())


def test_bad_arguments(tmp_path):
    import functx.distributed as fd
    import torch.distributed._functional_collectives as funcol

    params, buffers = _stacked_members()
    with pytest.raises(ValueError, match="at most 4 ranks or at least 5 members"):
        fd.shard_ensemble_state(params, 0, 5)
    with pytest.raises(ValueError, match="0 <= rank < world_size"):
        fd.shard_ensemble_state(params, 2, 2)
    with pytest.raises(ValueError, match="give both rank and world_size"):
        fd.shard_ensemble_state(params, 0)
    with pytest.raises(ValueError, match="one member count"):
        fd.shard_ensemble_state({"a": torch.zeros(4, 2), "b": torch.zeros(3)}, 0, 2)
    with pytest.raises(TypeError, match="pytree of stacked tensors"):
        fd.shard_ensemble_state({"a": torch.zeros(4, 2), "b": 3}, 0, 2)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = MLP().to(DT)
        x, y = batch("mlp", 0)
        with pytest.raises(ValueError, match="method must be 'kernels' or 'vmap'"):
            fd.clipped_grad(model, per_sample_loss, x, y, max_norm=1.0, method="loop")
        with pytest.raises(TypeError, match="ProcessGroup"):
            fd.clipped_grad(model, per_sample_loss, x, y, max_norm=1.0, group="world")
        with pytest.raises(ValueError, match="max_norm must be a positive number"):
            fd.clipped_grad(model, per_sample_loss, x, y, max_norm=0.0, method="vmap")
        with pytest.raises(ValueError, match="noise_multiplier must be a number >= 0"):
            fd.noised_sum({"w": torch.ones(2)}, max_norm=1.0, noise_multiplier=-1.0)
        with pytest.raises(ValueError, match="one loss per sample"):
            fd.clipped_grad(model, F.cross_entropy, x, y, max_norm=1.0, method="vmap")
        with pytest.raises(RuntimeError, match="0-dim sample.*unsqueeze"):
            functx.vmap(lambda t: funcol.all_gather_single(t, 0, dist.group.WORLD))(torch.ones(3))
        with pytest.raises(NotImplementedError, match="all_reduce_ has no batching rule.*out-of-place form"):
            functx.vmap(lambda t: torch.ops._c10d_functional.all_reduce_(t, "sum", dist.group.WORLD.group_name))(torch.ones(3, 2))
        # a world of one: both methods give functx.dp.clipped_grad
        for method in ("kernels", "vmap"):
            grads, norms = fd.clipped_grad(
                model, per_sample_loss, x, y, max_norm=0.5, noise_multiplier=1.0, generator=noise_generator(0), method=method
            )
            expected, expected_norms = functx.dp.clipped_grad(
                model, per_sample_loss, x, y, max_norm=0.5, noise_multiplier=1.0, generator=noise_generator(0)
            )
            torch.testing.assert_close(norms, expected_norms)
            for name in expected:
                torch.testing.assert_close(grads[name], expected[name])
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("method", ["kernels", "vmap"])
@pytest.mark.parametrize(
    "clip, message",
    [
        (dict(max_norm=True), "max_norm must be a positive number, got True"),
        (dict(max_norm=float("nan")), "max_norm must be a positive number, got nan"),
        (dict(max_norm=1.0, noise_multiplier=-1.0), "noise_multiplier must be a number >= 0, got -1.0"),
        (dict(max_norm=1.0, noise_multiplier=None), "noise_multiplier must be a number >= 0, got None"),
        (dict(max_norm=1.0, noise_multiplier=True), "noise_multiplier must be a number >= 0, got True"),
    ],
)
def test_clip_settings_are_checked_up_front_for_every_method(method, clip, message):
    """Before any per-sample work (the loss is never computed), the message naming
    functx.distributed.clipped_grad (with method="kernels" a negative noise_multiplier was
    found by noised_sum, after the per-sample work)."""
    import functx.distributed as fd

    def loss_fn(out, y):
        raise AssertionError("the settings are checked before the forward")

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        x, y = batch("mlp", 0)
        with pytest.raises(ValueError, match=f"^functx.distributed.clipped_grad: {message}$"):
            fd.clipped_grad(MLP().to(DT), loss_fn, x, y, method=method, **clip)
        with pytest.raises(ValueError, match=f"^functx.distributed.noised_sum: {message}$"):
            fd.noised_sum({"w": torch.ones(2)}, **clip)
    finally:
        dist.destroy_process_group()


def test_wrapped_collectives_let_other_threads_run():
    """functx wraps the collectives' autograd kernels (forward mode, functx/ad/library_ops.py);
    the wrapper must call the kernel it shadows without the GIL, as a plain call does: held,
    gloo deadlocked (a worker thread holding the queue lock waits for the GIL to free a
    finished collective's tensors while this thread, holding the GIL, waits for the lock).
    Seen once in CI, then in 1 of ~5 runs of this file with the CPUs loaded. Checked here
    directly: a broadcast (torch's autograd fallback; its C++ clone of the input takes tens of
    ms) must let a spinning Python thread run while it works."""
    import threading

    import torch.distributed._functional_collectives as funcol

    from functx.ad import library_ops

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        functx.vmap(lambda t: funcol.broadcast(t, 0, dist.group.WORLD))(torch.ones(2, 3))  # installs the wrappers
        op = torch.ops._c10d_functional.broadcast.default
        assert op in library_ops._forward_aware_ops
        big = torch.ones(2**25, dtype=DT)  # 256 MiB: its clone takes tens of ms
        state = {"longest": 0.0, "stop": False}

        def spin():  # the longest stretch this thread waited for the GIL
            last = time.perf_counter()
            while not state["stop"]:
                now = time.perf_counter()
                state["longest"], last = max(state["longest"], now - last), now

        spinner = threading.Thread(target=spin)
        spinner.start()
        try:
            waits, clones = [], []
            for _ in range(3):
                start = time.perf_counter()
                big.clone()  # a plain clone (without the GIL): how long the broadcast's own takes
                clones.append(time.perf_counter() - start)
                state["longest"] = 0.0
                out = op(big, 0, dist.group.WORLD.group_name)
                waits.append(state["longest"])
                torch.ops._c10d_functional.wait_tensor(out)
        finally:
            state["stop"] = True
            spinner.join()
        # held, each call makes the spinner wait out its clone (~half of `clones`); let go: at most a
        # switch interval (5 ms)
        assert min(waits) < 0.2 * min(clones), f"the spinner waited {waits} s in the broadcasts (clones: {clones} s)"
        torch.testing.assert_close(out, big)
        del big, out
        # a leaf that requires grad: the shadowed kernel still runs (autograd fallback: a grad_fn)
        leaf = torch.ones(3, dtype=DT, requires_grad=True)
        reduced = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(leaf * 2, "sum", dist.group.WORLD.group_name))
        (grad,) = torch.autograd.grad(reduced.sum(), leaf)
        torch.testing.assert_close(grad, torch.full((3,), 2.0, dtype=DT))
        assert torch.ops._c10d_functional.wait_tensor(op(leaf, 0, dist.group.WORLD.group_name)).grad_fn is not None
    finally:
        dist.destroy_process_group()


# -- the tutorial under torchrun ----------------------------------------------------------------
def test_tutorial_runs_under_torchrun(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    result = subprocess.run(
        [*torchrun, str(ROOT / "tutorials" / "distributed_dp_sgd.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=JOIN_TIMEOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert "parameters identical on all 2 ranks" in result.stdout
    assert list(tmp_path.glob("*.png"))


SCENARIOS = {"dp_sgd": _dp_sgd, "ensemble": _ensemble, "collectives": _collectives}
