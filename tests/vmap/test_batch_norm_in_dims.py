"""Batch norm under vmap for every in_dims combination (issue 27).

What was wrong: in training mode, an *unbatched* input with running stats of which one is
batched and the other is not (`in_dims=(None, 0, None, ...)` / `(None, None, 0, ...)`)
was refused with "batch norm in training mode got a tensor batched ... while its
running_mean/running_var ... are not (all) batched". Those programs have a per-sample
meaning: the batch statistics come from the input alone, so they are the same for every
element, and every element makes the same update to an unbatched running stat (it takes
it once) and its own update to a batched one. (torch.func runs them but leaves the
unbatched running stat un-updated; the per-sample loop decides, see `loop_reference`.)
The same refusal hit `vmap(grad(f))` / `vmap(jvp(...))` with an unbatched differentiated
input and an unbatched running stat: the direct AD level gives such an input a batch dim
(an expand, docs/architecture.md "grad, jacrev and jvp inside vmap"), so batch norm saw a batched input
holding the same value in every element, where torch.func sees an unbatched one.

Every case is compared with `loop_reference`, a float64 per-sample loop of plain PyTorch:
the output AND the running stats, which batch norm updates in place (the observable side
effect). Where the loop has no meaning (elements would write different values into one
unbatched running stat), functx must raise its documented error (docs/errors.md) and
leave the interpreter stack empty.
"""

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F

import functx
from functx.core import current_stack
from .loop_reference import stack_tree

B, N, C = 3, 4, 2
f64 = torch.float64
MOMENTUM, EPS = 0.3, 1e-3
UNBATCHED_STATS_ERROR = "batch norm in training mode got a tensor batched at this vmap level"
PER_SAMPLE_SHAPES = {"NC": (N, C), "NCL": (N, C, 5), "NCHW": (N, C, 3, 2)}


def loop_reference(fn, args, in_dims, shared_positions):
    """`fn` per batch element on clones of `args`: batched args are sliced as views (so
    in-place updates land in the batched clone); the args at `shared_positions` that are
    unbatched (running stats, buffers) are cloned per element, and written back once when
    every element wrote the same value into them. Returns (stacked outputs, args after the
    loop), or None when elements disagree on an unbatched buffer: one buffer for the whole
    batch cannot hold several elements' updates, so the program has no per-sample meaning."""
    args = [None if a is None else a.clone() for a in args]
    outs, copies = [], {k: [] for k in shared_positions}
    for i in range(B):
        element = []
        for k, (a, d) in enumerate(zip(args, in_dims)):
            if a is None:
                element.append(None)
            elif d is not None:
                element.append(a.select(d, i))
            elif k in copies:
                copies[k].append(a.clone())
                element.append(copies[k][-1])
            else:
                element.append(a)
        outs.append(fn(*element))
    for k, written in copies.items():
        if written:
            if not all(torch.equal(written[0], w) for w in written):
                return None
            args[k].copy_(written[0])
    return stack_tree(outs), args


def batched(shape, dim, positive=False):
    """A float64 tensor of per-sample `shape`, with B samples stacked at `dim` (or not)."""
    full = shape if dim is None else (B, *shape)
    t = torch.rand(full, dtype=f64) + 0.5 if positive else torch.randn(full, dtype=f64)
    return t if dim is None else t.movedim(0, dim)


# -- F.batch_norm: the sweep -------------------------------------------------------------------
def _sweep():
    for shape, x_dim, stats, affine, training in itertools.product(
        PER_SAMPLE_SHAPES,
        (None, 0, 1),
        (None, *itertools.product((None, 0), repeat=2)),  # running stats: absent, or their in_dims
        (None, *itertools.product((None, 0), repeat=2)),  # weight/bias: absent, or their in_dims
        (True, False),
    ):
        if not training and stats is None:
            continue  # eval mode needs running stats (an error without vmap too)
        dims = (x_dim, *(stats or (None, None)), *(affine or (None, None)))
        if all(d is None for d in dims):
            continue  # nothing batched
        label = "-".join(
            [shape, f"x{x_dim}", "nostats" if stats is None else f"stats{stats[0]}{stats[1]}",
             "noaffine" if affine is None else f"wb{affine[0]}{affine[1]}", "train" if training else "eval"]
        )
        yield pytest.param(shape, x_dim, stats, affine, training, id=label.replace("None", "u"))


