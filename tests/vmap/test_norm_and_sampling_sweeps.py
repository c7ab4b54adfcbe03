"""Issue 12 sweeps: functx may raise where it cannot do something, but never returns a value
that differs from what each sample gives in plain PyTorch.

- batch norm (and instance/layer/group norm) under vmap over every combination of where the
  input, the running stats and the affine parameters are batched (or not), training mode,
  momentum, per-sample rank and dtype: outputs *and* the in-place running-stat updates
  against a per-sample loop (running stats cloned per sample). torch.func serves only as the
  oracle of "supported": where it succeeds functx must succeed (with the loop's values, even
  where torch.func's own values are wrong); where it raises, functx may raise clearly or give
  the loop's values;
- per-sample gradients of BatchNorm models through functional_call (batched running-stat
  buffers; replace_all_batch_norm_modules_), against loops of torch.autograd.grad;
- grid_sample (2-D and 3-D, every mode, padding mode and align_corners) under every in_dims
  pattern, where torch.func returns wrong values for (1, 0) and (0, 1); affine_grid; the
  gradients w.r.t. input and grid (vmap(grad), vmap(vjp), jacrev) against torch.autograd;
- vmap of jacfwd/jacrev with in_dims=1 and chunk_size, against per-column jacobians.
"""

import copy
import itertools
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import functx

B = 3  # vmap batch size
N, C = 4, 3  # per-sample (N, C, *spatial) of batch norm
f32, f64 = torch.float32, torch.float64


def _tolerance(dtype):
    return dict(atol=1e-4, rtol=1e-4) if dtype == f32 else dict(atol=1e-10, rtol=1e-9)


def _select(t, dim, i):
    return t if dim is None or t is None else t.select(dim, i)


def _clone(t):
    return None if t is None else t.clone()


def _stack_at(make, dim):
    """B samples from `make()` stacked at `dim`, or one unbatched sample for dim None."""
    return make() if dim is None else torch.stack([make() for _ in range(B)], dim)


def _outcome(fn):
    """('ok', result) or ('error', exception) of fn()."""
    try:
        return "ok", fn()
    except Exception as error:  # noqa: BLE001 - any refusal is an outcome here
        return "error", error


# -- batch norm: the sweep -------------------------------------------------------------------
# Where each argument's batch dim is (None: unbatched, closed over by the loop), by kind.
X_DIMS = {"x@0": 0, "x@1": 1, "x-unbatched": None}
STATS = {"stats-none": "none", "stats-unbatched": None, "stats@0": 0, "stats@-1": -1}
AFFINE = {"affine-none": "none", "affine-unbatched": None, "affine@0": 0}


def _bn_params():
    for (xk, xd), (sk, sd), (ak, ad) in itertools.product(X_DIMS.items(), STATS.items(), AFFINE.items()):
        if xd is None and sd in ("none", None) and ad in ("none", None):
            continue  # nothing batched: not a vmap
        for training, momentum, rank, dtype in itertools.product((True, False), (0.1, 1.0), (2, 3, 4), (f32, f64)):
            ident = f"{xk}-{sk}-{ak}-{'train' if training else 'eval'}-m{momentum}-{rank}d-{str(dtype)[6:]}"
            yield pytest.param(xd, sd, ad, training, momentum, rank, dtype, id=ident)


def _bn_args(x_dim, stats_dim, affine_dim, rank, dtype):
    """(x, running_mean, running_var, weight, bias) and their in_dims."""
    shape = (N, C, 5, 2)[:rank]
    x = _stack_at(lambda: torch.randn(shape, dtype=dtype), x_dim)
    if stats_dim == "none":
        mean = var = stats_dim = None
    else:
        mean = _stack_at(lambda: torch.randn(C, dtype=dtype), stats_dim)
        var = _stack_at(lambda: torch.rand(C, dtype=dtype) + 0.5, stats_dim)
    if affine_dim == "none":
        weight = bias = affine_dim = None
    else:
        weight, bias = (_stack_at(lambda: torch.randn(C, dtype=dtype), affine_dim) for _ in range(2))
    return [x, mean, var, weight, bias], (x_dim, stats_dim, stats_dim, affine_dim, affine_dim)


def _bn_loop(fn, args, in_dims):
    """Per-sample loop, each sample with its own copy of the running stats: (outputs, the
    per-sample running stats after the call)."""
    outs, means, variances = [], [], []
    for i in range(B):
        mean, var = (_clone(_select(t, d, i)) for t, d in zip(args[1:3], in_dims[1:3]))
        weight, bias = (_select(t, d, i) for t, d in zip(args[3:], in_dims[3:]))
        outs.append(fn(_select(args[0], in_dims[0], i), mean, var, weight, bias))
        means.append(mean)
        variances.append(var)
    return torch.stack(outs), means, variances


