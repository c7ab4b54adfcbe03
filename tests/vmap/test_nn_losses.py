"""vmap of losses (functx/vmap/rules/nn_losses.py) against per-sample loops.

Every case runs for each non-empty set of batched arguments (input, target, class
weights), with the batch dim at 0 and (for some) at the last dim, under `vmap_fallback("error")`,
which proves that no per-sample loop ran. Reductions must reduce each batch element's
logical dims only, which the loop checks. The composite losses (cross_entropy, kl_div,
l1, hinge, ...) are here too: they exercise the rules through the ops they decompose into.
"""

import itertools
from functools import partial

import pytest
import torch
import torch.nn.functional as F

import functx
from functx import vmap
from .loop_reference import loop, stack_tree, batched_inputs, check  # noqa: F401

pytestmark = pytest.mark.filterwarnings("ignore:reduction. 'mean' divides the total loss")

B = 3  # batch size of every test
f64 = torch.float64
aten = torch.ops.aten
REDUCTIONS = ("none", "mean", "sum")


# -- the check -------------------------------------------------------------------------------
def randn(*shape):
    return lambda: torch.randn(shape, dtype=f64)


def probs(*shape):
    return lambda: torch.rand(*shape, dtype=f64) * 0.9 + 0.05


def positive(*shape):
    return lambda: torch.rand(*shape, dtype=f64) + 0.1


def classes(n, *shape, ignore=None):
    """Class indices in [0, n); with `ignore`, about a third of them set to it."""

    def make():
        t = torch.randint(0, n, shape)
        if ignore is not None:
            t = torch.where(torch.rand(shape) < 0.3, ignore, t)
        return t

    return make


def signs(*shape):
    return lambda: torch.randint(0, 2, shape).to(f64) * 2 - 1


def with_patterns(cases, dims=(0, -1), every_pattern_at=(0,)):
    """pytest params: every case times sets of batched args and reductions: every
    non-empty set for the batch dims in `every_pattern_at`, else only one argument
    batched or all of them; every reduction with the batch dim at 0, only "sum" at the
    last dim (enough to catch a rule that ignores where the batch dim was, at a fraction
    of the cost)."""
    for name, fn, makers in cases:
        for reduction in REDUCTIONS:
            for pattern in itertools.product((False, True), repeat=len(makers)):
                for dim in dims:
                    corner = sum(pattern) in (1, len(pattern))
                    if not any(pattern) or (dim not in every_pattern_at and not corner):
                        continue
                    if dim != 0 and reduction != "sum":
                        continue
                    label = "".join("b" if p else "u" for p in pattern)
                    where = "first" if dim == 0 else "last"
                    yield pytest.param(partial(fn, reduction=reduction), makers, pattern, dim, id=f"{name}-{reduction}-{label}-{where}")


# -- elementwise losses ------------------------------------------------------------------------
def bce_with_logits_pos_weight(x, t, w, pos, reduction):
    return F.binary_cross_entropy_with_logits(x, t, w, reduction=reduction, pos_weight=pos)


def cross_entropy_probs(x, p, reduction):
    return F.cross_entropy(x, p.softmax(1), reduction=reduction, label_smoothing=0.1)


def kl_div_batchmean(x, t, reduction):
    return F.kl_div(x, t, reduction="batchmean" if reduction == "mean" else reduction)


ELEMENTWISE = [
    ("mse", F.mse_loss, (randn(4, 5), randn(4, 5))),
    ("mse_scalar", F.mse_loss, (randn(), randn())),
    ("smooth_l1", partial(F.smooth_l1_loss, beta=0.5), (randn(4, 5), randn(4, 5))),
    ("huber", partial(F.huber_loss, delta=0.7), (randn(2, 3, 2), randn(2, 3, 2))),
    ("soft_margin", F.soft_margin_loss, (randn(4, 5), signs(4, 5))),
    ("bce", F.binary_cross_entropy, (probs(4, 5), probs(4, 5))),
    ("bce_weight", lambda x, t, w, reduction: F.binary_cross_entropy(x, t, w, reduction=reduction), (probs(4, 5), probs(4, 5), positive(5))),
    ("bce_logits", F.binary_cross_entropy_with_logits, (randn(4, 5), probs(4, 5))),
    ("bce_logits_pos_weight", bce_with_logits_pos_weight, (randn(4, 5), probs(4, 5), positive(4, 5), positive(5))),
]

