"""The model zoo: about twenty models people train, small enough for CI (issue 30).

Each entry is a `ZooModel`: a module, a batch maker and a loss. A module written with one of
torch's control-flow operators or with checkpointing has a `reference` flag: set (on the
reference's copy), it runs the same program with Python control flow and no checkpointing,
so the reference shares nothing with the code functx has to get right. No downloads
(torchvision is not available): every architecture is written here, sized down.

    >>> model = make("gpt2")
    >>> x, y = model.batch(2)
    >>> model.loss(model.module(x), y).shape
    torch.Size([])
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._higher_order_ops.scan import scan
from torch._higher_order_ops.while_loop import while_loop
from torch.utils.checkpoint import checkpoint

import functx

VOCAB, SEQ, WIDTH, HEADS = 11, 6, 8, 2


@dataclasses.dataclass
class ZooModel:
    """A model of the zoo: `module(x)` on a batch from `batch(n)` (x, y), scored by `loss`.

    `fallback`: why functx runs (part of) it once per sample under vmap, or None when it
    vectorizes fully; `module` is float64 unless its input is tokens (then its weights are).
    """

    name: str
    module: nn.Module
    batch: Callable[[int], tuple]
    loss: Callable
    fallback: str | None = None


def _mse(out, y):
    return ((out - y) ** 2).mean()


def _next_token(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _class(logits, y):
    return F.cross_entropy(logits, y)


def _tokens(n):
    x = torch.randint(VOCAB, (n, SEQ))
    return x, torch.randint(VOCAB, (n, SEQ))


def _images(channels, size, classes=3):
    def batch(n):
        return torch.randn(n, channels, size, size, dtype=torch.float64), torch.randint(classes, (n,))

    return batch


def _vectors(features, outputs):
    def batch(n):
        return torch.randn(n, features, dtype=torch.float64), torch.randn(n, outputs, dtype=torch.float64)

    return batch


class Reference(nn.Module):
    """A module that can run as its reference: Python control flow, no checkpointing."""

    reference = False


# -- transformers ------------------------------------------------------------------------


class GPT2Block(nn.Module):
    """Pre-LN decoder block: causal fused attention, tanh-GELU MLP."""

    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, h):
        b, t, _ = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(b, t, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(attended.transpose(1, 2).reshape(b, t, WIDTH))
        return h + self.down(F.gelu(self.up(self.ln2(h)), approximate="tanh"))


class GPT2(Reference):
    """Token and position embeddings, two decoder blocks, a tied LM head; optionally each
    block under `torch.utils.checkpoint` (`checkpointed`: "reentrant" or "non-reentrant") or
    `functx.checkpoint` keeping the matrix products ("functx")."""

    def __init__(self, checkpointed=None):
        super().__init__()
        self.checkpointed = checkpointed
        self.tokens, self.positions = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList([GPT2Block(), GPT2Block()])
        self.ln = nn.LayerNorm(WIDTH)

    def forward(self, x):
        h = self.tokens(x) + self.positions(torch.arange(x.shape[1]))
        for block in self.blocks:
            if self.checkpointed == "functx" and not self.reference:  # keeping the matrix products
                h = functx.checkpoint(block, policy=functx.checkpoint_policies.dots_saveable)(h)
            elif self.checkpointed and not self.reference:
                h = checkpoint(block, h, use_reentrant=self.checkpointed == "reentrant")
            else:
                h = block(h)
        return self.ln(h) @ self.tokens.weight.T


class BERT(nn.Module):
    """Encoder with padding: torch's TransformerEncoder (post-LN, GELU) and a key padding
    mask from token 0, mean-pooled over the tokens that are not padding."""

    def __init__(self):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, HEADS, 2 * WIDTH, dropout=0.0, activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x):
        padding = x == 0
        h = self.encoder(self.tokens(x) + self.positions(torch.arange(x.shape[1])), src_key_padding_mask=padding)
        kept = (~padding).unsqueeze(-1).to(h.dtype)
        return self.head((h * kept).sum(1) / kept.sum(1).clamp(min=1))


def _bert_batch(n):
    x = torch.randint(1, VOCAB, (n, SEQ))
    x[:, -2:] = 0  # padding at the end of every sequence
    return x, torch.randint(3, (n,))


class ViT(nn.Module):
    """Patches by a strided convolution, a class token, learned positions, a pre-LN encoder."""

    def __init__(self, patch=2, size=4):
        super().__init__()
        self.patches = nn.Conv2d(3, WIDTH, patch, stride=patch)
        self.cls = nn.Parameter(torch.randn(1, 1, WIDTH) * 0.1)
        self.positions = nn.Parameter(torch.randn(1, (size // patch) ** 2 + 1, WIDTH) * 0.1)
        layer = nn.TransformerEncoderLayer(WIDTH, HEADS, 2 * WIDTH, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 3))

    def forward(self, x):
        h = self.patches(x).flatten(2).transpose(1, 2)
        h = torch.cat([self.cls.expand(h.shape[0], -1, -1), h], 1) + self.positions
        return self.head(self.encoder(h)[:, 0])


class MultiheadDecoder(nn.Module):
    """nn.MultiheadAttention with a causal mask and need_weights (its math path), residual."""

    def __init__(self):
        super().__init__()
        self.attention = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
        self.out = nn.Linear(WIDTH, 2)

    def forward(self, x):
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        attended, weights = self.attention(x, x, x, attn_mask=mask, need_weights=True)
        return self.out(x + attended).mean(1) + weights.sum((1, 2)).unsqueeze(-1)


# -- convolutional -------------------------------------------------------------------------


class BasicBlock(nn.Module):
    def __init__(self, channels_in, channels, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.shortcut = nn.Sequential()
        if stride != 1 or channels_in != channels:
            self.shortcut = nn.Sequential(nn.Conv2d(channels_in, channels, 1, stride, bias=False), nn.BatchNorm2d(channels))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """Stem, two residual stages with BatchNorm, global average pooling, a linear head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU())
        self.stages = nn.Sequential(BasicBlock(4, 4, 1), BasicBlock(4, 6, 2))
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(F.adaptive_avg_pool2d(self.stages(self.stem(x)), 1).flatten(1))


