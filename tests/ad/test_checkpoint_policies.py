"""`functx.checkpoint(f, policy=...)`, `functx.checkpoint_policies`, `functx.checkpoint_name`
(issue 30 item 4): JAX-style selective activation checkpointing over torch's non-reentrant
checkpoint (functx/ad/selective_checkpoint.py).

References are independent of functx: the same block without checkpointing, differentiated
by plain `torch.autograd.grad` (`create_graph=True` for second order) in float64, and loops
over samples for the per-sample cases. Whether a policy keeps or recomputes an op is read
off a TorchDispatchMode around the call that counts the ops actually run (an op whose kept
output is handed back in the recomputation does not run again).
"""

import collections

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import functx
from functx import checkpoint, checkpoint_name, checkpoint_policies
from functx.core.interpreter import current_stack

D = torch.float64
torch.manual_seed(0)
W1, W2, X = torch.randn(4, 5, dtype=D), torch.randn(5, 4, dtype=D), torch.randn(3, 4, dtype=D)


def block(w1, w2, x):
    a = checkpoint_name(torch.sin(x @ w1), "a")
    return torch.tanh(a @ w2)


def plain_block(w1, w2, x):  # the reference's block: plain torch, no name, no checkpoint
    return torch.tanh(torch.sin(x @ w1) @ w2)


def make_loss(fn):
    def loss(w1, w2, x):
        out = fn(w1, w2, x)
        return (out**2).sum() + (out * x).sum()

    return loss


plain_loss = make_loss(plain_block)

P = checkpoint_policies
POLICIES = {
    "default (None)": None,
    "nothing_saveable": P.nothing_saveable,
    "everything_saveable": P.everything_saveable,
    "dots_saveable": P.dots_saveable,
    "dots_with_no_batch_dims_saveable": P.dots_with_no_batch_dims_saveable,
    "save_only_these_names('a')": P.save_only_these_names("a"),
    "save_any_names_but_these('b')": P.save_any_names_but_these("b"),
    "save_from_both_policies": P.save_from_both_policies(P.dots_saveable, P.save_only_these_names("a")),
}


def checkpointed_loss(policy):
    return make_loss(checkpoint(block, policy=policy))


def reference_grads(w1, w2, x, create_graph=False):
    leaves = [t.clone().requires_grad_() for t in (w1, w2, x)]
    return torch.autograd.grad(plain_loss(*leaves), leaves, create_graph=create_graph), leaves


WANT = reference_grads(W1, W2, X)[0]


# ---- first derivatives, every transform, every policy ----

FIRST_ORDER = {
    "grad": lambda loss: functx.grad(loss, argnums=(0, 1, 2))(W1, W2, X),
    "vjp": lambda loss: functx.vjp(loss, W1, W2, X)[1](torch.tensor(1.0, dtype=D)),
    "jacrev": lambda loss: functx.jacrev(loss, argnums=(0, 1, 2))(W1, W2, X),
    "jacfwd": lambda loss: functx.jacfwd(loss, argnums=(0, 1, 2))(W1, W2, X),
    # directional derivatives along each input's own value: sum(grad * input)
    "jvp": lambda loss: functx.jvp(loss, (W1, W2, X), (W1, W2, X))[1],
    "linearize": lambda loss: functx.linearize(loss, W1, W2, X)[1](W1, W2, X),
    # grad of a vmap over rows: the rows' losses add up to the whole loss
    "grad(vmap)": lambda loss: functx.grad(
        lambda w1, w2, x: functx.vmap(loss, in_dims=(None, None, 0))(w1, w2, x[:, None]).sum(), argnums=(0, 1, 2)
    )(W1, W2, X),
}


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("transform", list(FIRST_ORDER))
def test_first_derivatives(transform, policy):
    """Every transform's first derivative through the checkpointed block, under every
    policy, against plain autograd on the block without checkpointing."""
    got = FIRST_ORDER[transform](checkpointed_loss(POLICIES[policy]))
    if transform in ("jvp", "linearize"):
        torch.testing.assert_close(got, sum((g * t).sum() for g, t in zip(WANT, (W1, W2, X))))
    else:
        torch.testing.assert_close(tuple(got), WANT)
    assert current_stack() == ()


