"""The VJP overrides the batching rules use under a direct grad level (`vmap(grad(f))`, torch's
autograd on the physical tensors): the batched matrix product (vmap/rules/linalg.py
`BatchedProduct`: each operand's gradient in that operand's per-element layout, as torch's
`mm` backward gives it per sample) and the embedding lookup (vmap/rules/indexing.py
`BatchedEmbedding`: one shared table, no stacked copy) and the convolution with a shared
weight (vmap/rules/nn_conv.py `SharedWeightConvolution`: one convolution against the weight,
not a grouped one against B copies).

Per-sample gradients must come out with torch.func's strides (a naive DP-SGD step reads
them with `flatten(1)` and `einsum`), with the values of a plain loop of torch.autograd.grad
(float64), also second order (a gradient penalty, MAML's outer gradient) and with the
module forms that reach these rules (Linear on 1-d, 2-d and 3-d inputs, Embedding with and
without padding_idx, shared or per-sample indices).
"""

import sys

import pytest
import torch
import torch.func as tf
from hypothesis import given, settings
from hypothesis import strategies as st
import torch.nn as nn
import torch.nn.functional as F

import functx

D = torch.float64
B = 4


class Model(nn.Module):
    """Embedding -> Conv1d -> LayerNorm -> Linear, the layers whose weight layouts matter."""

    def __init__(self, padding_idx=None):
        super().__init__()
        self.emb = nn.Embedding(20, 8, padding_idx=padding_idx)
        self.conv = nn.Conv1d(8, 6, 3, padding=1)
        self.ln = nn.LayerNorm(6)
        self.lin = nn.Linear(6, 5)

    def forward(self, tokens):
        h = self.emb(tokens)  # (L, 8)
        h = self.conv(h.t().unsqueeze(0)).squeeze(0).t()  # (L, 6)
        return self.lin(self.ln(h)).mean(0)


def per_sample(lib, model, params, xs, ys, loss=None):
    loss = loss or (lambda p, x, y: F.cross_entropy(lib.functional_call(model, p, (x,)).unsqueeze(0), y.unsqueeze(0)))
    return lib.vmap(lib.grad(loss), in_dims=(None, 0, 0))(params, xs, ys)


def loop(model, params, xs, ys, loss=None, create_graph=False):
    loss = loss or (lambda p, x, y: F.cross_entropy(tf.functional_call(model, p, (x,)).unsqueeze(0), y.unsqueeze(0)))
    grads = []
    for x, y in zip(xs, ys):
        leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
        grads.append(dict(zip(leaves, torch.autograd.grad(loss(leaves, x, y), list(leaves.values()), create_graph=create_graph))))
    return {k: torch.stack([g[k] for g in grads]) for k in params}


@pytest.mark.parametrize("padding_idx", [None, 3])
def test_per_sample_grads_have_torch_funcs_strides(padding_idx):
    torch.manual_seed(0)
    model = Model(padding_idx).to(D)
    params = {k: v.detach() for k, v in model.named_parameters()}
    xs = torch.randint(0, 20, (B, 7))
    xs[:, 0] = 3  # the padding row is used
    ys = torch.randint(0, 5, (B,))
    ours = per_sample(functx, model, params, xs, ys)
    theirs = per_sample(tf, model, params, xs, ys)
    want = loop(model, params, xs, ys)
    for k in want:
        torch.testing.assert_close(ours[k], want[k])
        assert ours[k].stride() == theirs[k].stride(), k
        assert ours[k].is_contiguous(), k
    if padding_idx is not None:
        assert (ours["emb.weight"][:, padding_idx] == 0).all()