def _resnet_eval():
    model = ResNet()
    with torch.no_grad():  # running statistics that are not 0 and 1
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
    return model.eval()


def _resnet_replaced():
    from functx import replace_all_batch_norm_modules_

    return replace_all_batch_norm_modules_(ResNet()).train()


class UNet(nn.Module):
    """Two levels: convolutions with GroupNorm, max-pool down, transposed convolution up,
    skip connections by concatenation, a per-pixel output."""

    def __init__(self):
        super().__init__()

        def double(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(2, cout), nn.SiLU(), nn.Conv2d(cout, cout, 3, padding=1), nn.SiLU())

        self.down1, self.down2 = double(2, 4), double(4, 8)
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2)
        self.up1 = double(8, 4)
        self.out = nn.Conv2d(4, 1, 1)

    def forward(self, x):
        skip = self.down1(x)
        h = self.down2(F.max_pool2d(skip, 2))
        h = self.up1(torch.cat([self.up(h), skip], 1))
        return self.out(h) + F.interpolate(x[:, :1], scale_factor=1.0, mode="bilinear")


def _unet_batch(n):
    return torch.randn(n, 2, 4, 4, dtype=torch.float64), torch.randn(n, 1, 4, 4, dtype=torch.float64)


class MLPMixer(nn.Module):
    """Patches by unfold, token mixing across patches (a transpose), channel mixing."""

    def __init__(self, patch=2, size=4, hidden=8):
        super().__init__()
        self.patch = patch
        tokens, channels = (size // patch) ** 2, 3 * patch * patch
        self.embed = nn.Linear(channels, hidden)
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.tokens = nn.Sequential(nn.Linear(tokens, 2 * tokens), nn.GELU(), nn.Linear(2 * tokens, tokens))
        self.channels = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))
        self.head = nn.Linear(hidden, 3)

    def forward(self, x):
        h = self.embed(F.unfold(x, self.patch, stride=self.patch).transpose(1, 2))
        h = h + self.tokens(self.norm1(h).transpose(1, 2)).transpose(1, 2)
        h = h + self.channels(self.norm2(h))
        return self.head(h.mean(1))


