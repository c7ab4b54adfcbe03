"""functx.rearrange against torch.func.rearrange: values, shapes and errors, plus random
patterns (hypothesis) and rearrange inside transforms."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functx

X = torch.arange(2 * 3 * 4 * 6, dtype=torch.float32).reshape(2, 3, 4, 6)

# (tensor shape, pattern, axes_lengths)
PATTERNS = [
    ((2, 3, 4, 6), "a b c d -> a b c d", {}),
    ((2, 3, 4, 6), "a b c d -> d c b a", {}),
    ((2, 3, 4, 6), "a b c d -> (a b) c d", {}),
    ((2, 3, 4, 6), "a b c d -> a (b c d)", {}),
    ((2, 3, 4, 6), "a b c d -> (a b c d)", {}),
    ((2, 3, 4, 6), "a b c d -> (d a) (c b)", {}),
    ((2, 3, 4, 6), "a b c (d1 d2) -> a b c d1 d2", {"d1": 2}),
    ((2, 3, 4, 6), "a b c (d1 d2) -> a b c d1 d2", {"d2": 2}),
    ((2, 3, 4, 6), "a b c (d1 d2) -> a b c d1 d2", {"d1": 3, "d2": 2}),
    ((2, 3, 4, 6), "a b (c1 c2) (d1 d2) -> (a c1 d1) b c2 d2", {"c1": 2, "d1": 2}),
    ((2, 3, 4, 6), "a b (c1 c2) (d1 d2) -> a b (c2 d2) (c1 d1)", {"c1": 2, "d1": 3}),
    ((2, 3, 4, 6), "a b c d -> a b c d 1", {}),
    ((2, 3, 4, 6), "a b c d -> 1 a () b c d", {}),
    ((2, 3, 4, 6), "a b c d -> a (b 1 c) d", {}),
    ((2, 3, 4, 6), "(a) b c d -> a b c d", {}),
    ((2, 3, 4, 6), "a ... -> ... a", {}),
    ((2, 3, 4, 6), "... d -> d ...", {}),
    ((2, 3, 4, 6), "a ... d -> a (...) d", {}),
    ((2, 3, 4, 6), "... -> (...)", {}),
    ((2, 3, 4, 6), "a b ... -> b a ...", {}),
    ((2, 3, 4, 6), "a b c d ... -> ... d c b a", {}),
    ((2, 3, 4, 6), "... (d1 d2) -> ... d2 d1", {"d1": 2}),
    ((2, 3, 4, 6), "a b c d -> a b c d", {"b": 3, "d": 6}),
    ((1, 3, 4, 6), "1 b c d -> b c d", {}),
    ((1, 3, 1, 6), "() b 1 d -> d b", {}),
    ((2, 3, 4, 6), "a if c d -> d if c a", {}),  # a keyword as a name: a warning
    ((5, 1), "(a b) c -> b a c", {"a": 5}),
    ((6, 2), "(a b c) d -> c b d a", {"a": 1, "b": 2}),
    ((0, 3), "a b -> b a", {}),
    ((0, 3), "(a c) b -> b a c", {"c": 2}),
    ((), " -> ", {}),
    ((), "... -> ...", {}),
    ((7,), "a -> a", {}),
]


def _both(shape, pattern, lengths):
    x = torch.randn(shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = functx.rearrange(x, pattern, **lengths)
        theirs = torch.func.rearrange(x, pattern, **lengths)
    return x, ours, theirs


@pytest.mark.parametrize("shape,pattern,lengths", PATTERNS, ids=[p for _, p, _ in PATTERNS])
def test_pattern_against_torch_func(shape, pattern, lengths):
    x, ours, theirs = _both(shape, pattern, lengths)
    assert ours.shape == theirs.shape
    assert torch.equal(ours, theirs)
    # a view of the input wherever torch.func's is one
    if theirs.numel() and (theirs._base is not None or theirs is x):
        assert ours._base is not None or ours is x


def test_split_of_a_one_dim_tensor():
    """torch.func fails to split the only dimension of a 1-d tensor ('at least 2 indices were
    supplied but the tensor only has 1 dimensions'); the reference is reshape + permute."""
    x = torch.arange(6.0)
    assert torch.equal(functx.rearrange(x, "(a b) -> b a", a=2), x.reshape(2, 3).t())
    assert torch.equal(functx.rearrange(x, "(a b c) -> c b a", a=1, b=2), x.reshape(1, 2, 3).permute(2, 1, 0))
    assert torch.equal(functx.rearrange(x, "(a b) -> (b a)", b=3), x.reshape(2, 3).t().reshape(6))
    with pytest.raises(ValueError):
        torch.func.rearrange(x, "(a b) -> b a", a=2)


def test_sequence_of_tensors_is_stacked():
    parts = [torch.randn(3, 4) for _ in range(5)]
    for pattern in ["n a b -> a n b", "n a b -> a (n b)", "n a b -> (n a) b"]:
        for seq in (parts, tuple(parts)):
            assert torch.equal(functx.rearrange(seq, pattern), torch.func.rearrange(seq, pattern))


def test_writes_through_the_view_reach_the_input():
    x = torch.zeros(2, 3)
    functx.rearrange(x, "a b -> b a")[1, 0] = 7.0
    assert x[0, 1] == 7.0


# (shape, pattern, axes_lengths): both raise, the same type and message where the message
# comes from the pattern (parsing, checking); binding lengths: both raise (torch.func's
# DimensionBindError, functx's ValueError with its own message).
PARSE_ERRORS = [
    ((2, 3), "a b", {}),
    ((2, 3), "a -> b -> c", {}),
    ((2, 3), "a b -> a b c", {}),
    ((2, 3), "a b -> a", {}),
    ((2, 3), "a b -> a b", {"c": 2}),
    ((2, 3), "a b -> a b", {"b": 3.0}),
    ((2, 3), "a b -> a 2 b", {}),
    ((2, 3), "a a -> a", {}),
    ((2, 3), "a ((b)) -> a b", {}),
    ((2, 3), "a (b -> a b", {}),
    ((2, 3), "a b) -> a b", {}),
    ((2, 3), "a b. -> a b", {}),
    ((2, 3), "a ... -> a ......", {}),
    ((2, 3), "a .. -> a ..", {}),
    ((2, 3), "_a b -> _a b", {}),
    ((2, 3), "a_ b -> a_ b", {}),
    ((2, 3), "a$ b -> a b", {}),
    ((2, 3), "2a b -> a b", {}),
    ((2, 3), "a 0 -> a", {}),
    ((2, 3), "a b -> b a", {"\u2026": 2}),
    ((2, 3), "a b -> ...", {}),
    ((2, 3), "a (...) -> a ...", {}),
    ((2, 3), "a ... -> a", {}),
    ((2, 3), "a b c -> a b c", {}),
    ((2, 3), "a -> a", {}),
    ((2, 3), "a b c ... -> a b c ...", {}),
]
BIND_ERRORS = [
    ((2, 4), "a (b c) -> a b c", {}),
    ((2, 4), "a (b c) -> a b c", {"b": 3}),
    ((2, 4), "a (b c) -> a b c", {"b": 2, "c": 3}),
    ((2, 4), "a b -> a b", {"b": 3}),
    ((2, 4), "a b -> a b", {"a": -2}),
]


def _error(f):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            f()
        except Exception as e:  # noqa: BLE001
            return e
    return None


@pytest.mark.parametrize("shape,pattern,lengths", PARSE_ERRORS, ids=[p for _, p, _ in PARSE_ERRORS])
def test_pattern_errors_as_torch_func(shape, pattern, lengths):
    x = torch.randn(shape)
    ours = _error(lambda: functx.rearrange(x, pattern, **lengths))
    theirs = _error(lambda: torch.func.rearrange(x, pattern, **lengths))
    assert theirs is not None and ours is not None
    assert type(ours) is type(theirs)
    assert str(ours) == str(theirs) or _same_set_message(str(ours), str(theirs))


def _same_set_message(a: str, b: str) -> bool:
    """Messages naming a set of identifiers ({'a', 'b'}) whose order may differ."""
    if "{" not in a or "{" not in b:
        return False
    head_a, _, set_a = a.partition("{")
    head_b, _, set_b = b.partition("{")
    return head_a == head_b and sorted(set_a.strip("}").split(", ")) == sorted(set_b.strip("}").split(", "))


@pytest.mark.parametrize("shape,pattern,lengths", BIND_ERRORS, ids=[f"{p} {lengths}" for _, p, lengths in BIND_ERRORS])
def test_length_errors(shape, pattern, lengths):
    x = torch.randn(shape)
    assert _error(lambda: torch.func.rearrange(x, pattern, **lengths)) is not None
    with pytest.raises(ValueError, match="rearrange"):
        functx.rearrange(x, pattern, **lengths)


def test_float_length_refused_even_after_the_int_one_was_cached():
    """torch.func caches plans by the lengths' values, so `b=3.0` after `b=3` slips through its
    integer check; functx's cache key holds the type."""
    x = torch.randn(2, 3)
    functx.rearrange(x, "a b -> b a", b=3)
    with pytest.raises(TypeError, match="must be integers"):
        functx.rearrange(x, "a b -> b a", b=3.0)


def test_unit_dimension_must_have_length_one():
    """`1` on the left is a dimension of length 1 (einops). torch.func sums over it instead
    when it is longer: functx refuses."""
    x = torch.randn(2, 3)
    with pytest.raises(ValueError, match="written as 1"):
        functx.rearrange(x, "1 b -> b")
    assert torch.equal(torch.func.rearrange(x, "1 b -> b"), x.sum(0))  # torch.func's reading


def test_unit_dimensions_of_a_scalar():
    """A 0-dim tensor gets the unit dims its pattern asks for (torch.func returns it as is)."""
    x = torch.tensor(3.0)
    assert functx.rearrange(x, " -> 1").shape == (1,)
    assert functx.rearrange(x, " -> 1 ()").shape == (1, 1)
    assert functx.rearrange(x, " -> ").shape == ()


def test_warnings_for_discouraged_names():
    x = torch.randn(2, 3)
    with pytest.warns(RuntimeWarning, match="keywords"):
        functx.rearrange(x, "for b -> b for")
    with pytest.warns(FutureWarning, match="'axis'"):
        functx.rearrange(x, "axis b -> b axis")


# -- random patterns --------------------------------------------------------------------------
@st.composite
def patterns(draw):
    """A tensor shape, a pattern and the reference result's recipe: input dims split into
    groups of axes, then the axes permuted and regrouped on the right (with unit dims and an
    ellipsis sometimes), and a last axis `z` that stays whole."""
    n_axes = draw(st.integers(1, 5))
    names = [f"x{i}" for i in range(n_axes)]
    sizes = {name: draw(st.integers(1, 3)) for name in names}
    sizes["z"] = 2
    cuts = sorted(draw(st.sets(st.integers(1, n_axes - 1), max_size=n_axes - 1))) if n_axes > 1 else []
    left_groups = [names[a:b] for a, b in zip([0, *cuts], [*cuts, n_axes])]
    ellipsis_at = draw(st.integers(0, len(left_groups) - 1)) if draw(st.booleans()) else None
    hidden = set(left_groups[ellipsis_at]) if ellipsis_at is not None else set()
    lengths, shape, left_text = {}, [], []
    for i, group in enumerate(left_groups):
        if i == ellipsis_at:  # the ellipsis stands for this group's axes, one dim each
            shape.extend(sizes[name] for name in group)
            left_text.append("...")
            continue
        shape.append(math.prod(sizes[name] for name in group))
        left_text.append(group[0] if len(group) == 1 else f"({' '.join(group)})")
        lengths.update({name: sizes[name] for name in group[1:]})  # all but the first: given
    order = draw(st.permutations([*names, "z"]))
    right_cuts = sorted(draw(st.sets(st.integers(1, n_axes), max_size=n_axes)))
    right_groups = [list(order[a:b]) for a, b in zip([0, *right_cuts], [*right_cuts, n_axes + 1])]
    right_text, out_shape, permuted = [], [], []
    for group in right_groups:
        if any(n in hidden for n in group) and not set(permuted) & hidden:
            right_text.append("...")  # the ellipsis's axes, one dim each, in their order
            out_shape.extend(sizes[n] for n in names if n in hidden)
            permuted.extend(n for n in names if n in hidden)
        shown = [n for n in group if n not in hidden]
        if shown:
            right_text.append(shown[0] if len(shown) == 1 else f"({' '.join(shown)})")
            out_shape.append(math.prod(sizes[n] for n in shown))
            permuted.extend(shown)
        if draw(st.integers(0, 3)) == 0:
            right_text.append(draw(st.sampled_from(["1", "()"])))
            out_shape.append(1)
    elementary = [*names, "z"]
    recipe = ([sizes[n] for n in elementary], [elementary.index(n) for n in permuted], out_shape)
    pattern = f"{' '.join(left_text)} z -> {' '.join(right_text)}"
    return (*shape, 2), pattern, lengths, recipe


@settings(max_examples=150, deadline=None)
@given(patterns())
def test_random_patterns(case):
    """Against the reshape/permute/reshape the pattern stands for, and torch.func where it
    takes the pattern (it refuses some valid ones: see test_split_of_a_one_dim_tensor and
    test_ellipsis_with_groups)."""
    shape, pattern, lengths, (elementary, permutation, out_shape) = case
    x = torch.randn(shape)
    ours = functx.rearrange(x, pattern, **lengths)
    expected = x.reshape(elementary).permute(permutation).reshape(out_shape)
    assert ours.shape == expected.shape, pattern
    assert torch.equal(ours, expected), pattern
    theirs = _error(lambda: torch.func.rearrange(x, pattern, **lengths))
    if theirs is None:
        assert torch.equal(ours, torch.func.rearrange(x, pattern, **lengths)), pattern


def test_ellipsis_with_groups():
    """torch.func counts the axes inside groups when it checks that the ellipsis has dims
    left ('Number of dimensions in pattern (4) ...'); einops counts dimensions."""
    x = torch.randn(1, 6, 2)
    expected = x.reshape(1, 1, 2, 3, 2).permute(4, 0, 1, 2, 3).reshape(2, 1, 6)
    assert torch.equal(functx.rearrange(x, "... (a b c) z -> z ... (a b c)", b=2, c=3), expected)
    with pytest.raises(ValueError, match="Number of dimensions"):
        torch.func.rearrange(x, "... (a b c) z -> z ... (a b c)", b=2, c=3)


# -- inside transforms --------------------------------------------------------------------------
def test_rearrange_inside_transforms():
    xs = torch.randn(5, 2, 6)
    f = lambda x: functx.rearrange(x, "a (b c) -> (c a) b", c=2).sin().sum(0)
    g = lambda x: torch.func.rearrange(x, "a (b c) -> (c a) b", c=2).sin().sum(0)
    assert torch.allclose(functx.vmap(f)(xs), torch.stack([g(x) for x in xs]))
    assert torch.allclose(functx.grad(lambda x: f(x).sum())(xs[0]), torch.func.grad(lambda x: g(x).sum())(xs[0]))
    assert torch.allclose(functx.jacrev(f)(xs[0]), torch.func.jacrev(g)(xs[0]))

    def write(x):
        y = x.clone()
        functx.rearrange(y, "a b -> b a").mul_(2)  # through the view
        return y

    assert torch.equal(functx.functionalize(write)(xs[0]), 2 * xs[0])
