"""Torch calls a vmap level takes whole (vmap/rules/whole_calls.py: `torch.matmul`, `@`,
`Tensor.matmul`, `F.linear`) against a per-sample loop in float64, over drawn operand ranks,
batch positions, broadcasting shapes and nesting; where the call is not taken whole (shapes
that do not line up with broadcasting, a graph on the wrappers, an AD level riding on the
level) the decomposed path gives the same values and errors."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import functx
from functx.vmap.batched_tensor import WHOLE_CALL_RULES

D = torch.float64
MATMULS = {"torch.matmul": torch.matmul, "@": lambda a, b: a @ b, "Tensor.matmul": lambda a, b: a.matmul(b)}


def _loop(f, args, in_dims, size):
    outs = []
    for i in range(size):
        outs.append(f(*(a if d is None else a.select(d, i) for a, d in zip(args, in_dims))))
    return torch.stack(outs)


def _shapes(draw):
    """Shapes of matmul's operands, ranks 1-4, with broadcasting leading dims (some 1)."""
    rank_a, rank_b = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    n, k, m = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    lead = draw(st.lists(st.sampled_from([1, 2, 3]), min_size=2, max_size=2))
    a = [*lead[: max(rank_a - 2, 0)], n, k][-rank_a:] if rank_a > 1 else [k]
    b = [*lead[: max(rank_b - 2, 0)], k, m] if rank_b > 1 else [k]
    if rank_a > 2 and rank_b > 2:  # broadcast: the shorter one's leading dims at the end of the longer's
        la, lb = a[:-2], b[:-2]
        shorter, longer = (la, lb) if len(la) <= len(lb) else (lb, la)
        for i in range(1, len(shorter) + 1):
            if shorter[-i] != 1 and longer[-i] != 1:
                shorter[-i] = longer[-i]
        a, b = [*la, *a[-2:]], [*lb, *b[-2:]]
    return a, b


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_matmul_under_vmap_matches_the_loop(data):
    name = data.draw(st.sampled_from(sorted(MATMULS)))
    f = MATMULS[name]
    shape_a, shape_b = _shapes(data.draw)
    size = data.draw(st.integers(1, 3))
    in_dims = data.draw(st.sampled_from([(0, None), (None, 0), (0, 0)]))
    args = []
    for shape, d in zip((shape_a, shape_b), in_dims):
        if d is None:
            args.append(torch.randn(shape, dtype=D))
        else:
            position = data.draw(st.integers(0, len(shape)))
            args.append(torch.randn([*shape[:position], size, *shape[position:]], dtype=D))
            in_dims = (*in_dims[: len(args) - 1], position, *in_dims[len(args):])
    expected = _loop(f, args, in_dims, size)
    torch.testing.assert_close(functx.vmap(f, in_dims=in_dims)(*args), expected)
    # one more level: the same batch again, outside
    outer = [a.unsqueeze(0).expand(2, *a.shape).clone() for a in args]
    torch.testing.assert_close(functx.vmap(functx.vmap(f, in_dims=in_dims))(*outer), expected.expand(2, *expected.shape))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("input_shape", [(4,), (3, 4), (2, 3, 4)])
def test_linear_under_vmap_matches_the_loop(input_shape, bias):
    x = torch.randn(5, *input_shape, dtype=D)
    w, b = torch.randn(6, 4, dtype=D), torch.randn(6, dtype=D) if bias else None
    f = lambda x: F.linear(x, w, b)
    torch.testing.assert_close(functx.vmap(f)(x), _loop(f, (x,), (0,), 5))
    f = lambda x: F.linear(x, w, bias=b)  # (keyword bias)
    torch.testing.assert_close(functx.vmap(f)(x), _loop(f, (x,), (0,), 5))
    # batched weights (an ensemble) and biases are not taken whole: the rules still batch them
    ws = torch.randn(5, 6, 4, dtype=D)
    g = lambda x, w: F.linear(x, w, b)
    torch.testing.assert_close(functx.vmap(g)(x, ws), _loop(g, (x, ws), (0, 0), 5))


def test_mismatched_shapes_keep_the_usual_error():
    a, b = torch.randn(3, 4, dtype=D), torch.randn(5, 2, dtype=D)
    with pytest.raises(RuntimeError, match="cannot be multiplied|size mismatch|shapes"):
        functx.vmap(torch.matmul, in_dims=(0, None))(a, b)


def test_gradients_flow_through_a_call_taken_whole():
    w = torch.randn(4, 3, dtype=D, requires_grad=True)
    xs = torch.randn(5, 4, dtype=D)
    functx.vmap(lambda x: (x @ w).tanh())(xs).sum().backward()
    expected = torch.autograd.grad(torch.stack([(x @ w).tanh() for x in xs]).sum(), w)[0]
    torch.testing.assert_close(w.grad, expected)
    # per-sample gradients (a direct grad level rides: not taken whole) and grad of vmap
    loss = lambda w, x: (x @ w).tanh().sum()
    per_sample = functx.vmap(functx.grad(loss), in_dims=(None, 0))(w.detach(), xs)
    loop = torch.stack([torch.autograd.grad(loss(w, x), w)[0] for x in xs])
    torch.testing.assert_close(per_sample, loop)
    torch.testing.assert_close(functx.grad(lambda w: functx.vmap(lambda x: loss(w, x))(xs).sum())(w.detach()), loop.sum(0))


def test_a_wrapper_that_records_a_graph_is_not_taken_whole():
    xs = torch.randn(5, 4, dtype=D)
    w = torch.randn(4, 3, dtype=D)

    def f(x):
        x = x.clone().requires_grad_()
        (g,) = torch.autograd.grad((x @ w).sum(), x)
        return g

    torch.testing.assert_close(functx.vmap(f)(xs), w.sum(1).expand(5, 4))


def test_the_rules_are_the_ones_registered():
    assert set(WHOLE_CALL_RULES) == {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, F.linear}