def _bn_vmap(vmap, fn, args, in_dims):
    """vmap of fn on copies of the running stats: (output, mean after, var after)."""
    mean, var = _clone(args[1]), _clone(args[2])
    out = vmap(fn, in_dims=in_dims)(args[0], mean, var, *args[3:])
    return out, mean, var


@pytest.mark.parametrize("x_dim, stats_dim, affine_dim, training, momentum, rank, dtype", list(_bn_params()))
def test_batch_norm_sweep(x_dim, stats_dim, affine_dim, training, momentum, rank, dtype):
    args, in_dims = _bn_args(x_dim, stats_dim, affine_dim, rank, dtype)

    def fn(x, mean, var, weight, bias):
        return F.batch_norm(x, mean, var, weight, bias, training=training, momentum=momentum, eps=1e-3)

    loop_status, loop_result = _outcome(lambda: _bn_loop(fn, args, in_dims))
    oracle_status, _ = _outcome(lambda: _bn_vmap(torch.func.vmap, fn, args, in_dims))
    status, result = _outcome(lambda: _bn_vmap(functx.vmap, fn, args, in_dims))

    if loop_status == "error":  # eval mode without running stats: every sample raises
        assert status == "error" and "running_mean" in str(result), result
        return
    if status == "error":
        assert oracle_status == "error", f"torch.func supports this, functx raised: {result!r}"
        # The one refusal: training mode would update unbatched running stats in place from
        # batched values (each element would need its own). It must say so and how to fix.
        assert training and args[1] is not None and stats_dim is None, result
        assert isinstance(result, RuntimeError) and "replace_all_batch_norm_modules_" in str(result)
        return
    out, mean, var = result
    ref, ref_means, ref_vars = loop_result
    tol = _tolerance(dtype)
    torch.testing.assert_close(out, ref, **tol)
    if args[1] is None:
        pass
    elif stats_dim is not None:  # batched: every element's update lands in its own slice
        torch.testing.assert_close(mean, torch.stack(ref_means, stats_dim), **tol)
        torch.testing.assert_close(var, torch.stack(ref_vars, stats_dim), **tol)
    elif args[1] is not None:
        # Unbatched stats: read only in eval mode; in training mode reached only when the
        # input is unbatched (an ensemble of affine parameters), then every element computes
        # the same update, which lands once, as for one sample.
        assert not training or x_dim is None
        torch.testing.assert_close(mean, ref_means[0], **tol)
        torch.testing.assert_close(var, ref_vars[0], **tol)


def test_batch_norm_sweep_covers_torch_func_wrong_values():
    """The sweep is stronger than agreeing with torch.func: with running stats batched at
    their last dim (a non-contiguous physical layout), torch.func drops the in-place update
    in training mode; functx must match the loop."""
    args, in_dims = _bn_args(0, -1, None, 3, f64)

    def fn(x, mean, var, weight, bias):
        return F.batch_norm(x, mean, var, weight, bias, training=True, momentum=0.5)

    _, ref_means, _ = _bn_loop(fn, args, in_dims)
    _, tf_mean, _ = _bn_vmap(torch.func.vmap, fn, args, in_dims)
    _, fx_mean, _ = _bn_vmap(functx.vmap, fn, args, in_dims)
    expected = torch.stack(ref_means, -1)
    assert not torch.allclose(tf_mean, expected)  # if torch.func gets fixed, drop this line
    torch.testing.assert_close(fx_mean, expected)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("stats_dim", [0, None])