# Composite losses (pointwise ops and reductions of other families, plus the rules here
# for the pieces that are losses themselves): checked with the batch dim at 0 only.
COMPOSITE = [
    ("l1", F.l1_loss, (randn(4, 5), randn(4, 5))),
    ("kl_div", F.kl_div, (randn(4, 5), probs(4, 5))),
    ("kl_div_log_target", partial(F.kl_div, log_target=True), (randn(4, 5), randn(4, 5))),
    ("kl_div_batchmean", kl_div_batchmean, (randn(4, 5), probs(4, 5))),
    ("poisson_nll", F.poisson_nll_loss, (randn(4, 5), positive(4, 5))),
    ("hinge", F.hinge_embedding_loss, (randn(4, 5), signs(4, 5))),
    ("margin_ranking", F.margin_ranking_loss, (randn(6), randn(6), signs(6))),
    ("cosine_embedding", F.cosine_embedding_loss, (randn(4, 5), randn(4, 5), signs(4))),
    ("triplet", F.triplet_margin_loss, (randn(4, 5), randn(4, 5), randn(4, 5))),
    ("multilabel_soft_margin", F.multilabel_soft_margin_loss, (randn(4, 5), probs(4, 5))),
    ("cross_entropy_probs", cross_entropy_probs, (randn(4, 5), randn(4, 5))),
]


@pytest.mark.parametrize("fn, makers, pattern, dim", list(with_patterns(ELEMENTWISE)))
def test_elementwise_losses(fn, makers, pattern, dim):
    check(fn, makers, pattern, dim)


@pytest.mark.parametrize("fn, makers, pattern, dim", list(with_patterns(COMPOSITE, dims=(0,), every_pattern_at=())))
def test_composite_losses(fn, makers, pattern, dim):
    check(fn, makers, pattern, dim)


def test_mse_loss_broadcasts_unbatched_target_of_lower_rank():
    x, t = torch.randn(B, 4, 5, dtype=f64), torch.randn(5, dtype=f64)
    with functx.vmap_fallback("error"):
        out = vmap(lambda x, t: aten.mse_loss(x, t, 2), in_dims=(0, None))(x, t)
    torch.testing.assert_close(out, ((x - t) ** 2).sum((1, 2)))


# -- negative log likelihood and cross entropy ---------------------------------------------------
def nll(x, t, reduction):
    return F.nll_loss(x, t, reduction=reduction)


def nll_weighted(x, t, w, reduction):
    return F.nll_loss(x, t, w, reduction=reduction, ignore_index=2)


def nll_forward(x, t, w, reduction):
    """The aten op, whose second output (total_weight) F.nll_loss drops."""
    return aten.nll_loss_forward(x, t, w, REDUCTIONS.index(reduction), -1)


def nll2d_forward(x, t, w, reduction):
    return aten.nll_loss2d_forward(x, t, w, REDUCTIONS.index(reduction), 1)


def cross_entropy(x, t, w, reduction):
    return F.cross_entropy(x, t, w, reduction=reduction, ignore_index=0)


def cross_entropy_smoothing(x, t, w, reduction):
    return F.cross_entropy(x, t, w, reduction=reduction, label_smoothing=0.2)




