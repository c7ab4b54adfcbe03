"""Activation checkpointing (`torch.utils.checkpoint.checkpoint`) inside functx transforms.

Issue 26 item 11: the reentrant form (`use_reentrant=True`) of a functional_call'd
Linear+tanh block inside `functx.grad` / `vmap(grad)` gave a gradient off by ~1 (the
parameters, passed in a dict, are not inputs of torch's CheckpointFunction, whose forward
runs under no_grad: the gradient through the block was silently zero), or torch's
"incompatible with .grad()" error for a gradient w.r.t. the block's input; torch.func
refuses the Function. Found with it: the non-reentrant form was wrong under wrapped grad
levels (`hessian`, `jacrev(jacrev)`, `jacfwd(jacrev)`, `vmap(hessian)`: off by ~4), its
saved-tensor hook's `detach()` of recomputed tensors cutting the levels below. Under a
transform functx now runs the reentrant form as the non-reentrant one, which is torch's
where every level records on the values (direct levels, vmap) and runs the block unchecked
under wrapped levels (ad/checkpointing.py). References: torch.autograd.grad
(create_graph=True) in float64 on the same block without checkpointing.
"""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import functx
from functx.core.interpreter import current_stack

D = torch.float64
torch.manual_seed(0)
LINEAR = torch.nn.Linear(4, 4).double()
PARAMS = {k: v.detach().clone() for k, v in LINEAR.named_parameters()}


def block(p, x):
    return torch.tanh(functx.nn.functional_call(LINEAR, p, (x,)))


def plain_block(p, x):  # the reference's block: plain torch, no checkpoint
    return torch.tanh(x @ p["weight"].T + p["bias"])


def make_loss(reentrant, calls=None):
    """Loss through the checkpointed block (`reentrant` None: not checkpointed)."""

    def counted(p, x):
        if calls is not None:
            calls.append(1)
        return block(p, x)

    def loss(p, x):
        if reentrant is None:
            h = counted(p, x)
        else:
            h = checkpoint(counted, p, x, use_reentrant=reentrant)
        return (h**2).sum() + (h * x).sum()

    return loss


def plain_loss(p, x):
    h = plain_block(p, x)
    return (h**2).sum() + (h * x).sum()


def reference_grad(p, x, create_graph=False):
    p = {k: v.clone().requires_grad_() for k, v in p.items()}
    x = x.clone().requires_grad_()
    grads = torch.autograd.grad(plain_loss(p, x), [*p.values(), x], create_graph=create_graph)
    return dict(zip(p, grads[:-1])), grads[-1], p, x


X = torch.randn(3, 4, dtype=D)


@pytest.mark.parametrize("reentrant", [True, False])
def test_grad_with_respect_to_parameters_and_inputs(reentrant):
    """The issue's case: was off by ~1 (parameters) or raised torch's reentrant error
    (inputs) with use_reentrant=True."""
    loss = make_loss(reentrant)
    want_p, want_x, _, _ = reference_grad(PARAMS, X)
    got_p = functx.grad(loss)(PARAMS, X)
    torch.testing.assert_close(got_p, want_p)
    got_x = functx.grad(loss, argnums=1)(PARAMS, X)
    torch.testing.assert_close(got_x, want_x)
    got_p, got_x = functx.grad(loss, argnums=(0, 1))(PARAMS, X)
    torch.testing.assert_close(got_p, want_p)
    torch.testing.assert_close(got_x, want_x)
    assert current_stack() == ()


@pytest.mark.parametrize("reentrant", [True, False])
def test_per_sample_gradients(reentrant):
    """vmap(grad) over samples (was off with use_reentrant=True), w.r.t. the shared
    parameters and the samples, against a loop of torch.autograd.grad."""
    loss = make_loss(reentrant)
    got_p = functx.vmap(functx.grad(loss), in_dims=(None, 0))(PARAMS, X)
    got_x = functx.vmap(functx.grad(loss, argnums=1), in_dims=(None, 0))(PARAMS, X)
    for i in range(X.shape[0]):
        want_p, want_x, _, _ = reference_grad(PARAMS, X[i])
        torch.testing.assert_close({k: v[i] for k, v in got_p.items()}, want_p)
        torch.testing.assert_close(got_x[i], want_x)
    assert current_stack() == ()


def _reference_second(p, x):
    """d/dx of sum(d loss/dx) and d/dp of sum(d loss/dp['weight']) by plain autograd."""
    g_p, g_x, leaves_p, leaf_x = reference_grad(p, x, create_graph=True)
    (hx,) = torch.autograd.grad(g_x.sum(), leaf_x, retain_graph=True)
    (hw,) = torch.autograd.grad(g_p["weight"].sum(), leaves_p["weight"])
    return hx, hw


