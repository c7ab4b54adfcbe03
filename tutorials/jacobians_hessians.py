"""Jacobians, Hessians, Hessian-vector products and the neural tangent kernel with functx.

What you learn:

1. `functx.jacrev` and `functx.jacfwd` compute the same Jacobian, checked against
   `torch.autograd.functional.jacobian`.
2. When each one wins: `jacrev` costs about one vector-Jacobian product (VJP) per *output*,
   `jacfwd` about one Jacobian-vector product (JVP) per *input*; we time both over a grid of
   shapes and plot it.
3. `functx.hessian` and three ways of computing Hessian-vector products without ever forming
   the Hessian (forward-over-reverse, reverse-over-reverse, and a VJP of the gradient).
4. Batched Jacobians with `vmap(jacrev(f))`, and `chunk_size` to trade speed for memory.
5. The empirical neural tangent kernel (NTK) of a small MLP, two ways: Jacobian contraction
   and NTK-vector products.

Run it (figures go to tutorials/out/jacobians_hessians/):

    .venv/bin/python tutorials/jacobians_hessians.py            # about 20 s (one CPU thread)
    .venv/bin/python tutorials/jacobians_hessians.py --quick    # a few seconds (CI)

Every result is asserted against plain torch autograd, so a regression fails loudly;
timings are printed only.
"""

# %% [markdown]
# # Jacobians, Hessians, hvp and the NTK
#
# `functx` mirrors `torch.func`: its transforms take a function and return a function.
# `jacrev(f)` and `jacfwd(f)` return a function computing the Jacobian of `f`, `hessian(f)`
# one computing its Hessian, and they compose with `vmap`, `grad`, `jvp` and `vjp` to any depth.
# This tutorial builds Jacobians and Hessians step by step, shows when forward mode beats
# reverse mode, and ends with the empirical neural tangent kernel of a network.

# %%
from __future__ import annotations

import resource
import sys
import time

import torch
import torch.nn as nn

import functx

try:  # run as a script from the repository root or from tutorials/
    from _common import median_time, parse_args, plt, save
except ImportError:  # imported as tutorials.jacobians_hessians
    from tutorials._common import median_time, parse_args, plt, save

NAME = "jacobians_hessians"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.2f} ms"


