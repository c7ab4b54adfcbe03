"""Per-sample gradients: `vmap(grad(loss), in_dims=(None, 0, 0))` over functional_call
equals a loop of torch.autograd.grad, one sample at a time, for common layers."""


import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

import functx

BATCH = 3


class SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x)[0]


class RNNOutput(nn.Module):
    """The output sequence of an RNN (drops the final hidden state); `h0` optional."""

    def __init__(self, rnn):
        super().__init__()
        self.rnn = rnn

    def forward(self, x, h0=None):
        if h0 is not None and isinstance(self.rnn, nn.LSTM):
            h0 = (h0, h0)
        return self.rnn(x, h0)[0]


def batch_norm_replaced():
    return functx.replace_all_batch_norm_modules_(nn.BatchNorm2d(3))


def batch_norm_eval():
    bn = nn.BatchNorm2d(3)
    bn.running_mean.uniform_(-1, 1)
    bn.running_var.uniform_(0.5, 1.5)
    return bn.eval()


# name -> (module factory, per-sample input shape or a sampler)
LAYERS = {
    "linear": (lambda: nn.Linear(4, 3), (4,)),
    "conv2d": (lambda: nn.Conv2d(4, 6, 3), (4, 7, 7)),
    "conv2d_groups_stride_padding_dilation": (
        lambda: nn.Conv2d(4, 6, 3, stride=2, padding=1, dilation=2, groups=2),
        (4, 9, 9),
    ),
    "conv1d_groups_stride_padding_dilation": (
        lambda: nn.Conv1d(4, 6, 3, stride=2, padding=2, dilation=2, groups=2),
        (4, 9),
    ),
    "conv_transpose2d": (lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2), (4, 5, 5)),
    "layer_norm": (lambda: nn.LayerNorm([5]), (3, 5)),
    "group_norm": (lambda: nn.GroupNorm(2, 4), (4, 5)),
    "embedding": (lambda: nn.Embedding(10, 3), lambda: torch.randint(0, 10, (BATCH, 5))),
    "batch_norm2d_replaced": (batch_norm_replaced, (3, 4, 4)),
    "batch_norm2d_eval": (batch_norm_eval, (3, 4, 4)),
    "multihead_attention": (SelfAttention, (3, 8)),
    "transformer_encoder_layer_eval": (
        lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).eval(),
        (3, 8),
    ),
    "transformer_encoder_layer_train": (
        lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True),
        (3, 8),
    ),
    "gru_with_batched_h0": (lambda: RNNOutput(nn.GRU(4, 5, batch_first=True)), (3, 4)),
    "lstm_with_batched_h0_no_mkldnn": (lambda: RNNOutput(nn.LSTM(4, 5, batch_first=True)), (3, 4)),
}

XFAIL: dict = {}  # layer name -> reason (none known)

# Layers whose forward takes a per-sample initial hidden state as a second input.
WITH_H0 = {"gru_with_batched_h0", "lstm_with_batched_h0_no_mkldnn"}


def sample_inputs(spec):
    return spec() if callable(spec) else torch.randn(BATCH, *spec)


def mse(module, state, x, target, extra):
    """The loss of one sample: the module sees a batch of one."""
    args = (x.unsqueeze(0),) + tuple(e.unsqueeze(1) for e in extra)
    return F.mse_loss(functx.functional_call(module, state, args), target.unsqueeze(0))


def functx_per_sample_grads(module, x, targets, extra=()):
    params = {k: v.detach() for k, v in module.named_parameters()}
    buffers = dict(module.named_buffers())

    def loss(params, x, target, *extra):
        return mse(module, (params, buffers), x, target, extra)

    in_dims = (None, 0, 0) + (0,) * len(extra)
    return functx.vmap(functx.grad(loss), in_dims=in_dims)(params, x, targets, *extra)


def loop_per_sample_grads(module, x, targets, extra=()):
    """Plain torch: one forward/backward per sample through the module's own parameters."""
    names, params = zip(*module.named_parameters())
    per_sample = []
    for i in range(x.shape[0]):
        args = (x[i : i + 1],) + tuple(e[:, i : i + 1] for e in extra)
        loss = F.mse_loss(module(*args), targets[i : i + 1])
        per_sample.append(torch.autograd.grad(loss, params))
    return {name: torch.stack([g[j] for g in per_sample]) for j, name in enumerate(names)}