@pytest.mark.parametrize("policy", list(POLICIES))
def test_per_sample_gradients(policy):
    """vmap(grad) over the rows of X (the parameters shared), against a loop of
    torch.autograd.grad over the rows."""
    got = functx.vmap(functx.grad(checkpointed_loss(POLICIES[policy]), argnums=(0, 1, 2)), in_dims=(None, None, 0))(
        W1, W2, X
    )
    for i in range(X.shape[0]):
        want = reference_grads(W1, W2, X[i])[0]
        torch.testing.assert_close(tuple(g[i] for g in got), want)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_plain_torch_autograd_first_and_second_order(policy):
    """No transform: `.backward()` fills `.grad`, and a create_graph gradient can be
    differentiated again (torch's own selective checkpoint raises "You are only allowed to
    backward once" there under every policy that keeps something)."""
    leaves = [t.clone().requires_grad_() for t in (W1, W2, X)]
    checkpointed_loss(POLICIES[policy])(*leaves).backward()
    torch.testing.assert_close(tuple(t.grad for t in leaves), WANT)
    leaves = [t.clone().requires_grad_() for t in (W1, W2, X)]
    g = torch.autograd.grad(checkpointed_loss(POLICIES[policy])(*leaves), leaves[0], create_graph=True)[0]
    (got,) = torch.autograd.grad(g.sum(), leaves[0])
    want_g, want_leaves = reference_grads(W1, W2, X, create_graph=True)
    (want,) = torch.autograd.grad(want_g[0].sum(), want_leaves[0])
    torch.testing.assert_close(got, want)


# ---- second derivatives ----


def _reference_hvp(t):
    """d/dw1 of <d loss/dw1, t> by double backward."""
    grads, leaves = reference_grads(W1, W2, X, create_graph=True)
    return torch.autograd.grad((grads[0] * t).sum(), leaves[0])[0]


def _reference_hessian_w1():
    grads, leaves = reference_grads(W1, W2, X, create_graph=True)
    rows = [torch.autograd.grad(g, leaves[0], retain_graph=True)[0] for g in grads[0].reshape(-1)]
    return torch.stack(rows).reshape(*W1.shape, *W1.shape)


T1 = torch.randn_like(W1)
SECOND_ORDER = {
    "hessian": lambda loss: functx.hessian(loss)(W1, W2, X),
    "jacfwd(jacrev)": lambda loss: functx.jacfwd(functx.jacrev(loss))(W1, W2, X),
    "jacrev(jacrev)": lambda loss: functx.jacrev(functx.jacrev(loss))(W1, W2, X),
    "grad(grad)": lambda loss: functx.grad(lambda w: (functx.grad(loss)(w, W2, X) * T1).sum())(W1),
    "jvp(grad)": lambda loss: functx.jvp(lambda w: functx.grad(loss)(w, W2, X), (W1,), (T1,))[1],
    "vmap(hessian)": lambda loss: functx.vmap(functx.hessian(loss), in_dims=(None, None, 0))(W1, W2, X[None]),
}


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("transform", list(SECOND_ORDER))
def test_second_derivatives(transform, policy):
    """Hessians and Hessian-vector products with respect to w1 through the checkpointed
    block, under every policy (a second derivative recomputes the region a second time:
    the values a policy kept are handed out again), against double backward of plain
    autograd."""
    got = SECOND_ORDER[transform](checkpointed_loss(POLICIES[policy]))
    if transform in ("grad(grad)", "jvp(grad)"):
        torch.testing.assert_close(got, _reference_hvp(T1))
    else:
        torch.testing.assert_close(got.reshape(*W1.shape, *W1.shape), _reference_hessian_w1())
    assert current_stack() == ()