class TextCNN(nn.Module):
    """Embedding, 1-d convolutions of two widths, max over time."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.convs = nn.ModuleList([nn.Conv1d(WIDTH, 4, 2), nn.Conv1d(WIDTH, 4, 3)])
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.embed(x).transpose(1, 2)
        return self.head(torch.cat([F.relu(conv(h)).amax(-1) for conv in self.convs], 1))


def _class_tokens(n):
    return torch.randint(VOCAB, (n, SEQ)), torch.randint(3, (n,))


# -- recurrent ---------------------------------------------------------------------------


class RecurrentLM(nn.Module):
    """Embedding, a two-layer nn.LSTM or nn.GRU, a linear head over the vocabulary."""

    def __init__(self, cell):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.rnn = cell(WIDTH, WIDTH, num_layers=2, batch_first=True)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x):
        return self.head(self.rnn(self.embed(x))[0])


class Mamba(Reference):
    """A Mamba-style selective state-space layer: input-dependent step `dt`, `B`, `C`; the
    recurrence h_t = exp(dt_t A) h_(t-1) + dt_t B_t x_t, y_t = C_t . h_t + D x_t, run as a Python
    loop over time (`with_scan=False`) or with torch's `scan` operator."""

    def __init__(self, with_scan, state=4, features=3):
        super().__init__()
        self.with_scan = with_scan
        self.inner = nn.Linear(features, WIDTH)
        self.log_a = nn.Parameter(torch.log(torch.arange(1, state + 1.0)).repeat(WIDTH, 1))
        self.dt, self.b, self.c = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, state), nn.Linear(WIDTH, state)
        self.skip = nn.Parameter(torch.ones(WIDTH))
        self.out = nn.Linear(WIDTH, 1)

    def forward(self, x):  # x: (batch, time, features)
        u = F.silu(self.inner(x))
        dt = F.softplus(self.dt(u))
        decay = torch.exp(-dt.unsqueeze(-1) * self.log_a.exp())  # (batch, time, width, state)
        drive = (dt * u).unsqueeze(-1) * self.b(u).unsqueeze(-2)
        c = self.c(u)
        h0 = torch.zeros(x.shape[0], WIDTH, self.log_a.shape[1], dtype=x.dtype)
        if self.with_scan and not self.reference:

            def step(h, inputs):
                decay_t, drive_t, c_t = inputs
                h = decay_t * h + drive_t
                return h, (h * c_t.unsqueeze(-2)).sum(-1)

            xs = tuple(t.movedim(1, 0) for t in (decay, drive, c))
            _, ys = scan(step, h0, xs)
            y = ys.movedim(0, 1)
        else:
            h, ys = h0, []
            for t in range(x.shape[1]):
                h = decay[:, t] * h + drive[:, t]
                ys.append((h * c[:, t].unsqueeze(-2)).sum(-1))
            y = torch.stack(ys, 1)
        return self.out(y + self.skip * u).squeeze(-1)


def _sequence_batch(n):
    return torch.randn(n, SEQ, 3, dtype=torch.float64), torch.randn(n, SEQ, dtype=torch.float64)


# -- graphs, ODEs, routing, data-dependent code -------------------------------------------

_EDGES = torch.tensor([[0, 1, 2, 3, 4, 0, 2, 5], [1, 2, 3, 4, 5, 3, 0, 1]])


