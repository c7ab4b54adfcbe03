"""vmap of normalization (functx/vmap/rules/nn_norm.py) against per-sample loops.

Every case runs for each non-empty set of batched arguments (input only = a batch of
inputs, weight/bias/running stats only = a model ensemble on one input, all = both), with
the batch dim at 0 and at the last dim, under `vmap_fallback("error")`, which proves that
no per-sample loop ran. Batch norm in training mode also checks where the running-stat
updates land.
"""


import pytest
import torch
import torch.nn.functional as F

import functx
from functx import vmap
from .loop_reference import loop, stack_tree, batched_inputs, check, with_patterns_and_dims as with_patterns  # noqa: F401

B = 3  # batch size of every test
f64 = torch.float64
aten = torch.ops.aten


# -- the check -------------------------------------------------------------------------------
def randn(*shape):
    return lambda: torch.randn(*shape, dtype=f64)


def positive(*shape):
    return lambda: torch.rand(*shape, dtype=f64) + 0.5


# -- layer norm, group norm, batch norm without running-stat updates ----------------------------
def batch_norm_eval(x, mean, var, w, b):
    return F.batch_norm(x, mean, var, w, b, training=False, eps=1e-3)


def batch_norm_train_no_stats(x, w, b):
    return F.batch_norm(x, None, None, w, b, training=True)


def instance_norm_eval(x, mean, var, w, b):
    return F.instance_norm(x, mean, var, w, b, use_input_stats=False)


def group_norm_stats(x, w, b):
    return aten.native_group_norm(x.contiguous(), w.contiguous(), b.contiguous(), 2, 4, 6, 2, 1e-5)


CASES = [
    ("layer_norm", lambda x, w, b: F.layer_norm(x, (3, 4), w, b), (randn(2, 3, 4), randn(3, 4), randn(3, 4))),
    ("layer_norm_last_dim", lambda x, w, b: F.layer_norm(x, (4,), w, b, eps=1e-3), (randn(2, 3, 4), randn(4), randn(4))),
    ("layer_norm_all_dims", lambda x, w: F.layer_norm(x, (5,), w), (randn(5), randn(5))),
    ("layer_norm_no_affine", lambda x: F.layer_norm(x, (3, 4)), (randn(2, 3, 4),)),
    ("layer_norm_stats", lambda x, w: aten.native_layer_norm(x, [4], w, None, 1e-5), (randn(2, 3, 4), randn(4))),
    ("group_norm", lambda x, w, b: F.group_norm(x, 2, w, b), (randn(2, 4, 3, 3), randn(4), randn(4))),
    ("group_norm_1d", lambda x, w: F.group_norm(x, 4, w), (randn(3, 4, 5), randn(4))),
    ("group_norm_no_spatial", lambda x, b: F.group_norm(x, 1, None, b), (randn(2, 4), randn(4))),
    # The aten op itself requires a contiguous input and misreads strided weight/bias
    # (F.group_norm makes them contiguous); so must this direct call.
    ("group_norm_stats", group_norm_stats, (randn(2, 4, 2, 3), randn(4), randn(4))),
    ("batch_norm_eval", batch_norm_eval, (randn(4, 3, 5), randn(3), positive(3), randn(3), randn(3))),
    ("batch_norm_eval_2d", lambda x, m, v: F.batch_norm(x, m, v), (randn(4, 3), randn(3), positive(3))),
    ("batch_norm_train", batch_norm_train_no_stats, (randn(4, 3, 2, 2), randn(3), randn(3))),
    ("batch_norm_train_2d", lambda x: F.batch_norm(x, None, None, training=True), (randn(4, 3),)),
    ("batch_norm_train_stats_out", lambda x, w: aten.native_batch_norm(x, w, None, None, None, True, 0.1, 1e-5), (randn(4, 3, 2), randn(3))),
    ("instance_norm", lambda x, w, b: F.instance_norm(x, weight=w, bias=b), (randn(2, 3, 4, 4), randn(3), randn(3))),
    ("instance_norm_eval", instance_norm_eval, (randn(2, 3, 5), randn(3), positive(3), randn(3), randn(3))),
]


@pytest.mark.parametrize("fn, makers, pattern, dim", list(with_patterns(CASES)))
def test_normalization(fn, makers, pattern, dim):
    check(fn, makers, pattern, dim)


def test_nested_layer_norm_and_batch_norm():
    x = torch.randn(2, 4, 3, 5, B, dtype=f64)
    w = torch.randn(2, 3, dtype=f64)

    def f(x, w):
        return F.layer_norm(F.batch_norm(x, None, None, w, training=True), (5,))

    with functx.vmap_fallback("error"):
        out = vmap(vmap(f, in_dims=(-1, None)), in_dims=(0, 0))(x, w)
    expected = torch.stack([torch.stack([f(x[i, ..., j], w[i]) for j in range(B)]) for i in range(2)])
    torch.testing.assert_close(out, expected)