def check_layer(name):
    factory, spec = LAYERS[name]
    module = factory()
    x = sample_inputs(spec)
    extra = ()
    if name in WITH_H0:
        extra = (torch.randn(1, BATCH, 5),)  # (num_layers, batch, hidden) -> batch at dim 1
    with torch.no_grad():
        out_shape = module(x[:1], *(e[:, :1] for e in extra)).shape[1:]
    targets = torch.randn(BATCH, *out_shape)
    expected = loop_per_sample_grads(module, x, targets, extra)
    with functx.vmap_fallback("error"):
        ours = functx_per_sample_grads(module, x, targets, tuple(e.movedim(1, 0) for e in extra))
    assert ours.keys() == expected.keys()
    for k in expected:
        assert_close(ours[k], expected[k], atol=1e-5, rtol=1e-4, msg=lambda m: f"{name} {k}: {m}")


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.xfail(reason=XFAIL[n], strict=True)) if n in XFAIL else n for n in LAYERS],
)
def test_per_sample_grads_match_loop(name):
    if name.endswith("no_mkldnn"):
        with torch.backends.mkldnn.flags(enabled=False):
            check_layer(name)
    else:
        check_layer(name)


def test_gru_default_initial_state_beyond_torch_func():
    """With the default (unbatched, zero) initial hidden state, ATen's GRU cell computes the
    hidden gates from unbatched weights and state, then adds batched values into them in
    place (aten::add_.Tensor): torch.func fails on that write. functx's grad right inside
    vmap gives the unbatched parameters the batch dim (physical_level.py), so the write
    is batched and the per-sample gradients match the loop."""
    module = RNNOutput(nn.GRU(4, 5, batch_first=True))
    x = torch.randn(BATCH, 3, 4)
    targets = torch.randn(BATCH, 3, 5)
    ours = functx_per_sample_grads(module, x, targets)
    expected = loop_per_sample_grads(module, x, targets)
    for k in expected:
        assert_close(ours[k], expected[k], atol=1e-5, rtol=1e-4)
    with pytest.raises(RuntimeError):
        params = {k: v.detach() for k, v in module.named_parameters()}
        torch.func.vmap(torch.func.grad(lambda p, x: torch.func.functional_call(module, p, x[None]).sum()), in_dims=(None, 0))(params, x)


@pytest.mark.parametrize("layers, bidirectional", [(1, False), (2, True)])
def test_lstm_default_path_is_vectorized(layers, bidirectional):
    """On CPU with oneDNN enabled, LSTM runs aten::mkldnn_rnn_layer (and its backward):
    batched by rules/nn_rnn.py, no per-sample fallback, under the physical grad level
    (vmap(grad)) and under a wrapping one (vmap of vjp: the backward op's rule)."""
    module = RNNOutput(nn.LSTM(4, 5, num_layers=layers, batch_first=True, bidirectional=bidirectional))
    x = torch.randn(BATCH, 3, 4)
    targets = torch.randn(BATCH, 3, 5 * (2 if bidirectional else 1))
    expected = loop_per_sample_grads(module, x, targets)
    with functx.vmap_fallback("error"):
        ours = functx_per_sample_grads(module, x, targets)
        params = {k: v.detach() for k, v in module.named_parameters()}

        def by_vjp(x, target):
            loss = lambda p: F.mse_loss(functx.functional_call(module, p, (x[None],)), target[None])
            return functx.vjp(loss, params)[1](torch.tensor(1.0))[0]

        wrapped = functx.vmap(by_vjp)(x, targets)
    for k in expected:
        assert_close(ours[k], expected[k], atol=1e-5, rtol=1e-4)
        assert_close(wrapped[k], expected[k], atol=1e-5, rtol=1e-4)


