"""functx.nn.Ensemble (N models as one vmapped module) and functx.nn.vmap_init (N members
initialised independently by one vmapped call), against loops over separate modules."""

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

import functx
from functx.nn import Ensemble, vmap_init


def mlp():
    return nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 3))


def bn_mlp():
    return nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 6 * 6, 2)

    def forward(self, x):
        return self.fc(F.relu(self.bn(self.conv(x))).flatten(1))


def with_distinct_running_stats(models):
    for m in models:
        for mod in m.modules():
            if isinstance(mod, nn.modules.batchnorm._BatchNorm):
                mod.running_mean.uniform_(-1, 1)
                mod.running_var.uniform_(0.5, 2)
    return models


# ---- forward ----

@pytest.mark.parametrize("make, shape", [(mlp, (6, 5)), (SmallCNN, (3, 1, 6, 6))], ids=["mlp", "cnn"])
@pytest.mark.parametrize("per_member", [False, True], ids=["same_input", "per_member_input"])
def test_forward_eval_equals_loop_over_models(make, shape, per_member):
    models = with_distinct_running_stats([make().eval() for _ in range(4)])
    ensemble = Ensemble(models, in_dims=0 if per_member else None).eval()
    x = torch.randn(4, *shape) if per_member else torch.randn(*shape)
    with functx.vmap_fallback("error"):
        out = ensemble(x)
    expected = torch.stack([m(x[i] if per_member else x) for i, m in enumerate(models)])
    assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_in_dims_tuple_and_kwargs_are_shared():
    class Affine(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x, shift, *, scale=1.0):
            return self.lin(x) * scale + shift

    models = [Affine() for _ in range(3)]
    ensemble = Ensemble(models, in_dims=(None, 0))
    x, shifts = torch.randn(5, 3), torch.randn(3, 2)
    out = ensemble(x, shifts, scale=2.0)
    assert_close(out, torch.stack([m(x, shifts[i], scale=2.0) for i, m in enumerate(models)]))


def test_models_are_copied_not_shared():
    models = [mlp() for _ in range(3)]
    before = [copy.deepcopy(m.state_dict()) for m in models]
    ensemble = Ensemble(models)
    with torch.no_grad():
        for p in ensemble.parameters():
            p.add_(1.0)
    for m, snap in zip(models, before):
        for k, v in m.state_dict().items():
            assert torch.equal(v, snap[k])


# ---- training ----

def test_training_mode_batch_norm_updates_per_member_running_stats_and_trains():
    """One training step (train-mode batch norm, SGD) equals the same step on each model."""
    models = with_distinct_running_stats([bn_mlp() for _ in range(3)])
    copies = [copy.deepcopy(m) for m in models]
    ensemble = Ensemble(models)
    x, y = torch.randn(6, 5), torch.randn(6, 3)

    opt = torch.optim.SGD(ensemble.parameters(), lr=0.1)
    with functx.vmap_fallback("error"):
        out = ensemble(x)
    # sum over members: each member's loss only depends on its own parameters
    F.mse_loss(out, y.expand(3, 6, 3), reduction="none").mean((1, 2)).sum().backward()
    opt.step()

    expected_out = []
    for m in copies:
        opt_m = torch.optim.SGD(m.parameters(), lr=0.1)
        out_m = m(x)
        F.mse_loss(out_m, y).backward()
        opt_m.step()
        expected_out.append(out_m.detach())
    assert_close(out.detach(), torch.stack(expected_out), atol=1e-5, rtol=1e-5)
    for i, m in enumerate(copies):
        member = ensemble.member(i)
        for name, value in m.state_dict().items():
            assert_close(member.state_dict()[name], value, atol=1e-5, rtol=1e-5)
    # gradients live on the ensemble's stacked parameters
    assert ensemble.stacked[0].weight.grad.shape == (3, 8, 5)


def test_gradients_equal_per_model_gradients():
    models = [mlp() for _ in range(4)]
    ensemble = Ensemble(models)
    x, y = torch.randn(6, 5), torch.randn(6, 3)
    out = ensemble(x)
    sum(F.mse_loss(out[i], y) for i in range(4)).backward()
    for i, m in enumerate(models):
        grads = torch.autograd.grad(F.mse_loss(m(x), y), list(m.parameters()))
        for (name, p), g in zip(ensemble.stacked.named_parameters(), grads):
            assert_close(p.grad[i], g, atol=1e-5, rtol=1e-5)