def test_nested_group_norm_ensemble():
    x = torch.randn(B, 2, 4, 3, dtype=f64)
    w, b = torch.randn(2, 4, dtype=f64), torch.randn(2, 4, dtype=f64)

    def f(x, w, b):
        return F.group_norm(x, 2, w, b)

    with functx.vmap_fallback("error"):
        out = vmap(vmap(f, in_dims=(None, 0, 0)), in_dims=(0, None, None))(x, w, b)
    expected = torch.stack([torch.stack([f(x[i], w[j], b[j]) for j in range(2)]) for i in range(B)])
    torch.testing.assert_close(out, expected)


# -- batch norm in training mode: running statistics ------------------------------------------
def batch_norm_train(x, mean, var, w):
    return F.batch_norm(x, mean, var, w, training=True, momentum=0.3)


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("weight_batched", [False, True])
def test_batch_norm_train_updates_batched_running_stats(dim, weight_batched):
    """Each batch element normalizes with its own statistics and updates its own buffers;
    in_dims=1 gives non-contiguous buffers, whose update must still land."""
    x = torch.randn(B, 4, 3, 2, dtype=f64)
    mean = torch.randn(3, B, dtype=f64).movedim(1, dim).contiguous() if dim else torch.randn(B, 3, dtype=f64)
    var = torch.rand(B, 3, dtype=f64).movedim(0, dim).contiguous() + 0.5
    w = torch.randn(B, 3, dtype=f64) if weight_batched else torch.randn(3, dtype=f64)
    mean_ref, var_ref = mean.clone(), var.clone()
    with functx.vmap_fallback("error"):
        out = vmap(batch_norm_train, in_dims=(0, dim, dim, 0 if weight_batched else None))(x, mean, var, w)
    expected = []
    for i in range(B):
        m, v = mean_ref.select(dim, i).clone(), var_ref.select(dim, i).clone()
        expected.append(batch_norm_train(x[i], m, v, w[i] if weight_batched else w))
        mean_ref.select(dim, i).copy_(m)
        var_ref.select(dim, i).copy_(v)
    torch.testing.assert_close(out, torch.stack(expected))
    torch.testing.assert_close(mean, mean_ref)
    torch.testing.assert_close(var, var_ref)


def test_batch_norm_train_unbatched_input_batched_stats():
    x = torch.randn(4, 3, dtype=f64)
    mean, var = torch.zeros(B, 3, dtype=f64), torch.ones(B, 3, dtype=f64)
    with functx.vmap_fallback("error"):
        out = vmap(batch_norm_train, in_dims=(None, 0, 0, None))(x, mean, var, None)
    m, v = torch.zeros(3, dtype=f64), torch.ones(3, dtype=f64)
    expected = batch_norm_train(x, m, v, None)
    torch.testing.assert_close(out, expected.expand(B, 4, 3))
    torch.testing.assert_close(mean, m.expand(B, 3))
    torch.testing.assert_close(var, v.expand(B, 3))


def test_batch_norm_train_ensemble_weights_updates_shared_stats_once():
    """Only the affine weight is batched: the input's statistics are the same for every
    batch element, and the unbatched buffers are updated once, as torch.func does."""
    x = torch.randn(4, 3, 2, dtype=f64)
    mean, var = torch.zeros(3, dtype=f64), torch.ones(3, dtype=f64)
    w = torch.randn(B, 3, dtype=f64)
    with functx.vmap_fallback("error"):
        out = vmap(batch_norm_train, in_dims=(None, None, None, 0))(x, mean, var, w)
    m, v = torch.zeros(3, dtype=f64), torch.ones(3, dtype=f64)
    expected = torch.stack([batch_norm_train(x, m.clone(), v.clone(), w[i]) for i in range(B)])
    batch_norm_train(x, m, v, None)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close((mean, var), (m, v))


@pytest.mark.parametrize("stats_in_dims", [(None, None), (0, None)])
def test_batch_norm_train_unbatched_running_stats_is_an_error(stats_in_dims):
    x = torch.randn(B, 4, 3, dtype=f64)
    mean, var = torch.zeros(3, dtype=f64), torch.ones(3, dtype=f64)
    if stats_in_dims[0] == 0:
        mean = torch.zeros(B, 3, dtype=f64)
    with pytest.raises(RuntimeError, match="replace_all_batch_norm_modules_.*track_running_stats=False.*eval"):
        vmap(batch_norm_train, in_dims=(0, *stats_in_dims, None))(x, mean, var, None)


