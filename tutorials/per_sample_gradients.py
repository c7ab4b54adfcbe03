"""Per-sample gradients of a CNN, and DP-SGD built on them.

An ordinary backward pass gives the gradient of the *mean* loss of a batch: the per-example
contributions are summed away. Some methods need each example's gradient on its own:
differentially private SGD (clip every example's gradient before averaging), gradient-noise
and influence diagnostics, importance sampling by gradient norm, ...

What you learn:

1. the functx recipe for per-sample gradients of any `nn.Module`: module parameters as a
   dict, `functx.functional_call` to run the module with them, a loss written for ONE example,
   and `functx.vmap(functx.grad(loss), in_dims=(None, None, 0, 0))` to get all the examples'
   gradients in one vectorized call;
2. how it compares with a Python loop of `torch.autograd.grad` (same numbers, much faster)
   and with `torch.func` (same API, same numbers);
3. DP-SGD: clip each per-sample gradient to norm C, sum, add Gaussian noise N(0, sigma^2 C^2),
   divide by the batch size and take an ordinary `torch.optim.SGD` step; trained side by side
   with plain SGD from the same initialization on the same batches;
4. `functx.dp.clipped_grad`: the same DP-SGD gradient without materialising the per-sample
   gradients (per-layer kernels), checked against the recipe and timed.

The data is synthetic and MNIST-shaped (1x28x28 images, 10 classes): every class has a fixed
random smooth template, and an image is its class template plus noise, so a small CNN can
learn it in a few hundred steps on a CPU.

Run:  python tutorials/per_sample_gradients.py            (~30 s on 2 CPU cores)
      python tutorials/per_sample_gradients.py --quick    (a few seconds, for CI)
Figures go to tutorials/out/per_sample_gradients/ (or --out DIR).
"""

# %% [markdown]
# ## Setup
#
# Everything runs on the CPU. `_common` holds the shared plumbing of the tutorials: the
# command line (`--quick`, `--out`), `median_time` and `save` for figures.

# %%
from __future__ import annotations

import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import functx
from _common import median_time, parse_args, plt, save

NAME = "per_sample_gradients"

# %% [markdown]
# ## A learnable synthetic MNIST
#
# Each of the 10 classes gets a fixed template: random noise blurred with an average pool,
# so it has blob-like structure a convolution can pick up. An example is its class
# template plus fresh pixel noise. With `noise` of about the templates' scale the task is
# not trivial for a freshly initialized network, but the loss falls steadily.


# %%
def make_templates(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randn(10, 1, 28, 28, generator=g)
    smooth = F.avg_pool2d(raw, kernel_size=5, stride=1, padding=2)  # blobs of ~5 pixels
    return smooth / smooth.std()  # unit scale


def make_data(templates: torch.Tensor, n: int, noise: float, generator: torch.Generator):
    """n images [n, 1, 28, 28] and labels [n] in 0..9."""
    labels = torch.randint(0, 10, (n,), generator=generator)
    images = templates[labels] + noise * torch.randn(n, 1, 28, 28, generator=generator)
    return images / (1 + noise**2) ** 0.5, labels  # unit variance pixels, like normalized MNIST


# %% [markdown]
# ## The model
#
# A small CNN: conv 1->8 (3x3), ReLU, 2x2 max-pool, conv 8->16 (3x3), ReLU, 2x2 max-pool,
# linear 16*5*5 -> 10. Nothing in it knows about per-sample gradients: the recipe below
# works for any module.


# %%
class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3)  # 28 -> 26, pool -> 13
        self.conv2 = nn.Conv2d(8, 16, 3)  # 13 -> 11, pool -> 5
        self.fc = nn.Linear(16 * 5 * 5, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


# %% [markdown]
# ## The recipe
#
# 1. Take the module's parameters (and buffers) out as plain tensors:
#    `params = {k: v.detach() for k, v in model.named_parameters()}`. `detach()` shares
#    storage with the module, so an optimizer step on the module is visible in `params`.
# 2. Write the loss of ONE example as a function of `(params, buffers, x, y)`. The model
#    expects a batch dimension, so the example is unsqueezed to a batch of 1 inside, and
#    `functx.functional_call` runs the module with the given tensors in place of its own.
# 3. `functx.grad(loss_of_one_sample)` differentiates with respect to the first argument
#    (the params dict, so the gradient is a dict of the same shapes), and `functx.vmap` maps
#    it over the batch: `in_dims=(None, None, 0, 0)` says params and buffers are shared,
#    `x` and `y` are split along dimension 0. The result is a dict whose every tensor has
#    a leading batch dimension: `grads["fc.weight"]` is `[N, 10, 400]`.


# %%
def make_loss_of_one_sample(model: nn.Module):
    def loss_of_one_sample(params, buffers, x, y):
        batch_x, batch_y = x.unsqueeze(0), y.unsqueeze(0)  # [1, 1, 28, 28], [1]
        logits = functx.functional_call(model, (params, buffers), (batch_x,))
        return F.cross_entropy(logits, batch_y)

    return loss_of_one_sample


def functx_per_sample_grads(model, images, labels):
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}
    loss = make_loss_of_one_sample(model)
    return functx.vmap(functx.grad(loss), in_dims=(None, None, 0, 0))(params, buffers, images, labels)