NLL = [
    ("nll", nll, (randn(4, 5), classes(5, 4))),
    ("nll_one_sample", nll, (randn(5), classes(5))),
    ("nll_weighted_ignore", nll_weighted, (randn(6, 5), classes(5, 6), positive(5))),
    ("nll_forward", nll_forward, (randn(6, 5), classes(5, 6, ignore=-1), positive(5))),
    ("nll_forward_one_sample", nll_forward, (randn(5), classes(5), positive(5))),
    ("nll2d_forward", nll2d_forward, (randn(2, 4, 3, 2), classes(4, 2, 3, 2), positive(4))),
    ("nll_3d", nll, (randn(2, 4, 3, 2, 2), classes(4, 2, 3, 2, 2))),
    ("cross_entropy", cross_entropy, (randn(6, 5), classes(5, 6), positive(5))),
    ("cross_entropy_2d", cross_entropy, (randn(2, 4, 3, 3), classes(4, 2, 3, 3), positive(4))),
    ("cross_entropy_smoothing", cross_entropy_smoothing, (randn(6, 5), classes(5, 6), positive(5))),
]


# torch's own composite for label smoothing cannot run under vmap in two cases (torch.func
# fails on them too): with an unbatched input and a batched target it writes the batched
# ignore mask in place into an unbatched loss (masked_fill_), and with "mean" and a plain
# weight tensor it calls masked_select (a data-dependent shape).
COMPOSITE_LIMITS = {
    "cross_entropy_smoothing-none-ubu": "masked_fill_ of a batched mask into an unbatched loss",
    "cross_entropy_smoothing-mean-ubu": "masked_fill_ of a batched mask into an unbatched loss",
    "cross_entropy_smoothing-sum-ubu": "masked_fill_ of a batched mask into an unbatched loss",
    "cross_entropy_smoothing-mean-bbu": "masked_select on the target (data-dependent shape)",
}


@pytest.mark.parametrize("fn, makers, pattern, dim", list(with_patterns(NLL)))
def test_nll_and_cross_entropy(request, fn, makers, pattern, dim):
    case = request.node.callspec.id.rsplit("-", 1)[0]
    if case in COMPOSITE_LIMITS:
        request.applymarker(pytest.mark.xfail(reason=COMPOSITE_LIMITS[case], raises=RuntimeError, strict=True))
    check(fn, makers, pattern, dim)


def test_nll_loss_all_ignored_is_nan_per_element():
    """A batch element whose targets are all ignored has total_weight 0 and a NaN mean;
    the others are unaffected."""
    x = torch.randn(B, 4, 5, dtype=f64)
    t = torch.randint(0, 5, (B, 4))
    t[1] = -100
    with functx.vmap_fallback("error"):
        out = vmap(F.nll_loss)(x, t)
    torch.testing.assert_close(out, torch.stack([F.nll_loss(x[i], t[i]) for i in range(B)]), equal_nan=True)
    assert out[1].isnan() and not out[0].isnan()


def test_nested_cross_entropy():
    x = torch.randn(2, B, 4, 5, dtype=f64)
    t = torch.randint(0, 5, (B, 4))
    w = torch.rand(2, 5, dtype=f64)

    def f(x, t, w):
        return F.cross_entropy(x, t, w)

    with functx.vmap_fallback("error"):
        out = vmap(vmap(f, in_dims=(0, 0, None)), in_dims=(0, None, 0))(x, t, w)
    expected = torch.stack([torch.stack([f(x[i, j], t[j], w[i]) for j in range(B)]) for i in range(2)])
    torch.testing.assert_close(out, expected)


def test_nested_mse_loss():
    x = torch.randn(2, B, 4, dtype=f64)
    t = torch.randn(B, 4, dtype=f64)
    with functx.vmap_fallback("error"):
        out = vmap(vmap(F.mse_loss, in_dims=(0, 0)), in_dims=(0, None))(x, t)
    torch.testing.assert_close(out, ((x - t) ** 2).mean(-1))


# -- margin losses over classes -----------------------------------------------------------------
def multi_margin(x, t, w, reduction):
    return F.multi_margin_loss(x, t, p=2, margin=0.5, weight=w, reduction=reduction)


