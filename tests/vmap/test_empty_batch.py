"""vmap over a batch of size 0 (issue 12): every op gives the empty stack of its per-sample
results, shaped (0, *per-sample shape), as a loop of plain torch calls would (the reference:
the loop over a batch of 2, sliced to none). torch.func is the oracle too where it is right
(its conv and pooling rules give a wrong (0, 0, ...) shape; many of its rules raise)."""

import pytest
import torch
import torch.func as tf
import torch.nn.functional as F

import functx

D = torch.float64


def loop_reference(f, args, in_dims):
    """The per-sample loop over a batch of 2 (the same per-sample shapes), then no samples."""
    full = [torch.stack([a, a]) if d == 0 else a for a, d in zip(args, in_dims)]
    per_sample = [f(*(a[i] if d == 0 else a for a, d in zip(full, in_dims))) for i in range(2)]
    return torch.stack(per_sample)[:0]


def batch_of_none(a, d):
    return a.unsqueeze(0)[:0] if d == 0 else a


def _mlp_loss(params, x, t):
    h = torch.tanh(F.linear(x, params["w1"], params["b1"]))
    return F.cross_entropy(F.linear(h, params["w2"], params["b2"]), t)


def per_sample_grads(params, x, t):
    return functx.vmap(functx.grad(_mlp_loss), in_dims=(None, 0, 0))(params, x, t)


class Transformed:
    """A case whose function uses transforms: `make(T)` builds it from functx or torch.func."""

    def __init__(self, make):
        self.make = make


def build(f, T):
    return f.make(T) if isinstance(f, Transformed) else f


M = torch.randn(3, 4, dtype=D)
W_CONV = torch.randn(4, 3, 3, 3, dtype=D)
SORTED = torch.tensor([-1.0, 0.0, 1.0], dtype=D)

# (name, f, per-sample arguments, in_dims, torch.func gets it right)
CASES = [
    ("sum", lambda x: x.sum(), (torch.randn(3, dtype=D),), (0,), True),
    ("sum 2d", lambda x: x.sum(), (torch.randn(2, 3, dtype=D),), (0,), True),
    ("mean", lambda x: x.mean(), (torch.randn(3, dtype=D),), (0,), True),
    ("prod", lambda x: x.prod(), (torch.randn(3, dtype=D),), (0,), True),
    ("max", lambda x: x.max(), (torch.randn(3, dtype=D),), (0,), True),
    ("min", lambda x: x.min(), (torch.randn(3, dtype=D),), (0,), True),
    ("median", lambda x: x.median(), (torch.randn(3, dtype=D),), (0,), True),
    ("all", lambda x: (x > 0).all(), (torch.randn(3, dtype=D),), (0,), True),
    ("any", lambda x: (x > 0).any(), (torch.randn(3, dtype=D),), (0,), True),
    ("norm", lambda x: x.norm(), (torch.randn(3, dtype=D),), (0,), True),
    ("var", lambda x: x.var(), (torch.randn(3, dtype=D),), (0,), True),
    ("std", lambda x: x.std(), (torch.randn(3, dtype=D),), (0,), True),
    ("sum dim", lambda x: x.sum(0), (torch.randn(2, 3, dtype=D),), (0,), True),
    ("logsumexp", lambda x: x.logsumexp(-1), (torch.randn(2, 3, dtype=D),), (0,), True),
    ("softmax", lambda x: x.softmax(-1), (torch.randn(3, dtype=D),), (0,), True),
    ("log_softmax", lambda x: x.log_softmax(-1), (torch.randn(3, dtype=D),), (0,), True),
    ("cumsum", lambda x: x.cumsum(0), (torch.randn(3, dtype=D),), (0,), True),
    ("sort", lambda x: x.sort()[0], (torch.randn(3, dtype=D),), (0,), True),
    ("matmul", lambda x: x @ M, (torch.randn(3, dtype=D),), (0,), True),
    ("matmul both", lambda x, m: x @ m, (torch.randn(3, dtype=D), M), (0, 0), True),
    ("linear", lambda x, w: F.linear(x, w), (torch.randn(3, dtype=D), M.T), (0, None), True),
    ("layer_norm", lambda x: F.layer_norm(x, (3,)), (torch.randn(3, dtype=D),), (0,), True),
    ("cross_entropy", lambda x, t: F.cross_entropy(x, t), (torch.randn(2, 3, dtype=D), torch.tensor([0, 2])), (0, 0), True),
    ("mse_loss", lambda x: F.mse_loss(x, torch.zeros(3, dtype=D)), (torch.randn(3, dtype=D),), (0,), True),
    ("searchsorted", lambda v: torch.searchsorted(SORTED, v), (torch.randn(2, 2, dtype=D),), (0,), True),
    ("histc", lambda x: torch.histc(x, 4), (torch.randn(5, dtype=D),), (0,), False),
    ("grad", Transformed(lambda T: T.grad(lambda x: x.sin().sum())), (torch.randn(3, dtype=D),), (0,), True),
    ("grad of mean", Transformed(lambda T: T.grad(lambda x: (x @ M).tanh().mean())), (torch.randn(3, dtype=D),), (0,), True),
    ("jacrev", Transformed(lambda T: T.jacrev(lambda x: (x @ M).tanh())), (torch.randn(3, dtype=D),), (0,), True),
    ("jacrev of sum", Transformed(lambda T: T.jacrev(lambda x: (x @ M).sum(-1))), (torch.randn(2, 3, dtype=D),), (0,), True),
    ("jacfwd", Transformed(lambda T: T.jacfwd(lambda x: (x @ M).tanh().sum())), (torch.randn(3, dtype=D),), (0,), True),
    ("hessian", Transformed(lambda T: T.hessian(lambda x: x.sin().sum())), (torch.randn(3, dtype=D),), (0,), True),
    ("jvp", Transformed(lambda T: lambda x: T.jvp(lambda y: y.sin().sum(), (x,), (x,))[1]), (torch.randn(3, dtype=D),), (0,), True),
    ("inner vmap", Transformed(lambda T: T.vmap(lambda x: x.sum())), (torch.randn(2, 3, dtype=D),), (0,), True),
]