def test_functional_forward_is_pure_and_returns_new_buffers():
    models = [bn_mlp() for _ in range(3)]
    ensemble = Ensemble(models)
    state = copy.deepcopy(ensemble.state_dict())
    params = dict(ensemble.stacked.named_parameters())
    x = torch.randn(6, 5)
    out, new_buffers = ensemble.functional_forward(params, {}, x)
    for name, value in ensemble.state_dict().items():
        assert torch.equal(value, state[name])
    for i, m in enumerate(models):
        assert_close(out[i], m(x), atol=1e-5, rtol=1e-5)  # m updates its own stats here
        for name, value in m.named_buffers():
            assert_close(new_buffers[name][i], value, atol=1e-5, rtol=1e-5)


def test_functional_forward_composes_with_functx_grad():
    models = [mlp() for _ in range(3)]
    ensemble = Ensemble(models)
    x = torch.randn(4, 5)
    params = {k: v.detach() for k, v in ensemble.stacked.named_parameters()}
    grads = functx.grad(lambda p: ensemble.functional_forward(p, {}, x)[0].pow(2).sum())(params)
    for i, m in enumerate(models):
        expected = torch.autograd.grad(m(x).pow(2).sum(), list(m.parameters()))
        for name, g in zip(params, expected):
            assert_close(grads[name][i], g, atol=1e-5, rtol=1e-5)


def test_state_dict_round_trip_and_len():
    ensemble = Ensemble([bn_mlp() for _ in range(3)])
    other = Ensemble([bn_mlp() for _ in range(3)])
    other.load_state_dict(ensemble.state_dict())
    x = torch.randn(6, 5)
    assert_close(other.eval()(x), ensemble.eval()(x))
    assert len(ensemble) == 3
    assert "stacked.0.weight" in ensemble.state_dict()
    assert ensemble.state_dict()["stacked.1.running_mean"].shape == (3, 8)


def test_dropout_draws_per_member_by_default():
    model = nn.Sequential(nn.Linear(5, 64), nn.Dropout(0.5))
    ensemble = Ensemble([copy.deepcopy(model) for _ in range(3)])  # identical members
    out = ensemble(torch.randn(2, 5))
    assert not torch.equal(out[0] == 0, out[1] == 0)
    assert torch.equal(ensemble.eval()(torch.ones(2, 5))[0], ensemble(torch.ones(2, 5))[1])


def test_tied_weights_stay_tied():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(self.a(x))

    models = [Tied() for _ in range(2)]
    ensemble = Ensemble(models)
    assert ensemble.stacked.a.weight is ensemble.stacked.b.weight
    x = torch.randn(3, 4)
    assert_close(ensemble(x), torch.stack([m(x) for m in models]))


def test_mismatched_models_raise():
    with pytest.raises(RuntimeError, match="same class"):
        Ensemble([mlp(), SmallCNN()])


def test_requires_grad_mismatch_names_the_api():
    """Ensemble's requires_grad error starts with "Ensemble: " as its other model checks do;
    stack_module_state's keeps torch.func's exact (unprefixed) wording."""
    models = [mlp() for _ in range(2)]
    models[1][0].weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"^Ensemble: Expected 0\.weight from each model to have the same \.requires_grad$"):
        Ensemble(models)
    with pytest.raises(RuntimeError) as ours:
        functx.stack_module_state(models)
    with pytest.raises(RuntimeError) as theirs:
        torch.func.stack_module_state(models)
    assert str(ours.value) == str(theirs.value) == "Expected 0.weight from each model to have the same .requires_grad"