def multilabel_target(n, *shape):
    """Multilabel targets: class indices, then -1 padding."""

    def make():
        t = torch.randint(0, n, (*shape, n))
        cut = torch.randint(1, n + 1, shape).unsqueeze(-1)
        return torch.where(torch.arange(n) < cut, t, -1)

    return make


MARGIN = [
    ("multi_margin", multi_margin, (randn(4, 5), classes(5, 4), positive(5))),
    ("multi_margin_one_sample", multi_margin, (randn(5), classes(5), positive(5))),
    ("multi_margin_one_sample_1d_target", multi_margin, (randn(5), classes(5, 1), positive(5))),
    ("multi_margin_scalar", multi_margin, (randn(), classes(1), positive(1))),
    ("multilabel_margin", F.multilabel_margin_loss, (randn(4, 5), multilabel_target(5, 4))),
    ("multilabel_margin_one_sample", F.multilabel_margin_loss, (randn(5), multilabel_target(5))),
    ("multilabel_margin_scalar", F.multilabel_margin_loss, (randn(), classes(1))),
]


@pytest.mark.parametrize("fn, makers, pattern, dim", list(with_patterns(MARGIN)))
def test_margin_losses(fn, makers, pattern, dim):
    check(fn, makers, pattern, dim)


# -- backward ops (what vmap(grad(loss)) sends to vmap) ------------------------------------------
def grad_of(loss, x, *rest, reduction):
    """d loss / d x for one sample, through torch.autograd; with a grad-output that is
    itself an argument so that it can be batched."""
    x = x.detach().requires_grad_()
    out = loss(x, *rest, reduction=reduction)
    return torch.autograd.grad(out, x, torch.ones_like(out) * 0.7)[0]


def direct_backward(op, reduction_last=False, full_grad=False):
    """fn(grad, x, t, [w], reduction=...) calling a loss backward op directly. `full_grad`:
    the grad keeps the input's shape under every reduction, as in the double backward's
    `mse_loss_backward(grad, self, target, reduction)` for grad_output's own gradient
    (the vmap rule once assumed a 0-dim grad there: jacrev(jacrev(grad)) and hessian of
    sin(mse_loss(x, t)) raised)."""

    def fn(grad, x, t, *w, reduction):
        r = REDUCTIONS.index(reduction)
        if grad.dim() and reduction != "none" and not full_grad:
            grad = grad.sum()  # a reduced loss has a 0-dim grad
        return op(grad, x, t, *w, r)

    return fn


BACKWARD = [
    ("mse_backward", direct_backward(aten.mse_loss_backward), (randn(4, 5), randn(4, 5), randn(4, 5))),
    ("mse_backward_full_grad", direct_backward(aten.mse_loss_backward, full_grad=True), (randn(4, 5), randn(4, 5), randn(4, 5))),
    ("mse_backward_row_grad", direct_backward(aten.mse_loss_backward, full_grad=True), (randn(5), randn(4, 5), randn(4, 5))),
    ("soft_margin_backward", direct_backward(aten.soft_margin_loss_backward), (randn(4, 5), randn(4, 5), signs(4, 5))),
    ("bce_backward", direct_backward(aten.binary_cross_entropy_backward), (randn(4, 5), probs(4, 5), probs(4, 5), positive(5))),
    (
        "smooth_l1_backward",
        lambda g, x, t, reduction: aten.smooth_l1_loss_backward(g.sum() if reduction != "none" else g, x, t, REDUCTIONS.index(reduction), 0.5),
        (randn(4, 5), randn(4, 5), randn(4, 5)),
    ),
    (
        "huber_backward",
        lambda g, x, t, reduction: aten.huber_loss_backward(g.sum() if reduction != "none" else g, x, t, REDUCTIONS.index(reduction), 0.5),
        (randn(4, 5), randn(4, 5), randn(4, 5)),
    ),
    ("multi_margin_grad", partial(grad_of, multi_margin), (randn(4, 5), classes(5, 4), positive(5))),
    ("multi_margin_grad_one_sample", partial(grad_of, multi_margin), (randn(5), classes(5), positive(5))),
    ("multi_margin_grad_1d_target", partial(grad_of, multi_margin), (randn(5), classes(5, 1), positive(5))),
    ("multilabel_margin_grad", partial(grad_of, F.multilabel_margin_loss), (randn(4, 5), multilabel_target(5, 4))),
    ("multilabel_margin_grad_one_sample", partial(grad_of, F.multilabel_margin_loss), (randn(5), multilabel_target(5))),
    ("cross_entropy_grad", partial(grad_of, cross_entropy), (randn(6, 5), classes(5, 6), positive(5))),
]


