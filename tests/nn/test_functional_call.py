"""functional_call: torch.func semantics (module untouched, tied weights, strict, several
dicts, kwargs), functx's return_state mode, and use under nested transforms."""

import copy

import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close
from torch.utils.checkpoint import checkpoint

import functx


def module_snapshot(module):
    """Everything functional_call could disturb: which tensor objects sit at which names
    (in each submodule's _parameters/_buffers and plain attributes) and their values."""
    tensors = {}
    for mod_name, mod in module.named_modules():
        for slot in ("_parameters", "_buffers"):
            for name, t in getattr(mod, slot).items():
                tensors[(mod_name, slot, name)] = (t, None if t is None else t.detach().clone())
        for name, value in vars(mod).items():
            if isinstance(value, torch.Tensor):
                tensors[(mod_name, "attr", name)] = (value, value.detach().clone())
    return tensors


def assert_unchanged(module, snapshot):
    now = module_snapshot(module)
    assert now.keys() == snapshot.keys()
    for key, (t, value) in snapshot.items():
        assert now[key][0] is t, f"{key} is a different object"
        if value is not None:
            assert torch.equal(t.detach(), value), f"{key} changed value"


class Tied(nn.Module):
    """y = x @ (w + w_tied) + b; w_tied is the same Parameter as w."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 3))
        self.w_tied = self.w
        self.b = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return x @ (self.w + self.w_tied) + self.b


class Raises(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.lin(x)
        raise ValueError("boom")


class Counter(nn.Module):
    """Re-assigns a buffer in forward (not in place)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count = self.count + 1
        return x * self.count


class WithKwargs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x, *, scale=1.0, shift=None):
        out = self.lin(x) * scale
        return out if shift is None else out + shift


def zeros_like_params(module):
    return {k: torch.zeros_like(v) for k, v in module.named_parameters()}


def test_matches_module_with_swapped_values_and_leaves_module_unchanged():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2)).eval()
    other = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2)).eval()
    other[1].running_mean.uniform_()
    snap = module_snapshot(model)
    x = torch.randn(5, 3)
    state = {**dict(other.named_parameters()), **dict(other.named_buffers())}
    assert_close(functx.functional_call(model, state, x), other(x))
    assert_close(functx.functional_call(model, state, (x,)), other(x))
    assert_unchanged(model, snap)


def test_module_unchanged_after_exception_in_forward():
    model = Raises()
    snap = module_snapshot(model)
    state = {"lin.weight": torch.zeros(3, 3), "count": torch.ones(())}
    with pytest.raises(ValueError, match="boom"):
        functx.functional_call(model, state, torch.randn(2, 3))
    assert_unchanged(model, snap)


def test_module_unchanged_after_exception_under_transforms():
    model = Raises()
    snap = module_snapshot(model)

    def f(w, x):
        return functx.functional_call(model, {"lin.weight": w}, x).sum()

    with pytest.raises(ValueError, match="boom"):
        functx.vmap(functx.grad(f), in_dims=(None, 0))(torch.randn(3, 3), torch.randn(4, 2, 3))
    assert_unchanged(model, snap)


def test_missing_names_keep_module_tensors():
    model = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    out = functx.functional_call(model, {"bias": torch.zeros(2)}, x)
    assert_close(out, x @ model.weight.T)


def test_tie_weights_true_uses_value_for_all_tied_names():
    model = Tied()
    snap = module_snapshot(model)
    x = torch.randn(2, 3)
    w = torch.randn(3, 3)
    out = functx.functional_call(model, {"w": w}, x)
    assert_close(out, x @ (w + w) + model.b)
    # the same tensor under both tied names is fine
    assert_close(functx.functional_call(model, {"w": w, "w_tied": w}, x), out)
    assert_unchanged(model, snap)


def test_tie_weights_false_leaves_other_name_alone():
    model = Tied()
    x = torch.randn(2, 3)
    w = torch.randn(3, 3)
    out = functx.functional_call(model, {"w": w}, x, tie_weights=False)
    assert_close(out, x @ (w + model.w) + model.b)
    w2 = torch.randn(3, 3)
    out = functx.functional_call(model, {"w": w, "w_tied": w2}, x, tie_weights=False)
    assert_close(out, x @ (w + w2) + model.b)