def test_from_state_checks_per_member_shapes_and_dtypes():
    """A stacked state of other models (same names, other shapes or dtypes) is refused at
    construction, naming the tensor and both shapes, not at the forward."""
    state = functx.stack_module_state([nn.Linear(2, 2) for _ in range(3)])
    with pytest.raises(ValueError, match="does not match the template") as info:
        Ensemble.from_state(nn.Conv1d(2, 2, 1), *state)
    assert "parameter 'weight' is (2, 2, 1), torch.float32 in the template" in str(info.value)
    assert "but (2, 2), torch.float32 per member" in str(info.value)
    with pytest.raises(ValueError, match=r"parameter 'weight' is \(3, 2\), torch.float32 in the template but \(2, 2\)"):
        Ensemble.from_state(nn.Linear(2, 3), *state)
    with pytest.raises(ValueError, match=r"parameter 'weight' is \(2, 2\), torch.float64 in the template but \(2, 2\), torch.float32"):
        Ensemble.from_state(nn.Linear(2, 2).double(), *state)
    params, buffers = functx.stack_module_state([nn.BatchNorm1d(4) for _ in range(2)])
    buffers["running_var"] = torch.ones(2, 5)
    with pytest.raises(ValueError, match=r"buffer 'running_var' is \(4,\), torch.float32 in the template but \(5,\)"):
        Ensemble.from_state(nn.BatchNorm1d(4), params, buffers)
    params, buffers = functx.stack_module_state([nn.BatchNorm1d(4) for _ in range(2)])
    buffers["num_batches_tracked"] = torch.tensor(0)
    with pytest.raises(ValueError, match=r"'num_batches_tracked' is \(\), torch.int64 in the template but a 0-dim tensor"):
        Ensemble.from_state(nn.BatchNorm1d(4), params, buffers)
    # a matching state builds, and so does one whose template is a member of an ensemble
    # (as shard_ensemble_state passes); an ensemble's `stacked` module (tensors with the
    # member dim) is not a template
    ensemble = Ensemble.from_state(nn.Linear(2, 2), *state)
    params = {k: v[:2] for k, v in ensemble.stacked.named_parameters()}
    assert len(Ensemble.from_state(ensemble.member(0), params, {})) == 2
    with pytest.raises(ValueError, match=r"'weight' is \(3, 2, 2\), torch.float32 in the template but \(2, 2\)"):
        Ensemble.from_state(ensemble.stacked, params, {})


# ---- initialisation under vmap ----

def uniform_checks(w, bound, *, rel=0.03):
    """w ~ U(-bound, bound): inside the bounds, close to both, mean 0 and std bound/sqrt(3)."""
    assert w.abs().max() <= bound
    assert w.max() > bound * 0.99 and w.min() < -bound * 0.99
    assert abs(w.mean().item()) < 5 * bound / math.sqrt(3 * w.numel())
    assert w.std().item() == pytest.approx(bound / math.sqrt(3), rel=rel)


def test_vmap_init_linear_matches_torch_init_distribution_per_member():
    torch.manual_seed(0)
    fan_in, n = 256, 6
    params, _ = vmap_init(nn.Linear(fan_in, 512), n)
    weight, bias = params["weight"], params["bias"]
    assert weight.shape == (n, 512, fan_in) and weight.requires_grad and weight.is_leaf
    bound = 1 / math.sqrt(fan_in)  # kaiming_uniform_(a=sqrt(5)) as Linear.reset_parameters
    for i in range(n):
        uniform_checks(weight[i], bound)
        assert bias[i].abs().max() <= bound
    # members are independent: no two equal, near-zero correlation
    flat = weight.flatten(1)
    corr = torch.corrcoef(flat)
    off_diagonal = corr[~torch.eye(n, dtype=torch.bool)]
    assert off_diagonal.abs().max() < 0.02
    # same distribution as torch's own init: quantiles agree with a freshly built Linear's
    q = torch.linspace(0.05, 0.95, 19)
    assert_close(torch.quantile(weight[0].flatten(), q), torch.quantile(nn.Linear(fan_in, 512).weight.detach().flatten(), q), atol=0.02 * bound, rtol=0)