# ---- what is recomputed: the ops actually run, counted ----


class CountOps(TorchDispatchMode):
    """Counts the ops run below it, by name (entered around the transform call, it sees the
    plain-tensor ops functx runs; an op whose output the checkpoint hands back from its cache
    in the recomputation is not run, so not counted)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


COUNTED = ("mm", "sin", "tanh", "checkpoint_name")
COUNT_UNDER = {
    "grad": lambda loss: functx.grad(loss, argnums=(0, 1, 2))(W1, W2, X),
    "vjp": lambda loss: functx.vjp(loss, W1, W2, X)[1](torch.tensor(1.0, dtype=D)),
    "vmap(grad)": lambda loss: functx.vmap(functx.grad(loss, argnums=(0, 1, 2)), in_dims=(None, None, 0))(W1, W2, X),
    "jvp(grad)": lambda loss: functx.jvp(lambda w: functx.grad(loss)(w, W2, X), (W1,), (T1,)),
}
# which of the counted ops each policy runs again in the backward: the block runs
# x @ w1 (mm), sin, checkpoint_name, @ w2 (mm), tanh. torch recomputes every op whose
# output was not kept, also those before a kept one (eager torch cannot tell which are dead)
RECOMPUTED = {
    "default (None)": {"mm", "sin", "tanh", "checkpoint_name"},
    "nothing_saveable": {"mm", "sin", "tanh", "checkpoint_name"},
    "everything_saveable": set(),
    "dots_saveable": {"sin", "tanh", "checkpoint_name"},
    "dots_with_no_batch_dims_saveable": {"sin", "tanh", "checkpoint_name"},
    "save_only_these_names('a')": {"mm", "sin", "tanh"},
    "save_any_names_but_these('b')": {"mm", "sin", "tanh"},
    "save_from_both_policies": {"sin", "tanh"},
}


def _counts(loss, transform):
    with CountOps() as counter:
        COUNT_UNDER[transform](loss)
    return counter.counts


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("transform", list(COUNT_UNDER))
def test_what_each_policy_recomputes(transform, policy):
    """Each op runs again in the backward exactly where the policy did not keep its output:
    the counts of ops run, minus those of the block without checkpointing. The name reaches
    the policy under vmap (the op of each sample's name runs at the physical level) and
    under forward-over-reverse (jvp(grad))."""
    unchecked = _counts(make_loss(block), transform)
    counts = _counts(checkpointed_loss(POLICIES[policy]), transform)
    extra = {op: counts[op] - unchecked[op] for op in COUNTED}
    assert {op for op, n in extra.items() if n} == RECOMPUTED[policy], extra
    if transform == "grad" and RECOMPUTED[policy]:  # once each: the block's two products, one sin, ...
        assert extra == {op: (2 if op == "mm" else 1) * (op in RECOMPUTED[policy]) for op in COUNTED}


def test_the_policy_sees_the_name_under_vmap_and_jvp():
    """A spy policy: the name arrives among checkpoint_name's arguments, under grad,
    vmap(grad) and jvp(grad); under grad(vmap), where functx runs the block unchecked, the
    policy is never asked."""
    seen = []

    def spy(op, *args, **kwargs):
        if op is torch.ops.functx.checkpoint_name.default:
            seen.append(args[1])
        return False

    loss = checkpointed_loss(spy)
    for name in ("grad", "vmap(grad)", "jvp(grad)"):
        seen.clear()
        COUNT_UNDER[name](loss)
        assert seen == ["a"], name
    seen.clear()
    FIRST_ORDER["grad(vmap)"](loss)
    assert seen == []


# ---- checkpoint_name: the identity ----

NAMED = lambda x: (torch.sin(checkpoint_name(x, "n")) * checkpoint_name(x, "m") ** 2).sum()
UNNAMED = lambda x: (torch.sin(x) * x**2).sum()


@pytest.mark.parametrize(
    "transform",
    [
        lambda f: f,
        functx.grad,
        functx.hessian,
        functx.jacfwd,
        lambda f: lambda x: functx.jvp(f, (x,), (torch.ones_like(x),))[1],
        lambda f: functx.vmap(f),
        lambda f: functx.vmap(functx.grad(f)),
        lambda f: functx.vmap(functx.hessian(f)),
        lambda f: functx.grad(lambda x: functx.vmap(f)(x).sum()),
        lambda f: functx.jacfwd(functx.jacrev(f)),
    ],
    ids=[
        "value",
        "grad",
        "hessian",
        "jacfwd",
        "jvp",
        "vmap",
        "vmap(grad)",
        "vmap(hessian)",
        "grad(vmap)",
        "jacfwd(jacrev)",
    ],
)
def test_checkpoint_name_is_the_identity(transform):
    """Values and derivatives through checkpoint_name are those without it, under every
    transform (vmap and the others' rules are the identity's), with no PerformanceWarning
    (no per-sample loop)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", functx.PerformanceWarning)
        got = transform(NAMED)(X)
    torch.testing.assert_close(got, transform(UNNAMED)(X))


# ---- the policies themselves, and bad input ----


def test_the_ready_made_policies():
    aten = torch.ops.aten
    for op in (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.convolution.default,
               aten._scaled_dot_product_flash_attention_for_cpu.default):  # fmt: skip
        assert P.dots_saveable(op)
    assert not P.dots_saveable(aten.sin.default) and not P.dots_saveable(aten.add.Tensor)
    assert P.dots_with_no_batch_dims_saveable(aten.mm.default) and P.dots_with_no_batch_dims_saveable(
        aten.addmm.default
    )
    for op in (aten.bmm.default, aten.baddbmm.default, aten.convolution.default, aten.sin.default):
        assert not P.dots_with_no_batch_dims_saveable(op)
    assert P.everything_saveable(aten.sin.default) and not P.nothing_saveable(aten.mm.default)
    name = torch.ops.functx.checkpoint_name.default
    assert P.save_only_these_names("a", "b")(name, X, "b") and not P.save_only_these_names("a")(name, X, "b")
    assert not P.save_only_these_names("a")(aten.mm.default, X, X)
    assert P.save_any_names_but_these("a")(name, X, "b") and not P.save_any_names_but_these("a")(name, X, "a")
    assert not P.save_any_names_but_these("a")(aten.mm.default, X, X)  # unnamed values are not saved
    both = P.save_from_both_policies(P.dots_with_no_batch_dims_saveable, P.save_only_these_names("a"))
    assert both(aten.mm.default, X, X) and both(name, X, "a") and not both(aten.sin.default, X)


def test_bad_input_raises_clear_errors():
    with pytest.raises(TypeError, match="policy"):
        checkpoint(block, policy="dots_saveable")
    with pytest.raises(TypeError, match="callable fun"):
        checkpoint(3)
    with pytest.raises(TypeError, match="name must be a str"):
        checkpoint_name(X, 3)
    with pytest.raises(TypeError, match="Tensor"):
        checkpoint_name([1.0], "a")
    with pytest.raises(TypeError, match="names must be str"):
        P.save_only_these_names("a", 1)
    with pytest.raises(TypeError, match="policy_2"):
        P.save_from_both_policies(P.dots_saveable, None)


def test_save_from_both_policies_refuses_none_with_a_true_message():
    """None is a policy for `checkpoint` only (keep nothing): `save_from_both_policies`
    refuses it, so its message must not offer it (it said "... or None"), and it names the
    function with the module's prefix."""
    for args, which in (((None, P.dots_saveable), "policy_1"), ((P.dots_saveable, None), "policy_2")):
        with pytest.raises(
            TypeError, match=f"^functx.checkpoint_policies.save_from_both_policies's {which}: "
        ) as caught:
            P.save_from_both_policies(*args)
        assert "None," not in str(caught.value) and str(caught.value).endswith("got NoneType")
    with pytest.raises(TypeError, match=r"dots_saveable\) or None, got str"):  # checkpoint's does take None
        checkpoint(block, policy="dots_saveable")


def test_the_recomputation_replays_the_random_state():
    """Dropout inside the checkpointed function: the recomputation draws the forward's mask
    (preserve_rng_state), so the gradient is the one of the mask the forward's output shows."""
    w, x = torch.randn(64, dtype=D), torch.randn(64, dtype=D)
    for policy in (None, P.dots_saveable, P.everything_saveable):
        f = checkpoint(lambda w, x: F.dropout(torch.sin(x * w), p=0.5), policy=policy)
        grad, out = functx.grad(lambda w: (lambda o: (o.sum(), o))(f(w, x)), has_aux=True)(w)
        mask = (out != 0).to(D)
        assert 0 < mask.sum() < 64
        torch.testing.assert_close(grad, 2 * mask * torch.cos(x * w) * x)


# ---- per-sample gradients of a small transformer (benchmarks/checkpoint_memory.py, small) ----


class Block(torch.nn.Module):
    """A pre-LN transformer layer, as in benchmarks/checkpoint_memory.py."""

    def __init__(self, d=8, heads=2):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.out = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.up, self.down = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)

    def forward(self, x):  # (L, d), one sample
        q, k, v = self.qkv(self.ln1(x)).unflatten(-1, (3, self.heads, -1)).permute(1, 2, 0, 3)
        x = x + self.out(F.scaled_dot_product_attention(q, k, v).transpose(0, 1).flatten(1))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class Model(torch.nn.Module):
    def __init__(self, wrap):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
        self.wrap = wrap

    def forward(self, x):
        for layer in self.blocks:
            x = self.wrap(layer)(x)
        return x