def test_tied_names_with_different_values_raise_like_torch():
    model = Tied()
    snap = module_snapshot(model)
    values = {"w": torch.randn(3, 3), "w_tied": torch.randn(3, 3)}
    with pytest.raises(ValueError) as ours:
        functx.functional_call(model, values, torch.randn(2, 3))
    with pytest.raises(ValueError) as theirs:
        torch.func.functional_call(model, values, torch.randn(2, 3))
    assert str(ours.value) == str(theirs.value)
    assert "Consider using tie_weights=False" in str(ours.value)
    assert_unchanged(model, snap)


def test_tie_weights_under_grad_gives_summed_gradient():
    model = Tied()
    x = torch.randn(2, 3)
    w = torch.randn(3, 3)
    g = functx.grad(lambda w: functx.functional_call(model, {"w": w}, x).sum())(w)
    g_ref = torch.func.grad(lambda w: torch.func.functional_call(model, {"w": w}, x).sum())(w)
    assert_close(g, g_ref)


def test_strict_reports_missing_and_unexpected_keys():
    model = nn.Linear(3, 2)
    x = torch.randn(2, 3)
    with pytest.raises(RuntimeError, match=r"Missing key\(s\): 'bias'"):
        functx.functional_call(model, {"weight": torch.zeros(2, 3)}, x, strict=True)
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\): 'extra'"):
        functx.functional_call(model, {**zeros_like_params(model), "extra": torch.zeros(1)}, x, strict=True)
    with pytest.raises(RuntimeError, match=r"(?s)Unexpected key\(s\): 'extra'.*Missing key\(s\): 'bias'"):
        functx.functional_call(model, {"weight": torch.zeros(2, 3), "extra": torch.zeros(1)}, x, strict=True)
    assert_close(functx.functional_call(model, zeros_like_params(model), x, strict=True), torch.zeros(2, 2))


def test_strict_counts_tied_names_as_given():
    model = Tied()
    out = functx.functional_call(model, {"w": torch.zeros(3, 3), "b": torch.zeros(3)}, torch.randn(2, 3), strict=True)
    assert_close(out, torch.zeros(2, 3))


def test_multiple_dicts_and_duplicate_keys():
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)).eval()
    params = {k: torch.randn_like(v) for k, v in model.named_parameters()}
    buffers = {k: v.clone() + 1 for k, v in model.named_buffers()}
    x = torch.randn(4, 3)
    expected = torch.func.functional_call(model, {**params, **buffers}, x)
    assert_close(functx.functional_call(model, (params, buffers), x), expected)
    assert_close(functx.functional_call(model, [params, buffers], x), expected)
    with pytest.raises(ValueError, match="appeared in multiple dictionaries"):
        functx.functional_call(model, (params, {"0.weight": params["0.weight"]}), x)
    with pytest.raises(ValueError, match="dict"):
        functx.functional_call(model, (params, 3), x)
    with pytest.raises(ValueError, match="dict"):
        functx.functional_call(model, 3, x)


def test_kwargs_and_multiple_args():
    model = WithKwargs()
    params = {k: torch.randn_like(v) for k, v in model.named_parameters()}
    x = torch.randn(4, 3)
    shift = torch.randn(2)
    expected = torch.func.functional_call(model, params, (x,), {"scale": 2.0, "shift": shift})
    assert_close(functx.functional_call(model, params, (x,), {"scale": 2.0, "shift": shift}), expected)
    assert_close(functx.functional_call(model, params, x, {"scale": 2.0, "shift": shift}), expected)
    bilinear = nn.Bilinear(3, 2, 4)
    a, b = torch.randn(5, 3), torch.randn(5, 2)
    assert_close(functx.functional_call(bilinear, dict(bilinear.named_parameters()), (a, b)), bilinear(a, b))


def test_in_place_buffer_update_reaches_passed_tensor_like_torch():
    bn = nn.BatchNorm1d(3)
    snap = module_snapshot(bn)
    x = torch.randn(8, 3)
    ours = {k: v.clone() for k, v in bn.named_buffers()}
    theirs = {k: v.clone() for k, v in bn.named_buffers()}
    functx.functional_call(bn, ours, x)
    torch.func.functional_call(bn, theirs, x)
    for k in theirs:
        assert_close(ours[k], theirs[k])
    assert not torch.equal(ours["running_mean"], bn.running_mean)
    assert_unchanged(bn, snap)


