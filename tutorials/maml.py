"""MAML: meta-learning an initialisation for sine-wave regression (Finn et al., 2017).

Model-Agnostic Meta-Learning looks for initial weights from which a few plain gradient
steps on a handful of examples of a *new* task already give a good model. Each task here
is a sine wave y = A sin(x + phase) with amplitude A in [0.1, 5] and phase in [0, pi],
seen through K = 10 "support" points (to adapt on) and K = 10 "query" points (to judge the
adapted model on), x in [-5, 5].

What you learn:

1. how MAML reads as three nested transforms in functx: `functx.grad` of the support loss
   for the inner SGD steps, `functx.vmap` of the per-task loss over a meta-batch of tasks,
   and an outer `functx.grad` of the mean query loss, which differentiates *through* the
   inner gradient steps (the second-order meta-gradient);
2. how to check that meta-gradient against a plain `torch.autograd` loop over tasks with
   `create_graph=True` (in float64, to a tight tolerance), and that the check can tell it
   from the cheaper first-order approximation;
3. meta-training with Adam, and what the learned initialisation does on new tasks: before
   adaptation it predicts roughly the average of all tasks (a weak bump), after one or a few
   steps on 10 points it follows the new task's sine; a randomly initialised network
   adapted with the same steps barely moves.

Run:  python tutorials/maml.py            (~30 s on a 2-core CPU)
      python tutorials/maml.py --quick    (a few seconds, for CI)
Figures go to tutorials/out/maml/ (or --out DIR).
"""

# %% [markdown]
# ## Setup
#
# Everything runs on the CPU. `_common` holds the shared plumbing of the tutorials: the
# command line (`--quick`, `--out`), `median_time`, and `save` for figures.
#
# The tensors in MAML on sine waves are tiny (a 1-40-40-1 MLP on 10 points per task), so
# the run time is all per-operation overhead and a second intra-op thread only adds
# synchronisation: we use one thread (on a busy 2-core machine two threads made the
# meta-gradient several times *slower*).

# %%
from __future__ import annotations

import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import functx

try:  # run as a script (python tutorials/maml.py) ...
    from _common import median_time, parse_args, plt, save
except ImportError:  # ... or imported as tutorials.maml
    from tutorials._common import median_time, parse_args, plt, save

NAME = "maml"
K_SUPPORT = K_QUERY = 10  # points per task to adapt on / to evaluate the adapted model on
INNER_LR = 0.01  # step size of the inner SGD steps (fixed, not learned)
INNER_STEPS = 2  # inner steps during meta-training
META_LR = 1e-3  # Adam on the initialisation

# %% [markdown]
# ## Tasks: sine waves
#
# A task is an (amplitude, phase) pair. `sample_tasks` draws `n` of them and, for each,
# `K_SUPPORT` support points and `K_QUERY` query points with x uniform in [-5, 5]. Shapes
# are `[n, K, 1]`: a leading task dimension (the one `vmap` will map over), then the points
# of one task, then one input feature. Every random draw goes through an explicit
# `torch.Generator`, so runs are reproducible.


# %%
def sample_tasks(n: int, generator: torch.Generator, k_support: int = K_SUPPORT, k_query: int = K_QUERY):
    amplitude = torch.rand(n, 1, 1, generator=generator) * 4.9 + 0.1  # [0.1, 5]
    phase = torch.rand(n, 1, 1, generator=generator) * math.pi  # [0, pi]
    xs = torch.rand(n, k_support, 1, generator=generator) * 10 - 5
    xq = torch.rand(n, k_query, 1, generator=generator) * 10 - 5
    return {
        "amplitude": amplitude,
        "phase": phase,
        "xs": xs,
        "ys": amplitude * torch.sin(xs + phase),
        "xq": xq,
        "yq": amplitude * torch.sin(xq + phase),
    }


# %% [markdown]
# ## The model as a function of its parameters
#
# MAML needs to run the same network with many different weights (the initialisation, and
# each task's adapted copy), so we write it as a plain function `mlp(params, x)` of a dict
# of tensors. The initial values come from `nn.Linear`'s default initialisation.
#
# If you already have an `nn.Module`, you do not need to rewrite it: take
# `params = {k: v.detach() for k, v in model.named_parameters()}` and replace `mlp(params, x)`
# below by `functx.functional_call(model, params, (x,))`; everything else stays the same.