def test_instance_norm_updates_batched_running_stats():
    x = torch.randn(B, 2, 3, 4, dtype=f64)
    mean, var = torch.randn(B, 3, dtype=f64), torch.rand(B, 3, dtype=f64) + 0.5
    mean_ref, var_ref = mean.clone(), var.clone()

    def f(x, m, v):
        return F.instance_norm(x, m, v, use_input_stats=True, momentum=0.3)

    with functx.vmap_fallback("error"):
        out = vmap(f)(x, mean, var)
    expected = torch.stack([f(x[i], mean_ref[i], var_ref[i]) for i in range(B)])
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close((mean, var), (mean_ref, var_ref))


def test_instance_norm_with_unbatched_running_stats_is_an_error():
    x = torch.randn(B, 2, 3, 4, dtype=f64)
    with pytest.raises(RuntimeError, match="replace_all_batch_norm_modules_"):
        vmap(lambda x: F.instance_norm(x, torch.zeros(3, dtype=f64), torch.ones(3, dtype=f64), use_input_stats=True))(x)


def test_batch_norm_eval_without_running_stats_is_an_error():
    x = torch.randn(B, 4, 3, dtype=f64)
    with pytest.raises(RuntimeError, match="running_mean and running_var must be defined"):
        vmap(lambda x: aten.native_batch_norm(x, None, None, None, None, False, 0.1, 1e-5))(x)


def test_batch_norm_module_ensemble_in_training_mode():
    """An ensemble of BatchNorm modules (stacked parameters and buffers) in training mode:
    per-model outputs match, and every model's running stats land in the stacked buffers."""
    models = [torch.nn.BatchNorm2d(3, momentum=0.2).double() for _ in range(B)]
    for m in models:
        torch.nn.init.normal_(m.weight)
        torch.nn.init.normal_(m.bias)
    names = [n for n, _ in models[0].named_parameters()] + [n for n, _ in models[0].named_buffers()]
    state = {n: torch.stack([dict(m.state_dict(keep_vars=True))[n].detach() for m in models]) for n in names}
    x = torch.randn(4, 3, 2, 2, dtype=f64)

    def run(state, x):
        return torch.func.functional_call(models[0], state, (x,))

    with functx.vmap_fallback("error"):
        out = vmap(run, in_dims=(0, None))(state, x)
    with torch.no_grad():
        expected = torch.stack([m(x) for m in models])
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(state["running_mean"], torch.stack([m.running_mean for m in models]))
    torch.testing.assert_close(state["running_var"], torch.stack([m.running_var for m in models]))
    torch.testing.assert_close(state["num_batches_tracked"], torch.stack([m.num_batches_tracked for m in models]))


# -- the other batch-norm overloads (what tracing produces) --------------------------------------
def legit(x, w, mean, var):
    return aten._native_batch_norm_legit(x, w, None, mean, var, False, 0.1, 1e-5)


def legit_no_stats(x, w):
    return aten._native_batch_norm_legit.no_stats(x, w, None, True, 0.1, 1e-5)


def legit_no_training(x, w, mean, var):
    return aten._native_batch_norm_legit_no_training(x, w, None, mean, var, 0.1, 1e-5)


def no_update(x, w, mean, var):
    return aten._batch_norm_no_update(x, w, None, mean, var, 0.1, 1e-5)


OVERLOADS = [
    ("legit", legit, (randn(4, 3, 2), randn(3), randn(3), positive(3))),
    ("legit_no_stats", legit_no_stats, (randn(4, 3, 2), randn(3))),
    ("legit_no_training", legit_no_training, (randn(4, 3, 2), randn(3), randn(3), positive(3))),
    ("no_update", no_update, (randn(4, 3, 2), randn(3), randn(3), positive(3))),
]


@pytest.mark.parametrize("fn, makers, pattern, dim", list(with_patterns(OVERLOADS, dims=(0,))))
def test_batch_norm_overloads(fn, makers, pattern, dim):
    check(fn, makers, pattern, dim)


def test_batch_norm_with_update():
    x = torch.randn(B, 4, 3, dtype=f64)
    mean, var = torch.randn(B, 3, dtype=f64), torch.rand(B, 3, dtype=f64) + 0.5
    mean_ref, var_ref = mean.clone(), var.clone()
    with functx.vmap_fallback("error"):
        out = vmap(lambda x, m, v: aten._batch_norm_with_update(x, None, None, m, v, 0.1, 1e-5))(x, mean, var)
    expected = loop(lambda x, m, v: aten._batch_norm_with_update(x, None, None, m, v, 0.1, 1e-5), (x, mean_ref, var_ref), (0, 0, 0))
    torch.testing.assert_close(out[:3], expected[:3])
    assert out[3].shape == (B, 0) and out[3].dtype == torch.uint8
    torch.testing.assert_close((mean, var), (mean_ref, var_ref))