def test_reassigned_buffer_is_written_back_to_the_dict_like_torch():
    model = Counter()
    state = {"count": torch.tensor(3.0)}
    out = functx.functional_call(model, state, torch.ones(2))
    assert_close(out, torch.full((2,), 4.0))
    assert_close(state["count"], torch.tensor(4.0))
    assert_close(model.count, torch.tensor(0.0))


def test_rnn_weight_cache_is_restored():
    lstm = nn.LSTM(3, 4)
    cache = list(lstm._flat_weights)
    params = {k: torch.randn_like(v) for k, v in lstm.named_parameters()}
    x = torch.randn(5, 2, 3)
    ours = functx.functional_call(lstm, params, x)[0]
    assert all(a is b for a, b in zip(lstm._flat_weights, cache))
    assert_close(ours, torch.func.functional_call(lstm, params, x)[0])
    out_after = lstm(x)[0]  # the module still computes with its own weights
    assert_close(out_after, torch.func.functional_call(lstm, dict(lstm.named_parameters()), x)[0])


# --- return_state=True ----------------------------------------------------------------


def bn_net(cumulative_average=True):
    """Two training-mode batch norms; the second (momentum=None) keeps a cumulative
    average, which reads num_batches_tracked as a Python float."""
    momentum = None if cumulative_average else 0.2
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3, momentum=momentum))


def test_return_state_matches_torch_training_step_and_mutates_nothing():
    model = bn_net()
    reference = bn_net()
    reference.load_state_dict(model.state_dict())
    snap = module_snapshot(model)
    params = dict(model.named_parameters())
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    passed = {k: v.clone() for k, v in buffers.items()}
    x = torch.randn(6, 2, 5, 5)

    out, new_buffers = functx.functional_call(model, (params, buffers), x, return_state=True)

    assert_close(out, reference(x))
    assert new_buffers.keys() == dict(reference.named_buffers()).keys()
    for name, value in reference.named_buffers():
        assert_close(new_buffers[name], value)
    for name in buffers:  # neither the passed tensors nor the module changed
        assert torch.equal(buffers[name], passed[name])
    assert_unchanged(model, snap)


def test_return_state_without_buffers_given_uses_copies_of_the_module_buffers():
    model = bn_net()
    reference = bn_net()
    reference.load_state_dict(model.state_dict())
    snap = module_snapshot(model)
    x = torch.randn(6, 2, 5, 5)
    out, new_buffers = functx.functional_call(model, {}, x, return_state=True)
    assert_close(out, reference(x))
    for name, value in reference.named_buffers():
        assert_close(new_buffers[name], value)
    assert_unchanged(model, snap)


def test_return_state_does_not_write_back_reassigned_buffers():
    model = Counter()
    state = {"count": torch.tensor(3.0)}
    passed = state["count"]
    out, new_buffers = functx.functional_call(model, state, torch.ones(2), return_state=True)
    assert_close(out, torch.full((2,), 4.0))
    assert_close(new_buffers["count"], torch.tensor(4.0))
    assert state["count"] is passed and passed.item() == 3.0


def test_return_state_twice_chains_like_two_torch_steps():
    model = bn_net()
    reference = bn_net()
    reference.load_state_dict(model.state_dict())
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    x1, x2 = torch.randn(4, 2, 5, 5), torch.randn(4, 2, 5, 5)
    _, buffers = functx.functional_call(model, (params, buffers), x1, return_state=True)
    _, buffers = functx.functional_call(model, (params, buffers), x2, return_state=True)
    reference(x1)
    reference(x2)
    for name, value in reference.named_buffers():
        assert_close(buffers[name], value)


def test_return_state_under_vmap_over_stacked_buffers():
    """Ensembling training-mode batch norm: each model updates its own running stats.
    (A cumulative average would need float(num_batches_tracked) of a batched tensor.)"""
    models = [bn_net(cumulative_average=False) for _ in range(3)]
    params, buffers = functx.stack_module_state(models)
    passed = {k: v.clone() for k, v in buffers.items()}
    x = torch.randn(3, 4, 2, 5, 5)

    def step(params, buffers, x):
        return functx.functional_call(models[0], (params, buffers), x, return_state=True)

    with functx.vmap_fallback("error"):
        out, new_buffers = functx.vmap(step)(params, buffers, x)
    for i, model in enumerate(models):
        assert_close(out[i], model(x[i]), atol=1e-5, rtol=1e-5)
        for name, value in model.named_buffers():
            assert_close(new_buffers[name][i], value, atol=1e-5, rtol=1e-5)
    for name in buffers:
        assert torch.equal(buffers[name], passed[name])