@pytest.mark.parametrize("shape", [(C, 1), (1, C), (1, 1, C)])
@pytest.mark.parametrize("batched", ["x", "weight", "x+weight"])
def test_batch_norm_weight_of_any_shape_with_c_elements(shape, batched, stats_dim, training):
    """native_batch_norm reads weight/bias as flat vectors of C elements, whatever their
    shape: a (C, 1) or (1, 1, C) weight works in plain PyTorch, so it must under vmap (with
    unbatched running stats it raised, or with (1, 1, C) silently broadcast to wrong values)."""
    x_dim = 0 if "x" in batched else None
    w_dim = 0 if "weight" in batched else None
    refused = training and stats_dim is None and x_dim is not None  # as torch.func refuses
    x = _stack_at(lambda: torch.randn(N, C, 5, dtype=f64), x_dim)
    weight = _stack_at(lambda: torch.randn(shape, dtype=f64), w_dim)
    bias = torch.randn(shape, dtype=f64)
    mean = _stack_at(lambda: torch.randn(C, dtype=f64), stats_dim)
    var = _stack_at(lambda: torch.rand(C, dtype=f64) + 0.5, stats_dim)

    def fn(x, weight, mean, var):
        return F.batch_norm(x, mean, var, weight, bias, training=training, momentum=0.3)

    if refused:  # a batched input would update the unbatched running stats in place
        with pytest.raises(RuntimeError, match="running_mean"):
            functx.vmap(fn, in_dims=(x_dim, w_dim, stats_dim, stats_dim))(x, weight, mean, var)
        return
    ref, ref_means, ref_vars = [], [], []
    for i in range(B):
        ref_means.append(_select(mean, stats_dim, i).clone())
        ref_vars.append(_select(var, stats_dim, i).clone())
        ref.append(fn(_select(x, x_dim, i), _select(weight, w_dim, i), ref_means[-1], ref_vars[-1]))
    out = functx.vmap(fn, in_dims=(x_dim, w_dim, stats_dim, stats_dim))(x, weight, mean, var)
    torch.testing.assert_close(out, torch.stack(ref))
    if stats_dim is None:  # read in eval mode; in training one update from the one input
        torch.testing.assert_close((mean, var), (ref_means[0], ref_vars[0]))
    else:
        torch.testing.assert_close((mean, var), (torch.stack(ref_means), torch.stack(ref_vars)))


def test_batch_norm_nested_vmap_training_with_batched_stats():
    """Two vmap levels, stats batched at both (ensembles of ensembles), input at the inner."""
    x = torch.randn(N, 2, C, 5, dtype=f64)  # inner batch at dim 1
    mean = torch.randn(B, 2, C, dtype=f64)
    var = torch.rand(C, B, 2, dtype=f64) + 0.5  # outer batch at 1, inner at 2 (0 after the outer)

    def fn(x, mean, var):
        return F.batch_norm(x, mean, var, training=True, momentum=0.2)

    ref_mean, ref_var = mean.clone(), var.clone()
    ref = torch.stack(
        [torch.stack([fn(x[:, j], ref_mean[i, j], ref_var[:, i, j]) for j in range(2)]) for i in range(B)]
    )
    inner = functx.vmap(fn, in_dims=(1, 0, 1))
    out = functx.vmap(inner, in_dims=(None, 0, 1))(x, mean, var)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close((mean, var), (ref_mean, ref_var))


# -- instance / layer / group norm, briefly ----------------------------------------------------
def _instance_train(x, mean, var, w, b):
    return F.instance_norm(x, mean, var, w, b, use_input_stats=True, momentum=0.3)


def _instance_eval(x, mean, var, w, b):
    return F.instance_norm(x, mean, var, w, b, use_input_stats=False)


def _layer(x, mean, var, w, b):
    return F.layer_norm(x, (C,), w, b)


def _group(x, mean, var, w, b):
    return F.group_norm(x, 3, w, b)


def _norm_params():
    for (name, fn), (xk, xd), (sk, sd), (ak, ad), rank in itertools.product(
        [("instance-train", _instance_train), ("instance-eval", _instance_eval), ("layer", _layer), ("group", _group)],
        X_DIMS.items(),
        STATS.items(),
        AFFINE.items(),
        (3, 4),
    ):
        if name in ("layer", "group") and sk != "stats-none":
            continue
        if xd is None and sd in ("none", None) and ad in ("none", None):
            continue
        yield pytest.param(fn, xd, sd, ad, rank, id=f"{name}-{xk}-{sk}-{ak}-{rank}d")


@pytest.mark.parametrize("fn, x_dim, stats_dim, affine_dim, rank", list(_norm_params()))
def test_other_norms_sweep(fn, x_dim, stats_dim, affine_dim, rank):
    args, in_dims = _bn_args(x_dim, stats_dim, affine_dim, rank, f64)
    if fn is _layer:  # normalize the last dim, of size C
        args[0] = _stack_at(lambda: torch.randn((N, 5, 2)[: rank - 1] + (C,), dtype=f64), x_dim)
    loop_status, loop_result = _outcome(lambda: _bn_loop(fn, args, in_dims))
    oracle_status, _ = _outcome(lambda: _bn_vmap(torch.func.vmap, fn, args, in_dims))
    status, result = _outcome(lambda: _bn_vmap(functx.vmap, fn, args, in_dims))
    if loop_status == "error":  # instance norm eval without running stats
        assert status == "error", "each sample raises; vmap returned a value"
        return
    if status == "error":
        assert oracle_status == "error", f"torch.func supports this, functx raised: {result!r}"
        assert fn is _instance_train and args[1] is not None and stats_dim is None
        assert "replace_all_batch_norm_modules_" in str(result)
        return
    out, mean, var = result
    ref, ref_means, ref_vars = loop_result
    torch.testing.assert_close(out, ref)
    if stats_dim is not None and args[1] is not None:
        torch.testing.assert_close(mean, torch.stack(ref_means, stats_dim))
        torch.testing.assert_close(var, torch.stack(ref_vars, stats_dim))