# -- gradients: vmap of grad (per-sample gradients) and grad of vmap ------------------------------
def grad_of(fn, *wrt):
    """x, *rest -> d sum(fn(x, *rest) * cotangent) / d (args at `wrt`), for one sample;
    taken inside vmap, the backward ops reach vmap batched."""

    def grads(*args):
        args = [a.detach().requires_grad_() if i in wrt else a for i, a in enumerate(args)]
        out = fn(*args)
        cotangent = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
        return torch.autograd.grad(out, [args[i] for i in wrt], cotangent)

    return grads


PER_SAMPLE_GRADS = [
    ("layer_norm", grad_of(lambda x, w, b: F.layer_norm(x, (4,), w, b), 0, 1, 2), (randn(2, 3, 4), randn(4), randn(4))),
    ("group_norm", grad_of(lambda x, w, b: F.group_norm(x, 2, w, b), 0, 1, 2), (randn(2, 4, 3), randn(4), randn(4))),
    ("batch_norm_train", grad_of(batch_norm_train_no_stats, 0, 1, 2), (randn(4, 3, 2), randn(3), randn(3))),
    ("batch_norm_eval", grad_of(batch_norm_eval, 0, 3), (randn(4, 3), randn(3), positive(3), randn(3), randn(3))),
]


@pytest.mark.parametrize("fn, makers, pattern, dim", list(with_patterns(PER_SAMPLE_GRADS, dims=(0,))))
def test_per_sample_gradients(fn, makers, pattern, dim):
    check(fn, makers, pattern, dim)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x, w: F.batch_norm(x, None, None, w, training=True),
        lambda x, w: F.layer_norm(x, (3,), w),
        lambda x, w: F.group_norm(x, 3, w),
    ],
    ids=["batch_norm", "layer_norm", "group_norm"],
)
def test_gradient_through_vmap(fn):
    x = torch.randn(B, 4, 3, dtype=f64)
    w = torch.randn(3, dtype=f64, requires_grad=True)
    cotangent = torch.randn(B, 4, 3, dtype=f64)
    with functx.vmap_fallback("error"):
        (grad,) = torch.autograd.grad(vmap(fn, in_dims=(0, None))(x, w), w, cotangent)
    (expected,) = torch.autograd.grad(torch.stack([fn(x[i], w) for i in range(B)]), w, cotangent)
    torch.testing.assert_close(grad, expected)


def test_per_sample_gradients_with_functx_grad():
    """Per-sample gradients of a model with layer, group and (stat-free) batch norm."""
    w1, g1, g2 = torch.randn(6, 3, dtype=f64), torch.randn(6, dtype=f64), torch.randn(6, dtype=f64)
    xs, ts = torch.randn(B, 4, 3, dtype=f64), torch.randn(B, 4, 6, dtype=f64)

    def loss(params, x, t):
        w, a, b = params
        h = F.layer_norm(F.linear(x, w), (6,), a)
        h = F.group_norm(h, 2, b)  # (N, C=6): groups over the features of each sample
        h = F.batch_norm(h, None, None, a, b, training=True)
        return F.mse_loss(h, t)

    with functx.vmap_fallback("error"):
        grads = vmap(functx.grad(loss), in_dims=(None, 0, 0))((w1, g1, g2), xs, ts)
    expected = []
    for x, t in zip(xs, ts):
        p = [q.detach().requires_grad_() for q in (w1, g1, g2)]
        expected.append(torch.autograd.grad(loss(p, x, t), p))
    torch.testing.assert_close(list(grads), [torch.stack(g) for g in zip(*expected)])


@pytest.mark.parametrize("argnums", [(0, 1, 2), (0,), (2,)])
@pytest.mark.parametrize("shape", [(4, 3, 5), (4, 5)])
def test_layer_norm_backward_rule_gives_per_sample_gradients(argnums, shape):
    """native_layer_norm_backward under vmap(grad): weight/bias gradients per sample."""
    import torch.func as tf

    w, b, x = torch.randn(5, dtype=f64), torch.randn(5, dtype=f64), torch.randn(*shape, dtype=f64)

    def loss(w, b, xi):
        return (F.layer_norm(xi, (5,), w, b) ** 3).sum()

    with functx.vmap_fallback("error"):
        got = vmap(functx.grad(loss, argnums=argnums), in_dims=(None, None, 0))(w, b, x)
    want = tf.vmap(tf.grad(loss, argnums=argnums), in_dims=(None, None, 0))(w, b, x)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e)