def test_return_state_gradient_flows_through_output():
    model = bn_net()
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(4, 2, 5, 5)

    def loss(params):
        out, _ = functx.functional_call(model, params, x, return_state=True)
        return out.square().mean()

    g = functx.grad(loss)(params)
    g_ref = torch.func.grad(lambda p: torch.func.functional_call(copy.deepcopy(model), p, x).square().mean())(params)
    for k in g_ref:
        assert_close(g[k], g_ref[k], atol=1e-5, rtol=1e-5)


# --- under transforms -----------------------------------------------------------------


def mlp():
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def test_grad_of_grad_hessian_vector_product_matches_torch_func():
    model = mlp()
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(5, 3)
    v = {k: torch.randn_like(p) for k, p in params.items()}

    def hvp(call, grad, vjp_params):
        def loss(p):
            return call(model, p, x).square().sum()

        def dot_grad(p):
            g = grad(loss)(p)
            return sum((g[k] * v[k]).sum() for k in g)

        return grad(dot_grad)(vjp_params)

    ours = hvp(functx.functional_call, functx.grad, params)
    theirs = hvp(torch.func.functional_call, torch.func.grad, params)
    for k in theirs:
        assert_close(ours[k], theirs[k], atol=1e-5, rtol=1e-5)


def test_jvp_and_jacrev_over_functional_call():
    model = mlp()
    params = {k: v.detach() for k, v in model.named_parameters()}
    tangents = {k: torch.randn_like(p) for k, p in params.items()}
    x = torch.randn(5, 3)

    def f_ours(p):
        return functx.functional_call(model, p, x)

    def f_theirs(p):
        return torch.func.functional_call(model, p, x)

    out, jvp_out = functx.jvp(f_ours, (params,), (tangents,))
    out_ref, jvp_ref = torch.func.jvp(f_theirs, (params,), (tangents,))
    assert_close(out, out_ref)
    assert_close(jvp_out, jvp_ref, atol=1e-5, rtol=1e-5)
    jac = functx.jacrev(f_ours)(params)
    jac_ref = torch.func.jacrev(f_theirs)(params)
    for k in jac_ref:
        assert_close(jac[k], jac_ref[k], atol=1e-5, rtol=1e-5)


def test_nested_vmap_over_stacked_params_and_batched_input():
    model = mlp()
    params = {k: torch.randn(2, *v.shape) for k, v in model.named_parameters()}
    x = torch.randn(3, 5, 3)

    def f(p, x):
        return functx.functional_call(model, p, x)

    with functx.vmap_fallback("error"):
        out = functx.vmap(functx.vmap(f, in_dims=(None, 0)), in_dims=(0, None))(params, x)
    expected = torch.stack(
        [torch.stack([torch.func.functional_call(model, {k: v[i] for k, v in params.items()}, x[j]) for j in range(3)]) for i in range(2)]
    )
    assert_close(out, expected)


# -- threads: each thread sees only its own parameters (functx/nn/per_thread.py) ------------


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1), nn.BatchNorm1d(1))


def _state(module, seed):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=g) for n, p in module.named_parameters()}


def _loaded_copy(module, state):
    """The plain-torch reference: a copy of the module holding `state`."""
    copy_ = copy.deepcopy(module)
    copy_.load_state_dict(state, strict=False)
    return copy_


def _in_threads(work, n_threads=2):
    import threading

    barrier = threading.Barrier(n_threads)
    errors = []

    def run(i):
        try:
            barrier.wait()
            work(i)
        except BaseException as e:  # reported in the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def test_threads_each_see_only_their_own_parameters():
    """Issue 27: two threads calling functional_call on one module 200 times each: swapping
    the tensors into the module made 176 of 400 calls see the other thread's parameters."""
    model = _mlp().eval()
    x = torch.randn(16, 8)
    states = [_state(model, 1), _state(model, 2)]
    expected = [_loaded_copy(model, s)(x) for s in states]
    own = {n: p for n, p in model.named_parameters()}
    wrong = [0, 0]

    def work(i):
        for _ in range(200):
            if not torch.equal(functx.functional_call(model, states[i], (x,)), expected[i]):
                wrong[i] += 1

    _in_threads(work)
    assert wrong == [0, 0]
    assert type(model._parameters) is dict and {n: p for n, p in model.named_parameters()} == own