# %% [markdown]
# Two references for the same quantity: (a) the obvious loop, one forward and one
# `torch.autograd.grad` per example, and (b) torch.func's identical recipe (functx mirrors
# its API, so only the module name changes).
#
# What to look at in the printout: the max differences are float32 rounding (~1e-7 against
# entries of order 1), and the assertions fail loudly otherwise. The timings are medians on
# a shared CPU, so read them as rough: at batch 64 the single vectorized call beats the
# Python loop by about 2x; at the tiny batch of `--quick` the loop's per-call overhead is
# small and it can win.


# %%
def loop_per_sample_grads(model, images, labels):
    names = [k for k, _ in model.named_parameters()]
    per_example = []
    for i in range(images.shape[0]):
        loss = F.cross_entropy(model(images[i : i + 1]), labels[i : i + 1])
        per_example.append(torch.autograd.grad(loss, list(model.parameters())))
    return {k: torch.stack([g[j] for g in per_example]) for j, k in enumerate(names)}


def torch_func_per_sample_grads(model, images, labels):
    import torch.func  # only as a comparison

    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}

    def loss_of_one_sample(params, buffers, x, y):
        logits = torch.func.functional_call(model, (params, buffers), (x.unsqueeze(0),))
        return F.cross_entropy(logits, y.unsqueeze(0))

    return torch.func.vmap(torch.func.grad(loss_of_one_sample), in_dims=(None, None, 0, 0))(
        params, buffers, images, labels
    )


def max_abs_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def check_and_time(model, images, labels):
    ours = functx_per_sample_grads(model, images, labels)
    loop = loop_per_sample_grads(model, images, labels)
    tfunc = torch_func_per_sample_grads(model, images, labels)
    n = images.shape[0]
    print(f"\nper-sample gradients of a batch of {n} images:")
    for k, v in ours.items():
        print(f"  {k:12s} {tuple(v.shape)}")

    # Same numbers, up to float32 rounding (the vectorized convolutions sum in another order).
    torch.testing.assert_close(ours, loop, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours, tfunc, rtol=1e-4, atol=1e-5)
    # Averaging the per-sample gradients gives back the ordinary batch gradient.
    batch_grads = torch.autograd.grad(F.cross_entropy(model(images), labels), list(model.parameters()))
    mean_of_ours = {k: v.mean(0) for k, v in ours.items()}
    torch.testing.assert_close(mean_of_ours, dict(zip(ours, batch_grads)), rtol=1e-4, atol=1e-6)
    scale = max(v.abs().max().item() for v in loop.values())
    print(f"  max |functx - loop|       = {max_abs_diff(ours, loop):.2e}   (largest entry {scale:.2e})")
    print(f"  max |functx - torch.func| = {max_abs_diff(ours, tfunc):.2e}")

    repeats = 3 if n <= 16 else 11  # medians of several runs: the machine may be busy
    t_loop = median_time(lambda: loop_per_sample_grads(model, images, labels), repeats=repeats)
    t_ours = median_time(lambda: functx_per_sample_grads(model, images, labels), repeats=repeats)
    t_tfunc = median_time(lambda: torch_func_per_sample_grads(model, images, labels), repeats=repeats)
    print(f"  time, loop of autograd.grad : {t_loop * 1e3:7.1f} ms")
    print(f"  time, functx vmap(grad)     : {t_ours * 1e3:7.1f} ms   (speed-up over the loop: {t_loop / t_ours:.1f}x)")
    print(f"  time, torch.func vmap(grad) : {t_tfunc * 1e3:7.1f} ms   (functx time / torch.func time = {t_ours / t_tfunc:.2f})")