# -- batch norm in models: per-sample gradients -------------------------------------------------------
def _model():
    torch.manual_seed(1)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 5), nn.BatchNorm1d(5)
    ).double()


def _loop_grads(models, xs, ys):
    """torch.autograd.grad of each model's loss on its own minibatch (mutates the models'
    running stats, as training does)."""
    grads = []
    for model, x, y in zip(models, xs, ys):
        loss = F.cross_entropy(model(x), y)
        names, params = zip(*model.named_parameters())
        grads.append(dict(zip(names, torch.autograd.grad(loss, params))))
    return {k: torch.stack([g[k] for g in grads]) for k in grads[0]}


@pytest.mark.parametrize("x_dim", [0, 1])
def test_per_group_gradients_with_batched_running_stat_buffers(x_dim):
    """vmap(grad(loss)) in training mode over B minibatches, each with its own copy of the
    running-stat buffers: gradients and buffer updates equal B separate training steps."""
    model = _model()
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach().expand(B, *v.shape).clone() for k, v in model.named_buffers()}
    xs = torch.randn(B, 3, 2, 6, 6, dtype=f64)
    ys = torch.randint(0, 5, (B, 3))

    def loss(params, buffers, x, y):
        return F.cross_entropy(functx.functional_call(model, (params, buffers), (x,)), y)

    with functx.vmap_fallback("error"):
        grads = functx.vmap(functx.grad(loss), in_dims=(None, 0, x_dim, 0))(params, buffers, xs.movedim(0, x_dim), ys)
    models = [copy.deepcopy(model) for _ in range(B)]
    torch.testing.assert_close(grads, _loop_grads(models, xs, ys))
    for name, value in buffers.items():
        torch.testing.assert_close(value, torch.stack([dict(m.named_buffers())[name] for m in models]))


def test_per_sample_gradients_after_replace_all_batch_norm_modules():
    """The torch.func recipe: batch norm without running stats, one sample per element."""
    model = functx.nn.replace_all_batch_norm_modules_(_model()[:4])  # Conv2d, BatchNorm2d, ReLU, Flatten
    head = torch.randn(64, 5, dtype=f64)
    params = {k: v.detach() for k, v in model.named_parameters()}
    xs = torch.randn(B, 2, 6, 6, dtype=f64)
    ys = torch.randint(0, 5, (B,))

    def loss(params, x, y):
        out = functx.functional_call(model, params, (x.unsqueeze(0),)) @ head
        return F.cross_entropy(out, y.unsqueeze(0))

    with functx.vmap_fallback("error"):
        grads = functx.vmap(functx.grad(loss), in_dims=(None, 0, 0))(params, xs, ys)
    ref = []
    for x, y in zip(xs, ys):
        value = F.cross_entropy(model(x.unsqueeze(0)) @ head, y.unsqueeze(0))
        ref.append(torch.autograd.grad(value, list(model.parameters())))
    torch.testing.assert_close(list(grads.values()), [torch.stack(g) for g in zip(*ref)])


@pytest.mark.parametrize("vmap", [torch.func.vmap, functx.vmap], ids=["torch.func", "functx"])
def test_training_mode_with_unbatched_running_stat_buffers_is_refused(vmap):
    """Both refuse (each element would update the one buffer); functx names the fixes."""
    model = _model()
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    grad = torch.func.grad if vmap is torch.func.vmap else functx.grad
    call = torch.func.functional_call if vmap is torch.func.vmap else functx.functional_call

    def loss(params, buffers, x, y):
        return F.cross_entropy(call(model, (params, buffers), (x,)), y)

    x, y = torch.randn(B, 3, 2, 6, 6, dtype=f64), torch.randint(0, 5, (B, 3))
    with pytest.raises(RuntimeError, match="running_mean or running_var") as error:
        vmap(grad(loss), in_dims=(None, None, 0, 0))(params, buffers, x, y)
    if vmap is functx.vmap:
        assert "replace_all_batch_norm_modules_" in str(error.value)