def test_a_thread_calling_the_module_itself_sees_its_own_tensors_meanwhile():
    model = _mlp().eval()
    x = torch.randn(16, 8)
    state = _state(model, 3)
    expected_own, expected_given = model(x), _loaded_copy(model, state)(x)
    wrong = [0, 0]

    def work(i):
        for _ in range(200):
            out = functx.functional_call(model, state, (x,)) if i == 0 else model(x)
            if not torch.equal(out, expected_given if i == 0 else expected_own):
                wrong[i] += 1

    _in_threads(work)
    assert wrong == [0, 0]


def test_per_sample_gradients_in_two_threads_equal_serial_ones():
    """vmap(grad(functional_call)) in two threads at once, against a per-sample loop of
    torch.autograd.grad on copies of the module."""
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1))
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 1, dtype=torch.float64)
    model = model.double()
    states = [{n: p.detach() * (1 + i) for n, p in model.named_parameters()} for i in range(2)]

    def loss(params, xi, yi):
        return ((functx.functional_call(model, params, (xi[None],)) - yi) ** 2).sum()

    def reference(state):
        ref = _loaded_copy(model, state)
        grads = []
        for xi, yi in zip(x, y):
            out = ((ref(xi[None]) - yi) ** 2).sum()
            grads.append(dict(zip([n for n, _ in ref.named_parameters()], torch.autograd.grad(out, list(ref.parameters())))))
        return {n: torch.stack([g[n] for g in grads]) for n in grads[0]}

    expected = [reference(s) for s in states]
    results = [[], []]

    def work(i):
        for _ in range(20):
            results[i].append(functx.vmap(functx.grad(loss), in_dims=(None, 0, 0))(states[i], x, y))

    _in_threads(work)
    for i in range(2):
        for got in results[i]:
            for name in expected[i]:
                assert_close(got[name], expected[i][name])