# %%
SIZES = (1, 40, 40, 1)


def init_params(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    layers = [nn.Linear(i, o) for i, o in zip(SIZES[:-1], SIZES[1:])]
    return {
        f"{kind}{i}": getattr(layer, kind).detach().clone()
        for i, layer in enumerate(layers)
        for kind in ("weight", "bias")
    }


def mlp(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    depth = len(SIZES) - 1
    for i in range(depth):
        x = F.linear(x, params[f"weight{i}"], params[f"bias{i}"])
        if i < depth - 1:
            x = F.relu(x)
    return x


def mse(params, x, y):
    return F.mse_loss(mlp(params, x), y)


# %% [markdown]
# ## MAML in three transforms
#
# Written for ONE task, the inner loop is ordinary SGD, with `functx.grad(mse)` giving the
# gradient of the support loss as a dict shaped like `params`:
#
#     theta_task = theta - alpha * grad_theta L_support(theta)        (repeated `steps` times)
#
# and the task's loss is the query loss of the adapted weights, L_query(theta_task).
# Nothing is detached, so `theta_task` remains a differentiable function of `theta`.
#
# `functx.vmap(task_loss, in_dims=(None, 0, 0, 0, 0))` runs it for a whole meta-batch of
# tasks at once: `None` says the initialisation is shared, the `0`s say the support and
# query sets are split along their leading task dimension. The mean over tasks is the
# meta-loss, and `functx.grad(meta_loss)` its gradient with respect to the shared
# initialisation. Because that outer `grad` differentiates through the inner `grad`s, it
# includes the second-order terms (Hessian-vector products of the support loss); we use
# `functx.grad_and_value` during training to get the loss for free alongside.


# %%
def adapt(params, xs, ys, steps: int, lr: float = INNER_LR):
    """`steps` SGD steps on one task's support set; returns the adapted parameter dict."""
    for _ in range(steps):
        grads = functx.grad(mse)(params, xs, ys)
        params = {k: params[k] - lr * grads[k] for k in params}
    return params


def make_meta_loss(steps: int):
    def task_loss(params, xs, ys, xq, yq):  # ONE task: xs, ys [K_SUPPORT, 1]; xq, yq [K_QUERY, 1]
        return mse(adapt(params, xs, ys, steps), xq, yq)

    def meta_loss(params, xs, ys, xq, yq):  # a meta-batch: every data tensor [tasks, K, 1]
        return functx.vmap(task_loss, in_dims=(None, 0, 0, 0, 0))(params, xs, ys, xq, yq).mean()

    return meta_loss


# %% [markdown]
# ## Checking the meta-gradient against a plain autograd loop
#
# The reference is how MAML is usually written without function transforms: loop over the
# tasks, take the inner steps with `torch.autograd.grad(..., create_graph=True)` so that the
# graph of the inner gradients is kept, add up the query losses, and backpropagate once.
#
# We compare in float64, where both must agree to ~1e-10, and use 3 inner steps so the
# check covers gradients through several stacked inner steps. To be sure the comparison
# is sensitive to the second-order terms, we also compute the *first-order* approximation
# (FOMAML: `create_graph=False`, i.e. the inner gradients treated as constants), which must
# differ from both by far more than the tolerance.
#
# Last, the time of one meta-gradient both ways (printed, not asserted). The vmapped
# version does each inner step for all tasks in one batched call, so it pulls ahead of the
# loop as the meta-batch grows; with only a handful of tasks (as in `--quick`) the loop can
# be faster, because functx's transforms cost Python overhead per operation.


# %%
def loop_meta_gradient(params, tasks, steps: int, second_order: bool = True):
    leaves = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    total = 0.0
    n = tasks["xs"].shape[0]
    for t in range(n):
        adapted = leaves
        for _ in range(steps):
            loss = mse(adapted, tasks["xs"][t], tasks["ys"][t])
            grads = torch.autograd.grad(loss, list(adapted.values()), create_graph=second_order)
            adapted = {k: adapted[k] - INNER_LR * g for k, g in zip(adapted, grads)}
        total = total + mse(adapted, tasks["xq"][t], tasks["yq"][t])
    return dict(zip(leaves, torch.autograd.grad(total / n, list(leaves.values()))))


def rel_diff(a: dict, b: dict) -> float:
    num = sum((a[k] - b[k]).pow(2).sum() for k in a).sqrt()
    den = sum(b[k].pow(2).sum() for k in b).sqrt()
    return (num / den).item()


def check_meta_gradient(n_tasks: int, steps: int = 3):
    params64 = {k: v.double() for k, v in init_params(seed=0).items()}
    tasks = sample_tasks(n_tasks, torch.Generator().manual_seed(100))
    data = [tasks[k].double() for k in ("xs", "ys", "xq", "yq")]
    tasks64 = dict(zip(("xs", "ys", "xq", "yq"), data))

    ours = functx.grad(make_meta_loss(steps))(params64, *data)
    loop = loop_meta_gradient(params64, tasks64, steps)
    first_order = loop_meta_gradient(params64, tasks64, steps, second_order=False)
    torch.testing.assert_close(ours, loop, rtol=1e-9, atol=1e-11)
    max_diff = max((ours[k] - loop[k]).abs().max().item() for k in ours)
    fo_diff = rel_diff(first_order, loop)
    assert fo_diff > 1e-3, "the first-order approximation should differ visibly from the exact meta-gradient"
    print(f"meta-gradient check ({n_tasks} tasks, {steps} inner steps, float64):")
    print(f"  max |functx - autograd loop|           = {max_diff:.1e}")
    print(f"  relative difference, first-order MAML   = {fo_diff:.1e}  (what dropping the second-order terms changes)")

    # The same in float32, the precision we train in: equal up to float32 rounding.
    params32 = init_params(seed=0)
    tasks32 = {k: tasks[k] for k in ("xs", "ys", "xq", "yq")}
    ours32 = functx.grad(make_meta_loss(steps))(params32, *tasks32.values())
    loop32 = loop_meta_gradient(params32, tasks32, steps)
    torch.testing.assert_close(ours32, loop32, rtol=1e-4, atol=1e-5)
    max_diff32 = max((ours32[k] - loop32[k]).abs().max().item() for k in ours32)
    print(f"  float32: max |functx - autograd loop|  = {max_diff32:.1e}")

    # How long one meta-gradient of a training meta-batch takes, both ways.
    meta_grad = functx.grad(make_meta_loss(INNER_STEPS))
    t_functx = median_time(lambda: meta_grad(params32, *tasks32.values()))
    t_loop = median_time(lambda: loop_meta_gradient(params32, tasks32, INNER_STEPS))
    print(
        f"  time per meta-gradient ({n_tasks} tasks, {INNER_STEPS} inner steps): functx {t_functx * 1e3:.1f} ms, "
        f"autograd loop {t_loop * 1e3:.1f} ms"
    )


# %% [markdown]
# ## Meta-training
#
# The meta-parameters are ordinary leaf tensors owned by `torch.optim.Adam`. Each
# iteration draws a fresh meta-batch of tasks, computes the meta-gradient with functx on
# detached copies of the leaves, writes it into `.grad` and takes an Adam step, exactly as
# if it came from `.backward()`.
#
# Every `eval_every` iterations we also measure, on a fixed set of held-out tasks, the
# query loss *before* adaptation (the initialisation used as-is) and *after*
# `INNER_STEPS` steps. MAML only optimises the second; watching both shows that it does
# not learn "one curve that fits all tasks" (impossible: the tasks disagree), but a
# starting point that is quick to specialise.


# %%
def adapted_loss(params, tasks, steps: int) -> float:
    """Mean query MSE over `tasks` after `steps` inner steps from `params` (no outer graph)."""

    def one(params, xs, ys, xq, yq):
        return mse(adapt(params, xs, ys, steps), xq, yq)

    losses = functx.vmap(one, in_dims=(None, 0, 0, 0, 0))(params, tasks["xs"], tasks["ys"], tasks["xq"], tasks["yq"])
    return losses.mean().item()


def meta_train(iterations: int, meta_batch: int, print_every: int, eval_every: int, val_tasks):
    leaves = {k: v.requires_grad_() for k, v in init_params(seed=0).items()}
    opt = torch.optim.Adam(leaves.values(), lr=META_LR)
    meta_grad_and_loss = functx.grad_and_value(make_meta_loss(INNER_STEPS))
    gen = torch.Generator().manual_seed(1)
    curve = {"iteration": [], "loss": [], "eval_iteration": [], "val_before": [], "val_after": []}

    print(
        f"\nmeta-training: {iterations} iterations, {meta_batch} tasks each, "
        f"{INNER_STEPS} inner steps (lr {INNER_LR}), Adam lr {META_LR}"
    )
    start = time.perf_counter()
    for it in range(iterations + 1):
        if it % eval_every == 0 or it == iterations:
            params = {k: v.detach() for k, v in leaves.items()}
            curve["eval_iteration"].append(it)
            curve["val_before"].append(adapted_loss(params, val_tasks, 0))
            curve["val_after"].append(adapted_loss(params, val_tasks, INNER_STEPS))
        if it == iterations:
            break
        t = sample_tasks(meta_batch, gen)
        grads, loss = meta_grad_and_loss({k: v.detach() for k, v in leaves.items()}, t["xs"], t["ys"], t["xq"], t["yq"])
        for k, v in leaves.items():
            v.grad = grads[k]
        opt.step()
        curve["iteration"].append(it)
        curve["loss"].append(loss.item())
        if (it + 1) % print_every == 0:
            recent = sum(curve["loss"][-print_every:]) / print_every
            elapsed = time.perf_counter() - start
            print(f"  iteration {it + 1:5d}: meta-loss (mean of the last {print_every}) {recent:.3f}   [{elapsed:5.1f} s]")
    elapsed = time.perf_counter() - start
    print(f"  done in {elapsed:.1f} s ({elapsed / iterations * 1e3:.1f} ms per iteration)")
    print(
        f"  held-out query loss: before adaptation {curve['val_before'][0]:.3f} -> {curve['val_before'][-1]:.3f}, "
        f"after {INNER_STEPS} steps {curve['val_after'][0]:.3f} -> {curve['val_after'][-1]:.3f}"
    )
    return {k: v.detach() for k, v in leaves.items()}, curve


# %% [markdown]
# ## MAML initialisation vs a random one on new tasks
#
# The real test: tasks never seen in training, adapted with the same inner SGD
# (lr `INNER_LR`) for 0 to 10 steps, judged on 100 evenly spaced points covering the whole
# interval [-5, 5] (not only the 10 query points). The baseline is a randomly initialised
# network of the same shape adapted in exactly the same way. With a step size of 0.01 a
# random network barely moves in 10 steps, while the MAML initialisation has learned to
# sit where such small steps are enough: its gradients on a new task point straight at
# that task's amplitude and phase.


# %%
def dense_tasks(n: int, seed: int):
    """Held-out tasks with their K_SUPPORT support points and a dense query grid on [-5, 5]."""
    t = sample_tasks(n, torch.Generator().manual_seed(seed))
    grid = torch.linspace(-5, 5, 100).view(1, -1, 1).expand(n, -1, -1)
    t["xq"], t["yq"] = grid, t["amplitude"] * torch.sin(grid + t["phase"])
    return t


def compare_with_random(maml_params, n_tasks: int, step_list=(0, 1, 2, 5, 10)):
    tasks = dense_tasks(n_tasks, seed=3)
    random_params = init_params(seed=123)
    print(f"\npost-adaptation MSE on {n_tasks} held-out tasks (K={K_SUPPORT} support points, inner lr {INNER_LR}):")
    print("  steps   MAML init   random init")
    results = {}
    for steps in step_list:
        results[steps] = (adapted_loss(maml_params, tasks, steps), adapted_loss(random_params, tasks, steps))
        print(f"  {steps:5d}   {results[steps][0]:9.3f}   {results[steps][1]:11.3f}")
    return results


# %% [markdown]
# ## Figures
#
# `maml_training.png`: the meta-loss of every training meta-batch (noisy, since each batch
# is 25 fresh tasks, with a running mean), and the held-out query loss before and after
# adaptation.
#
# `maml_adaptation.png`: three new tasks. Each panel shows the true sine, the 10 support
# points (all the model gets to see of that task), and the meta-learned model's prediction
# before adaptation, after 1 and after 10 inner steps on those points.


# %%
def plot_training(args, curve):
    fig, ax = plt.subplots(figsize=(7, 4.2))
    losses = torch.tensor(curve["loss"])
    window = max(1, min(100, len(losses) // 10))
    smooth = losses.unfold(0, window, 1).mean(1) if len(losses) >= window else losses
    ax.plot(curve["iteration"], losses, color="C0", alpha=0.25, lw=0.7, label="meta-loss per meta-batch")
    ax.plot(curve["iteration"][window - 1 :], smooth, color="C0", lw=1.8, label=f"running mean ({window} iterations)")
    ax.plot(curve["eval_iteration"], curve["val_before"], "s--", color="C3", ms=3, label="held-out, before adaptation")
    after_label = f"held-out, after {INNER_STEPS} inner steps"
    ax.plot(curve["eval_iteration"], curve["val_after"], "o-", color="C2", ms=3, label=after_label)
    ax.set_yscale("log")
    ax.set_xlabel("meta-training iteration")
    ax.set_ylabel("query MSE")
    ax.set_title("MAML meta-training on sine waves")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    save(
        fig,
        args.out,
        "maml_training.png",
        f"the meta-loss and the held-out loss after {INNER_STEPS} inner steps fall steadily, while the "
        "held-out loss before adaptation drops a little and then stays high (no single curve fits "
        "all tasks): MAML learns a starting point that adapts fast, not an average fit."
        + (" (With --quick there are too few iterations to see much.)" if args.quick else ""),
    )


def plot_adaptation(args, maml_params, n_panels: int = 3):
    tasks = dense_tasks(n_panels, seed=7)
    grid = tasks["xq"][0, :, 0]
    # One panel per task, plus a narrow last panel that only holds the legend.
    fig, axes = plt.subplots(1, n_panels + 1, figsize=(4 * n_panels + 1.8, 3.8), width_ratios=[1] * n_panels + [0.4])
    ylim = 1.15 * tasks["amplitude"].max().item() + 0.3
    for i, ax in enumerate(axes[:n_panels]):
        xs, ys = tasks["xs"][i], tasks["ys"][i]
        ax.plot(grid, tasks["yq"][i, :, 0], color="k", lw=2, label="true sine")
        ax.scatter(xs[:, 0], ys[:, 0], color="k", marker="^", s=40, zorder=5, label=f"{K_SUPPORT} support points")
        for steps, style in ((0, ":"), (1, "--"), (10, "-")):
            with torch.no_grad():  # plain forward passes: no graph needed
                pred = mlp(adapt(maml_params, xs, ys, steps), tasks["xq"][i])
            ax.plot(grid, pred[:, 0], style, lw=1.8, label=f"MAML init + {steps} step{'s' if steps != 1 else ''}")
        a, p = tasks["amplitude"][i].item(), tasks["phase"][i].item()
        ax.set_title(f"new task: A = {a:.2f}, phase = {p:.2f}")
        ax.set_xlabel("x")
        ax.set_ylim(-ylim, ylim)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("y")
    axes[-1].axis("off")
    axes[-1].legend(*axes[0].get_legend_handles_labels(), loc="center left", fontsize=9, frameon=False)
    note = " (With --quick the model is barely meta-trained, so expect little of this.)" if args.quick else ""
    save(
        fig,
        args.out,
        "maml_adaptation.png",
        "before adaptation (dotted) the model predicts the same weak curve for every task; after "
        "ONE gradient step on the 10 support points (dashed) it already has the new task's "
        "amplitude and phase roughly right, and after 10 steps (solid) it follows the true sine "
        "over most of the interval, also between and beyond the support points." + note,
    )


# %% [markdown]
# ## Putting it together
#
# Default mode trains for a few thousand iterations (~30 s); `--quick` runs a few dozen
# iterations on a tiny meta-batch, enough to exercise every code path. For a better
# model, train longer (Finn et al. use 70,000 iterations) or raise `INNER_STEPS`.


# %%
def main():
    args = parse_args(NAME, __doc__)
    torch.set_num_threads(1)
    quick = args.quick
    iterations, meta_batch = (40, 5) if quick else (4000, 25)
    print_every, eval_every = (10, 10) if quick else (500, 100)

    check_meta_gradient(n_tasks=meta_batch)
    val_tasks = sample_tasks(50 if quick else 200, torch.Generator().manual_seed(2))
    maml_params, curve = meta_train(iterations, meta_batch, print_every, eval_every, val_tasks)
    results = compare_with_random(maml_params, n_tasks=50 if quick else 500)
    if not quick:  # enough meta-training for adaptation to work clearly
        maml_10, random_10 = results[10]
        assert maml_10 < 0.5 * results[0][0], results  # adapting helps a lot ...
        assert maml_10 < 0.25 * random_10, results  # ... and far more than from a random start
    plot_training(args, curve)
    plot_adaptation(args, maml_params)


if __name__ == "__main__":
    main()