@pytest.mark.parametrize("shape, x_dim, stats, affine, training", list(_sweep()))
def test_batch_norm_in_dims_sweep(shape, x_dim, stats, affine, training):
    """functx.vmap(F.batch_norm) equals the per-sample loop, outputs and running-stat
    updates, for every in_dims of (input, running_mean, running_var, weight, bias); where
    the loop has no meaning (a batched input in training mode with an unbatched running
    stat), it raises the documented error."""
    per_sample = PER_SAMPLE_SHAPES[shape]
    x = batched(per_sample, x_dim)
    mean = None if stats is None else batched((C,), stats[0])
    var = None if stats is None else batched((C,), stats[1], positive=True)
    weight = None if affine is None else batched((C,), affine[0])
    bias = None if affine is None else batched((C,), affine[1])
    args = [x, mean, var, weight, bias]
    in_dims = (x_dim, *(stats or (None, None)), *(affine or (None, None)))

    def fn(x, mean, var, weight, bias):
        return F.batch_norm(x, mean, var, weight, bias, training=training, momentum=MOMENTUM, eps=EPS)

    expected = loop_reference(fn, args, in_dims, shared_positions=(1, 2))
    got_args = [None if a is None else a.clone() for a in args]
    if expected is None:
        assert training and x_dim is not None
        with pytest.raises(RuntimeError, match=UNBATCHED_STATS_ERROR + ".*replace_all_batch_norm_modules_"):
            functx.vmap(fn, in_dims=in_dims)(*got_args)
        assert current_stack() == ()
        return
    with functx.vmap_fallback("error"):  # no per-sample loop inside functx
        out = functx.vmap(fn, in_dims=in_dims)(*got_args)
    expected_out, expected_args = expected
    torch.testing.assert_close(out, expected_out)
    for name, got, want in zip(("running_mean", "running_var"), got_args[1:3], expected_args[1:3]):
        if want is not None:
            torch.testing.assert_close(got, want, msg=lambda m: f"{name} update: {m}")


@pytest.mark.parametrize("stats_dim", [1, -1])
@pytest.mark.parametrize("batched_stat", ["running_mean", "running_var", "both"])
def test_unbatched_input_with_some_batched_stats_at_another_dim(batched_stat, stats_dim):
    """The formerly refused case with the batched running stat stored at dim 1 (a
    non-contiguous physical value): each element's update lands in its own column."""
    x = torch.randn(N, C, 3, dtype=f64)
    mean = torch.randn(C, B, dtype=f64) if batched_stat in ("running_mean", "both") else torch.randn(C, dtype=f64)
    var = torch.rand(C, B, dtype=f64) + 0.5 if batched_stat in ("running_var", "both") else torch.rand(C, dtype=f64) + 0.5
    in_dims = (None, stats_dim if mean.dim() == 2 else None, stats_dim if var.dim() == 2 else None)

    def fn(x, mean, var):
        return F.batch_norm(x, mean, var, None, None, training=True, momentum=MOMENTUM, eps=EPS)

    expected_out, expected_args = loop_reference(fn, [x, mean, var], in_dims, shared_positions=(1, 2))
    with functx.vmap_fallback("error"):
        out = functx.vmap(fn, in_dims=in_dims)(x, mean, var)
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close((mean, var), tuple(expected_args[1:]))
    out.add_(1)  # every element owns its output: in-place writes work