CASES = [pytest.param(*case, id=case[0]) for case in CASES]
E = torch.randn(5, 3, dtype=D)
MASK = torch.tensor([True, False, True])
_more = [  # rules that fold the batch into another dim, or flatten each element
    ("argmax", lambda x: x.argmax(), (torch.randn(3, dtype=D),), (0,), True),
    ("argmin keepdim", lambda x: x.argmin(dim=None, keepdim=True), (torch.randn(2, 3, dtype=D),), (0,), False),
    ("count_nonzero", lambda x: torch.count_nonzero(x), (torch.randn(3, dtype=D),), (0,), True),
    ("index_select", lambda x, i: x.index_select(0, i), (torch.randn(3, dtype=D), torch.tensor([0, 2])), (0, 0), True),
    ("index_select shared", lambda x, i: x.index_select(0, i), (torch.randn(3, dtype=D), torch.tensor([0, 2])), (None, 0), True),
    ("index_add", lambda x, i, s: x.index_add(0, i, s), (torch.randn(3, dtype=D), torch.tensor([0, 2]), torch.randn(2, dtype=D)), (0, 0, 0), False),
    ("conv2d", lambda x: F.conv2d(x, W_CONV), (torch.randn(2, 3, 5, 5, dtype=D),), (0,), False),
    ("conv2d batched bias", lambda x, b: F.conv2d(x, W_CONV, b), (torch.randn(2, 3, 5, 5, dtype=D), torch.randn(4, dtype=D)), (0, 0), False),
    ("conv2d grad input", Transformed(lambda T: T.grad(lambda x: F.conv2d(x, W_CONV).sum())), (torch.randn(2, 3, 5, 5, dtype=D),), (0,), False),
    ("max_pool2d", lambda x: F.max_pool2d(x, 2), (torch.randn(2, 3, 4, 4, dtype=D),), (0,), False),
    ("avg_pool2d", lambda x: F.avg_pool2d(x, 2), (torch.randn(2, 3, 4, 4, dtype=D),), (0,), False),
    ("max_pool2d grad", Transformed(lambda T: T.grad(lambda x: F.max_pool2d(x, 2).sum())), (torch.randn(2, 3, 4, 4, dtype=D),), (0,), False),
    ("upsample grad", Transformed(lambda T: T.grad(lambda x: F.interpolate(x, scale_factor=2, mode="bilinear").sum())), (torch.randn(2, 3, 4, 4, dtype=D),), (0,), False),
    ("masked_scatter", lambda x, s: x.masked_scatter(MASK, s), (torch.randn(3, dtype=D), torch.randn(3, dtype=D)), (0, 0), False),
    ("masked_scatter grad", Transformed(lambda T: T.grad(lambda s, x: x.masked_scatter(MASK, s).sum())), (torch.randn(3, dtype=D), torch.randn(3, dtype=D)), (0, 0), False),
    ("embedding grad", Transformed(lambda T: T.grad(lambda w, i: F.embedding(i, w).sum())), (E, torch.tensor([0, 2])), (0, None), False),
    ("multi_margin_loss", lambda x, t: F.multi_margin_loss(x, t), (torch.randn(3, dtype=D), torch.tensor(1)), (0, 0), False),
    ("roll", lambda x: x.roll(1), (torch.randn(2, 3, dtype=D),), (0,), True),
    ("nonzero_static", lambda x: torch.nonzero_static(x, size=2), (torch.randn(3, dtype=D),), (0,), False),
    ("view(-1)", lambda x: x.view(-1), (torch.randn(2, 3, dtype=D),), (0,), False),
    ("reshape(3, -1)", lambda x: x.reshape(3, -1), (torch.randn(2, 3, dtype=D),), (0,), False),
]
CASES += [pytest.param(*case, id=case[0]) for case in _more]