@pytest.mark.parametrize("shared_counter", [False, True])
def test_cumulative_momentum_module(shared_counter):
    """BatchNorm(momentum=None) averages cumulatively: its factor is 1 / num_batches_tracked,
    a Python float read from the buffer. With a batched counter that is a data-dependent
    .item() (torch.func raises too): a clear error. With one shared counter every element
    reads the same factor: the loop's values."""
    models = [nn.BatchNorm1d(C, momentum=None).double() for _ in range(B)]
    for m in models:
        m.num_batches_tracked.fill_(2)
        m.running_mean.normal_()
    params, buffers = functx.stack_module_state(copy.deepcopy(models))
    buffers = {k: v.clone() for k, v in buffers.items()}
    x = torch.randn(B, N, C, dtype=f64)
    counter = torch.tensor(2)

    def run(params, mean, var, count, x):
        state = {"running_mean": mean, "running_var": var, "num_batches_tracked": count}
        return functx.functional_call(models[0], (params, state), (x,))

    args = (params, buffers["running_mean"], buffers["running_var"])
    if not shared_counter:
        with functx.vmap_fallback("error"), pytest.raises(RuntimeError, match=re.escape(".item()")):
            functx.vmap(run)(*args, buffers["num_batches_tracked"], x)
        return
    out = functx.vmap(run, in_dims=(0, 0, 0, None, 0))(*args, counter, x)
    torch.testing.assert_close(out, torch.stack([m(xi) for m, xi in zip(models, x)]))
    torch.testing.assert_close(buffers["running_mean"], torch.stack([m.running_mean for m in models]))
    torch.testing.assert_close(buffers["running_var"], torch.stack([m.running_var for m in models]))
    assert counter.item() == 3


@pytest.mark.parametrize("affine_dim", [None, 0])
@pytest.mark.parametrize("stats", ["none", "batched", "eval"])
@pytest.mark.parametrize("x_dim", [0, 1, None])
def test_vmap_grad_through_functional_batch_norm(x_dim, stats, affine_dim):
    """Per-sample gradients w.r.t. input, weight and bias through F.batch_norm (with nothing
    batched, vmap's error, as torch.func's)."""
    training = stats != "eval"
    stats_dim = {"none": "none", "batched": 0, "eval": 0}[stats]
    args, in_dims = _bn_args(x_dim, stats_dim, affine_dim, 3, f64)
    args[3], args[4] = (_stack_at(lambda: torch.randn(C, dtype=f64), affine_dim) for _ in range(2))
    in_dims = (*in_dims[:3], affine_dim, affine_dim)
    cotangent = torch.randn(N, C, 5, dtype=f64)

    def loss(x, mean, var, weight, bias):
        return (F.batch_norm(x, mean, var, weight, bias, training=training, momentum=0.3) * cotangent).sum()

    mean = _clone(args[1])
    if all(d is None for d in in_dims):
        with pytest.raises(ValueError, match="at least one input"):
            functx.vmap(functx.grad(loss, argnums=(0, 3, 4)), in_dims=in_dims)(args[0], mean, args[2], *args[3:])
        return
    with functx.vmap_fallback("error"):
        grads = functx.vmap(functx.grad(loss, argnums=(0, 3, 4)), in_dims=in_dims)(args[0], mean, args[2], *args[3:])
    ref, ref_means = [], []
    for i in range(B):
        x, m, v, w, b = (_clone(_select(t, d, i)) for t, d in zip(args, in_dims))
        for t in (x, w, b):
            t.requires_grad_()
        ref.append(torch.autograd.grad(loss(x, m, v, w, b), (x, w, b)))
        ref_means.append(m)
    torch.testing.assert_close(grads, tuple(torch.stack(g) for g in zip(*ref)))
    if mean is not None:
        torch.testing.assert_close(mean, torch.stack(ref_means))


# -- grid_sample --------------------------------------------------------------------------------
GRID_IN_DIMS = [(0, 0), (0, None), (None, 0), (1, 0), (0, 1), (1, 1), (2, None), (None, 2)]
GN, GC = 2, 2  # per-sample N, C of grid_sample


