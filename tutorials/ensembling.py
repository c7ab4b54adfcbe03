"""Model ensembling: train 10 small networks as ONE vmapped model.

An ensemble of N models with the same architecture is usually run as a Python loop: N
forwards, N backwards, N small kernels per layer. Because the models differ only in their
weights, we can instead stack the weights along a new leading "model" dimension and run
all N models in a single call with `functx.vmap`. In this tutorial you learn to

- stack the state of 10 `nn.Module`s with `functx.stack_module_state` and run them with
  `functx.functional_call` under `functx.vmap` (on a weightless "meta" copy of the model);
- feed every model the same minibatch (`in_dims=(0, 0, None)`) or each model its own
  minibatch (`in_dims=(0, 0, 0)`), checked against a Python loop over the models;
- train all 10 together with ONE optimizer over the stacked parameters (checked against
  10 separately trained models), and time one training step against the loop;
- read per-model and ensemble-average test accuracy on a noisy 3-class spiral problem;
- do all of the above in a few lines with `functx.nn.Ensemble` (and `Ensemble.from_factory`,
  which initialises the 10 members independently with one vmapped call).

Run it:

    python tutorials/ensembling.py            # ~10-20 s on a 2-core CPU
    python tutorials/ensembling.py --quick    # a few seconds (CI)

Figures go to `tutorials/out/ensembling/` (or `--out DIR`).
"""

# %% [markdown]
# ## Setup
#
# The task: three interleaved noisy spiral arms in 2-D (a classic toy problem where a
# small MLP has to learn a curved decision boundary). We use a deliberately small, noisy
# training set (40 points per arm), so that individual models overfit in different ways
# and averaging their predictions helps. Everything here is plain torch plus `functx`.
#
# To make the members diverse we use *bagging*: model `i` trains on its own bootstrap
# resample of the training set (drawn with replacement), on top of its own random
# initialisation. That means every model needs its own minibatches, which is exactly the
# `in_dims=(0, 0, 0)` case below.

# %%
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import functx

try:  # run as a script (python tutorials/ensembling.py) ...
    from _common import median_time, parse_args, plt, save
except ImportError:  # ... or imported as tutorials.ensembling
    from tutorials._common import median_time, parse_args, plt, save

NAME = "ensembling"
N_MODELS = 10
N_CLASSES = 3


def make_spirals(n_per_class: int, noise: float, generator: torch.Generator):
    """`n_per_class` points on each of 3 spiral arms, plus Gaussian noise: (X [n, 2], y [n])."""
    t = torch.rand(N_CLASSES, n_per_class, generator=generator)  # position along the arm, 0..1
    arm = torch.arange(N_CLASSES).unsqueeze(1)
    angle = 3.5 * t + arm * (2 * torch.pi / N_CLASSES)
    radius = 0.1 + t
    x = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=-1)
    x = x + noise * torch.randn(x.shape, generator=generator)
    return x.reshape(-1, 2), arm.expand(-1, n_per_class).reshape(-1)


def make_model() -> nn.Module:
    """The architecture every member shares: an MLP 2 -> 64 -> 64 -> 3."""
    return nn.Sequential(
        nn.Linear(2, 64), nn.ReLU(),
        nn.Linear(64, 64), nn.ReLU(),
        nn.Linear(64, N_CLASSES),
    )


def train(per_model_losses, parameters, sample_batch, steps: int, lr: float) -> torch.Tensor:
    """Train with Adam on `sum(per_model_losses(*sample_batch()))`; returns losses [steps, N]."""
    opt = torch.optim.Adam(parameters, lr=lr)
    history = []
    for _ in range(steps):
        losses = per_model_losses(*sample_batch())  # [N_MODELS], one loss per model
        opt.zero_grad()
        losses.sum().backward()  # the models are independent: d(sum)/d(model i) = d(loss i)/d(model i)
        opt.step()
        history.append(losses.detach())
    return torch.stack(history)