# -- BatchNorm modules via functional_call (ensembles) -------------------------------------------
def _module_sweep():
    for kind, track, training, x_batched, params_stacked, buffers_stacked in itertools.product(
        ("1d-NC", "1d-NCL", "2d"), (True, False), (True, False), (True, False), (True, False), (True, False)
    ):
        if not track and buffers_stacked:
            continue  # no buffers to stack
        if not (x_batched or params_stacked or (track and buffers_stacked)):
            continue  # nothing batched
        label = (f"{kind}-{'track' if track else 'notrack'}-{'train' if training else 'eval'}"
                 f"-x{'b' if x_batched else 'u'}-p{'b' if params_stacked else 'u'}-buf{'b' if buffers_stacked else 'u'}")
        yield pytest.param(kind, track, training, x_batched, params_stacked, buffers_stacked, id=label)


@pytest.mark.parametrize("kind, track, training, x_batched, params_stacked, buffers_stacked", list(_module_sweep()))
def test_batch_norm_module_functional_call_sweep(kind, track, training, x_batched, params_stacked, buffers_stacked):
    """BatchNorm1d/2d (track_running_stats on/off, train/eval) through functx.functional_call
    with stacked or shared parameters and buffers, on a batched or a shared input (the
    Ensemble pattern): outputs and buffers (running stats, num_batches_tracked) equal a loop
    over the members, each a copy of the module holding that member's state."""
    module_type, shape = {"1d-NC": (torch.nn.BatchNorm1d, (N, C)), "1d-NCL": (torch.nn.BatchNorm1d, (N, C, 5)),
                          "2d": (torch.nn.BatchNorm2d, (N, C, 3, 2))}[kind]
    template = module_type(C, momentum=MOMENTUM, eps=EPS, track_running_stats=track).double()
    template.train(training)
    names = [n for n, _ in template.named_parameters()]
    buffer_names = [n for n, _ in template.named_buffers()]

    def state(name, stacked):
        value = dict(template.state_dict())[name]
        if value.is_floating_point():
            value = torch.randn_like(value) if "running_var" not in name else torch.rand_like(value) + 0.5
        return torch.stack([value.clone() for _ in range(B)]) if stacked else value.clone()

    params = {n: state(n, params_stacked) for n in names}
    for n in names:
        if params_stacked:
            params[n] = params[n] + torch.randn_like(params[n])  # members differ
    buffers = {n: state(n, buffers_stacked) for n in buffer_names}
    x = batched(shape, 0 if x_batched else None)

    def run(x, *flat):
        p = dict(zip(names, flat[: len(names)]))
        b = dict(zip(buffer_names, flat[len(names):]))
        return functx.functional_call(template, {**p, **b}, (x,))

    def member(x, *flat):
        model = copy.deepcopy(template)
        with torch.no_grad():
            for n, value in zip(names + buffer_names, flat):
                target = dict(model.named_parameters()).get(n)
                if target is None:
                    target = dict(model.named_buffers())[n]
                target.copy_(value)
        out = model(x)
        for n, value in zip(buffer_names, flat[len(names):]):
            value.copy_(dict(model.named_buffers())[n])  # the member's buffer updates
        return out.detach()

    args = [x, *params.values(), *buffers.values()]
    in_dims = (0 if x_batched else None, *([0 if params_stacked else None] * len(names)),
               *([0 if buffers_stacked else None] * len(buffer_names)))
    buffer_positions = range(1 + len(names), len(args))
    expected = loop_reference(member, args, in_dims, shared_positions=buffer_positions)
    got_args = [a.clone() for a in args]
    if expected is None:
        assert training and track and x_batched and not buffers_stacked
        with pytest.raises(RuntimeError, match=UNBATCHED_STATS_ERROR):
            functx.vmap(run, in_dims=in_dims)(*got_args)
        assert current_stack() == ()
        return
    with functx.vmap_fallback("error"):
        out = functx.vmap(run, in_dims=in_dims)(*got_args)
    expected_out, expected_args = expected
    torch.testing.assert_close(out, expected_out)
    for k in buffer_positions:
        torch.testing.assert_close(got_args[k], expected_args[k], msg=lambda m: f"{buffer_names[k - 1 - len(names)]}: {m}")