def _grid_args(spatial, in_dims, dtype=f64):
    """input (N, C, *in_spatial) and grid (N, *out_spatial, spatial) per sample, batched at
    in_dims; grid points reach a little outside [-1, 1] so padding modes matter."""
    input_shape = (GN, GC, *(4, 5, 3)[:spatial])
    grid_shape = (GN, *(3, 2, 4)[:spatial], spatial)

    def batched(shape, dim, scale):
        make = lambda: torch.randn(shape, dtype=dtype) * scale
        return _stack_at(make, dim)

    return batched(input_shape, in_dims[0], 1.0), batched(grid_shape, in_dims[1], 0.8)


def _grid_params():
    for spatial, mode, padding, align_corners in itertools.product(
        (2, 3), ("bilinear", "nearest", "bicubic"), ("zeros", "border", "reflection"), (True, False)
    ):
        if spatial == 3 and mode == "bicubic":
            continue  # 2-D only in PyTorch
        for in_dims in GRID_IN_DIMS:
            ident = f"{spatial}d-{mode}-{padding}-{'ac' if align_corners else 'noac'}-{in_dims[0]}-{in_dims[1]}"
            yield pytest.param(spatial, mode, padding, align_corners, in_dims, id=ident)


def _loop(fn, args, in_dims):
    return torch.stack([fn(*(_select(a, d, i) for a, d in zip(args, in_dims))) for i in range(B)])


@pytest.mark.parametrize("spatial, mode, padding, align_corners, in_dims", list(_grid_params()))
def test_grid_sample_sweep(spatial, mode, padding, align_corners, in_dims):
    def fn(input, grid):
        return F.grid_sample(input, grid, mode=mode, padding_mode=padding, align_corners=align_corners)

    args = _grid_args(spatial, in_dims)
    with functx.vmap_fallback("error"):  # vectorized: no per-sample loop ran
        out = functx.vmap(fn, in_dims=in_dims)(*args)
    torch.testing.assert_close(out, _loop(fn, args, in_dims))


@pytest.mark.parametrize("in_dims", [(1, 0), (0, 1)])
def test_grid_sample_where_torch_func_is_wrong(in_dims):
    args = _grid_args(2, in_dims)
    fn = lambda input, grid: F.grid_sample(input, grid, align_corners=False)
    ref = _loop(fn, args, in_dims)
    wrong = torch.func.vmap(fn, in_dims=in_dims)(*args)  # wrong shape, or wrong values; drop once fixed
    assert wrong.shape != ref.shape or not torch.allclose(wrong, ref)
    torch.testing.assert_close(functx.vmap(fn, in_dims=in_dims)(*args), ref)


@pytest.mark.parametrize("spatial", [2, 3])
def test_grid_sample_float32(spatial):
    fn = lambda input, grid: F.grid_sample(input, grid, mode="bilinear", align_corners=True)
    for in_dims in GRID_IN_DIMS:
        args = _grid_args(spatial, in_dims, f32)
        torch.testing.assert_close(functx.vmap(fn, in_dims=in_dims)(*args), _loop(fn, args, in_dims))


@pytest.mark.parametrize("spatial", [2, 3])
@pytest.mark.parametrize(
    "outer, inner", [((0, None), (None, 0)), ((None, 0), (0, None)), ((0, 0), (1, 0)), ((1, None), (0, 1))]
)
def test_grid_sample_nested_vmap(spatial, outer, inner):
    fn = lambda input, grid: F.grid_sample(input, grid, padding_mode="border", align_corners=False)
    input, grid = _grid_args(spatial, (None, None))
    args = [_stack_at(lambda t=t: t + 0.1 * torch.randn_like(t), d) for t, d in zip((input, grid), inner)]
    args = [_stack_at(lambda t=t: t + 0.1 * torch.randn_like(t), d) for t, d in zip(args, outer)]
    with functx.vmap_fallback("error"):
        out = functx.vmap(functx.vmap(fn, in_dims=inner), in_dims=outer)(*args)
    ref = _loop(lambda *a: _loop(fn, a, inner), args, outer)
    torch.testing.assert_close(out, ref)


def test_grid_sample_invalid_samples_raise_with_logical_shapes():
    """Not the folded physical shapes, which no sample has."""
    input, grid = _grid_args(2, (0, 0))
    sample = lambda input, grid: F.grid_sample(input, grid, align_corners=False)
    with pytest.raises(RuntimeError, match=r"same batch size.*\[2, 2, 4, 5\].*\[1, 3, 2, 2\]"):
        functx.vmap(sample, in_dims=(0, 0))(input, grid[:, :1])
    with pytest.raises(RuntimeError, match=r"size 2 in last dimension.*\[2, 3, 2, 3\]"):
        functx.vmap(sample, in_dims=(0, None))(input, torch.randn(2, 3, 2, 3, dtype=f64))
    with pytest.raises(RuntimeError, match="4D or 5D"):
        functx.vmap(sample, in_dims=(0, 0))(input[:, 0], grid[:, 0])