TRANSFORMER_WRAPS = {
    "none": lambda layer: layer,
    "torch.utils.checkpoint": lambda layer: lambda x: torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False),
    "functx.checkpoint": lambda layer: checkpoint(layer),
    "nothing_saveable": lambda layer: checkpoint(layer, policy=P.nothing_saveable),
    "dots_saveable": lambda layer: checkpoint(layer, policy=P.dots_saveable),
    "dots_with_no_batch_dims_saveable": lambda layer: checkpoint(layer, policy=P.dots_with_no_batch_dims_saveable),
}


@pytest.mark.parametrize("wrap", list(TRANSFORMER_WRAPS))
def test_per_sample_gradients_of_a_checkpointed_transformer(wrap):
    """The benchmark's case, small (2 layers, d 8, 2 heads, L 4, batch 3): per-sample
    parameter gradients by vmap(grad) over functional_call, each layer checkpointed,
    against a loop of torch.autograd.grad over the samples of the unwrapped model."""
    torch.manual_seed(0)
    model = Model(TRANSFORMER_WRAPS[wrap]).double()
    params = {k: v.detach() for k, v in model.named_parameters()}
    xs, ys = torch.randn(3, 4, 8, dtype=D), torch.randn(3, 4, 8, dtype=D)

    def loss(p, x, y):
        return ((functx.functional_call(model, p, (x,)) - y) ** 2).mean()

    got = functx.vmap(functx.grad(loss), in_dims=(None, 0, 0))(params, xs, ys)
    model.wrap = TRANSFORMER_WRAPS["none"]
    for i in range(3):
        leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
        out = torch.func.functional_call(model, leaves, (xs[i],))
        want = torch.autograd.grad(((out - ys[i]) ** 2).mean(), list(leaves.values()))
        torch.testing.assert_close({k: g[i] for k, g in got.items()}, dict(zip(leaves, want)))
