"""vmap's whole-function fallback (functx/vmap/api._vmap_once, vmap/nested.map_per_sample):
where the function needs each sample's own Python value (`if x > 0`, `.item()`, `bool()`,
`int()`, `float()`, `.tolist()`) or a shape that differs between samples, vmap runs it once
per sample and stacks, with one PerformanceWarning naming the user's line; torch.func
raises. Reference: the function looped over the samples, float64; derivatives against
`torch.autograd` on the loop.
"""

import functools
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functx
from functx.core.interpreter import current_stack

D = torch.float64
pytestmark = pytest.mark.filterwarnings("ignore::functx.PerformanceWarning")


def branchy(v):
    if v.sum() > 0:  # Python control flow on a sample's value
        return v.exp() * 2
    return -v.sin()


def loop(f, x, dim=0):
    return torch.stack([f(v) for v in x.unbind(dim)])


def test_python_if_on_a_sample_runs_per_sample():
    x = torch.randn(6, 3, dtype=D)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = functx.vmap(branchy)(x)
    torch.testing.assert_close(out, loop(branchy, x))
    perf = [w for w in caught if issubclass(w.category, functx.PerformanceWarning)]
    assert len(perf) == 1 and perf[0].filename == __file__
    assert "once per sample (6 samples)" in str(perf[0].message)
    assert f"{__file__}:" in str(perf[0].message) and "if v.sum() > 0:" in str(perf[0].message)


@pytest.mark.parametrize(
    "f",
    [
        lambda v: v * v.sum().item(),
        lambda v: v * float(v.max()),
        lambda v: v[: int(v.abs().argmax()) + 1].sum() * v,
        lambda v: v * len([t for t in v.tolist() if t > 0]),
        lambda v: v * 2 if bool(v[0] > 0) else v,
        lambda v: v.exp() if torch.equal(v, v.abs()) else v,
    ],
    ids=["item", "float", "int", "tolist", "bool", "equal"],
)
def test_each_way_of_reading_a_value(f):
    x = torch.randn(5, 4, dtype=D)
    x[1] = x[1].abs()
    torch.testing.assert_close(functx.vmap(f)(x), loop(f, x))


def test_error_mode_keeps_the_error():
    x = torch.randn(4, 3)
    with functx.vmap_fallback("error"):
        with pytest.raises(RuntimeError, match=r"torch\.where"):
            functx.vmap(branchy)(x)
        with pytest.raises(RuntimeError, match=r"tolist"):
            functx.vmap(lambda v: v.tolist())(x)
    assert current_stack() == ()


def test_in_dims_out_dims_kwargs_and_chunks():
    x = torch.randn(3, 5, dtype=D)
    w = torch.randn(3, dtype=D)

    def f(v, w, *, scale):
        return branchy(v * w) * scale, w.sum()

    out, s = functx.vmap(f, in_dims=(1, None), out_dims=(1, None), chunk_size=2)(x, w, scale=3.0)
    torch.testing.assert_close(out, torch.stack([f(v, w, scale=3.0)[0] for v in x.unbind(1)], 1))
    torch.testing.assert_close(s, w.sum())


def test_nested_vmaps():
    x = torch.randn(3, 4, 2, dtype=D)
    out = functx.vmap(functx.vmap(branchy))(x)
    torch.testing.assert_close(out, torch.stack([loop(branchy, row) for row in x]))
    out = functx.vmap(functx.vmap(branchy, in_dims=1), in_dims=2)(x)
    torch.testing.assert_close(out, torch.stack([torch.stack([branchy(x[:, j, k]) for j in range(4)]) for k in range(2)]))


def test_gradients_through_the_fallback():
    x = torch.randn(5, 3, dtype=D)
    w = torch.randn(3, dtype=D)

    def loss(w, v):
        return branchy(v * w).sum()

    per_sample = functx.vmap(functx.grad(loss), in_dims=(None, 0))(w, x)
    wr = w.clone().requires_grad_()
    want = torch.stack([torch.autograd.grad(loss(wr, v), wr)[0] for v in x])
    torch.testing.assert_close(per_sample, want)

    def total(w):
        return functx.vmap(loss, in_dims=(None, 0))(w, x).sum()

    torch.testing.assert_close(functx.grad(total)(w), want.sum(0))
    torch.testing.assert_close(functx.jacrev(total)(w), want.sum(0))
    t = torch.randn(3, dtype=D)
    torch.testing.assert_close(functx.jvp(total, (w,), (t,))[1], want.sum(0) @ t)
    # forward mode inside: jacfwd of each sample
    jac = functx.vmap(functx.jacfwd(lambda v: branchy(v * w)))(x)
    torch.testing.assert_close(jac, torch.stack([torch.autograd.functional.jacobian(lambda v: branchy(v * w), v) for v in x]))