# -- vmap(grad): per-sample gradients through batch norm in training mode --------------------------
def _grad_sweep():
    for shape, x_dim, stats, affine_dim in itertools.product(
        ("NC", "NCHW"), (None, 0), ((0, 0), (None, 0), (0, None), (None, None), None), (None, 0)
    ):
        if x_dim is None and affine_dim is None and stats in ((None, None), None):
            continue  # nothing batched
        if x_dim is not None and stats is not None and None in stats:
            continue  # no per-sample meaning: the error is covered by the sweep above
        label = f"{shape}-x{x_dim}-" + ("nostats" if stats is None else f"stats{stats[0]}{stats[1]}") + f"-wb{affine_dim}"
        yield pytest.param(shape, x_dim, stats, affine_dim, id=label.replace("None", "u"))


@pytest.mark.parametrize("shape, x_dim, stats, affine_dim", list(_grad_sweep()))
def test_vmap_grad_batch_norm_training(shape, x_dim, stats, affine_dim):
    """functx.vmap(functx.grad(f)) with f a loss through F.batch_norm in training mode,
    gradients with respect to input, weight and bias: equal to torch.autograd.grad per
    sample (float64), and the running stats updated as by the per-sample loop."""
    per_sample = PER_SAMPLE_SHAPES[shape]
    x = batched(per_sample, x_dim)
    mean = None if stats is None else batched((C,), stats[0])
    var = None if stats is None else batched((C,), stats[1], positive=True)
    weight, bias = batched((C,), affine_dim), batched((C,), affine_dim)
    target = torch.randn(per_sample, dtype=f64)

    def loss(x, weight, bias, mean, var):
        out = F.batch_norm(x, mean, var, weight, bias, training=True, momentum=MOMENTUM, eps=EPS)
        return (out.sin() * target).sum()

    def reference_grads(x, weight, bias, mean, var):
        leaves = [t.detach().clone().requires_grad_() for t in (x, weight, bias)]
        return torch.autograd.grad(loss(*leaves, mean, var), leaves)

    in_dims = (x_dim, affine_dim, affine_dim, *(stats or (None, None)))
    args = [x, weight, bias, mean, var]
    expected_grads, expected_args = loop_reference(reference_grads, args, in_dims, shared_positions=(3, 4))
    got_args = [None if a is None else a.clone() for a in args]
    with functx.vmap_fallback("error"):
        grads = functx.vmap(functx.grad(loss, argnums=(0, 1, 2)), in_dims=in_dims)(*got_args)
    torch.testing.assert_close(grads, expected_grads)
    for got, want in zip(got_args[3:], expected_args[3:]):
        if want is not None:
            torch.testing.assert_close(got, want)


def test_vmap_grad_batched_input_with_unbatched_running_stat_is_an_error():
    """Under vmap(grad) batch norm accepts an unbatched running stat with a batched input
    only when every element's update of it is the same (see the next test); with a truly
    batched input the elements disagree: the documented error, nothing written into either
    running stat (the check comes before any write), and an empty interpreter stack."""
    x = torch.randn(B, N, C, dtype=f64)
    mean, var = torch.randn(B, C, dtype=f64), torch.rand(C, dtype=f64) + 0.5
    mean_before, var_before = mean.clone(), var.clone()
    weight = torch.randn(C, dtype=f64)

    def loss(weight, x, mean, var):
        return F.batch_norm(x, mean, var, weight, training=True, momentum=MOMENTUM, eps=EPS).sin().sum()

    with pytest.raises(RuntimeError, match=UNBATCHED_STATS_ERROR):
        functx.vmap(functx.grad(loss), in_dims=(None, 0, 0, None))(weight, x, mean, var)
    assert current_stack() == ()
    assert torch.equal(mean, mean_before) and torch.equal(var, var_before)