def main():
    args = parse_args(NAME, __doc__)
    # These tensors are tiny: one thread avoids thread-pool overhead and keeps timings
    # stable on a busy machine. Try more threads for bigger models.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    quick = args.quick
    steps = 60 if quick else 500
    batch_size = 64
    lr = 3e-3
    timing_repeats = 3 if quick else 20

    gen = torch.Generator().manual_seed(0)
    x_train, y_train = make_spirals(n_per_class=40, noise=0.1, generator=gen)
    x_test, y_test = make_spirals(n_per_class=1000, noise=0.1, generator=gen)
    n_train = len(x_train)
    bootstrap = torch.randint(0, n_train, (N_MODELS, n_train), generator=gen)  # row i: model i's data
    distinct = [row.unique().numel() for row in bootstrap]
    print(f"data: {n_train} training points, {len(x_test)} test points, {N_CLASSES} classes; "
          f"each model's bootstrap set holds {min(distinct)}-{max(distinct)} distinct training points")

    def sample_batches(size: int = batch_size, generator: torch.Generator = gen):
        """One minibatch per model, from that model's bootstrap set:
        xb [N_MODELS, size, 2], yb [N_MODELS, size]."""
        pick = torch.randint(0, n_train, (N_MODELS, size), generator=generator)
        idx = bootstrap.gather(1, pick)
        return x_train[idx], y_train[idx]

    # %% [markdown]
    # ## 1. Stack 10 models into one set of tensors
    #
    # `stack_module_state(models)` returns two dicts, `params` and `buffers`, keyed by the
    # usual parameter names (`"0.weight"`, ...), where every tensor has a new leading
    # dimension of size 10: entry `i` is model `i`'s tensor. The stacked tensors are
    # copies, so training them does not touch `models`.
    #
    # To *call* the architecture with these stacked weights we need one module to pass to
    # `functional_call`. Any of the models would do, but we move a copy to the `meta`
    # device: it keeps the structure and shapes but holds no data, which makes it obvious
    # that its own weights are never used; only the tensors we pass in are.

    # %%
    models = [make_model() for _ in range(N_MODELS)]  # 10 independent initialisations
    params, buffers = functx.stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")
    print("stacked parameter shapes:", {name: tuple(p.shape) for name, p in params.items()})

    def fmodel(params, buffers, x):
        """ONE model: its (unstacked) params/buffers and a batch x [B, 2] -> logits [B, 3]."""
        return functx.functional_call(base, (params, buffers), (x,))

    # %% [markdown]
    # ### (a) The same minibatch for every model
    #
    # `in_dims=(0, 0, None)`: map over dim 0 of the params and buffers (the model
    # dimension), and give every model the full, shared `x`. The result has shape
    # `[10, B, 3]`: row `i` is what model `i` predicts.

    # %%
    x_shared = x_train[:batch_size]
    same_batch = functx.vmap(fmodel, in_dims=(0, 0, None))(params, buffers, x_shared)
    loop_same = torch.stack([m(x_shared) for m in models])
    torch.testing.assert_close(same_batch, loop_same, rtol=1e-5, atol=1e-6)
    print(f"(a) same minibatch:      vmap output {tuple(same_batch.shape)}, "
          f"max |vmap - loop| = {(same_batch - loop_same).abs().max():.1e}")

    # %% [markdown]
    # ### (b) A different minibatch per model
    #
    # `in_dims=(0, 0, 0)`: now `x` also has a leading model dimension, `[10, B, 2]`, and
    # model `i` sees `x[i]`. This is what we will train with: each model draws its
    # minibatches from its own bootstrap set.

    # %%
    xb, yb = sample_batches()
    per_model_batch = functx.vmap(fmodel, in_dims=(0, 0, 0))(params, buffers, xb)
    loop_per_model = torch.stack([m(xb[i]) for i, m in enumerate(models)])
    torch.testing.assert_close(per_model_batch, loop_per_model, rtol=1e-5, atol=1e-6)
    print(f"(b) per-model minibatch: vmap output {tuple(per_model_batch.shape)}, "
          f"max |vmap - loop| = {(per_model_batch - loop_per_model).abs().max():.1e}")

    # %% [markdown]
    # ## 2. One loss per model, one backward for all
    #
    # We write the loss for ONE model and vmap it, so it returns a vector of 10 losses.
    # To train, make the stacked tensors leaves that require grad and hand them to a
    # single optimizer. Since the models do not interact, the gradient of the *sum* of the
    # losses with respect to slice `i` of a stacked tensor is exactly the gradient of model
    # `i`'s own loss. Adam works element by element, so one Adam over the stacked tensors
    # is the same as 10 Adams, one per model.
    #
    # Check: the stacked gradients equal those of the 10 models trained in a loop.
    #
    # The purely functional alternative is `functx.vmap(functx.grad(model_loss))`: it
    # returns the per-model gradients as a dict shaped like `params` (no `.grad`, no
    # `backward`), handy if you write the update yourself. We check it gives the same.

    # %%
    for p in params.values():
        p.requires_grad_()

    def model_loss(params, buffers, x, y):
        return F.cross_entropy(fmodel(params, buffers, x), y)

    per_model_losses_vmap = functx.vmap(model_loss, in_dims=(0, 0, 0, 0))

    def per_model_losses(x, y):
        return per_model_losses_vmap(params, buffers, x, y)

    losses = per_model_losses(xb, yb)
    losses.sum().backward()
    for i, m in enumerate(models):
        F.cross_entropy(m(xb[i]), yb[i]).backward()
    for name, p in params.items():
        loop_grad = torch.stack([dict(m.named_parameters())[name].grad for m in models])
        torch.testing.assert_close(p.grad, loop_grad, rtol=1e-5, atol=1e-6)
    print(f"initial per-model losses: {[round(v, 3) for v in losses.tolist()]}")
    print("stacked gradients == per-model gradients of a loop: OK")
    functional_grads = functx.vmap(functx.grad(model_loss), in_dims=(0, 0, 0, 0))(params, buffers, xb, yb)
    for name, p in params.items():
        torch.testing.assert_close(functional_grads[name], p.grad, rtol=1e-5, atol=1e-6)
    print("vmap(grad(model_loss)) == the same gradients: OK")
    for p in (*params.values(), *(q for m in models for q in m.parameters())):
        p.grad = None

    # %% [markdown]
    # ## 3. Speed: one training step, vmapped ensemble vs a loop over the models
    #
    # We build two copies from the same starting point: the stacked ensemble with one
    # Adam, and 10 separate models trained in a Python loop (one Adam over all their
    # parameters). First we run a few identical steps with identical minibatches and check
    # that both end with the same weights, then we time one step of each.
    #
    # The vmapped step launches one (bigger) kernel per layer instead of 10 small ones,
    # and Adam updates 6 stacked tensors instead of 60 small ones; with models this tiny
    # the loop is dominated by per-call overhead, which is what stacking removes. How much
    # you gain depends on model size, batch size and hardware: on a CPU the gain shrinks
    # as the per-model work grows (at large batches both versions do the same arithmetic,
    # and one batched matmul is not always faster than 10 plain ones), while on a GPU a
    # loop of small models wastes even more (one kernel launch per op per model).

    # %%
    bench_params = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    bench_models = copy.deepcopy(models)
    bench_vmap_loss = functx.vmap(model_loss, in_dims=(0, 0, 0, 0))
    opt_vmap = torch.optim.Adam(list(bench_params.values()), lr=lr)
    opt_loop = torch.optim.Adam([p for m in bench_models for p in m.parameters()], lr=lr)

    def step_vmap(x, y):
        opt_vmap.zero_grad()
        bench_vmap_loss(bench_params, buffers, x, y).sum().backward()
        opt_vmap.step()

    def step_loop(x, y):
        opt_loop.zero_grad()
        sum(F.cross_entropy(m(x[i]), y[i]) for i, m in enumerate(bench_models)).backward()
        opt_loop.step()

    bench_gen = torch.Generator().manual_seed(1)  # keeps the training data stream below unchanged
    for _ in range(5):
        batch = sample_batches(generator=bench_gen)
        step_vmap(*batch)
        step_loop(*batch)
    for name, p in bench_params.items():
        looped = torch.stack([dict(m.named_parameters())[name] for m in bench_models])
        torch.testing.assert_close(p.detach(), looped.detach(), rtol=1e-4, atol=1e-5)
    print("5 Adam steps: vmapped ensemble weights == 10 looped models' weights: OK")

    print(f"one training step of {N_MODELS} models (forward, backward, Adam), median of {timing_repeats}:")
    for size in [batch_size] if quick else [16, batch_size, 256, 1024]:
        batch = sample_batches(size, bench_gen)
        t_vmap = median_time(lambda b=batch: step_vmap(*b), repeats=timing_repeats, warmup=2)
        t_loop = median_time(lambda b=batch: step_loop(*b), repeats=timing_repeats, warmup=2)
        print(f"  batch {size:4d} per model: vmapped ensemble {t_vmap * 1e3:6.2f} ms, "
              f"loop over models {t_loop * 1e3:6.2f} ms -> speedup {t_loop / t_vmap:.2f}x")

    # %% [markdown]
    # ## 4. Train all 10 models together
    #
    # The training loop is an ordinary PyTorch loop; the only unusual thing is that the
    # loss is a vector with one entry per model, which we keep to draw 10 loss curves.

    # %%
    history = train(per_model_losses, list(params.values()), sample_batches, steps, lr)
    print(f"trained {steps} steps; final losses (mean of last 20 steps) per model: "
          f"{[round(v, 3) for v in history[-20:].mean(0).tolist()]}")

    fig, ax = plt.subplots(figsize=(7, 4.2))
    window = 1 if quick else 15
    kernel = torch.ones(window) / window
    for i in range(N_MODELS):
        smooth = F.conv1d(history[:, i].view(1, 1, -1), kernel.view(1, 1, -1)).flatten()
        ax.plot(torch.arange(len(smooth)) + window - 1, smooth, lw=1.2, label=f"model {i}")
    ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel(f"cross-entropy (moving average over {window} steps)")
    ax.set_title(f"{N_MODELS} MLPs trained as one vmapped ensemble")
    ax.legend(ncol=2, fontsize=8)
    save(fig, args.out, "ensemble_training.png",
         "10 loss curves falling together from about 1 (ln 3 = 1.1 is chance for 3 classes) "
         "by more than an order of magnitude; they spread apart because each model has its own "
         "initialisation and its own bootstrap data")

    # %% [markdown]
    # ## 5. Per-model and ensemble accuracy
    #
    # All 10 models predict the whole test set in one call (`in_dims=(0, 0, None)`: same
    # input for every model). The ensemble's prediction averages the 10 models' class
    # probabilities; it usually beats the typical member, because the members' mistakes
    # are partly independent.

    # %%
    with torch.no_grad():
        test_logits = functx.vmap(fmodel, in_dims=(0, 0, None))(params, buffers, x_test)  # [10, N, 3]
    member_acc = (test_logits.argmax(-1) == y_test).float().mean(1)
    ensemble_probs = test_logits.softmax(-1).mean(0)
    ensemble_acc = (ensemble_probs.argmax(-1) == y_test).float().mean().item()
    print("\n model | test accuracy")
    print("-------+--------------")
    for i, acc in enumerate(member_acc.tolist()):
        print(f"   {i:2d}  |    {acc:6.2%}")
    print("-------+--------------")
    print(f"  mean |    {member_acc.mean().item():6.2%}")
    print(f"  ens. |    {ensemble_acc:6.2%}   (average of the 10 models' probabilities)\n")
    if not quick:
        assert member_acc.min() > 0.6, "every model should learn the spirals well above chance (33%)"
        assert ensemble_acc >= member_acc.mean().item() - 0.01, "averaging should not be worse than a typical member"

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [str(i) for i in range(N_MODELS)] + ["ensemble\naverage"]
    values = member_acc.tolist() + [ensemble_acc]
    colors = ["tab:blue"] * N_MODELS + ["tab:orange"]
    bars = ax.bar(labels, values, color=colors)
    ax.bar_label(bars, labels=[f"{v:.1%}" for v in values], fontsize=8)
    ax.axhline(member_acc.mean().item(), color="k", ls="--", lw=1, label="mean of the members")
    lo = min(values)
    ax.set_ylim(max(0.0, lo - 0.05), min(1.0, max(values) + 0.03))
    ax.set_xlabel("model")
    ax.set_ylabel("test accuracy")
    ax.set_title("Per-model test accuracy and the ensemble-average prediction")
    ax.legend(loc="lower right")
    save(fig, args.out, "ensemble_accuracy.png",
         "blue bars (single models) vary by a few points; the orange bar (averaged "
         "probabilities) sits at or above the dashed mean of the members")

    # %% [markdown]
    # ## 6. The short recipe: `functx.nn.Ensemble`
    #
    # `functx.nn.Ensemble` packages sections 1-4 as an ordinary `nn.Module`: it holds the
    # stacked tensors as its own parameters (so `ensemble.parameters()` goes straight to an
    # optimizer, and `state_dict`, `.to()`, `.train()` work) and its `forward` runs the
    # vmapped `functional_call`. `in_dims=0` means member `i` gets slice `i` of the input;
    # `in_dims=None` (the default) gives every member the same input.
    #
    # `Ensemble(models)` stacks existing models (copying them). `Ensemble.from_factory(
    # make_model, n)` instead builds the architecture once and initialises `n` members
    # independently in ONE vmapped call (`functx.vmap_init`, with
    # `randomness="different"`), using the layers' own `reset_parameters()`: same
    # distribution as `n` calls of `make_model()`, without building `n` modules.

    # %%
    wrapped = functx.nn.Ensemble(models, in_dims=0)  # the untrained models from section 1
    torch.testing.assert_close(wrapped(xb), loop_per_model, rtol=1e-5, atol=1e-6)
    print("Ensemble(models)(x) == loop over the models: OK")

    torch.manual_seed(1)  # a fresh draw: these members differ from section 1's models
    ensemble = functx.nn.Ensemble.from_factory(make_model, N_MODELS, in_dims=0)
    w = ensemble.stacked[0].weight  # [10, 64, 2]: the first layer's weight of every member
    assert not torch.equal(w[0], w[1]), "members must be initialised independently"
    assert w.abs().max() <= 1 / 2**0.5, "kaiming-uniform bound of nn.Linear(2, 64) is 1/sqrt(2)"
    print(f"Ensemble.from_factory: {len(ensemble)} members, parameters "
          f"{[(name, tuple(p.shape)) for name, p in ensemble.named_parameters()][:2]} ...")
    print(f"  first-layer weights {tuple(w.shape)}, std {w.std():.3f} "
          f"(a fresh nn.Linear(2, 64): {nn.Linear(2, 64).weight.std():.3f})")

    # The whole training loop, with per-model minibatches and per-model losses:
    per_model_ce = functx.vmap(F.cross_entropy)  # logits [10, B, 3], labels [10, B] -> losses [10]
    history2 = train(lambda x, y: per_model_ce(ensemble(x), y), ensemble.parameters(), sample_batches, steps, lr)
    assert history2[-20:].mean() < 0.7 * history2[:20].mean(), "the Ensemble should train"

    with torch.no_grad():
        ensemble.in_dims = None  # evaluate: every member sees the same test set
        logits2 = ensemble(x_test)
        torch.testing.assert_close(logits2[3], ensemble.member(3)(x_test), rtol=1e-5, atol=1e-5)
    acc2 = (logits2.argmax(-1) == y_test).float().mean(1)
    ens_acc2 = (logits2.softmax(-1).mean(0).argmax(-1) == y_test).float().mean().item()
    print(f"Ensemble.from_factory after {steps} steps: final loss {history2[-20:].mean():.3f}, "
          f"member accuracy {acc2.min():.1%}..{acc2.max():.1%} (mean {acc2.mean():.1%}), "
          f"ensemble average {ens_acc2:.1%}")

    # %% [markdown]
    # ## Bonus: where do the members disagree?
    #
    # Evaluating all 10 models on a grid is again one vmapped call. The left panel shows a
    # single member's decision regions, the right one the ensemble average, shaded by how
    # much the members disagree (standard deviation of their class probabilities): the
    # disagreement concentrates between the arms and away from the data, exactly where a
    # single model's answer is least trustworthy.

    # %%
    n_grid = 120 if not quick else 50
    lin = torch.linspace(-1.4, 1.4, n_grid)
    gx, gy = torch.meshgrid(lin, lin, indexing="xy")
    grid = torch.stack([gx.flatten(), gy.flatten()], dim=-1)
    with torch.no_grad():
        grid_probs = functx.vmap(fmodel, in_dims=(0, 0, None))(params, buffers, grid).softmax(-1)  # [10, G, 3]
    mean_probs = grid_probs.mean(0)
    disagreement = grid_probs.std(0).sum(-1)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.6))
    extent = (-1.4, 1.4, -1.4, 1.4)
    cmap = plt.get_cmap("tab10")
    panels = ((axes[0], grid_probs[0], f"model 0 alone (test accuracy {member_acc[0]:.1%})\n"),
              (axes[1], mean_probs, f"ensemble average (test accuracy {ensemble_acc:.1%})\npaler = the members disagree more"))
    for ax, probs, title in panels:
        colors = cmap(probs.argmax(-1).numpy())[:, :3]
        if probs is mean_probs:
            shade = (1 - disagreement / disagreement.max()).clamp(0.15, 1).numpy()[:, None]
            colors = 1 - shade * (1 - colors) * 0.6  # pale where the members disagree
        else:
            colors = 1 - (1 - colors) * 0.6
        ax.imshow(colors.reshape(n_grid, n_grid, 3), origin="lower", extent=extent)
        for c in range(N_CLASSES):
            sel = y_train == c
            ax.scatter(x_train[sel, 0], x_train[sel, 1], s=8, color=cmap(c), edgecolor="k", lw=0.3, label=f"class {c}")
        ax.set_xlabel("$x_1$")
        ax.set_ylabel("$x_2$")
        ax.set_title(title)
    axes[0].legend(loc="lower left", fontsize=8)
    save(fig, args.out, "ensemble_regions.png",
         "three spiral-shaped decision regions; on the right they fade to white between the "
         "arms and at the edges, where the 10 members disagree")


if __name__ == "__main__":
    main()
