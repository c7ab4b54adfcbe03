"""Per-sample gradients do not depend on whether the caller's parameters require grad.

`vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)` with `params = dict(
model.named_parameters())` (requiring grad) took another path than with detached params:
the level's leaves stay connected to the caller's graph, and vmap's matrix-product rule
then skipped its VJP override, so the weight gradients came out by another GEMM order
(up to 7e-7 apart in float32) and transposed (issue 27: dattri's TracIn tests compare
them with allclose's defaults; torch.func gives bitwise-equal results). The override is
now skipped only where an outer functx transform differentiates the level again (MAML).
The connected results still carry the caller's graph: a gradient penalty through them is
checked against plain torch's double backward per sample.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import functx


def _model(kind):
    torch.manual_seed(0)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(20, 16), nn.ReLU(), nn.Linear(16, 5)), torch.randn(12, 20)
    if kind == "conv":
        return nn.Sequential(nn.Conv1d(3, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 6, 5)), torch.randn(12, 3, 8)
    if kind == "embedding":
        return nn.Sequential(nn.Embedding(10, 6), nn.Flatten(), nn.Linear(18, 5)), torch.randint(0, 10, (12, 3))
    raise ValueError(kind)


def _per_sample(model, params, x, y):
    def loss(p, xi, yi):
        return F.cross_entropy(functx.functional_call(model, p, (xi[None],)), yi[None])

    return functx.vmap(functx.grad(loss), in_dims=(None, 0, 0))(params, x, y)


@pytest.mark.parametrize("kind", ["mlp", "conv", "embedding"])
def test_bitwise_equal_with_and_without_requires_grad(kind):
    model, x = _model(kind)
    y = torch.randint(0, 5, (x.shape[0],))
    detached = _per_sample(model, {k: v.detach() for k, v in model.named_parameters()}, x, y)
    tracked = _per_sample(model, dict(model.named_parameters()), x, y)
    for name in detached:
        assert torch.equal(detached[name], tracked[name].detach()), name
        assert detached[name].stride() == tracked[name].stride(), name
    # and against the per-sample loop of plain autograd (float32 tolerance)
    for i in range(x.shape[0]):
        out = F.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
        grads = torch.autograd.grad(out, list(model.parameters()))
        for (name, _), g in zip(model.named_parameters(), grads):
            torch.testing.assert_close(tracked[name][i], g, rtol=1e-5, atol=1e-6)


def test_connected_per_sample_gradients_still_carry_the_callers_graph():
    """A per-sample gradient penalty: d/dparams of sum_i |g_i|^2 with g_i the per-sample
    gradients at parameters requiring grad, against plain torch (create_graph per sample)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.randint(0, 3, (6,))
    params = dict(model.named_parameters())
    per_sample = _per_sample(model, params, x, y)
    penalty = sum((g**2).sum() for g in per_sample.values())
    actual = torch.autograd.grad(penalty, list(params.values()))
    expected = [torch.zeros_like(p) for p in params.values()]
    for i in range(x.shape[0]):
        out = F.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
        grads = torch.autograd.grad(out, list(model.parameters()), create_graph=True)
        for e, h in zip(expected, torch.autograd.grad(sum((g**2).sum() for g in grads), list(model.parameters()))):
            e += h
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e)