def test_nested_calls_in_one_thread_and_reassignment():
    """A functional_call inside another's forward (the innermost call's values win; names it
    does not give keep the outer call's), and a buffer re-assigned in the forward written
    back into the outer caller's dict, with the module's own dicts back afterwards."""

    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.register_buffer("count", torch.zeros(()))

        def forward(self, x):
            self.count = self.count + 1
            return self.lin(x)

    class Outer(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return functx.functional_call(self.inner, {"lin.bias": torch.ones(2)}, (x,))

    outer = Outer(Counter())
    x = torch.randn(3, 2)
    state = {"inner.lin.weight": torch.eye(2), "inner.lin.bias": torch.zeros(2), "inner.count": torch.zeros(())}
    out = functx.functional_call(outer, state, (x,))
    assert_close(out, x + 1)  # weight from the outer call, bias from the inner one
    assert state["inner.count"].item() == 1  # the re-assignment landed in the outer call's dict
    assert outer.inner.count.item() == 0
    assert all(type(m._parameters) is dict and type(m._buffers) is dict for m in outer.modules())


def test_exception_in_a_thread_leaves_the_module_as_it_was():
    model = _mlp().eval()
    own = {n: p for n, p in model.named_parameters()}

    def work(i):
        for _ in range(50):
            if i == 0:
                with pytest.raises(RuntimeError):
                    functx.functional_call(model, _state(model, 4), (torch.randn(2, 7),))  # wrong width
            else:
                functx.functional_call(model, _state(model, 5), (torch.randn(2, 8),))

    _in_threads(work)
    assert type(model._parameters) is dict and type(model[0]._parameters) is dict
    assert {n: p for n, p in model.named_parameters()} == own


@pytest.mark.parametrize(
    "call, names",
    [
        (lambda: functx.functional_call(lambda x: x, {}, (torch.ones(1),)), ["functional_call", "function"]),
        (lambda: functx.functional_call([nn.Linear(1, 1)], {}, (torch.ones(1),)), ["functional_call", "list"]),
        (lambda: functx.replace_all_batch_norm_modules_(3), ["replace_all_batch_norm_modules_", "int"]),
        (lambda: functx.nn.replace_all_batch_norm_modules_(lambda x: x), ["replace_all_batch_norm_modules_", "function"]),
        (lambda: functx.make_functional(lambda x: x), ["make_functional", "function"]),
        (lambda: functx.make_functional([nn.Linear(1, 1)]), ["make_functional", "list"]),
        (lambda: functx.make_functional_with_buffers([nn.Linear(1, 1)]), ["make_functional_with_buffers", "list"]),
        (lambda: functx.make_functional_with_buffers(lambda x: x), ["make_functional_with_buffers", "function"]),
        (lambda: functx.nn.vmap_init(lambda x: x, 2), ["vmap_init", "function"]),
        (lambda: functx.nn.vmap_init([nn.Linear(1, 1)], 2), ["vmap_init", "list"]),
        (lambda: functx.nn.Ensemble.from_state([nn.Linear(1, 1)], {}, {}), ["Ensemble.from_state", "list"]),
        (lambda: functx.nn.Ensemble.from_factory(lambda: [nn.Linear(1, 1)], 2), ["Ensemble.from_factory", "list"]),
    ],
)
def test_something_that_is_not_a_module_is_a_clear_type_error(call, names):
    """Issue 27: a TypeError naming the function, what was expected and what came; still an
    AttributeError, which torch.func raises there, for code that catches that."""
    with pytest.raises(TypeError, match="expected a torch.nn.Module") as info:
        call()
    assert isinstance(info.value, AttributeError)
    for name in names:
        assert name in str(info.value)


class _CheckpointedTanh(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.lin = nn.Linear(3, 3).double()
        self.reentrant = reentrant

    def forward(self, x):
        return checkpoint(lambda x: self.lin(x).tanh(), x, use_reentrant=self.reentrant).sum()


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("how", ["autograd", "grad", "vmap_grad", "hessian"])
def test_checkpoint_recomputes_with_the_given_tensors(reentrant, how):
    """torch's checkpoint recomputes the module's forward in the backward, after
    functional_call returned: it must see the given parameters again (core/recompute.py;
    torch.func's functional_call gives d/db of sum(tanh(W x + b)) wrong there, in plain
    torch too), not the module's own. Reference: the tanh layer written out, in float64."""
    module = _CheckpointedTanh(reentrant)
    g = torch.Generator().manual_seed(0)
    params = {"lin.weight": torch.randn(3, 3, dtype=torch.float64, generator=g), "lin.bias": torch.randn(3, dtype=torch.float64, generator=g)}
    x = torch.randn(4, 3, dtype=torch.float64, generator=g)

    def written_out(w, b, x):
        return (x @ w.T + b).tanh().sum()

    if how == "autograd":  # no transform: plain torch autograd, leaves in the dict
        leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
        actual = dict(zip(leaves, torch.autograd.grad(functx.functional_call(module, leaves, (x,)), list(leaves.values()))))
        expected = dict(zip(params, torch.autograd.grad(written_out(*(v.requires_grad_() for v in leaves.values()), x), list(leaves.values()))))
    elif how == "grad":
        actual = functx.grad(lambda p: functx.functional_call(module, p, (x,)))(params)
        w, b = (v.clone().requires_grad_() for v in params.values())
        expected = dict(zip(params, torch.autograd.grad(written_out(w, b, x), (w, b))))
    elif how == "vmap_grad":
        actual = functx.vmap(functx.grad(lambda p, x: functx.functional_call(module, p, (x,))), in_dims=(None, 0))(params, x)
        w, b = (v.clone().requires_grad_() for v in params.values())
        rows = [torch.autograd.grad(written_out(w, b, x[i]), (w, b)) for i in range(len(x))]
        expected = {k: torch.stack([r[j] for r in rows]) for j, k in enumerate(params)}
    else:
        actual = functx.hessian(lambda b: functx.functional_call(module, {"lin.weight": params["lin.weight"], "lin.bias": b}, (x,)))(params["lin.bias"])
        expected = torch.autograd.functional.hessian(lambda b: written_out(params["lin.weight"], b, x), params["lin.bias"])
        actual, expected = {"b": actual}, {"b": expected}
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=1e-10, atol=1e-12)
    assert all(p.dtype == torch.float64 and not isinstance(p, functx.core.LevelTensor) for p in module.parameters())