@pytest.mark.parametrize("input_rank", [1, 2, 3])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_weight_gradient_layout(input_rank, bias):
    """F.linear of a 1-d (mv), 2-d (addmm / mm) and 3-d (matmul -> mm) per-sample input."""
    torch.manual_seed(1)
    lin = nn.Linear(6, 5, bias=bias).to(D)
    params = {k: v.detach() for k, v in lin.named_parameters()}
    shape = {1: (6,), 2: (3, 6), 3: (2, 3, 6)}[input_rank]
    xs, ys = torch.randn(B, *shape, dtype=D), torch.randn(B, dtype=D)
    loss = lambda lib: lambda p, x, y: (lib.functional_call(lin, p, (x,)).tanh().sum() - y) ** 2
    ours = functx.vmap(functx.grad(loss(functx)), in_dims=(None, 0, 0))(params, xs, ys)
    theirs = tf.vmap(tf.grad(loss(tf)), in_dims=(None, 0, 0))(params, xs, ys)
    want = loop(lin, params, xs, ys, loss(tf))
    for k in want:
        torch.testing.assert_close(ours[k], want[k])
        assert ours[k].stride() == theirs[k].stride(), (k, ours[k].stride(), theirs[k].stride())


def test_naive_dp_step_matches_the_loop():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(10, 8), nn.ReLU(), nn.Linear(8, 3)).to(D)
    params = {k: v.detach() for k, v in model.named_parameters()}
    xs, ys = torch.randn(B, 10, dtype=D), torch.randint(0, 3, (B,))

    def dp_step(grads, clip=0.5):
        norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()]).norm(dim=0)
        scale = (clip / (norms + 1e-6)).clamp(max=1.0)
        return {k: torch.einsum("b,b...->...", scale, g) for k, g in grads.items()}

    ours = dp_step(per_sample(functx, model, params, xs, ys))
    want = dp_step(loop(model, params, xs, ys))
    for k in want:
        torch.testing.assert_close(ours[k], want[k])


def test_second_order_through_the_overrides():
    """A per-sample input-gradient penalty (torch.autograd.grad with create_graph inside
    vmap(grad)), and the gradient of summed per-sample gradient norms with respect to the
    parameters (grad of vmap(grad): the direct level's gradient built with create_graph):
    double backward through BatchedProduct / BatchedEmbedding against plain autograd."""
    torch.manual_seed(3)
    emb, lin = nn.Embedding(11, 4).to(D), nn.Linear(4, 3).to(D)
    params = {"emb": emb.weight.detach(), "w": lin.weight.detach(), "b": lin.bias.detach()}
    xs = torch.randint(0, 11, (B, 5))
    ys = torch.randn(B, 3, dtype=D)

    def loss(p, x, y):
        h = F.embedding(x, p["emb"])  # (5, 4)
        return ((F.linear(h, p["w"], p["b"]).tanh().mean(0) - y) ** 2).sum()

    def penalty(p):
        per = functx.vmap(functx.grad(loss), in_dims=(None, 0, 0))(p, xs, ys)
        return sum((g**2).sum() for g in per.values())

    ours = functx.grad(penalty)(params)
    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
    total = 0
    for x, y in zip(xs, ys):
        gs = torch.autograd.grad(loss(leaves, x, y), list(leaves.values()), create_graph=True)
        total = total + sum((g**2).sum() for g in gs)
    want = dict(zip(leaves, torch.autograd.grad(total, list(leaves.values()))))
    for k in want:
        torch.testing.assert_close(ours[k], want[k])

    w = torch.randn(4, 3, dtype=D)
    hs = torch.randn(B, 2, 4, dtype=D)

    def input_penalty(w, h):
        h = h * 1.0
        score = (h @ w).tanh().sum()
        (gh,) = torch.autograd.grad(score, h, create_graph=True)
        return score + (gh**2).sum()

    ours = functx.vmap(functx.grad(input_penalty, argnums=(0, 1)), in_dims=(None, 0))(w, hs)
    want = tf.vmap(tf.grad(input_penalty, argnums=(0, 1)), in_dims=(None, 0))(w, hs)
    for o, t in zip(ours, want):
        torch.testing.assert_close(o, t)
    loop_w = []
    for h in hs:
        wl, hl = w.clone().requires_grad_(), h.clone().requires_grad_()
        loop_w.append(torch.autograd.grad(input_penalty(wl, hl), wl)[0])
    torch.testing.assert_close(ours[0], torch.stack(loop_w))