@pytest.mark.parametrize("fn, makers, pattern, dim", list(with_patterns(BACKWARD, every_pattern_at=())))
def test_loss_backward_ops(fn, makers, pattern, dim):
    check(fn, makers, pattern, dim)


# -- per-sample gradients: functx.vmap(functx.grad(loss)) -----------------------------------
def per_sample_grads_reference(loss, params, xs, ts):
    grads = []
    for x, t in zip(xs, ts):
        p = [q.detach().requires_grad_() for q in params]
        grads.append(torch.autograd.grad(loss(p, x, t), p))
    return [torch.stack(g) for g in zip(*grads)]


@pytest.mark.parametrize(
    "loss, target",
    [
        (lambda logits, t: F.cross_entropy(logits, t, label_smoothing=0.1), lambda: torch.randint(0, 5, (B, 4))),
        (lambda logits, t: F.nll_loss(logits.log_softmax(-1), t, torch.arange(1.0, 6.0, dtype=f64)), lambda: torch.randint(0, 5, (B, 4))),
        (F.mse_loss, lambda: torch.randn(B, 4, 5, dtype=f64)),
        (F.binary_cross_entropy_with_logits, lambda: torch.rand(B, 4, 5, dtype=f64)),
        (lambda logits, t: F.multi_margin_loss(logits, t), lambda: torch.randint(0, 5, (B, 4))),
    ],
    ids=["cross_entropy", "nll_weighted", "mse", "bce_with_logits", "multi_margin"],
)
def test_per_sample_gradients_with_functx_grad(loss, target):
    """The DP-SGD pattern: per-sample gradients of a linear model's loss."""
    w, b = torch.randn(5, 3, dtype=f64), torch.randn(5, dtype=f64)
    xs, ts = torch.randn(B, 4, 3, dtype=f64), target()

    def model_loss(params, x, t):
        return loss(F.linear(x, *params), t)

    with functx.vmap_fallback("error"):
        grads = vmap(functx.grad(model_loss), in_dims=(None, 0, 0))((w, b), xs, ts)
    torch.testing.assert_close(list(grads), per_sample_grads_reference(model_loss, (w, b), xs, ts))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", ["mse_loss", "smooth_l1_loss", "huber_loss", "soft_margin_loss", "binary_cross_entropy_with_logits"])
def test_third_order_through_reduced_losses(name, reduction):
    """hessian and jacrev(jacrev(grad)) of a function of a reduced loss: the double
    backward calls the loss's backward op with a grad shaped like the input."""
    torch.manual_seed(0)
    x = torch.randn(4, dtype=f64)
    target = torch.randn(4, dtype=f64)
    if name == "soft_margin_loss":
        target = target.sign()
    elif name == "binary_cross_entropy_with_logits":
        target = target.sigmoid()
    loss = getattr(F, name)
    f = lambda v: torch.sin(loss(v, target, reduction=reduction))
    expected_hessian = torch.autograd.functional.hessian(f, x)
    torch.testing.assert_close(functx.hessian(f)(x), expected_hessian)
    torch.testing.assert_close(functx.jacrev(functx.jacrev(f))(x), expected_hessian)
    third = functx.jacrev(functx.jacrev(functx.grad(f)))(x)
    expected_third = torch.autograd.functional.jacobian(lambda v: torch.autograd.functional.hessian(f, v, create_graph=True), x)
    torch.testing.assert_close(third, expected_third)