SECOND_ORDER = {
    "grad(grad)": lambda loss, p, x: (
        functx.grad(lambda y: functx.grad(loss, argnums=1)(p, y).sum())(x),
        functx.grad(lambda q: functx.grad(loss)(q, x)["weight"].sum())(p)["weight"],
    ),
    "hessian": lambda loss, p, x: (
        functx.hessian(loss, argnums=1)(p, x).sum(dim=(0, 1)),
        functx.hessian(lambda w: loss({**p, "weight": w}, x))(p["weight"]).sum(dim=(0, 1)),
    ),
    "jacrev(jacrev)": lambda loss, p, x: (
        functx.jacrev(functx.jacrev(loss, argnums=1), argnums=1)(p, x).sum(dim=(0, 1)),
        functx.jacrev(lambda w: functx.jacrev(loss)({**p, "weight": w}, x)["weight"])(p["weight"]).sum(dim=(0, 1)),
    ),
    "jvp(grad)": lambda loss, p, x: (
        functx.jvp(lambda y: functx.grad(loss, argnums=1)(p, y), (x,), (torch.ones_like(x),))[1],
        functx.jvp(lambda w: functx.grad(loss)({**p, "weight": w}, x)["weight"], (p["weight"],), (torch.ones_like(p["weight"]),))[1],
    ),
}


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("name", list(SECOND_ORDER))
def test_second_derivatives(name, reentrant):
    """Second derivatives through the checkpointed block (the reentrant form raised or
    was wrong under each of them; the non-reentrant one was wrong under hessian and
    jacrev(jacrev)), against double backward of plain autograd."""
    hx, hw = SECOND_ORDER[name](make_loss(reentrant), PARAMS, X)
    want_hx, want_hw = _reference_second(PARAMS, X)
    torch.testing.assert_close(hx, want_hx)
    torch.testing.assert_close(hw, want_hw)
    assert current_stack() == ()


@pytest.mark.parametrize("reentrant", [True, False])
def test_per_sample_second_derivatives(reentrant):
    """vmap(grad(grad)) and vmap(hessian): per-sample d/dx sum(d loss/dx), against a loop
    of double backward."""
    loss = make_loss(reentrant)
    got = functx.vmap(lambda x: functx.grad(lambda y: functx.grad(loss, argnums=1)(PARAMS, y).sum())(x))(X)
    hessians = functx.vmap(functx.hessian(loss, argnums=1), in_dims=(None, 0))(PARAMS, X)
    for i in range(X.shape[0]):
        want, _ = _reference_second(PARAMS, X[i])
        torch.testing.assert_close(got[i], want)
        torch.testing.assert_close(hessians[i].sum(dim=0), want)
    assert current_stack() == ()


@pytest.mark.parametrize("reentrant", [True, False])
def test_jvp_through_the_checkpointed_block(reentrant):
    """Forward mode: the tangent of the loss, against plain autograd's gradient . tangent."""
    loss = make_loss(reentrant)
    t = torch.randn_like(X)
    _, want_x, _, _ = reference_grad(PARAMS, X)
    torch.testing.assert_close(functx.jvp(lambda x: loss(PARAMS, x), (X,), (t,))[1], (want_x * t).sum())
    torch.testing.assert_close(functx.jacfwd(lambda x: loss(PARAMS, x))(X), want_x)


@pytest.mark.parametrize("reentrant", [True, False])
def test_the_block_is_still_recomputed_where_the_levels_record_on_values(reentrant):
    """Checkpointing is a memory-for-time trade: under the outermost grad (a direct level)
    the block still runs twice (forward, then recomputed in the backward), as plain
    torch's checkpoint. Under hessian (jacrev over jacrev, both recording on the values
    with torch's autograd) it is recomputed too: three runs, the forward and two in the
    create_graph backward (wrapped levels ran it once, unchecked)."""
    calls = []
    functx.grad(make_loss(reentrant, calls))(PARAMS, X)
    assert len(calls) == 2
    calls.clear()
    functx.vmap(functx.grad(make_loss(reentrant, calls)), in_dims=(None, 0))(PARAMS, X)
    assert len(calls) == 2
    calls.clear()
    functx.hessian(make_loss(reentrant, calls), argnums=1)(PARAMS, X)
    assert len(calls) == 3


def test_checkpoint_sequential_under_hessian():
    """`checkpoint_sequential` (reentrant and not) under hessian, against plain autograd."""
    from torch.utils.checkpoint import checkpoint_sequential

    layers = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1), torch.nn.Tanh()).double()
    x = torch.randn(4, dtype=D)
    want = torch.autograd.functional.hessian(lambda v: layers(v).sum(), x)
    for reentrant in (True, False):
        got = functx.hessian(lambda v: checkpoint_sequential(layers, 2, v, use_reentrant=reentrant).sum())(x)
        torch.testing.assert_close(got, want)


def test_without_transforms_torch_checkpoint_is_untouched():
    """No transform running: torch's own reentrant checkpoint, `.backward()` fills `.grad`."""
    lin = torch.nn.Linear(4, 4).double()
    x = X.clone().requires_grad_()
    out = checkpoint(lambda v: torch.tanh(lin(v)), x, use_reentrant=True)
    assert type(out.grad_fn).__name__ == "CheckpointFunctionBackward"
    out.pow(2).sum().backward()
    w = lin.weight.detach().clone().requires_grad_()
    want = torch.autograd.grad(torch.tanh(X @ w.T + lin.bias.detach()).pow(2).sum(), w)[0]
    torch.testing.assert_close(lin.weight.grad, want)
    calls = []

    def counted(v):
        calls.append(1)
        return torch.tanh(lin(v))

    checkpoint(counted, x, use_reentrant=False).pow(2).sum().backward()
    assert len(calls) == 2  # the non-reentrant form recomputes, as torch's
