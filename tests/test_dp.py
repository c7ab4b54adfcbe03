"""functx.dp.clipped_grad against the materialised reference: torch.func's vmap(grad)
per-sample gradients, their norms, clipped by min(1, C / (‖g_b‖ + 1e-6)) and summed
(float64; float32 with its tolerance); models drawn at random from the layer kinds; edge
cases: batch 1, zero gradients, every sample clipped, none clipped, tied weights, a layer
called twice, padding ids, frozen parameters; the noise; bad input."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import functx

DT = torch.float64


def per_sample_loss(out, y):
    return F.cross_entropy(out, y, reduction="none")


def reference(model, loss_fn, inputs, targets, max_norm):
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}

    def one(p, x_b, y_b):
        out = torch.func.functional_call(model, {**p, **frozen}, (x_b[None],))
        return loss_fn(out, y_b[None]).sum()

    per = torch.func.vmap(torch.func.grad(one), in_dims=(None, 0, 0))(params, inputs, targets)
    norms = torch.sqrt(sum(g.reshape(g.shape[0], -1).pow(2).sum(1) for g in per.values()))
    clip = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    return {n: torch.tensordot(clip, g, dims=1) for n, g in per.items()}, norms


def assert_matches(model, inputs, targets, max_norm, dtype=DT, loss_fn=per_sample_loss):
    grads, norms = functx.dp.clipped_grad(model, loss_fn, inputs, targets, max_norm=max_norm)
    expected, expected_norms = reference(model, loss_fn, inputs, targets, max_norm)
    tol = {} if dtype == DT else {"rtol": 2e-4, "atol": 2e-5}
    torch.testing.assert_close(norms, expected_norms, **tol)
    assert grads.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(grads[name], expected[name], msg=name, **tol)
    return norms


class Tokens(nn.Module):
    """Embedding (padding id 0) -> Linear -> LayerNorm -> Conv1d -> GroupNorm -> Linear."""

    def __init__(self, vocab=11, dim=6, classes=3, tied=False, direct_use=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.mix = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.conv = nn.Conv1d(dim, dim, 3, padding=1)
        self.group = nn.GroupNorm(2, dim)
        self.head = nn.Linear(dim, classes)
        self.unembed = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.unembed.weight = self.embed.weight
        self.tied, self.direct_use = tied, direct_use

    def forward(self, ids):
        h = self.norm(torch.tanh(self.mix(self.embed(ids))))
        h = self.group(self.conv(h.transpose(1, 2))).transpose(1, 2)
        if self.tied:  # the embedding matrix used again, as the weight of an output layer
            h = h + self.unembed(h).softmax(-1)[..., : h.shape[-1]]
        if self.direct_use:
            h = h + self.unembed(h).softmax(-1) @ self.embed.weight
        return self.head(h).mean(1)


def mlp(sizes, dtype=DT):
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers += [nn.Linear(a, b)] + ([nn.Tanh()] if i < len(sizes) - 2 else [])
    return nn.Sequential(*layers).to(dtype)


@pytest.mark.parametrize("max_norm", [1e-4, 0.3, 1e6])  # every sample clipped, some, none
def test_mlp(max_norm):
    model = mlp((5, 7, 3))
    x, y = torch.randn(8, 5, dtype=DT), torch.randint(0, 3, (8,))
    norms = assert_matches(model, x, y, max_norm)
    if max_norm == 1e-4:
        assert (norms > max_norm).all()
    if max_norm == 1e6:
        assert (norms < max_norm).all()


@pytest.mark.parametrize("tied", [False, True])
def test_token_model_with_padding_ids_and_tied_weights(tied):
    model = Tokens(tied=tied).to(DT)
    ids = torch.randint(0, 11, (6, 9))
    ids[:, -2:] = 0  # padded
    ids[0, :4] = 3  # repeated
    assert_matches(model, ids, torch.randint(0, 3, (6,)), 0.5)


def test_a_parameter_used_outside_its_module_is_refused():
    ids, y = torch.randint(0, 11, (4, 5)), torch.randint(0, 3, (4,))
    with pytest.raises(ValueError, match="'embed.weight' is used outside the forward"):
        functx.dp.clipped_grad(Tokens(direct_use=True).to(DT), per_sample_loss, ids, y, max_norm=1.0)


def test_in_place_writes_into_a_layer_output():
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(inplace=True), nn.Linear(5, 3)).to(DT)
    x, y = torch.randn(6, 4, dtype=DT), torch.randint(0, 3, (6,))
    assert_matches(model, x, y, 0.3)


def test_a_layer_input_written_in_place_after_the_call():
    """The first layer's input is written after its call. Its weight gradient needs the
    input as it was, and the backward never runs that layer's own node (nothing below the
    first layer's output is differentiated), so autograd's version check does not catch it
    (torch's own backward would refuse this program): the recorded input must be a copy.
    The reference: the same model writing out of place (the same function)."""

    class WritesInput(nn.Module):
        def __init__(self, in_place):
            super().__init__()
            self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 2)
            self.in_place = in_place

        def forward(self, x):
            x = x.clone()
            h = torch.tanh(self.first(x))
            x = x.mul_(3.0) if self.in_place else x * 3.0
            return self.second(h + x)

    x, y = torch.randn(6, 4, dtype=DT), torch.randint(0, 2, (6,))
    model = WritesInput(in_place=True).to(DT)
    grads, norms = functx.dp.clipped_grad(model, per_sample_loss, x, y, max_norm=0.3)
    model.in_place = False
    expected, expected_norms = reference(model, per_sample_loss, x, y, 0.3)
    torch.testing.assert_close(norms, expected_norms)
    for name in expected:
        torch.testing.assert_close(grads[name], expected[name], msg=name)


def test_tuple_outputs_and_outputs_nested_in_them():
    """A layer returning a named tuple, one item unused (its gradient: zeros); the loss
    reaching a tensor nested inside an output tuple (an LSTM's (h_n, c_n), batch not first)
    is refused with what to use instead, not silently dropped."""
    import collections

    Pair = collections.namedtuple("Pair", "main extra")

    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 6)

        def forward(self, x):
            out = self.lin(x)
            return Pair(torch.tanh(out), out.pow(2))

    class UsesMain(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads, self.out = TwoHeads(), nn.Linear(6, 3)

        def forward(self, x):
            return self.out(self.heads(x).main)

    x, y = torch.randn(5, 4, dtype=DT), torch.randint(0, 3, (5,))
    assert_matches(UsesMain().to(DT), x, y, 0.4)

    class LastState(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.head = nn.LSTM(4, 6, batch_first=True), nn.Linear(6, 3)

        def forward(self, x):
            _, (h, _) = self.rnn(x)
            return self.head(h[-1])

    with pytest.raises(ValueError, match=r"nested inside LSTM's output.*output\[:, -1\]"):
        functx.dp.clipped_grad(LastState().to(DT), per_sample_loss, torch.randn(5, 7, 4, dtype=DT), y, max_norm=1.0)


class Encoder(nn.Module):
    """An embedding, a TransformerEncoderLayer (its MultiheadAttention reads `out_proj`'s
    parameters without calling it: one layer with its submodules, materialised), a head."""

    def __init__(self, batch_first=True):
        super().__init__()
        self.embed = nn.Embedding(13, 8)
        self.block = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=batch_first)
        self.head = nn.Linear(8, 3)

    def forward(self, ids):
        return self.head(self.block(self.embed(ids)).mean(-2))


def test_transformer_encoder_layer():
    ids, y = torch.randint(0, 13, (4, 5)), torch.randint(0, 3, (4,))
    assert_matches(Encoder().to(DT), ids, y, 0.5)


def test_a_module_owning_a_parameter_and_calling_a_layer():
    class Scaled(nn.Module):  # its own parameter and a child it calls: one layer
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.tensor(1.5))
            self.inner = nn.Linear(4, 4)

        def forward(self, x):
            return self.scale * torch.tanh(self.inner(x))

    model = nn.Sequential(Scaled(), nn.Linear(4, 2)).to(DT)
    x, y = torch.randn(5, 4, dtype=DT), torch.randint(0, 2, (5,))
    assert_matches(model, x, y, 0.4)


def test_lstm_against_a_per_sample_autograd_loop():
    """An LSTM (a tuple output, materialised by vmap of grad of ⟨output, gradient⟩: vmap of
    its vjp fails on the zero initial state, as torch.func's vmap(grad) of the model does),
    against a loop of torch.autograd.grad per sample."""

    class Recurrent(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.head = nn.LSTM(4, 6, batch_first=True), nn.Linear(6, 3)

        def forward(self, x):
            return self.head(self.rnn(x)[0][:, -1])

    model = Recurrent().to(DT)
    x, y = torch.randn(5, 7, 4, dtype=DT), torch.randint(0, 3, (5,))
    max_norm = 0.3
    grads, norms = functx.dp.clipped_grad(model, per_sample_loss, x, y, max_norm=max_norm)
    params = [p for p in model.parameters()]
    per = [torch.autograd.grad(per_sample_loss(model(x[b : b + 1]), y[b : b + 1]).sum(), params) for b in range(5)]
    expected_norms = torch.stack([torch.sqrt(sum(g.pow(2).sum() for g in sample)) for sample in per])
    torch.testing.assert_close(norms, expected_norms)
    clip = (max_norm / (expected_norms + 1e-6)).clamp(max=1.0)
    for i, (name, _) in enumerate(model.named_parameters()):
        torch.testing.assert_close(grads[name], sum(clip[b] * per[b][i] for b in range(5)), msg=name)


def test_functional_state():
    """params=: the gradient at the given state, against the module loaded with it and
    against torch.func's vmap(grad) of functional_call; the module and the given tensors
    are left as they were; parameters not given are held fixed."""
    model = Tokens().to(DT)
    ids, y = torch.randint(0, 11, (5, 6)), torch.randint(0, 3, (5,))
    state = {k: v.detach() + 0.1 * torch.randn_like(v) for k, v in model.named_parameters()}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    objects = [id(p) for p in model.parameters()]
    grads, norms = functx.dp.clipped_grad(model, per_sample_loss, ids, y, max_norm=0.5, params=state)
    loaded = Tokens().to(DT)
    loaded.load_state_dict({**model.state_dict(), **state})
    expected, expected_norms = functx.dp.clipped_grad(loaded, per_sample_loss, ids, y, max_norm=0.5)
    torch.testing.assert_close(norms, expected_norms)
    for name in expected:
        torch.testing.assert_close(grads[name], expected[name], msg=name)
    reference_grads, reference_norms = reference(loaded, per_sample_loss, ids, y, 0.5)
    torch.testing.assert_close(norms, reference_norms)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items()) and objects == [id(p) for p in model.parameters()]
    assert all(not t.requires_grad for t in state.values())
    partial = {"head.weight": state["head.weight"]}  # the others held fixed: only head.weight differentiated
    grads, _ = functx.dp.clipped_grad(model, per_sample_loss, ids, y, max_norm=0.5, params=partial)
    assert list(grads) == ["head.weight"]
    with pytest.raises(TypeError, match="params must be a dict"):
        functx.dp.clipped_grad(model, per_sample_loss, ids, y, max_norm=0.5, params=[state])


def test_a_layer_that_does_not_keep_the_batch_first_is_refused():
    class SequenceFirst(Encoder):
        def forward(self, ids):
            return self.head(self.block(self.embed(ids).transpose(0, 1)).mean(0))

    ids, y = torch.randint(0, 13, (4, 5)), torch.randint(0, 3, (4,))
    with pytest.raises(ValueError, match="first dim is not the batch"):
        functx.dp.clipped_grad(SequenceFirst(batch_first=False).to(DT), per_sample_loss, ids, y, max_norm=1.0)


def test_a_layer_called_twice():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x):
            return self.head(torch.tanh(self.layer(torch.tanh(self.layer(x)))))

    x, y = torch.randn(5, 4, dtype=DT), torch.randint(0, 2, (5,))
    assert_matches(Twice().to(DT), x, y, 0.2)


def test_batch_of_one_and_zero_gradients():
    model = mlp((3, 4, 2))
    x, y = torch.randn(1, 3, dtype=DT), torch.randint(0, 2, (1,))
    assert_matches(model, x, y, 0.1)
    constant = lambda out, y: out.sum(1) * 0  # zero gradients: norm 0, nothing clipped
    grads, norms = functx.dp.clipped_grad(model, constant, torch.randn(4, 3, dtype=DT), y, max_norm=1.0)
    assert torch.equal(norms, torch.zeros(4, dtype=DT))
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads.values())


def test_frozen_parameters_and_grad_fields_untouched():
    model = mlp((3, 4, 2))
    model[0].weight.requires_grad_(False)
    x, y = torch.randn(6, 3, dtype=DT), torch.randint(0, 2, (6,))
    assert_matches(model, x, y, 0.5)
    assert all(p.grad is None for p in model.parameters())


def test_noise():
    model = mlp((3, 4, 2))
    x, y = torch.randn(6, 3, dtype=DT), torch.randint(0, 2, (6,))
    clean, _ = functx.dp.clipped_grad(model, per_sample_loss, x, y, max_norm=0.5)
    noisy, _ = functx.dp.clipped_grad(
        model, per_sample_loss, x, y, max_norm=0.5, noise_multiplier=2.0, generator=torch.Generator().manual_seed(3)
    )
    again, _ = functx.dp.clipped_grad(
        model, per_sample_loss, x, y, max_norm=0.5, noise_multiplier=2.0, generator=torch.Generator().manual_seed(3)
    )
    deviation = torch.cat([(noisy[k] - clean[k]).flatten() for k in clean])
    assert torch.equal(torch.cat([again[k].flatten() for k in again]), torch.cat([noisy[k].flatten() for k in noisy]))
    # N(0, (σC)²) = N(0, 1): the sample deviation of 26 draws is within a loose bound
    assert 0.5 < deviation.std().item() < 1.6


def test_bad_input():
    model = mlp((3, 4, 2))
    x, y = torch.randn(4, 3, dtype=DT), torch.randint(0, 2, (4,))
    with pytest.raises(ValueError, match="one loss per sample"):
        functx.dp.clipped_grad(model, lambda out, y: F.cross_entropy(out, y), x, y, max_norm=1.0)
    with pytest.raises(ValueError, match="max_norm must be a positive number"):
        functx.dp.clipped_grad(model, per_sample_loss, x, y, max_norm=0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        functx.dp.clipped_grad(model, per_sample_loss, x, y, max_norm=1.0, noise_multiplier=-1)
    with_bn = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).to(DT)
    with pytest.raises(ValueError, match="BatchNorm1d.*mixes the samples"):
        functx.dp.clipped_grad(with_bn, per_sample_loss, x, y, max_norm=1.0)
    with_bn.eval()  # running statistics: per-sample gradients are defined
    assert_matches(with_bn, x, y, 0.5)
    assert all(len(m._forward_hooks) == 0 for m in with_bn.modules())  # hooks removed, also after errors


@pytest.mark.parametrize(
    "clip, message",
    [
        (dict(max_norm=True), "max_norm must be a positive number, got True"),  # a bool is not a number here
        (dict(max_norm=None), "max_norm must be a positive number, got None"),
        (dict(max_norm=float("nan")), "max_norm must be a positive number, got nan"),
        (dict(max_norm="1"), "max_norm must be a positive number, got '1'"),
        (dict(max_norm=-1.0), "max_norm must be a positive number, got -1.0"),
        (dict(max_norm=1.0, noise_multiplier=None), "noise_multiplier must be a number >= 0, got None"),
        (dict(max_norm=1.0, noise_multiplier=True), "noise_multiplier must be a number >= 0, got True"),
        (dict(max_norm=1.0, noise_multiplier=float("nan")), "noise_multiplier must be a number >= 0, got nan"),
        (dict(max_norm=1.0, noise_multiplier=-0.5), "noise_multiplier must be a number >= 0, got -0.5"),
    ],
)
@pytest.mark.parametrize("with_params", [False, True])
def test_clip_settings_are_checked_before_any_work(clip, message, with_params):
    """As functx.distributed checks them (one helper): bools, None and NaN refused; the loss
    is never computed."""

    def loss_fn(out, y):
        raise AssertionError("the settings are checked before the forward")

    model = mlp((3, 4, 2))
    x, y = torch.randn(4, 3, dtype=DT), torch.randint(0, 2, (4,))
    params = dict(model.named_parameters()) if with_params else None
    with pytest.raises(ValueError, match=re.escape(f"functx.dp.clipped_grad: {message}")):
        functx.dp.clipped_grad(model, loss_fn, x, y, params=params, **clip)


def test_integer_clip_settings_are_numbers():
    model = mlp((3, 4, 2))
    x, y = torch.randn(4, 3, dtype=DT), torch.randint(0, 2, (4,))
    grads, norms = functx.dp.clipped_grad(model, per_sample_loss, x, y, max_norm=1, noise_multiplier=0)
    expected, expected_norms = reference(model, per_sample_loss, x, y, 1.0)
    torch.testing.assert_close(norms, expected_norms)
    for name in expected:
        torch.testing.assert_close(grads[name], expected[name], msg=name)


@settings(max_examples=20, deadline=None)
@given(
    batch=st.integers(1, 5),
    steps=st.integers(1, 6),
    dims=st.lists(st.integers(1, 6), min_size=1, max_size=3),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    max_norm=st.sampled_from([1e-3, 0.1, 1.0, 1e3]),
    sequence=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_models(batch, steps, dims, dtype, max_norm, sequence, seed):
    """Linear stacks with tanh and an optional LayerNorm, on vectors or sequences."""
    torch.manual_seed(seed)
    model = mlp((4, *dims, 3), dtype)
    if seed % 2:
        model.insert(1, nn.LayerNorm(dims[0]).to(dtype))
    shape = (batch, steps, 4) if sequence else (batch, 4)
    x = torch.randn(shape, dtype=dtype)
    y = torch.randint(0, 3, shape[:-1])
    loss = (lambda out, y: F.cross_entropy(out.transpose(1, 2), y, reduction="none").sum(1)) if sequence else per_sample_loss
    assert_matches(model, x, y, max_norm, dtype, loss)