def test_vmap_init_conv_and_batch_norm_reset_like_torch():
    template = with_distinct_running_stats([SmallCNN()])[0]
    with torch.no_grad():
        template.bn.weight.fill_(3.0)
    params, buffers = vmap_init(template, 4)
    fan_in = 1 * 3 * 3
    assert params["conv.weight"].abs().max() <= 1 / math.sqrt(fan_in)  # kaiming uniform bound
    assert params["conv.weight"].std().item() == pytest.approx(1 / math.sqrt(3 * fan_in), rel=0.2)
    assert not torch.equal(params["conv.weight"][0], params["conv.weight"][1])
    assert torch.equal(params["bn.weight"], torch.ones(4, 4))  # reset, not the template's 3.0
    assert torch.equal(buffers["bn.running_mean"], torch.zeros(4, 4))
    assert torch.equal(buffers["bn.running_var"], torch.ones(4, 4))
    assert torch.equal(buffers["bn.num_batches_tracked"], torch.zeros(4, dtype=torch.long))
    assert torch.equal(template.bn.weight, torch.full((4,), 3.0))  # template untouched


def test_vmap_init_with_custom_init_functions():
    """Common custom inits: nn.init.* on parameters, `.data.normal_`. (nn.init.trunc_normal_
    is not supported: its rejection loop branches on `mask.any()`, data-dependent under vmap.)"""

    def init(model):
        nn.init.xavier_normal_(model[0].weight)
        model[0].bias.data.normal_(0.0, 0.02)
        nn.init.kaiming_normal_(model[1].weight, nonlinearity="relu")
        nn.init.zeros_(model[1].bias)

    params, _ = vmap_init(nn.Sequential(nn.Linear(200, 300), nn.Linear(300, 200)), 3, init)
    xavier_std = math.sqrt(2.0 / (200 + 300))
    for i in range(3):
        assert params["0.weight"][i].std().item() == pytest.approx(xavier_std, rel=0.03)
        assert params["0.bias"][i].std().item() == pytest.approx(0.02, rel=0.25)
        assert params["1.weight"][i].std().item() == pytest.approx(math.sqrt(2 / 300), rel=0.03)
    assert not torch.equal(params["0.weight"][0], params["0.weight"][1])
    assert not torch.equal(params["0.bias"][0], params["0.bias"][2])
    assert torch.equal(params["1.bias"], torch.zeros(3, 200))


def test_from_factory_builds_trainable_ensemble_of_distinct_members():
    ensemble = Ensemble.from_factory(bn_mlp, 5, in_dims=0)
    assert len(ensemble) == 5
    w = ensemble.stacked[0].weight
    assert isinstance(w, nn.Parameter) and w.shape == (5, 8, 5)
    assert len({tuple(w[i].flatten().tolist()) for i in range(5)}) == 5
    x = torch.randn(5, 6, 5)
    out = ensemble(x)
    expected = torch.stack([ensemble.member(i).eval()(x[i]) for i in range(5)])  # stats after update
    members = [ensemble.member(i) for i in range(5)]
    ensemble.eval()
    assert_close(ensemble(x), torch.stack([m.eval()(x[i]) for i, m in enumerate(members)]), atol=1e-5, rtol=1e-5)
    assert_close(ensemble(x), expected, atol=1e-5, rtol=1e-5)
    out.sum().backward()
    assert all(p.grad is not None for p in ensemble.parameters())


@pytest.mark.parametrize("n", [True, False, 0, -1, 2.0])
def test_vmap_init_refuses_n_that_is_not_a_positive_int(n):
    """A bool is an int to isinstance; vmap_init refuses it as it refuses 0."""
    with pytest.raises(ValueError, match="vmap_init: n must be a positive int"):
        vmap_init(nn.Linear(2, 2), n)
    with pytest.raises(ValueError, match="vmap_init: n must be a positive int"):
        Ensemble.from_factory(lambda: nn.Linear(2, 2), n)


def test_vmap_init_reassigned_parameters_and_no_per_member_loop():
    """An init that builds a new Parameter from a factory draws per member; the usual
    layers' reset_parameters need no per-sample fallback."""

    def init(linear):
        linear.weight = nn.Parameter(torch.randn(3, 4))

    params, _ = vmap_init(nn.Linear(4, 3), 3, init)
    assert params["weight"].shape == (3, 3, 4)
    assert not torch.equal(params["weight"][0], params["weight"][1])
    layers = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Linear(4, 4), nn.LayerNorm(4), nn.Embedding(10, 4))
    with functx.vmap_fallback("error"):
        params, _ = vmap_init(layers, 3)
    assert not torch.equal(params["4.weight"][0], params["4.weight"][1])  # Embedding: normal_