def test_ensemble_of_lstms_matches_a_loop():
    """Batched weights (an ensemble): the LSTM layer runs with per-model weights."""
    models = [nn.LSTM(4, 5, batch_first=True) for _ in range(3)]
    params, buffers = functx.stack_module_state(models)
    x = torch.randn(2, 6, 4)
    base = nn.LSTM(4, 5, batch_first=True)
    with functx.vmap_fallback("error"):
        ours = functx.vmap(lambda p, b: functx.functional_call(base, (p, b), (x,))[0], in_dims=(0, 0))(params, buffers)
    for i, m in enumerate(models):
        assert_close(ours[i], m(x)[0].detach())


def test_per_sample_grads_of_small_cnn_classifier():
    """The DP-SGD use: cross-entropy of a conv net, per sample."""
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(4 * 3 * 3, 5))
    x = torch.randn(4, 1, 8, 8)
    y = torch.randint(0, 5, (4,))
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(params, x, y):
        return F.cross_entropy(functx.functional_call(model, params, x[None]), y[None])

    with functx.vmap_fallback("error"):
        ours = functx.vmap(functx.grad(loss), in_dims=(None, 0, 0))(params, x, y)
    for i in range(4):
        grads = torch.autograd.grad(F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]), list(model.parameters()))
        for (k, _), g in zip(model.named_parameters(), grads):
            assert_close(ours[k][i], g, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("randomness", ["different", "same"])
def test_dropout_per_sample_gradients(randomness):
    """d/dx sum(W dropout(x)) = W^T 1 * mask / (1 - p): the masks behind the per-sample
    gradients follow the randomness mode, and each has about p of its entries dropped."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Dropout(0.5), nn.Linear(200, 1, bias=False)).train()
    params = dict(model.named_parameters())
    x = torch.randn(8, 200)

    def loss(p, xi):
        return functx.functional_call(model, p, (xi,)).sum()

    grads = functx.vmap(functx.grad(loss, argnums=1), in_dims=(None, 0), randomness=randomness)(params, x)
    scale = model[1].weight.detach()[0] * 2.0  # W^T 1 / (1 - p)
    masks = grads / scale
    assert torch.all((masks.abs() < 1e-5) | ((masks - 1).abs() < 1e-5)), "gradients are not mask * W / (1-p)"
    dropped = (masks.abs() < 1e-5).float().mean(1)
    assert torch.all((dropped > 0.3) & (dropped < 0.7))
    if randomness == "same":
        torch.testing.assert_close(masks, masks[0].expand_as(masks))
    else:
        assert all(not torch.equal(masks[0], masks[i]) for i in range(1, 8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.LSTM(4, 5, num_layers=2, batch_first=True, bidirectional=True),
        lambda: nn.GRU(4, 5, num_layers=2, batch_first=True),
        lambda: nn.RNN(4, 5, nonlinearity="relu"),
        lambda: nn.RNN(4, 5, num_layers=2, bidirectional=True),
    ],
    ids=["lstm", "gru", "rnn_relu", "rnn_tanh"],
)
def test_recurrent_layers_under_grad_of_vmap(make, dtype):
    """grad(vmap(f)) over recurrent layers: the weights and the first state are not batched
    at the vmap level, the input is; torch's C++ layers write the input's (batched) gates into
    the state's (unbatched) in place, which vmap refuses. They run out of place under vmap
    (vmap/rules/nn_rnn.py). Reference: autograd over a loop of per-sample calls."""
    module = make().to(dtype)
    x = torch.randn(BATCH, 3, 4, dtype=dtype)
    params = {k: v.detach() for k, v in module.named_parameters()}

    def sample_loss(p, x):
        return functx.functional_call(module, p, (x.unsqueeze(0) if module.batch_first else x.unsqueeze(1),))[0].pow(2).sum()

    with functx.vmap_fallback("error"):
        ours = functx.grad(lambda p: functx.vmap(sample_loss, in_dims=(None, 0))(p, x).sum())(params)
        ensemble_in = functx.vmap(lambda xi: sample_loss(params, xi))(x)
    total = sum(module(x[i : i + 1] if module.batch_first else x[i : i + 1].transpose(0, 1))[0].pow(2).sum() for i in range(BATCH))
    expected = dict(zip(params, torch.autograd.grad(total, list(module.parameters()))))
    tolerance = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else {}
    for k in expected:
        assert_close(ours[k], expected[k], **tolerance)
    assert_close(ensemble_in.sum(), total.detach(), **tolerance)