# %% [markdown]
# ## DP-SGD
#
# Differentially private SGD (Abadi et al., 2016) bounds how much any single example can
# move the model:
#
# 1. per-sample gradients g_i (the recipe above);
# 2. clip each to total norm C: flatten all of example i's parameter gradients, take the
#    norm n_i, scale g_i by min(1, C / n_i);
# 3. sum the clipped gradients and add Gaussian noise N(0, sigma^2 C^2) to every coordinate
#    (sigma is the "noise multiplier");
# 4. divide by the batch size and take an ordinary optimizer step. Here we write the result
#    into each parameter's `.grad` and call `torch.optim.SGD.step()`, so any torch optimizer
#    could be swapped in.
#
# This tutorial stops at the mechanism: turning (sigma, batch size, number of steps) into an
# (epsilon, delta) privacy guarantee needs a privacy accountant (e.g. the RDP accountant in
# Opacus) and proper Poisson sampling of the batches, which we leave out.


# %%
def clip_and_noise(grads: dict, clip: float, sigma: float, generator: torch.Generator):
    """The DP-SGD gradient (a dict like the model's parameters) and the norms before clipping."""
    n = next(iter(grads.values())).shape[0]
    flat = torch.cat([g.reshape(n, -1) for g in grads.values()], dim=1)  # [N, num_params]
    norms = flat.norm(dim=1)  # [N], each example's total gradient norm
    factors = (clip / (norms + 1e-12)).clamp(max=1.0)  # min(1, C / norm)
    out = {}
    for k, g in grads.items():
        clipped_sum = (g * factors.view(-1, *[1] * (g.dim() - 1))).sum(0)
        if sigma > 0:
            clipped_sum = clipped_sum + torch.randn(clipped_sum.shape, generator=generator) * (sigma * clip)
        out[k] = clipped_sum / n
    return out, norms


def per_sample_loss(logits, labels):
    return F.cross_entropy(logits, labels, reduction="none")  # one loss per example


def dp_sgd_step(model, opt, images, labels, clip, sigma, noise_gen):
    # functx.dp computes the same clipped, noised sum without the per-sample gradients
    # (see "DP-SGD without per-sample gradients" below); the recipe above is its reference
    summed, norms = functx.dp.clipped_grad(
        model, per_sample_loss, images, labels, max_norm=clip, noise_multiplier=sigma, generator=noise_gen
    )
    for name, p in model.named_parameters():
        p.grad = summed[name] / images.shape[0]
    opt.step()
    return norms


def sgd_step(model, opt, images, labels):
    opt.zero_grad()
    F.cross_entropy(model(images), labels).backward()
    opt.step()


@torch.no_grad()
def evaluate(model, images, labels):
    logits = model(images)
    loss = F.cross_entropy(logits, labels).item()
    acc = (logits.argmax(1) == labels).float().mean().item()
    return loss, acc


# %% [markdown]
# A sanity check of the DP-SGD code path: with no noise (sigma = 0) and a clip norm no
# example reaches (C = infinity), the DP-SGD gradient is exactly the ordinary mean
# gradient. Every clipped per-sample gradient must also have norm <= C.


# %%
def check_dp_gradient(model, images, labels, clip):
    grads = functx_per_sample_grads(model, images, labels)
    g = torch.Generator().manual_seed(0)
    unclipped, _ = clip_and_noise(grads, float("inf"), 0.0, g)
    batch_grads = torch.autograd.grad(F.cross_entropy(model(images), labels), list(model.parameters()))
    torch.testing.assert_close(unclipped, dict(zip(unclipped, batch_grads)), rtol=1e-4, atol=1e-6)
    # Clipping alone: every example's contribution has norm <= C, so the mean has norm <= C.
    clipped, norms = clip_and_noise(grads, clip, 0.0, g)
    mean_norm = torch.cat([v.flatten() for v in clipped.values()]).norm().item()
    assert mean_norm <= clip * (1 + 1e-5), (mean_norm, clip)
    print(
        f"\nDP gradient checks passed: sigma=0, C=inf gives the batch gradient; "
        f"clipped mean has norm {mean_norm:.3f} <= C={clip}"
    )


# %% [markdown]
# ## DP-SGD without per-sample gradients
#
# DP-SGD needs only two things from the per-sample gradients: each example's norm and the
# clipped sum. Both follow from what each layer saw, its input a_i and the gradient g_i of
# the loss at its output: a linear layer's per-sample weight gradient is the outer product
# g_i a_i^T, whose norm is |g_i| |a_i|, and the clipped sum is one matrix product
# (c * G)^T A. `functx.dp.clipped_grad(model, per_sample_loss, x, y, max_norm=C,
# noise_multiplier=sigma)` does this per layer (Linear, Embedding, LayerNorm, GroupNorm, and
# convolutions with few output positions; other layers materialise their own per-sample
# gradients) after one forward and one backward to the layers' outputs. Below: the same
# numbers as the recipe (sigma = 0), and the time of each route. The training loop above
# uses it. On this small CNN most of the work is the convolutions' own per-sample gradients
# (many output positions, small weights: cheaper to materialise), so the gain is small; on
# models of linear and embedding layers it is 20-150x (`benchmarks/dp_sgd.py`).


