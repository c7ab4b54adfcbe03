"""A physics-informed network for a Poisson problem in 5 to 50 dimensions, trained through
`functx.laplacian` (collapsed Taylor mode).

What you learn:

1. `functx.laplacian(u)` computes the Laplacian of a network in one forward pass: checked
   against the Laplacian by nested backprop (one backward pass per dimension).
2. Training a PINN: the residual of `-laplacian(u) = f` at random interior points, plus the
   boundary condition, minimised with Adam; the gradient of a loss that contains a Laplacian
   is one `loss.backward()` (torch's autograd through functx's Taylor coefficients).
3. The stochastic Laplacian (`samples=`): an unbiased estimate from a few random directions,
   for high dimensions.
4. How the cost grows with the dimension: collapsed Taylor mode against nested backprop.

The problem: on the cube [0, 1]^d, `-laplacian(u) = f` with `u = g` on the boundary, where
the exact solution is `u*(x) = mean_i sin(pi x_i / 2)` (so `f = pi^2 / 4 * u*`).

Run it (figures go to tutorials/out/pinn_poisson/):

    .venv/bin/python tutorials/pinn_poisson.py            # about a minute (one CPU thread)
    .venv/bin/python tutorials/pinn_poisson.py --quick    # a few seconds (CI)

Every result is asserted (the Laplacians against nested backprop, the training against the
exact solution), so a regression fails loudly; timings are printed only.
"""

# %% [markdown]
# # A PINN for Poisson's equation with `functx.laplacian`
#
# Physics-informed networks put derivatives of the network *in the loss*. For Poisson's
# equation the loss needs the Laplacian `sum_i d^2 u / dx_i^2` at every training point.
# Nested backprop computes it with one backward pass per dimension; Taylor mode pushes the
# second-order Taylor coefficients forward through the network in one pass, and collapsed
# Taylor mode sums them over the directions at every layer. `functx.laplacian(u)` is that.

# %%
from __future__ import annotations

import math

import torch
import torch.nn as nn

import functx

try:  # run as a script from the repository root or from tutorials/
    from _common import median_time, parse_args, plt, save
except ImportError:  # imported as tutorials.pinn_poisson
    from tutorials._common import median_time, parse_args, plt, save

NAME = "pinn_poisson"


def exact(x):
    """u*(x) = mean_i sin(pi x_i / 2)."""
    return torch.sin(math.pi * x / 2).mean(-1)


def source(x):
    """f = -laplacian(u*) = pi^2 / 4 * u*."""
    return math.pi**2 / 4 * exact(x)


def network(d: int, width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))


def laplacian_nested_backprop(u, points):
    """The Laplacian the usual way: the gradient with a graph, then one backward pass per
    dimension for the diagonal of the Hessian."""
    x = points.detach().requires_grad_()
    (gradient,) = torch.autograd.grad(u(x).sum(), x, create_graph=True)
    return sum(torch.autograd.grad(gradient[:, i].sum(), x, create_graph=True)[0][:, i] for i in range(x.shape[1]))


def interior(n, d, generator):
    return torch.rand(n, d, generator=generator)


def boundary(n, d, generator):
    """Points on the cube's faces: one coordinate set to 0 or 1."""
    x = torch.rand(n, d, generator=generator)
    face = torch.randint(0, d, (n,), generator=generator)
    x[torch.arange(n), face] = torch.randint(0, 2, (n,), generator=generator).float()
    return x