def test_embedding_with_shared_indices_and_batched_table():
    """Unbatched indices with a batched (differentiated) table, and a table batched by the
    caller (an ensemble, stride != 0): both against loops."""
    torch.manual_seed(4)
    table = torch.randn(9, 3, dtype=D)
    idx = torch.tensor([[1, 4], [4, 8]])
    ys = torch.randn(B, dtype=D)

    def loss(t, i, y):
        return (F.embedding(i, t).sin().sum() - y) ** 2

    ours = functx.vmap(functx.grad(loss), in_dims=(None, None, 0))(table, idx, ys)
    want = torch.stack([torch.func.grad(loss)(table, idx, y) for y in ys])
    torch.testing.assert_close(ours, want)
    tables = torch.randn(B, 9, 3, dtype=D)
    idxs = torch.randint(0, 9, (B, 2, 2))
    ours = functx.vmap(functx.grad(loss), in_dims=(0, 0, 0))(tables, idxs, ys)
    want = torch.stack([torch.func.grad(loss)(t, i, y) for t, i, y in zip(tables, idxs, ys)])
    torch.testing.assert_close(ours, want)


def test_matrix_product_of_a_transposed_batch_does_not_copy_rows():
    """mm of a batched left operand whose rows do not fold (a transposed batch) with an
    unbatched right one runs as bmm: values against a loop."""
    torch.manual_seed(5)
    a = torch.randn(B, 6, 5, dtype=D).transpose(1, 2)  # (B, 5, 6), per-element transposed
    b = torch.randn(6, 4, dtype=D)
    torch.testing.assert_close(functx.vmap(torch.mm, in_dims=(0, None))(a, b), torch.stack([x @ b for x in a]))


CONVS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


@settings(max_examples=30, deadline=None)
@given(
    spatial=st.sampled_from([1, 2, 3]), groups=st.integers(1, 2), per_group=st.sampled_from([1, 2, 24]),
    n=st.integers(1, 2), stride=st.integers(1, 2), padding=st.integers(0, 1), dilation=st.integers(1, 2),
    bias=st.sampled_from(["shared", "per-sample", None]), input_grad=st.booleans(),
)  # fmt: skip
def test_per_sample_convolution_gradients_with_a_shared_weight(spatial, groups, per_group, n, stride, padding, dilation, bias, input_grad):
    """vmap(grad) of a convolution: one convolution against the shared weight
    (`SharedWeightConvolution`), weight gradients grouped or unfolded (24 channels per group
    on a small map unfold); values of a float64 torch.autograd loop, torch.func's strides."""
    torch.manual_seed(0)
    conv_module = sys.modules["functx.vmap.rules.nn_conv"]
    c_in = groups * per_group
    w = torch.randn(2 * groups, per_group, *(3,) * spatial, dtype=D)
    b = torch.randn(B, 2 * groups, dtype=D) if bias == "per-sample" else torch.randn(2 * groups, dtype=D) if bias else None
    xs = torch.randn(B, n, c_in, *(5,) * spatial, dtype=D)

    def loss(w, b, x):
        return F.relu(CONVS[spatial](x, w, b, stride=stride, padding=padding, dilation=dilation, groups=groups)).square().sum()

    argnums = (0, *(1,) * (b is not None), *(2,) * input_grad)
    in_dims = (None, 0 if bias == "per-sample" else None, 0)
    applied = []
    original = conv_module.SharedWeightConvolution.forward
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(conv_module.SharedWeightConvolution, "forward", staticmethod(lambda *a: applied.append(1) or original(*a)))
        ours = functx.vmap(functx.grad(loss, argnums=argnums), in_dims=in_dims)(w, b, xs)
    assert applied
    theirs = tf.vmap(tf.grad(loss, argnums=argnums), in_dims=in_dims)(w, b, xs)
    for i, (o, t) in enumerate(zip(ours, theirs)):
        want = []
        for k in range(B):
            leaves = [w.clone().requires_grad_(), None if b is None else (b[k] if bias == "per-sample" else b).clone().requires_grad_(), xs[k].clone().requires_grad_()]
            want.append(torch.autograd.grad(loss(*leaves), leaves[argnums[i]]))
        torch.testing.assert_close(o, torch.stack([g[0] for g in want]))
        assert o.stride() == t.stride(), (i, o.stride(), t.stride())