class GraphNet(nn.Module):
    """Message passing on a fixed graph: messages from source nodes summed into destinations
    (`index_add`) and their maximum (`scatter_reduce(amax)`), a node update, a graph readout."""

    def __init__(self, features=3):
        super().__init__()
        self.message = nn.Linear(2 * features, WIDTH)
        self.update = nn.Linear(features + 2 * WIDTH, WIDTH)
        self.readout = nn.Linear(WIDTH, 2)

    def forward(self, x):  # x: (graphs, nodes, features)
        source, target = _EDGES
        messages = torch.tanh(self.message(torch.cat([x[:, source], x[:, target]], -1)))
        summed = torch.zeros(x.shape[0], x.shape[1], WIDTH, dtype=x.dtype).index_add(1, target, messages)
        index = target.view(1, -1, 1).expand_as(messages)
        largest = torch.zeros_like(summed).scatter_reduce(1, index, messages, "amax", include_self=False)
        nodes = torch.tanh(self.update(torch.cat([x, summed, largest], -1)))
        return self.readout(nodes.mean(1))


def _graph_batch(n):
    return torch.randn(n, 6, 3, dtype=torch.float64), torch.randn(n, 2, dtype=torch.float64)


class NeuralODE(Reference):
    """An ODE dh/dt = f(h) integrated by Euler steps with an adaptive step size (smaller where
    the field is large) until t reaches 1: a data-dependent trip count, with torch's
    `while_loop` (or a Python `while` as the reference)."""

    def __init__(self, features=3):
        super().__init__()
        self.field = nn.Sequential(nn.Linear(features, WIDTH), nn.Tanh(), nn.Linear(WIDTH, features))
        self.out = nn.Linear(features, 2)

    def _step(self, t, h):
        dh = self.field(h)
        dt = torch.minimum(0.25 / (1 + dh.detach().abs().amax()), 1 - t)
        return t + dt, h + dt * dh

    def forward(self, x):
        t = torch.zeros((), dtype=x.dtype)
        if self.reference:
            while t < 1:
                t, x = self._step(t, x)
        else:
            t, x = while_loop(lambda t, h: t < 1, self._step, (t, x))
        return self.out(x)


class DataDependentIf(nn.Module):
    """Python control flow on data: a branch chosen by the input's norm, a scale read with
    `.item()` (functx runs these once per sample under vmap)."""

    def __init__(self, features=4):
        super().__init__()
        self.small, self.large = nn.Linear(features, features), nn.Linear(features, features)
        self.out = nn.Linear(features, 2)

    def forward(self, x):
        h = self.large(x) if x.norm() > 2.0 else torch.tanh(self.small(x))
        return self.out(h / (1 + h.abs().max().item()))