def test_randomness_modes_under_the_fallback():
    x = torch.randn(4, 3, dtype=D)

    def noisy(v):
        noise = torch.rand_like(v)
        return branchy(v) + noise

    with pytest.raises(RuntimeError, match="randomness error mode"):
        functx.vmap(noisy)(x)
    # "different": the batched attempt's draws are undone; each sample then draws in turn,
    # what a loop over the samples draws from the same seed
    torch.manual_seed(3)
    out = functx.vmap(noisy, randomness="different")(x)
    torch.manual_seed(3)
    torch.testing.assert_close(out, loop(noisy, x))
    # "same": every sample starts from one state
    torch.manual_seed(3)
    same = functx.vmap(lambda v: torch.rand(3, dtype=D) * (1 if v.sum() > 0 else 1), randomness="same")(x)
    assert all(torch.equal(same[0], same[i]) for i in range(4))


def test_data_dependent_shapes():
    x = torch.randn(5, 6, dtype=D)
    f = lambda v: v[v > 0].sum() + v.nonzero().shape[0]  # noqa: E731
    torch.testing.assert_close(functx.vmap(f)(x), loop(f, x))
    x[0, :3] = -1.0
    x[0, 3:] = 1.0
    x[1] = 1.0
    with pytest.raises(RuntimeError, match=r"output 0 has different shapes per sample \(\(3,\), \(6,\).*per-sample fallback"):
        functx.vmap(lambda v: v[v > 0])(x)
    assert current_stack() == ()


def test_an_error_in_one_sample_leaves_nothing_behind():
    x = torch.randn(3, 2)
    x[2] = -1.0

    def f(v):
        if v.sum() < -1.5:
            raise KeyError("third")
        return v

    with pytest.raises(KeyError, match="third"):
        functx.vmap(f)(x)
    assert current_stack() == ()


STEPS = [
    ("sin", lambda v, w: v.sin()),
    ("scale by w", lambda v, w: v * w),
    ("if on the sum", lambda v, w: v.exp() if v.sum() > 0 else v * v),
    ("item", lambda v, w: v * v.mean().item()),
    ("prefix by argmax", lambda v, w: torch.cat([v[: int(v.argmax()) + 1], v]).sum() + v),
    ("softmax", lambda v, w: torch.softmax(v, 0)),
]


@settings(max_examples=30, deadline=None)
@given(
    steps=st.lists(st.sampled_from(range(len(STEPS))), min_size=1, max_size=4),
    batch=st.integers(1, 4),
    transform=st.sampled_from(["vmap", "vmap(grad)", "grad(vmap)", "vmap(vmap)"]),
    seed=st.integers(0, 2**16),
)
def test_random_programs_with_control_flow_match_the_loop(steps, batch, transform, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, dtype=D, generator=g)
    w = torch.randn(3, dtype=D, generator=g)

    def program(v, w):
        for i in steps:
            v = STEPS[i][1](v, w)
        return v

    def loss(w, v):
        return (program(v, w) * w).sum()

    if transform == "vmap":
        torch.testing.assert_close(functx.vmap(program, in_dims=(0, None))(x, w), torch.stack([program(v, w) for v in x]))
    elif transform == "vmap(vmap)":
        xx = torch.stack([x, x.flip(0)], 1)
        out = functx.vmap(functx.vmap(program, in_dims=(0, None)), in_dims=(1, None))(xx, w)
        torch.testing.assert_close(out, torch.stack([torch.stack([program(v, w) for v in xx[:, j]]) for j in range(2)]))
    else:
        wr = w.clone().requires_grad_()
        per_sample = [torch.autograd.grad(loss(wr, v), wr)[0] for v in x]
        if transform == "vmap(grad)":
            torch.testing.assert_close(functx.vmap(functx.grad(loss), in_dims=(None, 0))(w, x), torch.stack(per_sample))
        else:
            total = functx.grad(lambda w: functx.vmap(functools.partial(loss, w))(x).sum())(w)
            torch.testing.assert_close(total, sum(per_sample))
    assert current_stack() == ()


