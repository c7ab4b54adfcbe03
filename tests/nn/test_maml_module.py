"""MAML on an nn.Module through functional_call: 3 inner SGD steps per task, the outer
(second-order) gradient batched over tasks with functx.vmap, against a loop over tasks
with torch.autograd.grad(create_graph=True)."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

import functx

TASKS, SHOTS, INNER_STEPS, INNER_LR = 4, 10, 3, 0.1


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)).double()


def sine_tasks():
    """Support and query sets of TASKS sine regression tasks (amplitude, phase per task)."""
    g = torch.Generator().manual_seed(1)
    amplitude = torch.rand(TASKS, 1, 1, generator=g, dtype=torch.float64) * 4 + 1
    phase = torch.rand(TASKS, 1, 1, generator=g, dtype=torch.float64) * 3
    xs, xq = (torch.rand(TASKS, SHOTS, 1, generator=g, dtype=torch.float64) * 10 - 5 for _ in range(2))
    return xs, amplitude * torch.sin(xs + phase), xq, amplitude * torch.sin(xq + phase)


# ---- functx: pure functions of a params dict ----

def task_loss(model, params, x, y):
    return F.mse_loss(functx.functional_call(model, params, (x,)), y)


def adapt(model, params, xs, ys):
    """INNER_STEPS of SGD; functx.grad keeps the graph, so the outer grad is second order."""
    for _ in range(INNER_STEPS):
        grads = functx.grad(lambda p: task_loss(model, p, xs, ys))(params)
        params = {name: params[name] - INNER_LR * grads[name] for name in params}
    return params


def maml_loss(model, params, xs, ys, xq, yq):
    return task_loss(model, adapt(model, params, xs, ys), xq, yq)


# ---- reference: plain torch autograd, one task at a time ----

def reference_per_task(model, create_graph=True):
    """(query losses, meta-gradients) per task: a loop with torch.autograd.grad."""
    names = [name for name, _ in model.named_parameters()]
    losses, grads = [], []
    for xs, ys, xq, yq in zip(*sine_tasks()):
        params = [p for p in model.parameters()]
        for _ in range(INNER_STEPS):
            loss = F.mse_loss(torch.func.functional_call(model, dict(zip(names, params)), (xs,)), ys)
            inner = torch.autograd.grad(loss, params, create_graph=create_graph)
            params = [p - INNER_LR * g for p, g in zip(params, inner)]
        query = F.mse_loss(torch.func.functional_call(model, dict(zip(names, params)), (xq,)), yq)
        losses.append(query.detach())
        grads.append(dict(zip(names, torch.autograd.grad(query, list(model.parameters())))))
    return torch.stack(losses), {name: torch.stack([g[name] for g in grads]) for name in names}


def meta_params(model):
    return {name: p.detach() for name, p in model.named_parameters()}


def test_vmap_over_tasks_of_grad_of_maml_equals_autograd_loop():
    model = mlp()
    expected_losses, expected_grads = reference_per_task(model)

    def loss(params, xs, ys, xq, yq):
        return maml_loss(model, params, xs, ys, xq, yq)

    with functx.vmap_fallback("error"):
        grads, losses = functx.vmap(functx.grad_and_value(loss), in_dims=(None, 0, 0, 0, 0))(
            meta_params(model), *sine_tasks()
        )
    assert_close(losses, expected_losses)
    assert grads.keys() == expected_grads.keys()
    for name in grads:
        assert_close(grads[name], expected_grads[name])


def test_grad_of_mean_over_vmapped_tasks_equals_mean_of_autograd_loop():
    """The other nesting: the outer grad of the task-mean of a vmapped inner loop."""
    model = mlp()
    _, expected_grads = reference_per_task(model)

    def mean_loss(params):
        per_task = functx.vmap(lambda *task: maml_loss(model, params, *task))(*sine_tasks())
        return per_task.mean()

    with functx.vmap_fallback("error"):
        grads = functx.grad(mean_loss)(meta_params(model))
    for name in grads:
        assert_close(grads[name], expected_grads[name].mean(0))


def test_second_order_terms_matter():
    """Guard against a silently first-order result: the second-order meta-gradient must
    differ from first-order MAML (inner gradients treated as constants)."""
    model = mlp()
    _, second = reference_per_task(model, create_graph=True)
    _, first = reference_per_task(model, create_graph=False)
    gap = max((second[n] - first[n]).abs().max().item() for n in second)
    assert gap > 1e-4

    def loss(params, xs, ys, xq, yq):
        return maml_loss(model, params, xs, ys, xq, yq)

    grads = functx.vmap(functx.grad(loss), in_dims=(None, 0, 0, 0, 0))(meta_params(model), *sine_tasks())
    for name in grads:
        assert_close(grads[name], second[name])


def test_meta_training_steps_through_functx_reduce_query_loss():
    """A few outer Adam steps on the vmapped second-order meta-gradient lower the mean query loss."""
    model = mlp()
    params = {name: p.detach().clone().requires_grad_(False) for name, p in model.named_parameters()}

    def loss(params, xs, ys, xq, yq):
        return maml_loss(model, params, xs, ys, xq, yq)

    meta_grad = functx.vmap(functx.grad_and_value(loss), in_dims=(None, 0, 0, 0, 0))
    grads, before = meta_grad(params, *sine_tasks())
    for _ in range(5):
        params = {n: params[n] - 0.01 * grads[n].mean(0) for n in params}
        grads, after = meta_grad(params, *sine_tasks())
    assert after.mean() < before.mean()