# %%
def compare_dp_routes(model, images, labels, clip):
    grads = functx_per_sample_grads(model, images, labels)
    reference, reference_norms = clip_and_noise(grads, clip, 0.0, torch.Generator())
    summed, norms = functx.dp.clipped_grad(model, per_sample_loss, images, labels, max_norm=clip)
    n = images.shape[0]
    torch.testing.assert_close(norms, reference_norms, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close({k: v / n for k, v in summed.items()}, reference, rtol=1e-4, atol=1e-6)
    repeats = 3 if n <= 16 else 11

    def recipe():
        return clip_and_noise(functx_per_sample_grads(model, images, labels), clip, 0.0, torch.Generator())

    t_recipe = median_time(recipe, repeats=repeats)
    t_dp = median_time(lambda: functx.dp.clipped_grad(model, per_sample_loss, images, labels, max_norm=clip), repeats=repeats)
    print(f"\nDP-SGD gradient of a batch of {n}: functx.dp.clipped_grad equals vmap(grad) + clip")
    print(f"  time, vmap(grad) + clip       : {t_recipe * 1e3:7.1f} ms")
    print(f"  time, functx.dp.clipped_grad: {t_dp * 1e3:7.1f} ms   (speed-up {t_recipe / t_dp:.1f}x)")
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))
    loss_of_one = lambda p, x, y: F.cross_entropy(functx.functional_call(mlp, p, (x[None],)), y[None])
    mlp_params = {k: v.detach() for k, v in mlp.named_parameters()}

    def mlp_recipe():
        per = functx.vmap(functx.grad(loss_of_one), in_dims=(None, 0, 0))(mlp_params, images, labels)
        return clip_and_noise(per, clip, 0.0, torch.Generator())

    t_mlp_recipe = median_time(mlp_recipe, repeats=3)
    t_mlp_dp = median_time(lambda: functx.dp.clipped_grad(mlp, per_sample_loss, images, labels, max_norm=clip), repeats=3)
    print(f"  the same on an MLP 784-512-256-10: {t_mlp_recipe * 1e3:.1f} ms vs {t_mlp_dp * 1e3:.1f} ms "
          f"(speed-up {t_mlp_recipe / t_mlp_dp:.1f}x)")


# %% [markdown]
# ## Training both side by side
#
# Both runs start from the same initialization (`torch.manual_seed` before building each
# model), see the same batches in the same order and use the same learning rate. DP-SGD's
# gradient is biased (clipping) and noisy, so it learns more slowly; the gap shrinks with
# larger batches (the noise is divided by N) and more steps.
#
# Knobs to try: `clip` (C) and `lr` together set DP-SGD's step length (with every example
# clipped, the step is about lr * C); `sigma` sets the privacy/utility trade-off; `batch`
# divides the noise. Held-out loss is measured every `eval_every` steps on 2000 fresh
# examples.


# %%
def train(args):
    steps, batch, eval_every = (6, 8, 2) if args.quick else (300, 64, 10)
    lr, clip, sigma, noise = 0.1, 1.0, 1.0, 4.0
    templates = make_templates(seed=0)
    test_x, test_y = make_data(templates, 256 if args.quick else 2000, noise, torch.Generator().manual_seed(1))
    data_gen = torch.Generator().manual_seed(2)
    batches = [make_data(templates, batch, noise, data_gen) for _ in range(steps)]

    torch.manual_seed(0)
    dp_model = SmallCNN()
    torch.manual_seed(0)
    sgd_model = SmallCNN()
    dp_opt = torch.optim.SGD(dp_model.parameters(), lr=lr)
    sgd_opt = torch.optim.SGD(sgd_model.parameters(), lr=lr)
    noise_gen = torch.Generator().manual_seed(3)

    check_dp_gradient(dp_model, *batches[0], clip)
    compare_dp_routes(dp_model, *batches[0], clip)

    curve = {"step": [], "dp": [], "sgd": []}
    first_norms = last_norms = None
    start = time.perf_counter()
    for step in range(steps + 1):
        if step % eval_every == 0 or step == steps:
            curve["step"].append(step)
            curve["dp"].append(evaluate(dp_model, test_x, test_y)[0])
            curve["sgd"].append(evaluate(sgd_model, test_x, test_y)[0])
        if step == steps:
            break
        x, y = batches[step]
        norms = dp_sgd_step(dp_model, dp_opt, x, y, clip, sigma, noise_gen)
        sgd_step(sgd_model, sgd_opt, x, y)
        if first_norms is None:
            first_norms = norms
        last_norms = norms
    elapsed = time.perf_counter() - start

    dp_loss, dp_acc = evaluate(dp_model, test_x, test_y)
    sgd_loss, sgd_acc = evaluate(sgd_model, test_x, test_y)
    print(f"\ntrained {steps} steps of batch {batch} (lr={lr}, C={clip}, sigma={sigma}) in {elapsed:.1f} s")
    print(f"  held-out loss at step 0: {curve['dp'][0]:.3f} (both runs start from the same weights)")
    print(f"  DP-SGD    final held-out loss {dp_loss:.3f}, accuracy {dp_acc:6.1%}")
    print(f"  plain SGD final held-out loss {sgd_loss:.3f}, accuracy {sgd_acc:6.1%}")
    print(
        f"  per-sample gradient norms: median {first_norms.median():.2f} at step 0, "
        f"{last_norms.median():.2f} at the last step (C = {clip})"
    )
    assert curve["dp"][0] == curve["sgd"][0], "both runs must start from the same initialization"
    if not args.quick:  # enough steps for both to have learned something
        assert sgd_loss < curve["sgd"][0] and dp_loss < curve["dp"][0], (curve, dp_loss, sgd_loss)
    return curve, first_norms, last_norms, clip, batch