def train(d, width, steps, batch, samples=None, log=None):
    """Adam on the PINN loss; returns the network and the loss per step."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    u = network(d, width)
    optimizer = torch.optim.Adam(u.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)

    def scalar_u(x):
        return u(x).squeeze(-1)

    laplacian = functx.vmap(functx.laplacian(scalar_u, samples=samples, generator=generator))
    losses = []
    for step in range(steps):
        x, xb = interior(batch, d, generator), boundary(batch // 2, d, generator)
        residual = laplacian(x) + source(x)
        loss = (residual**2).mean() + 10 * ((scalar_u(xb) - exact(xb)) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()  # torch's autograd through the Taylor coefficients
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if log and (step % max(steps // 5, 1) == 0 or step == steps - 1):
            print(f"  d={d:3d} step {step:5d}  loss {loss.item():.3e}")
    return scalar_u, losses


def relative_error(u, d, n=2000):
    x = torch.rand(n, d, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        return ((u(x) - exact(x)).norm() / exact(x).norm()).item()


def main():
    args = parse_args(NAME, __doc__)
    torch.set_num_threads(1)
    quick = args.quick

    # %% [markdown]
    # ## 1. The Laplacian of a network, two ways
    #
    # `functx.laplacian(f)` returns a function computing the Laplacian of `f` at a point;
    # `functx.vmap` maps it over a batch. We compare it with nested backprop in float64.

    # %%
    torch.manual_seed(0)
    d = 5
    u64 = network(d, 32).double()
    points = torch.rand(16, d, dtype=torch.float64)
    by_taylor = functx.vmap(functx.laplacian(lambda x: u64(x).squeeze(-1)))(points)
    by_backprop = laplacian_nested_backprop(lambda x: u64(x).squeeze(-1), points)
    torch.testing.assert_close(by_taylor, by_backprop)
    print(f"1. laplacian by collapsed Taylor mode = nested backprop (16 points, d={d}): max difference "
          f"{(by_taylor - by_backprop).abs().max().item():.1e}")

    # %% [markdown]
    # ## 2. Training the PINN
    #
    # The loss is the mean squared residual of `laplacian(u) + f` at random interior points,
    # plus the boundary condition. `loss.backward()` differentiates through the Laplacian.

    # %%
    dims = [5] if quick else [5, 20]
    steps = 60 if quick else 1500
    histories = {}
    networks = {}
    for d in dims:
        u, losses = train(d, width=32 if quick else 64, steps=steps, batch=64 if quick else 128, log=True)
        histories[d], networks[d] = losses, u
        error = relative_error(u, d)
        print(f"2. d={d}: loss {losses[0]:.2e} -> {losses[-1]:.2e}, relative L2 error of u {error:.3f}")
        assert losses[-1] < losses[0] / (5 if quick else 100), "training did not reduce the loss"
        if not quick:
            assert error < 0.05, f"the PINN's solution is off by {error:.3f} (relative L2)"

    # %% [markdown]
    # ## 3. The stochastic Laplacian
    #
    # With `samples=S` the Laplacian is estimated from S random (Rademacher) directions:
    # unbiased, with a variance that falls as 1/S, and a cost of S directions instead of d.

    # %%
    d_high = 10 if quick else 50
    u_stochastic, losses_stochastic = train(d_high, width=32 if quick else 64, steps=steps, batch=64 if quick else 128, samples=4, log=True)
    error = relative_error(u_stochastic, d_high)
    print(f"3. d={d_high} with 4 random directions per point: loss {losses_stochastic[0]:.2e} -> "
          f"{losses_stochastic[-1]:.2e}, relative L2 error {error:.3f}")
    assert losses_stochastic[-1] < losses_stochastic[0], "stochastic training did not reduce the loss"

    # %% [markdown]
    # ## 4. Cost against the dimension
    #
    # One Laplacian of the batch (forward only, no training), collapsed Taylor mode against
    # nested backprop, for growing d.

    # %%
    timing_dims = [5, 10] if quick else [5, 10, 20, 50]
    taylor_ms, backprop_ms = [], []
    for d in timing_dims:
        net = network(d, 64)
        f = lambda x: net(x).squeeze(-1)  # noqa: E731
        pts = torch.rand(128, d)
        lap = functx.vmap(functx.laplacian(f))
        taylor_ms.append(median_time(lambda: lap(pts), repeats=3) * 1e3)
        backprop_ms.append(median_time(lambda: laplacian_nested_backprop(f, pts), repeats=3) * 1e3)
        print(f"4. d={d:3d}: collapsed Taylor {taylor_ms[-1]:7.1f} ms, nested backprop {backprop_ms[-1]:7.1f} ms "
              f"({backprop_ms[-1] / taylor_ms[-1]:.1f}x)")

    # %% [markdown]
    # ## Figures

    # %%
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for d, losses in histories.items():
        axes[0].semilogy(losses, label=f"d = {d} (exact Laplacian)")
    axes[0].semilogy(losses_stochastic, label=f"d = {d_high} (4 random directions)")
    axes[0].set(xlabel="step", ylabel="PINN loss", title="Training")
    axes[0].legend()
    d = dims[-1]
    s = torch.linspace(0, 1, 101)
    line = s[:, None].expand(-1, d)
    with torch.no_grad():
        axes[1].plot(s, exact(line), "k--", label="exact u*")
        axes[1].plot(s, networks[d](line), label="PINN u")
    axes[1].set(xlabel="s (the point s * (1, ..., 1))", ylabel="u", title=f"Solution along the diagonal, d = {d}")
    axes[1].legend()
    axes[2].plot(timing_dims, taylor_ms, "o-", label="functx.laplacian (collapsed Taylor)")
    axes[2].plot(timing_dims, backprop_ms, "s-", label="nested backprop")
    axes[2].set(xlabel="dimension d", ylabel="ms per Laplacian of 128 points", title="Cost")
    axes[2].legend()
    save(fig, args.out, "pinn_poisson.png",
         "the loss falling by orders of magnitude, the PINN's solution on the exact one, and the "
         "Taylor-mode Laplacian's cost growing more slowly with d than nested backprop's")


if __name__ == "__main__":
    main()