def test_only_the_level_that_needs_the_values_falls_back():
    """A value batched by the outer vmap read inside the inner one: the outer call runs per
    sample, the inner one stays batched (one warning, not a wasted inner loop first)."""
    x, y = torch.randn(3, 2, dtype=D), torch.randn(4, dtype=D)

    def outer(a):
        return functx.vmap(lambda b: b * a.sum().item())(y)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = functx.vmap(outer)(x)
    torch.testing.assert_close(out, torch.stack([y * a.sum() for a in x]))
    perf = [str(w.message) for w in caught if issubclass(w.category, functx.PerformanceWarning)]
    assert len(perf) == 1 and perf[0].startswith("vmap(outer) runs outer once per sample (3 samples)")


def test_silent_mode_runs_without_a_warning():
    x = torch.randn(3, 2, dtype=D)
    with functx.vmap_fallback("silent"), warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(functx.vmap(branchy)(x), loop(branchy, x))


def test_a_write_into_an_input_before_the_value_is_read_is_refused():
    """Found by the fuzzer: the batched attempt had multiplied the input in place before the
    `if`, and the per-sample run multiplied it again (107.98 where the loop gives -0.9994).
    Running the function twice would write twice: an error, the input written once."""
    x = torch.randn(3, 4, dtype=D)
    before = x.clone()

    def f(v):
        v.mul_(2.0)
        return branchy(v)

    with pytest.raises(RuntimeError, match=r"had already written in place into one of its inputs.*clone"):
        functx.vmap(f)(x)
    torch.testing.assert_close(x, before * 2)
    assert current_stack() == ()
    # written after the value is read, or into a copy: the loop's values
    x = before.clone()
    g = lambda v: branchy(v.clone().mul_(2.0))  # noqa: E731
    torch.testing.assert_close(functx.vmap(g)(x), loop(g, before))
    torch.testing.assert_close(x, before)


# --- ragged outputs as nested tensors, on request -------------------------------------------


def positives(v):
    return v[v > 0].exp()  # a shape that depends on the sample's values


def ragged_samples():
    x = torch.randn(5, 6, dtype=D, generator=torch.Generator().manual_seed(5))
    x[2] = x[2].abs()
    return x


@pytest.mark.parametrize("chunk_size", [None, 1, 2])
def test_ragged_outputs_come_back_nested_when_asked(chunk_size):
    x = ragged_samples()
    with functx.vmap_fallback("silent", ragged="nested"):
        out, total = functx.vmap(lambda v: (positives(v), v.sum()), chunk_size=chunk_size)(x)
    assert out.is_nested and out.layout == torch.jagged
    for got, v in zip(out.unbind(), x):
        torch.testing.assert_close(got, positives(v))
    torch.testing.assert_close(total, x.sum(1))  # outputs of one shape stay stacked
    assert functx.core.config.ragged == "error"  # the context restored the default


@pytest.mark.parametrize("chunk_size", [None, 1, 2])
def test_ragged_outputs_are_an_error_by_default(chunk_size):
    with pytest.raises(RuntimeError, match="different shapes per sample .* ragged='nested'"):
        functx.vmap(positives, chunk_size=chunk_size)(ragged_samples())
    assert current_stack() == ()


def test_ragged_outputs_in_two_dims_are_strided_and_out_dim_must_be_0():
    x = ragged_samples()

    def square(v):
        p = v[v > 0]
        return p[:, None] * p[None, :]

    with functx.vmap_fallback("silent", ragged="nested"):
        out = functx.vmap(square)(x)
        assert out.layout == torch.strided
        for got, v in zip(out.unbind(), x):
            torch.testing.assert_close(got, square(v))
        with pytest.raises(RuntimeError, match="give it out_dim 0"):
            functx.vmap(positives, out_dims=1)(x.reshape(5, 6, 1).expand(5, 6, 2).mT)
    with pytest.raises(ValueError, match="ragged outputs must be one of"):
        functx.set_vmap_fallback("warn", ragged="pad")
    assert functx.core.config.fallback == "warn"