# %% [markdown]
# ## Figures
#
# `training_curve.png`: held-out loss against the step for both optimizers.
# `grad_norms.png`: the per-sample gradient norms (before clipping) of the first and the
# last batch, with the clip norm C marked. Norms above C are the ones clipping shrinks:
# when every example sits above C (as at step 0 here, norms around 8 against C = 1), DP-SGD
# averages gradient *directions* and its steps are several times shorter than plain SGD's,
# which is why its curve starts flat. As the model learns, the examples it already gets
# right drop below C and the hard ones dominate what is left.


# %%
def plot(args, curve, first_norms, last_norms, clip, batch):
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(curve["step"], curve["sgd"], "o-", ms=3, label="plain SGD")
    ax.plot(curve["step"], curve["dp"], "s-", ms=3, label=f"DP-SGD (clip C = {clip}, noise std sigma*C)")
    ax.set_xlabel("training step")
    ax.set_ylabel("cross-entropy on held-out data")
    ax.set_title("Synthetic MNIST: DP-SGD vs plain SGD\n(same initialization, same batches, same lr)")
    ax.legend()
    ax.grid(alpha=0.3)
    save(
        fig,
        args.out,
        "training_curve.png",
        "both curves start at the same loss (about ln 10 = 2.30) and fall; plain SGD drops within "
        "~50 steps, DP-SGD follows more slowly because clipping shrinks its steps and noise blurs "
        "their direction." + (" (--quick trains only a few steps: expect little movement.)" if args.quick else ""),
    )

    fig, ax = plt.subplots(figsize=(6, 4))
    all_norms = torch.cat([first_norms, last_norms]).clamp(min=1e-3)
    low, high = all_norms.min().log10().item(), all_norms.max().log10().item()
    bins = torch.logspace(low - 0.05, high + 0.05, max(6, min(30, batch // 2))).numpy()
    ax.hist(first_norms.numpy(), bins=bins, alpha=0.6, label="first batch (step 0)")
    ax.hist(last_norms.numpy(), bins=bins, alpha=0.6, label="last batch")
    ax.axvline(clip, color="k", ls="--", label=f"clip norm C = {clip}")
    ax.set_xscale("log")
    ax.set_xlabel("per-sample gradient norm before clipping (log scale)")
    ax.set_ylabel("number of examples")
    ax.set_title(f"DP-SGD: per-sample gradient norms in a batch of {batch}")
    ax.legend()
    save(
        fig,
        args.out,
        "grad_norms.png",
        "at step 0 all norms cluster together above C (every example is clipped); in the last "
        "batch they spread over decades: examples the model already gets right fall below C "
        "and pass unchanged, hard ones stay far above C and clipping caps their influence.",
    )


# %% [markdown]
# ## Putting it together


# %%
def main():
    args = parse_args(NAME, __doc__)
    # One thread: the tensors are small, and on a busy 2-core machine extra threads mostly wait.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    templates = make_templates(seed=0)
    images, labels = make_data(templates, 8 if args.quick else 64, 4.0, torch.Generator().manual_seed(4))
    model = SmallCNN()
    check_and_time(model, images, labels)
    plot(args, *train(args))


if __name__ == "__main__":
    main()