def _grid_grad_params():
    for spatial, mode, in_dims, argnums in itertools.product(
        (2, 3), ("bilinear", "nearest", "bicubic"), GRID_IN_DIMS, ((0,), (1,), (0, 1))
    ):
        if spatial == 3 and mode == "bicubic":
            continue
        ident = f"{spatial}d-{mode}-{in_dims[0]}-{in_dims[1]}-wrt{argnums}"
        yield pytest.param(spatial, mode, in_dims, argnums, id=ident)


def _grid_loss(mode, spatial):
    cotangent = torch.randn(GN, GC, *(3, 2, 4)[:spatial], dtype=f64)

    def loss(input, grid):
        out = F.grid_sample(input, grid, mode=mode, padding_mode="reflection", align_corners=False)
        return (out * cotangent).sum()

    return loss


def _autograd_loop(loss, args, in_dims, argnums):
    grads = []
    for i in range(B):
        sample = [_select(a, d, i).clone().requires_grad_() for a, d in zip(args, in_dims)]
        grads.append(torch.autograd.grad(loss(*sample), [sample[k] for k in argnums]))
    return tuple(torch.stack(g) for g in zip(*grads))


@pytest.mark.parametrize("spatial, mode, in_dims, argnums", list(_grid_grad_params()))
def test_vmap_grad_through_grid_sample(spatial, mode, in_dims, argnums):
    loss = _grid_loss(mode, spatial)
    args = _grid_args(spatial, in_dims)
    with functx.vmap_fallback("error"):
        grads = functx.vmap(functx.grad(loss, argnums=argnums), in_dims=in_dims)(*args)
    torch.testing.assert_close(grads, _autograd_loop(loss, args, in_dims, argnums))


@pytest.mark.parametrize("spatial", [2, 3])
@pytest.mark.parametrize("in_dims", GRID_IN_DIMS)
def test_vmap_of_vjp_through_grid_sample(spatial, in_dims):
    """vjp levels wrap, so grid_sampler_*_backward itself meets vmap with batched input and
    grid (the rule's fold into N); the cotangent is batched too."""
    loss = _grid_loss("bilinear", spatial)
    args = _grid_args(spatial, in_dims)

    def per_sample(input, grid):
        _, vjp_fn = functx.vjp(loss, input, grid)
        return vjp_fn(torch.tensor(1.0, dtype=f64))

    with functx.vmap_fallback("error"):
        grads = functx.vmap(per_sample, in_dims=in_dims)(*args)
    torch.testing.assert_close(grads, _autograd_loop(loss, args, in_dims, (0, 1)))


@pytest.mark.parametrize("spatial", [2, 3])
@pytest.mark.parametrize("argnums", [0, 1, (0, 1)])
@pytest.mark.parametrize("in_dims", [None, (0, None), (None, 0), (0, 0)])
def test_jacrev_through_grid_sample(spatial, argnums, in_dims):
    """jacrev's rows are a vmap over the backward with a batched grad_output (the rule's
    folds into C and into the output dims), also inside another vmap."""

    def fn(input, grid):
        return F.grid_sample(input, grid, mode="bilinear", padding_mode="zeros", align_corners=True)

    args = _grid_args(spatial, (None, None) if in_dims is None else in_dims)
    with functx.vmap_fallback("error"):
        if in_dims is None:
            jac = functx.jacrev(fn, argnums=argnums)(*args)
        else:
            jac = functx.vmap(functx.jacrev(fn, argnums=argnums), in_dims=in_dims)(*args)

    def reference(*sample):
        full = torch.autograd.functional.jacobian(fn, sample)
        return full[argnums] if isinstance(argnums, int) else full

    if in_dims is None:
        torch.testing.assert_close(jac, reference(*args))
    else:
        refs = [reference(*(_select(a, d, i) for a, d in zip(args, in_dims))) for i in range(B)]
        expected = torch.stack(refs) if isinstance(argnums, int) else tuple(map(torch.stack, zip(*refs)))
        torch.testing.assert_close(jac, expected)