def peak_rss_mb() -> float:
    """The process's peak resident memory so far (a high-water mark, never decreases)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB on Linux


def mlp_map(n: int, m: int, hidden: int):
    """A function R^n -> R^m: two tanh layers of width `hidden`, then a linear read-out."""
    W1, b1 = torch.randn(hidden, n) / n**0.5, torch.randn(hidden)
    W2 = torch.randn(hidden, hidden) / hidden**0.5
    W3 = torch.randn(m, hidden) / hidden**0.5

    def f(x):
        return W3 @ torch.tanh(W2 @ torch.tanh(W1 @ x + b1))

    return f


def main():
    args = parse_args(NAME, __doc__)
    torch.manual_seed(0)
    # One thread: these are small ops, and with several processes sharing a 2-core machine,
    # multi-threaded kernels stall each other and make the timings far noisier.
    torch.set_num_threads(1)
    quick = args.quick
    t_start = time.perf_counter()

    # %% [markdown]
    # ## 1. A first Jacobian
    #
    # Take f(x) = sin(W x + b), from R^n to R^m. Its Jacobian is the m x n matrix
    # J[i, j] = d f_i / d x_j = cos(W x + b)_i * W[i, j]. `functx.jacrev(f)` is a new function;
    # calling it at `x` returns J. We check it against torch's own
    # `torch.autograd.functional.jacobian`, against the closed form, and against forward mode
    # `functx.jacfwd`, which must give the same matrix by a different route.

    # %%
    n, m = 5, 3
    W, b, x = torch.randn(m, n), torch.randn(m), torch.randn(n)

    def f(x):
        return torch.sin(W @ x + b)

    J_rev = functx.jacrev(f)(x)
    J_fwd = functx.jacfwd(f)(x)
    J_torch = torch.autograd.functional.jacobian(f, x)
    print("== 1. a first Jacobian ==")
    print(f"f: R^{n} -> R^{m}, jacrev(f)(x) has shape {tuple(J_rev.shape)}")
    torch.testing.assert_close(J_rev, J_torch)
    torch.testing.assert_close(J_rev, torch.cos(W @ x + b)[:, None] * W)  # closed form
    torch.testing.assert_close(J_fwd, J_rev)
    print(f"max |jacrev - autograd.functional.jacobian| = {(J_rev - J_torch).abs().max():.2e}")
    print(f"max |jacfwd - jacrev|                       = {(J_fwd - J_rev).abs().max():.2e}")

    # %% [markdown]
    # `argnums` picks which argument to differentiate, just like in `torch.func`: the Jacobian
    # with respect to the weight matrix W has shape [m, m, n] (output shape, then W's shape).

    # %%
    J_W = functx.jacrev(lambda W, x: torch.sin(W @ x + b), argnums=0)(W, x)
    J_W_torch = torch.autograd.functional.jacobian(lambda W: torch.sin(W @ x + b), W)
    torch.testing.assert_close(J_W, J_W_torch)
    print(f"Jacobian w.r.t. W: shape {tuple(J_W.shape)}, matches autograd.functional.jacobian")

    # %% [markdown]
    # ## 2. jacrev or jacfwd?
    #
    # Both build the full Jacobian, but they slice it differently:
    #
    # - `jacrev` runs the function forward once, then computes one vector-Jacobian product
    #   u^T J per **row** of J (u = each basis vector of the *output* space), all rows at once
    #   with `vmap`. Its cost grows with the number of outputs m.
    # - `jacfwd` computes one Jacobian-vector product J v per **column** of J (v = each basis
    #   vector of the *input* space), again vectorized. Its cost grows with the number of
    #   inputs n.
    #
    # So `jacrev` wins for wide inputs and narrow outputs (a loss: many parameters, one
    # number), `jacfwd` wins for narrow inputs and wide outputs. We time both on an MLP-shaped
    # map R^n -> R^m: first fixing n and growing m, then fixing m and growing n.

    # %%
    sizes = [16, 32, 64, 128] if quick else [16, 32, 64, 128, 256, 512]
    hidden = 128 if quick else 512
    fixed = 16
    repeats = 3 if quick else 5
    print("\n== 2. jacrev vs jacfwd ==")
    timings = {"vary m": {"jacrev": [], "jacfwd": []}, "vary n": {"jacrev": [], "jacfwd": []}}
    for sweep in timings:
        for size in sizes:
            n, m = (fixed, size) if sweep == "vary m" else (size, fixed)
            g = mlp_map(n, m, hidden)
            x = torch.randn(n)
            torch.testing.assert_close(functx.jacrev(g)(x), functx.jacfwd(g)(x), atol=1e-5, rtol=1e-4)
            t_rev = median_time(lambda: functx.jacrev(g)(x), repeats=repeats)
            t_fwd = median_time(lambda: functx.jacfwd(g)(x), repeats=repeats)
            timings[sweep]["jacrev"].append(t_rev)
            timings[sweep]["jacfwd"].append(t_fwd)
            faster = "jacrev" if t_rev < t_fwd else "jacfwd"
            print(f"n={n:4d} m={m:4d}: jacrev {ms(t_rev)}   jacfwd {ms(t_fwd)}   -> {faster} "
                  f"{max(t_rev, t_fwd) / min(t_rev, t_fwd):.1f}x faster")

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, sweep, xlabel, title in [
        (axes[0], "vary m", "number of outputs m", f"n = {fixed} inputs fixed, outputs grow"),
        (axes[1], "vary n", "number of inputs n", f"m = {fixed} outputs fixed, inputs grow"),
    ]:
        ax.plot(sizes, [t * 1e3 for t in timings[sweep]["jacrev"]], "o-", label="jacrev (one VJP per output)")
        ax.plot(sizes, [t * 1e3 for t in timings[sweep]["jacfwd"]], "s-", label="jacfwd (one JVP per input)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("time per Jacobian (ms, median)")
    fig.suptitle(f"Jacobian of an MLP map R^n -> R^m (hidden width {hidden})")
    save(fig, args.out, "jacrev_vs_jacfwd.png",
         "left, jacrev's time climbs with the number of outputs while jacfwd stays flat; right, "
         "the mirror image: jacfwd climbs with the number of inputs while jacrev stays flat.")

    # %% [markdown]
    # ## 3. Hessians and Hessian-vector products
    #
    # For a scalar function, `functx.hessian(f)` is the Jacobian of the gradient
    # (`jacrev(jacrev(f))` in functx; `jacfwd(jacrev(f))` is the forward-over-reverse
    # alternative and gives the same matrix). We check it against
    # `torch.autograd.functional.hessian`.
    #
    # Often you only need the Hessian applied to a vector, H v (Newton-CG, curvature
    # estimates, influence functions). Forming H costs n gradient-like passes and n^2 memory;
    # an hvp costs a small constant number of passes. Three equivalent ways:
    #
    # - forward-over-reverse: the JVP of the gradient, `jvp(grad(f), (x,), (v,))[1]`;
    # - reverse-over-reverse: the gradient of <grad f(x), v>, `grad(lambda x: (grad(f)(x) * v).sum())(x)`;
    # - a VJP of the gradient, `vjp(grad(f), x)[1](v)` (H is symmetric, so v^T H = H v).
    #
    # Which one is fastest depends on the function and the hardware (forward-mode AD has
    # more per-op overhead on CPU, in torch.func as well); compare the printed times with the
    # full Hessian, whose cost grows with n.

    # %%
    print("\n== 3. Hessians and hvp ==")
    n = 64 if quick else 512
    A, c = torch.randn(n, n) / n**0.5, torch.randn(n)

    def loss(x):
        return torch.tanh(A @ x + c).pow(2).sum() + 0.1 * x.pow(4).sum()

    x, v = torch.randn(n), torch.randn(n)
    H = functx.hessian(loss)(x)
    H_torch = torch.autograd.functional.hessian(loss, x)
    H_fwd_rev = functx.jacfwd(functx.jacrev(loss))(x)
    torch.testing.assert_close(H, H_torch, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(H_fwd_rev, H, atol=1e-4, rtol=1e-4)
    print(f"hessian shape {tuple(H.shape)}; max |functx - autograd.functional| = {(H - H_torch).abs().max():.2e}, "
          f"max |jacfwd(jacrev) - hessian| = {(H_fwd_rev - H).abs().max():.2e}")

    def hvp_fwd_rev(x, v):
        return functx.jvp(functx.grad(loss), (x,), (v,))[1]

    def hvp_rev_rev(x, v):
        return functx.grad(lambda x: (functx.grad(loss)(x) * v).sum())(x)

    def hvp_vjp(x, v):
        return functx.vjp(functx.grad(loss), x)[1](v)[0]  # vjp_fn returns a tuple, one per primal

    Hv = H @ v
    methods = {
        "forward-over-reverse jvp(grad)": hvp_fwd_rev,
        "reverse-over-reverse grad(<grad, v>)": hvp_rev_rev,
        "vjp(grad)": hvp_vjp,
    }
    for label, hvp in methods.items():
        out = hvp(x, v)
        torch.testing.assert_close(out, Hv, atol=1e-4, rtol=1e-4)
        print(f"{label:38s}: {ms(median_time(lambda: hvp(x, v), repeats=repeats))}   "
              f"max |. - H @ v| = {(out - Hv).abs().max():.2e}")
    t_hessian = median_time(lambda: functx.hessian(loss)(x) @ v, repeats=repeats)
    t_torch_h = median_time(lambda: torch.autograd.functional.hessian(loss, x), repeats=1 if not quick else 2)
    print(f"{'full functx.hessian(f)(x) @ v':38s}: {ms(t_hessian)}")
    print(f"{'torch.autograd.functional.hessian':38s}: {ms(t_torch_h)}   (builds H row by row in a Python loop)")
    print(f"an hvp never forms the {n}x{n} Hessian; its cost does not grow with n the way hessian's does.")

    # %% [markdown]
    # ## 4. Batched Jacobians, and chunk_size
    #
    # `jacrev(f)` is written for one input. To get the Jacobian at every point of a batch, wrap
    # it in `vmap`: `vmap(jacrev(f))(xs)` returns a [B, m, n] tensor in one vectorized call
    # instead of a Python loop over B calls.

    # %%
    print("\n== 4. batched Jacobians and chunk_size ==")
    B, n, m = (16, 16, 16) if quick else (128, 64, 64)
    g = mlp_map(n, m, 64 if quick else 128)
    xs = torch.randn(B, n)
    J_batched = functx.vmap(functx.jacrev(g))(xs)
    J_loop = torch.stack([torch.autograd.functional.jacobian(g, xi) for xi in xs])
    torch.testing.assert_close(J_batched, J_loop, atol=1e-5, rtol=1e-4)
    t_vmap = median_time(lambda: functx.vmap(functx.jacrev(g))(xs), repeats=repeats)
    t_loop = median_time(lambda: torch.stack([functx.jacrev(g)(xi) for xi in xs]), repeats=repeats)
    print(f"{B} Jacobians of R^{n} -> R^{m}, shape {tuple(J_batched.shape)}")
    print(f"vmap(jacrev(f))(xs)  : {ms(t_vmap)}")
    print(f"loop of jacrev(f)(x) : {ms(t_loop)}   -> vmap {t_loop / t_vmap:.1f}x faster")

    # %% [markdown]
    # `jacrev` pushes the whole identity basis (one row per output) through the backward pass
    # at once: for m outputs, every intermediate cotangent has m rows. With many outputs that is
    # a lot of memory. `jacrev(f, chunk_size=k)` processes k rows at a time and concatenates;
    # the result is identical, only the peak memory and the speed change (`jacfwd` and
    # `hessian` take `chunk_size` too). Below, f(x) = sin(W x) with many outputs, so the m x m
    # cotangent blocks dominate memory. We run chunk sizes from small to large and read the
    # process's peak resident memory (`ru_maxrss`) after each. It is a high-water mark, so a
    # run only shows up when it needs more than anything before it: that is why the sizes go up.

    # %%
    m, n = (1024, 32) if quick else (4096, 64)
    Wc = torch.randn(m, n) / n**0.5
    x = torch.randn(n)

    def wide(x):
        return torch.sin(Wc @ x)

    J_ref = torch.cos(Wc @ x)[:, None] * Wc  # closed form
    for k in [16, 256, 1024, None]:
        rows = m if k is None else min(k, m)
        before = peak_rss_mb()
        J = functx.jacrev(wide, chunk_size=k)(x)  # first call: read the memory high-water mark
        grew = peak_rss_mb() - before
        torch.testing.assert_close(J, J_ref)
        elapsed = median_time(lambda: functx.jacrev(wide, chunk_size=k)(x), repeats=repeats, warmup=0)
        print(f"chunk_size={str(k):5s}: {ms(elapsed)}   one cotangent block {rows}x{m} floats = "
              f"{rows * m * 4 / 2**20:6.2f} MiB   peak RSS grew by {grew:6.1f} MiB")
    print("all chunk sizes give the same Jacobian; the peak memory grows with the chunk, while the time "
          "first drops (fewer Python-level chunks) and can rise again once blocks outgrow the caches.")

    # %% [markdown]
    # ## 5. The empirical neural tangent kernel
    #
    # For a network f(theta, x) with parameters theta, the empirical NTK between two inputs is
    # K(x1, x2) = J(x1) J(x2)^T, where J(x) = d f(theta, x) / d theta is the [outputs x params]
    # Jacobian. It describes how a gradient step on x1 moves the prediction at x2. We make the
    # module's parameters an explicit argument with `functx.functional_call`, then compute K
    # for every pair in two batches in two ways:
    #
    # - **Jacobian contraction**: `vmap(jacrev(f))` over the batch gives per-example Jacobians
    #   with respect to each parameter tensor; contract them with einsum over the parameter
    #   dimensions and sum over the parameter tensors. Memory: the full [N, outputs, params]
    #   Jacobians.
    # - **NTK-vector products**: never form J. For a basis vector u of the output space,
    #   J(x2) (J(x1)^T u) is a VJP at x1 followed by a JVP at x2; `vmap` over the basis and
    #   over the pairs of inputs. Memory: no Jacobian, but one VJP+JVP per (pair, output).
    #
    # The contraction pays for the Jacobians (N x outputs x params floats) once and then does a
    # single einsum; the NTK-vector products pay one VJP + JVP per (pair, output) and never hold
    # a Jacobian. For a small MLP the Jacobians are tiny, so expect the contraction to win here;
    # the products are the way out when the Jacobians would not fit in memory.

    # %%
    print("\n== 5. empirical neural tangent kernel ==")
    N = 12 if quick else 48
    width = 32 if quick else 64
    n_out = 3
    net = nn.Sequential(nn.Linear(2, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, n_out))
    params = {k: v.detach() for k, v in net.named_parameters()}
    n_params = sum(p.numel() for p in params.values())

    def f_single(params, x):  # one input x of shape [2] -> [n_out]
        return functx.functional_call(net, params, (x.unsqueeze(0),)).squeeze(0)

    # inputs on the unit circle, sorted by angle, so the kernel has visible structure
    angles = torch.linspace(0, 2 * torch.pi, N + 1)[:-1]
    x1 = torch.stack([angles.cos(), angles.sin()], dim=1)
    x2 = x1.clone()

    def ntk_jacobian_contraction(params, x1, x2):
        jac1 = functx.vmap(functx.jacrev(f_single), in_dims=(None, 0))(params, x1)  # {name: [N, O, *shape]}
        jac2 = functx.vmap(functx.jacrev(f_single), in_dims=(None, 0))(params, x2)
        blocks = [torch.einsum("Naf,Mbf->NMab", jac1[k].flatten(2), jac2[k].flatten(2)) for k in jac1]
        return torch.stack(blocks).sum(0)  # [N, M, O, O]

    def ntk_vector_products(params, x1, x2):
        def ntk_pair(a, b):  # one input from each batch -> [O, O]
            out, vjp_fn = functx.vjp(lambda p: f_single(p, a), params)

            def column(u):  # J(b) J(a)^T u
                (cotangent,) = vjp_fn(u)
                return functx.jvp(lambda p: f_single(p, b), (params,), (cotangent,))[1]

            basis = torch.eye(out.numel(), dtype=out.dtype)
            return functx.vmap(column)(basis)  # row u = J(b) J(a)^T e_u, i.e. K[a, b][u, :]

        return functx.vmap(functx.vmap(ntk_pair, in_dims=(None, 0)), in_dims=(0, None))(x1, x2)

    K_jac = ntk_jacobian_contraction(params, x1, x2)
    K_vp = ntk_vector_products(params, x1, x2)
    torch.testing.assert_close(K_jac, K_vp, atol=1e-5, rtol=1e-4)

    # plain-torch reference for a few pairs: J(x) row by row with torch.autograd.grad
    def jac_plain(x):
        out = net(x.unsqueeze(0)).squeeze(0)
        rows = [torch.autograd.grad(out[o], list(net.parameters()), retain_graph=True) for o in range(n_out)]
        return torch.stack([torch.cat([g.flatten() for g in row]) for row in rows])  # [O, n_params]

    for i, j in [(0, 0), (0, N // 4), (N // 2, N - 1)]:
        torch.testing.assert_close(K_jac[i, j], jac_plain(x1[i]) @ jac_plain(x2[j]).T, atol=1e-5, rtol=1e-4)

    t_jac = median_time(lambda: ntk_jacobian_contraction(params, x1, x2), repeats=repeats)
    t_vp = median_time(lambda: ntk_vector_products(params, x1, x2), repeats=repeats)
    print(f"MLP 2 -> {width} -> {width} -> {n_out}, {n_params} parameters, NTK of {N}x{N} inputs: shape {tuple(K_jac.shape)}")
    print(f"max |contraction - NTK-vector products| = {(K_jac - K_vp).abs().max():.2e}; "
          f"3 entries match torch.autograd.functional.jacobian")
    print(f"Jacobian contraction  : {ms(t_jac)}")
    print(f"NTK-vector products   : {ms(t_vp)}")

    # %% [markdown]
    # The heatmap shows the trace of the [O, O] kernel block for every pair of inputs on the
    # circle. It is symmetric because x1 = x2, it is large along the diagonal band (nearby inputs
    # have similar parameter gradients), and it is smallest for roughly opposite points. The
    # circle closes, so the top-right and bottom-left corners continue the diagonal band.

    # %%
    K_trace = K_jac.diagonal(dim1=2, dim2=3).sum(-1)  # [N, M]
    torch.testing.assert_close(K_trace, K_trace.T, atol=1e-5, rtol=1e-4)
    fig, ax = plt.subplots(figsize=(5.5, 4.6))
    extent = [0, 360, 360, 0]
    im = ax.imshow(K_trace.numpy(), cmap="viridis", extent=extent)
    fig.colorbar(im, ax=ax, label="trace of K(x1, x2)")
    ax.set_xlabel("angle of x2 on the unit circle (degrees)")
    ax.set_ylabel("angle of x1 on the unit circle (degrees)")
    ax.set_title(f"Empirical NTK of a {n_params}-parameter MLP")
    save(fig, args.out, "ntk.png",
         "a symmetric kernel that changes smoothly with the two angles: a bright band along the "
         "diagonal (nearby inputs, similar parameter gradients) and dark blobs for inputs about "
         "180 degrees apart.")

    print(f"\ntotal time {time.perf_counter() - t_start:.1f} s")


if __name__ == "__main__":
    main()
