"""functx.jit (functx/staging/jit.py): values, caching, static arguments, retraces,
randomness, in-place writes, the per-sample loop, gradients through a jitted function.

Values are checked against eager functx and the independent plain-torch references of
test_compile.py (per-sample loops, torch.autograd.grad with create_graph), float64.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.utils._pytree as torch_pytree

import functx
from functx.staging.jit import RETRACE_WARNING_AFTER, EagerFallbackWarning, RetraceWarning
from tests.staging.test_compile import CASES, DT, MODEL, PARAMS, _assert_trees_close, _randn, _scalar_of

JIT_CASES = ("per_sample_grads", "jacrev", "jacfwd", "hessian", "maml", "hvp_forward_over_reverse", "jvp_vjp_linearize")
INDUCTOR_JIT_CASES = ("per_sample_grads", "hessian", "maml")  # inductor compiles take seconds each


@pytest.mark.parametrize(
    "name, backend", [(n, None) for n in JIT_CASES] + [(n, "inductor") for n in INDUCTOR_JIT_CASES]
)
def test_values_match_eager_and_reference(name, backend):
    fn, make_args, reference = CASES[name]
    args = make_args()
    eager = fn(*args)
    _assert_trees_close(eager, reference(*args))
    jitted = functx.jit(fn, backend=backend)
    _assert_trees_close(jitted(*args), eager)
    _assert_trees_close(jitted(*make_args()), eager)  # replayed
    assert jitted.traces == 1


@pytest.mark.parametrize("name", ["per_sample_grads", "maml", "hessian", "hvp_forward_over_reverse"])
def test_gradients_through_a_jitted_function(name):
    """torch.autograd.grad of a jitted function's output equals eager's and the reference's
    (the backward is traced as a graph, not recorded from autograd's side effects)."""
    fn, make_args, reference = CASES[name]

    def grads_of(f):
        args = torch_pytree.tree_map(lambda t: t.detach().clone().requires_grad_(), make_args())
        return torch.autograd.grad(_scalar_of(name, f(*args)), torch_pytree.tree_leaves(args[0]))

    jitted = functx.jit(fn)
    for got, eager, expected in zip(grads_of(jitted), grads_of(fn), grads_of(reference)):
        torch.testing.assert_close(eager, expected)
        torch.testing.assert_close(got, eager)


def test_gradient_of_a_gradient_norm():
    """The issue's example: d/dW of ||grad_x f(W, x)||^2 through the jitted grad, against
    torch.autograd.grad with create_graph (a trace that recorded autograd's detaches was
    wrong by 75% and detached from x)."""
    w = _randn(4, 3, seed=1).requires_grad_()
    x = _randn(3, seed=2).requires_grad_()
    f = lambda w, x: torch.tanh(w @ x).pow(2).sum()
    grad_x = functx.jit(functx.grad(f, argnums=1))
    (got,) = torch.autograd.grad(grad_x(w, x).pow(2).sum(), w)
    (gx,) = torch.autograd.grad(f(w, x), x, create_graph=True)
    (expected,) = torch.autograd.grad(gx.pow(2).sum(), w)
    torch.testing.assert_close(got, expected)
    assert grad_x(w, x).requires_grad  # attached to w and x


def test_a_second_backward_through_a_jitted_function_raises():
    """torch's AOTAutograd backward is not differentiable: a clear error, never a silently
    wrong second derivative; the transform inside the jitted function gives it."""
    w = _randn(3, seed=1).requires_grad_()
    f = functx.jit(lambda w: (w.sin() * 2).sum())
    (g,) = torch.autograd.grad(f(w), w, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(g.sum(), w)
    torch.testing.assert_close(functx.jit(functx.hessian(lambda w: (w.sin() * 2).sum()))(w.detach()), torch.diag(-2 * w.detach().sin()))


def test_cache_keys_and_retraces():
    f = functx.jit(functx.vmap(functx.grad(lambda w, x: (w * x).sin().sum()), in_dims=(None, 0)))
    w = _randn(3, seed=1)
    f(w, _randn(4, 3, seed=2))
    f(w, _randn(4, 3, seed=3))
    assert f.traces == 1  # same signature: replayed
    f(w, _randn(5, 3, seed=3))  # another batch size
    assert f.traces == 2
    f(w.float(), _randn(5, 3, seed=3).float())  # another dtype
    assert f.traces == 3
    out = f(w.clone().requires_grad_(), _randn(5, 3, seed=3))  # requires_grad: a graph with a backward
    assert out.requires_grad
    traces = f.traces
    with torch.no_grad():  # grad mode
        assert not f(w.clone().requires_grad_(), _randn(5, 3, seed=3)).requires_grad
    assert f.traces == traces + 1


def test_dynamic_shapes_trace_once():
    f = functx.jit(functx.vmap(functx.grad(lambda w, x: (w * x).sin().sum()), in_dims=(None, 0)), dynamic=True)
    w = _randn(3, seed=1)
    for b in (4, 5, 7):
        xs = _randn(b, 3, seed=b)
        torch.testing.assert_close(f(w, xs), torch.cos(w * xs) * xs)
    assert f.traces == 1


def test_retrace_warning():
    f = functx.jit(lambda x: functx.grad(lambda y: y.pow(3).sum())(x))
    with pytest.warns(RetraceWarning, match="dynamic=True"):
        for n in range(1, RETRACE_WARNING_AFTER + 1):
            torch.testing.assert_close(f(_randn(n, seed=n)), 3 * _randn(n, seed=n) ** 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RetraceWarning)
        f(_randn(2, seed=2))  # replays: no warning


def test_static_argnums():
    @functx.jit(static_argnums=(1,))
    def power_grad(x, n):
        return functx.grad(lambda y: (y**n).sum())(x)

    x = _randn(3, seed=1)
    torch.testing.assert_close(power_grad(x, 3), 3 * x**2)
    torch.testing.assert_close(power_grad(x, 2), 2 * x)
    torch.testing.assert_close(power_grad(x, 3), 3 * x**2)
    assert power_grad.traces == 2
    negative = functx.jit(lambda x, n: x * n, static_argnums=-1)
    torch.testing.assert_close(negative(x, 2.0), 2 * x)


def test_static_argnums_errors():
    with pytest.raises(TypeError, match="hashable"):
        functx.jit(lambda x, s: x * len(s), static_argnums=1)(_randn(2), [1, 2])
    with pytest.raises(ValueError, match="static_argnums names argument 2"):
        functx.jit(lambda x: x, static_argnums=2)(_randn(2))
    with pytest.raises(TypeError, match="static_argnums must be an int or a tuple of ints"):
        functx.jit(lambda x: x, static_argnums="0")
    with pytest.raises(TypeError, match="expected a function"):
        functx.jit(3)


def test_compiler_settings_reach_the_compiler(monkeypatch):
    """mode/options go to the backend as torch.compile passes them: as keyword arguments to
    a backend callable, as config patches to inductor's compile_fx (cpp_wrapper: the replay
    in C++), whose values equal eager's and the plain-torch reference's."""
    received = []

    def backend(graph_module, example_inputs, **settings):
        received.append(settings)
        return graph_module.forward

    fn, make_args, reference = CASES["per_sample_grads"]
    args = make_args()
    jitted = functx.jit(fn, backend=backend, mode="max-autotune", options={"some_setting": 3})
    _assert_trees_close(jitted(*args), reference(*args))
    assert received == [{"mode": "max-autotune", "options": {"some_setting": 3}}]

    import torch._inductor.compile_fx as compile_fx_module

    patches, compile_fx = [], compile_fx_module.compile_fx

    def recording(graph_module, example_inputs, *, config_patches=None, **kwargs):
        patches.append(dict(config_patches or {}))
        return compile_fx(graph_module, example_inputs, config_patches=config_patches, **kwargs)

    monkeypatch.setattr(compile_fx_module, "compile_fx", recording)
    w = _randn(3, 3, seed=4)
    f = functx.vmap(functx.grad(lambda w, x: torch.tanh(w @ x).sum()), in_dims=(None, 0))
    xs = _randn(4, 3, seed=5)
    out = functx.jit(f, backend="inductor", options={"cpp_wrapper": True})(w, xs)
    assert patches[0].get("cpp_wrapper") is True  # (compile_fx then calls itself, patches applied)
    expected = torch.stack([torch.autograd.functional.jacobian(lambda v: torch.tanh(v @ x).sum(), w) for x in xs])
    torch.testing.assert_close(out, expected)


def test_inductor_chooses_the_cpp_wrapper_for_graphs_of_many_small_ops(monkeypatch):
    """backend="inductor" without a `cpp_wrapper` option: the C++ wrapper for a flat graph of
    many small ops (a chain of 40 elementwise ops on 6 numbers, under vmap(grad)), Python for
    a few large ones; an explicit option is obeyed as given. Values equal the plain-torch
    reference either way."""
    import torch._functorch.config as functorch_config
    import torch._inductor.compile_fx as compile_fx_module

    monkeypatch.setattr(functorch_config, "enable_autograd_cache", False)  # so inductor compiles
    chosen, compile_fx_inner = [], compile_fx_module.compile_fx_inner

    def recording(graph_module, example_inputs, **kwargs):
        chosen.append(bool(kwargs.get("cpp_wrapper")))
        return compile_fx_inner(graph_module, example_inputs, **kwargs)

    monkeypatch.setattr(compile_fx_module, "compile_fx_inner", recording)

    def chain(w, x):
        for i in range(20):
            x = torch.sin(x * w + i)
        return x.sum()

    w, xs = _randn(3, seed=8), _randn(2, 3, seed=9)
    expected = torch.stack([torch.autograd.grad(chain(w.requires_grad_(), x), w)[0] for x in xs])
    w = w.detach()
    small = functx.jit(functx.vmap(functx.grad(chain), in_dims=(None, 0)), backend="inductor")
    torch.testing.assert_close(small(w, xs), expected)
    assert chosen == [True]

    chosen.clear()
    big = _randn(256, 256, seed=10)
    torch.testing.assert_close(functx.jit(lambda a: (a @ a).sin(), backend="inductor")(big), (big @ big).sin())
    assert chosen == [False]

    chosen.clear()
    patches, compile_fx = [], compile_fx_module.compile_fx

    def given(graph_module, example_inputs, *, config_patches=None, **kwargs):
        patches.append(dict(config_patches or {}))
        return compile_fx(graph_module, example_inputs, config_patches=config_patches, **kwargs)

    monkeypatch.setattr(compile_fx_module, "compile_fx", given)
    forced = functx.jit(functx.vmap(functx.grad(chain), in_dims=(None, 0)), backend="inductor", options={"cpp_wrapper": False})
    torch.testing.assert_close(forced(w, xs), expected)
    assert patches[0]["cpp_wrapper"] is False and chosen == []  # inductor's own compile, as configured


def test_compiler_settings_errors():
    with pytest.raises(ValueError, match="backend=None replays"):
        functx.jit(lambda x: x, mode="max-autotune")
    with pytest.raises(ValueError, match="backend=None replays"):
        functx.jit(lambda x: x, options={"cpp_wrapper": True})
    with pytest.raises(TypeError, match="options must be a dict"):
        functx.jit(lambda x: x, backend="inductor", options=[("cpp_wrapper", True)])
    with pytest.raises(RuntimeError, match="no_such_setting"):
        functx.jit(lambda x: x, backend="inductor", options={"no_such_setting": 1})


_WARM_PROCESS = """
import sys, torch, functx
from torch._dynamo.utils import counters
out_dims = int(sys.argv[1])
w = torch.linspace(-1, 1, 3, dtype=torch.float64)
xs = torch.linspace(0.5, 2, 12, dtype=torch.float64).reshape(4, 3)
f = functx.vmap(functx.grad(lambda w, x: (w * x).sin().sum()), in_dims=(None, 0), out_dims=out_dims)
out = functx.jit(f, backend="inductor")(w, xs)
expected = torch.cos(w * xs) * xs  # per sample: d/dw of sum(sin(w * x_i)), samples along out_dims
torch.testing.assert_close(out, expected.movedim(0, out_dims))
print("hits", counters["aot_autograd"]["autograd_cache_hit"])
"""


def test_a_warm_process_reuses_the_trace_and_only_the_same_call(tmp_path):
    """AOTAutograd's cache keeps a jitted functx graph across processes (a warm first call
    skips re-tracing the transforms): the staged calls say what they compute
    (StagedCall.cache_hash). A call differing only in a setting (vmap's out_dims: the same
    body, the same inputs) must not reuse it: its values are checked."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}

    def run(out_dims):
        done = subprocess.run([sys.executable, "-c", _WARM_PROCESS, str(out_dims)], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        return int(done.stdout.split("hits")[-1])

    assert run(0) == 0
    assert run(0) == 1  # the same call in a new process: the cached trace
    assert run(1) == 0  # other out_dims: traced anew, values right


def test_staged_calls_are_interned_under_a_name_saying_what_they_compute():
    import sys

    import torch.utils._pytree as torch_pytree

    from functx.staging.staged_call import StagedCall

    spec = torch_pytree.tree_flatten(((1, 2), {}))[1]
    settings = ("call", functx.vmap, ((None, 0), 0, "error", None), spec, 2, (None, [], []))
    call = StagedCall.interned(*settings)
    assert StagedCall.interned(*settings) is call
    assert getattr(sys.modules[StagedCall.__module__], call.__name__) is call  # importable: the cache key's name
    other = StagedCall.interned("call", functx.vmap, ((0, 0), 0, "error", None), spec, 2, (None, [], []))
    assert other is not call and other.__name__ != call.__name__
    with functx.vmap_fallback("error"):  # loop or error: another trace
        assert StagedCall(*settings).__name__ != call.__name__


def test_random_ops_draw_fresh_numbers_and_vmap_randomness_holds():
    f = functx.jit(functx.vmap(lambda x: x + torch.rand(()), randomness="different"))
    x = torch.zeros(4, 3, dtype=DT)
    a, b = f(x), f(x)
    assert not torch.equal(a, b)  # fresh per call
    assert not torch.equal(a[0], a[1])  # one draw per element
    torch.testing.assert_close(a - a[:, :1], torch.zeros_like(a))  # the same draw along each row
    same = functx.jit(functx.vmap(lambda x: x + torch.rand(()), randomness="same"))
    c = same(x)
    torch.testing.assert_close(c, torch.full_like(c, c[0, 0].item()))


def test_in_place_writes_to_inputs_and_buffers_are_reproduced():
    f = functx.jit(lambda x: x.add_(1.0).sum())
    x = torch.zeros(3, dtype=DT)
    f(x)
    f(x)
    torch.testing.assert_close(x, torch.full((3,), 2.0, dtype=DT))
    bn = torch.nn.BatchNorm1d(3).to(DT)
    state = {k: v.clone() for k, v in bn.state_dict().items()}
    forward = functx.jit(lambda s, x: functx.functional_call(bn, s, (x,)))
    expected = {k: v.clone() for k, v in state.items()}
    for seed in (1, 2):
        xb = _randn(8, 3, seed=seed)
        forward(state, xb)
        torch.nn.functional.batch_norm(xb, expected["running_mean"], expected["running_var"], training=True)
        expected["num_batches_tracked"] += 1
    for k in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(state[k], expected[k])


@torch.library.custom_op("functx_test_jit::scaled_cumsum", mutates_args=())
def _scaled_cumsum(x: torch.Tensor) -> torch.Tensor:
    """An op with no batching rule (vmap runs it once per element), with a fake kernel."""
    return torch.cumsum(x, 0) * x.shape[0]


@_scaled_cumsum.register_fake
def _(x):
    return torch.empty_like(x)


@pytest.mark.parametrize("dynamic", [False, True])
def test_per_sample_loop_follows_the_batch_size(dynamic):
    """An op with no batching rule runs vmap's per-sample loop, unrolled in the trace for its
    batch size: another batch size retraces (never the old loop)."""

    def f(x):
        return _scaled_cumsum(x).sin()

    jitted = functx.jit(functx.vmap(f), dynamic=dynamic)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # functx's PerformanceWarning for the loop
        for b in (3, 4, 3):
            xs = _randn(b, 5, seed=b)
            torch.testing.assert_close(jitted(xs), torch.stack([f(r) for r in xs]))
    assert jitted.traces == 2


def test_modules_through_functional_call_and_ensembles():
    models = [torch.nn.Linear(3, 2).to(DT) for _ in range(3)]
    params, buffers = functx.stack_module_state(models)
    base = models[0]
    x = _randn(5, 3, seed=1)
    ensemble = functx.jit(lambda p, b, x: functx.vmap(lambda p, b: functx.functional_call(base, (p, b), (x,)))(p, b))
    torch.testing.assert_close(ensemble(params, buffers, x), torch.stack([m(x) for m in models]).detach())
    psg = functx.jit(CASES["per_sample_grads"][0])
    _assert_trees_close(psg(PARAMS, _randn(5, 3, seed=2), _randn(5, 2, seed=3)), CASES["per_sample_grads"][2](PARAMS, _randn(5, 3, seed=2), _randn(5, 2, seed=3)))
    assert MODEL.training  # the module left as it was


def test_an_ensemble_with_batch_norm_trains_under_jit():
    """functx.nn.Ensemble (its forward: vmap of functional_call with return_state=True)
    jitted in one trace: losses, parameter gradients and running statistics as eager's."""
    torch.manual_seed(3)
    members = [torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).to(DT) for _ in range(3)]
    jitted_ensemble, eager_ensemble = functx.nn.Ensemble(members), functx.nn.Ensemble(members)
    step = functx.jit(lambda x: jitted_ensemble(x).pow(2).sum())
    for seed in (1, 2, 3):
        x = _randn(6, 4, seed=seed)
        loss, expected = step(x), eager_ensemble(x).pow(2).sum()
        loss.backward()
        expected.backward()
        torch.testing.assert_close(loss, expected)
        for ours, theirs in zip(jitted_ensemble.parameters(), eager_ensemble.parameters()):
            torch.testing.assert_close(ours.grad, theirs.grad)
        for ours, theirs in zip(jitted_ensemble.buffers(), eager_ensemble.buffers()):
            torch.testing.assert_close(ours, theirs)
    assert step.traces == 1


def test_debug_flag_prints_traces(capsys):
    f = functx.jit(lambda x: functx.grad(lambda y: y.sin().sum())(x), debug=True)
    f(_randn(3, seed=1))
    f(_randn(3, seed=2))
    out = capsys.readouterr().out
    assert out.count("functx.jit(") == 1 and "backend compile" in out and "[(3,)]" in out


# --- random programs under random transform stacks, jitted (tests/ad/test_fuzz_transforms) ----

from hypothesis import event, given  # noqa: E402

from tests.ad.test_fuzz_transforms import ALL, PURE_FAMILIES, cases  # noqa: E402
from tests.staging.test_compile import COMPILE_FUZZ, eager_checked  # noqa: E402


@COMPILE_FUZZ
@given(cases(PURE_FAMILIES, ALL))
def test_fuzz_jitted_transform_stacks(case):
    """functx.jit of a random program under a random stack of 1-3 transforms equals the
    plain-torch float64 reference, replayed on fresh inputs, and its gradient with respect
    to the inputs equals eager functx's. Long run:
    FUNCTX_COMPILE_FUZZ_EXAMPLES=200 .venv/bin/python -m pytest tests/staging -q -p no:xdist -k fuzz"""
    checked = eager_checked(case)
    if checked is None:
        return
    transformed, expected = checked
    jitted = functx.jit(transformed)
    torch.testing.assert_close(jitted(*case.inputs()), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(jitted(*case.inputs()), expected, rtol=1e-6, atol=1e-6)  # replayed

    def input_grads(f):
        inputs = [x.detach().clone().requires_grad_() for x in case.inputs()]
        out = f(*inputs)
        if not out.requires_grad:
            return None
        return torch.autograd.grad((out * torch.linspace(0.5, 1.5, out.numel(), dtype=out.dtype).reshape(out.shape)).sum(), inputs, allow_unused=True)

    try:
        want = input_grads(transformed)
    except Exception:
        event("eager functx's gradient raises")
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", EagerFallbackWarning)
        got = input_grads(jitted)
    if any(issubclass(w.category, EagerFallbackWarning) for w in caught):
        # test_regression_jitted_gradient_through_a_third_derivative_of_an_svd
        event("torch.compile refused the trace: eager fallback")
    assert (got is None) == (want is None)
    for g, w in zip(got or (), want or ()):
        if w is None:
            assert g is None or not g.abs().max() > 0
        else:
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("stage", ["jit", "compile", "fake"])
def test_per_sample_weight_gradients_keep_their_layout_when_staged(stage):
    """Per-sample weight gradients come out contiguous (torch.func's layout) when staged
    too: the layout rules took tracing tensors (fake, functional) for foreign ones, and the
    compiled gradients came out transposed (1.5x slower under inductor)."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).to(DT)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def per_sample(p, x, y):
        loss = lambda p, x, y: ((functx.functional_call(model, p, (x,)) - y) ** 2).sum()
        return functx.vmap(functx.grad(loss), in_dims=(None, 0, 0))(p, x, y)

    x, y = _randn(4, 6, seed=1), _randn(4, 3, seed=2)
    if stage == "fake":
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            out = per_sample(*torch_pytree.tree_map(mode.from_tensor, (params, x, y)))
    else:
        staged = functx.jit(per_sample) if stage == "jit" else torch.compile(per_sample, backend="aot_eager")
        out = staged(params, x, y)
        _assert_trees_close(out, per_sample(params, x, y))
    for name in ("0.weight", "2.weight"):
        assert out[name].is_contiguous(), (name, out[name].stride())


def test_transforms_stay_staged_after_torch_clears_dynamos_rule_cache():
    """torch.distributed.init_process_group clears dynamo's trace-rule cache
    (`trace_rules.clear_lru_cache`); functx's entries in it were lost, and every transform
    call under jit then ran eagerly behind a graph break (traces == 0), found when the
    distributed tests ran before the jit doctest. Here with a real one-process gloo group."""
    import torch.distributed as dist

    w, xs = torch.randn(3), torch.randn(4, 3)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        f = functx.jit(functx.vmap(functx.grad(lambda w, x: (w * x).sin().sum()), in_dims=(None, 0)))
        torch.testing.assert_close(f(w, xs), torch.cos(w * xs) * xs)
        assert f.traces == 1
        torch._dynamo.trace_rules.clear_lru_cache()
        g = functx.jit(functx.vmap(functx.grad(lambda w, x: (w * x).cos().sum()), in_dims=(None, 0)))
        torch.testing.assert_close(g(w, xs), -torch.sin(w * xs) * xs)
        assert g.traces == 1
    finally:
        dist.destroy_process_group()


def test_under_a_users_dispatch_mode_the_function_runs_eagerly_and_still_traces_later():
    """Called first under a TorchDispatchMode, a jitted function runs eagerly (the mode sees
    plain-tensor ops, as around any transform); dynamo would have declined that call and
    never traced the function again. Outside the mode it traces once and replays."""
    from tests.core.test_dispatch_modes import Recording

    w, xs = _randn(8, 8), _randn(4, 8)
    f = functx.vmap(functx.grad(lambda w, x: torch.tanh(w @ x).sum()), in_dims=(None, 0))
    expected = (1 - torch.tanh(xs @ w.T) ** 2).unsqueeze(-1) * xs.unsqueeze(1)
    jitted = functx.jit(f)
    with Recording() as mode:
        torch.testing.assert_close(jitted(w, xs), expected)
    assert mode.ops and mode.saw_wrappers() == []
    assert jitted.traces == 0
    for _ in range(2):
        torch.testing.assert_close(jitted(w, xs), expected)
    assert jitted.traces == 1


def test_regression_jitted_gradient_through_a_third_derivative_of_an_svd():
    """The caller's gradient through functx.jit of jvp(grad(grad(mix))) of a program with an
    expand and svdvals (found when the fuzzer's draws shifted): torch.compile raised
    "encountered a mutation on a view chain of length 3, where view 2 was an as_strided()
    call" while tracing the joint graph: torch's second-order SVD backward fills a diagonal
    view in place under create_graph, and the backward of that write (CopySlices) reads the
    slice with as_strided, which functionalization refuses; eager functx computes it. Now
    the jitted function warns and runs eagerly for that signature, with eager's values."""
    from tests.ad.test_fuzz_transforms import Case, Op, Program, T

    case = Case(
        Program([(3,)], [Op("logsumexp", dim=0), Op("conv1d", c=1, pad=1, ks=2, seed=4), Op("expand"), Op("linalg", kind="svdvals")]),
        [T("jvp", seed=2), T("grad", argnums=(0,), seed=1), T("grad", argnums=0, seed=1, mix=True)],
        seed=464,
    )
    transformed = case.build(functx)
    jitted = functx.jit(transformed)
    inputs = [x.detach().clone().requires_grad_() for x in case.inputs()]
    expected = torch.autograd.grad(transformed(*inputs).sum(), inputs)
    with pytest.warns(EagerFallbackWarning, match="as_strided"):
        got = torch.autograd.grad(jitted(*inputs).sum(), inputs)
    torch.testing.assert_close(got, expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error", EagerFallbackWarning)  # once per signature
        torch.testing.assert_close(torch.autograd.grad(jitted(*inputs).sum(), inputs), expected)


def test_an_error_of_the_function_itself_is_not_an_eager_fallback():
    """Only torch.compile's refusals fall back to eager; the function's own errors raise,
    at the first call and after."""
    def f(x):
        return x @ torch.ones(4, 2)

    jitted = functx.jit(f)
    for _ in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("error", EagerFallbackWarning)
            with pytest.raises(Exception, match="same reduction dim"):
                jitted(torch.randn(3, 3))