@pytest.mark.filterwarnings("ignore::functx.PerformanceWarning")  # no forward formula: double-VJP
@pytest.mark.parametrize("spatial", [2, 3])
@pytest.mark.parametrize("argnums", [0, 1])
def test_jacfwd_and_hessian_through_grid_sample(spatial, argnums):
    """Forward mode goes through the double-VJP identity, i.e. vmap of the backward rules."""

    def fn(input, grid):
        return F.grid_sample(input, grid, mode="bilinear", align_corners=False)

    def loss(input, grid):
        return fn(input, grid).pow(2).sum()

    inputs = torch.randn(B, 1, 2, *(3, 2, 2)[:spatial], dtype=f64)  # small: the references loop
    grids = torch.randn(B, 1, *(2, 1, 2)[:spatial], spatial, dtype=f64) * 0.8
    samples = [[inputs[i], grids[i]] for i in range(B)]

    def only(f, sample):  # f of the differentiated argument alone (a cheaper reference)
        return lambda a: f(*(a if k == argnums else t for k, t in enumerate(sample)))

    ref = [torch.autograd.functional.jacobian(only(fn, sample), sample[argnums]) for sample in samples]
    torch.testing.assert_close(functx.jacfwd(fn, argnums=argnums)(*samples[0]), ref[0])
    torch.testing.assert_close(functx.vmap(functx.jacfwd(fn, argnums=argnums))(inputs, grids), torch.stack(ref))
    torch.testing.assert_close(
        functx.hessian(loss, argnums=argnums)(*samples[0]),
        torch.autograd.functional.hessian(only(loss, samples[0]), samples[0][argnums]),
    )


@pytest.mark.parametrize("theta_dim", [0, 2])
@pytest.mark.parametrize("align_corners", [True, False])
@pytest.mark.parametrize("spatial", [2, 3])
def test_affine_grid_and_its_gradient(spatial, align_corners, theta_dim):
    size = (GN, GC, *(4, 5, 3)[:spatial])
    theta = torch.randn(B, GN, spatial, spatial + 1, dtype=f64).movedim(0, theta_dim)
    input = torch.randn(B, *size, dtype=f64)

    def grid_of(theta):
        return F.affine_grid(theta, size, align_corners=align_corners)

    def loss(theta, input):
        return F.grid_sample(input, grid_of(theta), align_corners=align_corners).pow(2).sum()

    in_dims = (theta_dim, 0)
    with functx.vmap_fallback("error"):
        grids = functx.vmap(grid_of, in_dims=theta_dim)(theta)
        grads = functx.vmap(functx.grad(loss, argnums=(0, 1)), in_dims=in_dims)(theta, input)
    torch.testing.assert_close(grids, _loop(grid_of, (theta,), (theta_dim,)))
    torch.testing.assert_close(grads, _autograd_loop(loss, (theta, input), in_dims, (0, 1)))


# -- vmap of jacfwd / jacrev over columns ------------------------------------------------------------
def _write_then_sin(v):
    h = v.clone()
    h[0] = h[0] * 2
    return h.sin()


@pytest.mark.parametrize("chunk_size", [None, 1, 2])
@pytest.mark.parametrize("where", ["vmap", "jacobian"])
@pytest.mark.parametrize(
    "jacobian, fn",
    [
        (functx.jacfwd, torch.sin),
        (functx.jacrev, _write_then_sin),
        (functx.jacfwd, _write_then_sin),
        (functx.jacrev, torch.sin),
    ],
    ids=["jacfwd-sin", "jacrev-write", "jacfwd-write", "jacrev-sin"],
)
def test_vmap_of_jacobian_over_columns(jacobian, fn, where, chunk_size):
    x = torch.randn(4, B, dtype=f64)  # each column a sample
    if where == "vmap":
        jac = functx.vmap(jacobian(fn), in_dims=1, chunk_size=chunk_size)(x)
    else:
        jac = functx.vmap(jacobian(fn, chunk_size=chunk_size) if chunk_size else jacobian(fn), in_dims=1)(x)
    ref = torch.stack([torch.autograd.functional.jacobian(fn, x[:, i]) for i in range(B)])
    torch.testing.assert_close(jac, ref)


@pytest.mark.parametrize("jacobian", [functx.jacfwd, functx.jacrev])
def test_vmap_of_jacobian_over_matrix_samples_and_out_dims(jacobian):
    x = torch.randn(2, B, 3, dtype=f64)  # samples (2, 3) at dim 1
    jac = functx.vmap(jacobian(_write_then_sin), in_dims=1, out_dims=-1, chunk_size=2)(x)
    ref = torch.stack([torch.autograd.functional.jacobian(_write_then_sin, x[:, i]) for i in range(B)], -1)
    torch.testing.assert_close(jac, ref)