@pytest.mark.parametrize("name, f, args, in_dims, torch_func_right", CASES)
@pytest.mark.filterwarnings("ignore:.*degrees of freedom")  # std/var of no samples, as torch warns
def test_batch_of_size_zero(name, f, args, in_dims, torch_func_right):
    batched = [batch_of_none(a, d) for a, d in zip(args, in_dims)]
    ours = functx.vmap(build(f, functx), in_dims=in_dims)(*batched)
    expected = loop_reference(build(f, tf), args, in_dims)
    assert ours.shape == expected.shape and ours.dtype == expected.dtype
    if torch_func_right:
        assert ours.shape == tf.vmap(build(f, tf), in_dims=in_dims)(*batched).shape


def test_issue_examples():
    assert functx.vmap(lambda x: x.sum())(torch.randn(0, 3)).shape == tf.vmap(lambda x: x.sum())(torch.randn(0, 3)).shape == (0,)
    g = lambda x: x.sin().sum()
    assert functx.vmap(functx.grad(g))(torch.randn(0, 3)).shape == tf.vmap(tf.grad(g))(torch.randn(0, 3)).shape == (0, 3)


def test_nested_vmaps_with_an_empty_level():
    for shape in [(0, 2, 3), (2, 0, 3)]:
        x = torch.randn(shape, dtype=D)
        ours = functx.vmap(functx.vmap(lambda v: v.sum()))(x)
        assert ours.shape == tf.vmap(tf.vmap(lambda v: v.sum()))(x).shape == shape[:2]


def test_per_sample_gradients_of_an_empty_batch():
    params = {
        "w1": torch.randn(5, 3, dtype=D), "b1": torch.randn(5, dtype=D),
        "w2": torch.randn(4, 5, dtype=D), "b2": torch.randn(4, dtype=D),
    }
    x, t = torch.randn(0, 3, dtype=D), torch.zeros(0, dtype=torch.long)
    ours = per_sample_grads(params, x, t)
    theirs = tf.vmap(tf.grad(_mlp_loss), in_dims=(None, 0, 0))(params, x, t)
    for k, p in params.items():
        assert ours[k].shape == theirs[k].shape == (0, *p.shape)