def test_vmap_grad_shared_model_per_target_gradients_update_shared_buffers_once():
    """Per-target gradients of one model on one input (`in_dims=(None, None, 0)`), a conv and
    a BatchNorm2d in training mode whose buffers are the module's own (unbatched). The grad
    level batches the unbatched parameters, so the conv output reaching batch norm is batched
    with the same value in every element; each element updates the shared running stats
    identically, which the per-sample loop writes once. This was refused ("batch norm in
    training mode got a tensor batched ..."), while torch.func computes it."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(2, C, 3).double()
    bn = torch.nn.BatchNorm2d(C, momentum=MOMENTUM, eps=EPS).double()
    params = {"w": conv.weight.detach().clone(), "b": conv.bias.detach().clone()}
    x = torch.randn(N, 2, 5, 5, dtype=f64)
    targets = torch.randn(B, N, C, 3, 3, dtype=f64)
    buffers = [bn.running_mean, bn.running_var, bn.num_batches_tracked]
    before = [b.clone() for b in buffers]

    def loss(params, x, target):
        return (bn(F.conv2d(x, params["w"], params["b"])) - target).pow(2).sum()

    with functx.vmap_fallback("error"):
        grads = functx.vmap(functx.grad(loss), in_dims=(None, None, 0))(params, x, targets)
    after = [b.clone() for b in buffers]

    expected = {"w": [], "b": []}
    for i in range(B):
        with torch.no_grad():
            for b, v in zip(buffers, before):
                b.copy_(v)  # each element starts from the shared buffers
        leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
        gw, gb = torch.autograd.grad(loss(leaves, x, targets[i]), [leaves["w"], leaves["b"]])
        expected["w"].append(gw)
        expected["b"].append(gb)
    torch.testing.assert_close(grads, {k: torch.stack(v) for k, v in expected.items()})
    for got, want in zip(after, buffers):  # the loop's (every element's) update, once
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("stats", [(None, None), (0, None), (None, 0)])
def test_vmap_jvp_unbatched_primal_batched_tangent(stats):
    """vmap(jvp) with an unbatched primal input and batched tangents (the forward level
    copies the primal to the batch, as the grad level expands it) and unbatched or partly
    batched running stats: per-sample forward derivatives equal central finite differences
    in float64, and the running stats take each element's update as the loop does."""
    x = torch.randn(N, C, 3, dtype=f64)
    tangents = torch.randn(B, N, C, 3, dtype=f64)
    mean = batched((C,), stats[0])
    var = batched((C,), stats[1], positive=True)
    in_dims = (None, 0, *stats)

    def f(x, mean, var):
        return F.batch_norm(x, mean, var, None, None, training=True, momentum=MOMENTUM, eps=EPS).sin()

    def per_sample(x, t, mean, var):
        out = f(x, mean, var)
        h = 1e-6
        m0, v0 = mean.clone(), var.clone()  # the stats the differences see: not updated by them
        derivative = (f(x + h * t, m0.clone(), v0.clone()) - f(x - h * t, m0.clone(), v0.clone())) / (2 * h)
        return out, derivative

    expected, expected_args = loop_reference(per_sample, [x, tangents, mean, var], in_dims, shared_positions=(2, 3))
    got_mean, got_var = mean.clone(), var.clone()
    with functx.vmap_fallback("error"):
        out = functx.vmap(lambda x, t, m, v: functx.jvp(lambda x: f(x, m, v), (x,), (t,)), in_dims=in_dims)(
            x, tangents, got_mean, got_var
        )
    torch.testing.assert_close(out[0], expected[0])
    torch.testing.assert_close(out[1], expected[1], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close((got_mean, got_var), tuple(expected_args[2:]))