class MixtureOfExperts(nn.Module):
    """Token-choice routing as in Mixtral's reference code: top-2 experts per token by a
    router, each expert applied to the tokens routed to it (`torch.where` on the choice: a
    data-dependent number of tokens), results weighted and summed back with `index_add`."""

    def __init__(self, experts=4, top=2):
        super().__init__()
        self.top = top
        self.router = nn.Linear(WIDTH, experts)
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.SiLU(), nn.Linear(2 * WIDTH, WIDTH)) for _ in range(experts)])
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):  # x: (batch, tokens, width)
        tokens = x.reshape(-1, WIDTH)
        weights, chosen = self.router(tokens).softmax(-1).topk(self.top, -1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            out = out.index_add(0, token, expert(tokens[token]) * weights[token, slot].unsqueeze(-1))
        return self.head(out.view_as(x) + x).squeeze(-1)


def _moe_batch(n):
    return torch.randn(n, 4, WIDTH, dtype=torch.float64), torch.randn(n, 4, dtype=torch.float64)


class OldStyleSwish(torch.autograd.Function):
    """x * sigmoid(beta x) written the old way (`forward(ctx, ...)`, no setup_context, no
    vmap rule), as CUDA extensions are; its backward is differentiable torch code."""

    @staticmethod
    def forward(ctx, x, beta):
        ctx.save_for_backward(x, beta)
        return x * torch.sigmoid(beta * x)

    @staticmethod
    def backward(ctx, grad):
        x, beta = ctx.saved_tensors
        s = torch.sigmoid(beta * x)
        ds = s * (1 - s)
        return grad * (s + beta * x * ds), (grad * x * x * ds).sum().reshape(beta.shape)


class OldStyleFunctionNet(nn.Module):
    def __init__(self, features=4):
        super().__init__()
        self.inner, self.out = nn.Linear(features, WIDTH), nn.Linear(WIDTH, 2)
        self.beta = nn.Parameter(torch.tensor(1.3))

    def forward(self, x):
        return self.out(OldStyleSwish.apply(self.inner(x), self.beta))


def _mlp():
    return nn.Sequential(nn.Linear(4, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Softplus(), nn.Linear(WIDTH, 2))


def _zoo():
    """(name, factory, batch, loss, fallback) for every model."""
    return [
        ("mlp", _mlp, _vectors(4, 2), _mse, None),
        ("gpt2", GPT2, _tokens, _next_token, None),
        ("gpt2_checkpoint", lambda: GPT2("non-reentrant"), _tokens, _next_token, None),
        ("gpt2_checkpoint_reentrant", lambda: GPT2("reentrant"), _tokens, _next_token, None),
        ("gpt2_functx_checkpoint", lambda: GPT2("functx"), _tokens, _next_token, None),
        ("bert", BERT, _bert_batch, _class, None),
        ("vit", ViT, _images(3, 4), _class, None),
        ("multihead_attention", MultiheadDecoder, lambda n: (torch.randn(n, SEQ, WIDTH, dtype=torch.float64), torch.randn(n, 2, dtype=torch.float64)), _mse, None),
        ("resnet_bn_eval", _resnet_eval, _images(3, 4), _class, None),
        ("resnet_bn_replaced", _resnet_replaced, _images(3, 4), _class, None),
        ("unet", UNet, _unet_batch, _mse, None),
        ("mlp_mixer", MLPMixer, _images(3, 4), _class, None),
        ("text_cnn", TextCNN, _class_tokens, _class, None),
        ("lstm_lm", lambda: RecurrentLM(nn.LSTM), _tokens, _next_token, None),
        ("gru_lm", lambda: RecurrentLM(nn.GRU), _tokens, _next_token, None),
        ("mamba_loop", lambda: Mamba(with_scan=False), _sequence_batch, _mse, None),
        ("mamba_scan", lambda: Mamba(with_scan=True), _sequence_batch, _mse, None),
        ("graph_net", GraphNet, _graph_batch, _mse, None),
        ("neural_ode_while", NeuralODE, _vectors(3, 2), _mse, None),
        ("data_dependent_if", DataDependentIf, _vectors(4, 2), _mse, "Python `if` on a value and `.item()`"),
        ("moe_topk", MixtureOfExperts, _moe_batch, _mse, "data-dependent shapes (tokens per expert)"),
        ("old_style_function", OldStyleFunctionNet, _vectors(4, 2), _mse, None),
    ]


def make(name: str) -> ZooModel:
    """A fresh float64 model of the zoo, with weights from the current seed."""
    for entry_name, factory, batch, loss, fallback in _zoo():
        if entry_name == name:
            return ZooModel(name, factory().double(), batch, loss, fallback)
    raise KeyError(name)


def as_reference(module: nn.Module) -> nn.Module:
    """`module`, switched to its reference program (Python control flow, no checkpointing)."""
    for part in module.modules():
        if isinstance(part, Reference):
            part.reference = True
    return module


NAMES = [entry[0] for entry in _zoo()]
