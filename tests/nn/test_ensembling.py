"""Model ensembling: stack_module_state + vmap(functional_call), and the legacy functorch
API (make_functional, make_functional_with_buffers, combine_state_for_ensemble),
each against a loop over the models."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

import functx


def mlp():
    return nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 3))


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 6, 3, stride=2)
        self.fc = nn.Linear(6 * 3 * 3, 2)

    def forward(self, x):
        x = F.relu(self.bn(self.conv1(x)))
        x = F.max_pool2d(x, 1)
        x = F.relu(self.conv2(x))
        return self.fc(x.flatten(1))


def cnn_ensemble(n):
    models = [SmallCNN() for _ in range(n)]
    for m in models:  # distinct running stats, so buffers matter
        m.bn.running_mean.uniform_(-1, 1)
        m.bn.running_var.uniform_(0.5, 2)
        m.eval()
    return models


CASES = {
    "mlp": (lambda: [mlp() for _ in range(8)], (6, 5)),
    "cnn": (lambda: cnn_ensemble(4), (6, 1, 7, 7)),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("same_minibatch", [True, False], ids=["same_minibatch", "different_minibatches"])
def test_stack_module_state_vmap_functional_call_equals_loop(case, same_minibatch):
    make_models, shape = CASES[case]
    models = make_models()
    params, buffers = functx.stack_module_state(models)
    x = torch.randn(*shape) if same_minibatch else torch.randn(len(models), *shape)

    def call(params, buffers, x):
        return functx.functional_call(models[0], (params, buffers), (x,))

    with functx.vmap_fallback("error"):
        out = functx.vmap(call, in_dims=(0, 0, None if same_minibatch else 0))(params, buffers, x)
    expected = torch.stack([m(x if same_minibatch else x[i]) for i, m in enumerate(models)])
    assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("same_minibatch", [True, False], ids=["same_minibatch", "different_minibatches"])
def test_combine_state_for_ensemble_equals_loop(case, same_minibatch):
    make_models, shape = CASES[case]
    models = make_models()
    snapshots = [copy.deepcopy(m.state_dict()) for m in models]
    fmodel, params, buffers = functx.combine_state_for_ensemble(models)
    x = torch.randn(*shape) if same_minibatch else torch.randn(len(models), *shape)
    with functx.vmap_fallback("error"):
        out = functx.vmap(fmodel, in_dims=(0, 0, None if same_minibatch else 0))(params, buffers, x)
    expected = torch.stack([m(x if same_minibatch else x[i]) for i, m in enumerate(models)])
    assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert all(not p.requires_grad for p in params)  # functorch: detached
    for m, snap in zip(models, snapshots):
        for k, v in m.state_dict().items():
            assert torch.equal(v, snap[k])


def test_ensemble_gradients_equal_per_model_gradients():
    models = [mlp() for _ in range(4)]
    params, buffers = functx.stack_module_state(models)
    x, y = torch.randn(6, 5), torch.randn(6, 3)

    def loss(params, buffers):
        return F.mse_loss(functx.functional_call(models[0], (params, buffers), (x,)), y)

    with functx.vmap_fallback("error"):
        grads = functx.vmap(functx.grad(loss))(params, buffers)
    for i, m in enumerate(models):
        expected = torch.autograd.grad(F.mse_loss(m(x), y), list(m.parameters()))
        for (k, _), g in zip(m.named_parameters(), expected):
            assert_close(grads[k][i], g, atol=1e-5, rtol=1e-5)


def test_stacked_leaves_are_independent_of_models():
    models = cnn_ensemble(3)
    params, buffers = functx.stack_module_state(models)
    assert list(params) == [k for k, _ in models[0].named_parameters()]
    assert list(buffers) == [k for k, _ in models[0].named_buffers()]
    for name, p in params.items():
        assert p.is_leaf and p.requires_grad and p.grad_fn is None
        assert p.shape == (3, *dict(models[0].named_parameters())[name].shape)
        for i, m in enumerate(models):
            assert torch.equal(p[i], dict(m.named_parameters())[name])
    for b in buffers.values():
        assert b.is_leaf and not b.requires_grad
    # no shared memory: writing into the stack leaves the models alone
    before = models[0].fc.weight.detach().clone()
    with torch.no_grad():
        params["fc.weight"].zero_()
        buffers["bn.running_mean"].zero_()
    assert torch.equal(models[0].fc.weight, before)
    assert not torch.equal(models[0].bn.running_mean, torch.zeros(4))
    # and the stack is optimizable on its own
    torch.optim.SGD(list(params.values()), lr=0.1)


def test_stack_module_state_keeps_requires_grad_false():
    models = [mlp() for _ in range(2)]
    for m in models:
        m[0].bias.requires_grad_(False)
    params, _ = functx.stack_module_state(models)
    assert not params["0.bias"].requires_grad and params["0.weight"].requires_grad
    models[1][0].weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match="0.weight from each model to have the same .requires_grad"):
        functx.stack_module_state(models)


class OtherMLP(nn.Sequential):
    pass


@pytest.mark.parametrize("stack", [functx.stack_module_state, functx.combine_state_for_ensemble])
def test_mismatched_models_give_clear_errors(stack):
    with pytest.raises(RuntimeError, match="at least one model"):
        stack([])
    with pytest.raises(RuntimeError, match="same class"):
        stack([mlp(), OtherMLP(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 3))])
    with pytest.raises(RuntimeError, match="training/eval mode: the model is in training"):
        stack([mlp(), mlp().eval()])
    partly_eval = mlp()
    partly_eval[2].eval()
    with pytest.raises(RuntimeError, match="submodule '2' is in training mode in model 0 and in eval mode in model 1"):
        stack([mlp(), partly_eval])
    wider = nn.Sequential(nn.Linear(5, 17), nn.ReLU(), nn.Linear(17, 3))
    with pytest.raises(RuntimeError, match=r"parameter '0.weight' differs between model 0 \(\(16, 5\)"):
        stack([mlp(), wider])
    no_bias = nn.Sequential(nn.Linear(5, 16, bias=False), nn.ReLU(), nn.Linear(16, 3))
    with pytest.raises(RuntimeError, match=r"different parameters: only in model 0: \['0.bias'\]"):
        stack([mlp(), no_bias])
    double = mlp().double()
    with pytest.raises(RuntimeError, match="torch.float64"):
        stack([mlp(), double])
    with pytest.raises(RuntimeError, match="different buffers"):
        stack([SmallCNN(), functx.replace_all_batch_norm_modules_(SmallCNN())])


# --- make_functional / make_functional_with_buffers -------------------------------------


def test_make_functional_matches_model_and_leaves_it_alone():
    model = mlp()
    snapshot = {k: (v, v.detach().clone()) for k, v in model.named_parameters()}
    fmodel, params = functx.make_functional(model)
    x = torch.randn(4, 5)
    assert_close(fmodel(params, x), model(x))
    assert len(params) == len(snapshot)
    for p, (name, (orig, _)) in zip(params, snapshot.items()):
        assert p is not orig and p.is_leaf and p.requires_grad
        assert torch.equal(p, orig)
    new_params = [torch.randn_like(p) for p in params]
    expected = torch.func.functional_call(model, dict(zip(snapshot, new_params)), x)
    assert_close(fmodel(new_params, x), expected)
    for name, p in model.named_parameters():  # original untouched
        assert p is snapshot[name][0] and torch.equal(p, snapshot[name][1])
    with pytest.raises(ValueError, match="expected 4 params"):
        fmodel(params[:2], x)


def test_make_functional_disable_autograd_tracking_and_grad():
    model = mlp()
    fmodel, params = functx.make_functional(model, disable_autograd_tracking=True)
    assert all(not p.requires_grad for p in params)
    assert all(p.requires_grad for p in model.parameters())
    x, y = torch.randn(4, 5), torch.randn(4, 3)
    grads = functx.grad(lambda p: F.mse_loss(fmodel(p, x), y))(params)
    expected = torch.autograd.grad(F.mse_loss(model(x), y), list(model.parameters()))
    for g, e in zip(grads, expected):
        assert_close(g, e)


def test_make_functional_rejects_buffers():
    with pytest.raises(RuntimeError, match="make_functional_with_buffers"):
        functx.make_functional(nn.BatchNorm1d(3))


def test_make_functional_with_tied_weights_returns_one_param():
    class TiedLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(7, 4)
            self.out = nn.Linear(4, 7, bias=False)
            self.out.weight = self.embed.weight

        def forward(self, ids):
            return self.out(self.embed(ids))

    model = TiedLM()
    fmodel, params = functx.make_functional(model)
    assert len(params) == 1
    ids = torch.randint(0, 7, (3,))
    w = torch.randn(7, 4)
    assert_close(fmodel((w,), ids), w[ids] @ w.T)


def test_make_functional_with_buffers_matches_model():
    model = SmallCNN()
    model.bn.running_mean.uniform_()
    model.eval()
    fmodel, params, buffers = functx.make_functional_with_buffers(model)
    assert [b.shape for b in buffers] == [b.shape for b in model.buffers()]
    x = torch.randn(2, 1, 7, 7)
    assert_close(fmodel(params, buffers, x), model(x))
    # training mode: the forward updates the returned buffers, not the model's
    model.train()
    fmodel, params, buffers = functx.make_functional_with_buffers(model)
    before = model.bn.running_mean.clone()
    fmodel(params, buffers, x)
    assert torch.equal(model.bn.running_mean, before)
    model(x)
    assert_close(buffers[0], model.bn.running_mean)


def test_make_functional_per_sample_grads():
    model = mlp()
    fmodel, params = functx.make_functional(model, disable_autograd_tracking=True)
    x, y = torch.randn(4, 5), torch.randn(4, 3)

    def loss(params, x, y):
        return F.mse_loss(fmodel(params, x[None]), y[None])

    with functx.vmap_fallback("error"):
        grads = functx.vmap(functx.grad(loss), in_dims=(None, 0, 0))(params, x, y)
    for i in range(4):
        expected = torch.autograd.grad(F.mse_loss(model(x[i : i + 1]), y[i : i + 1]), list(model.parameters()))
        for g, e in zip(grads, expected):
            assert_close(g[i], e, atol=1e-6, rtol=1e-5)
