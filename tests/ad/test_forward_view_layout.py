"""torch's forward-AD layout assert ("Expected the output of forward differentiable view
operations to have the tangent have the same layout as primal", autograd_meta.cpp) is not
reachable from valid programs (issue 27): a write of a dual value into a view of a tensor
batched at a dim that is not outermost in memory (vmap in_dims=1: batch stride 1), and a
chunk of a batched primal under functx.jit (functionalization's zeros lose a storage
offset). References: plain torch forward AD per sample (no vmap), closed forms."""

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import functx

D = torch.float64


def _write_into_view(x, y):
    h = x.unsqueeze(1).clone()
    h[..., 0] = y[0] * y[1]
    return torch.sin(h)


def _jvp_in_y(x, y, t):
    return functx.jvp(lambda yy: _write_into_view(x, yy), (y,), (t,))[1]


def _plain_forward_ad(x, y, t):
    with fwAD.dual_level():
        out = _write_into_view(x, fwAD.make_dual(y, t))
        return fwAD.unpack_dual(out).tangent


def _per_sample(x, in_dim, y, t):
    return torch.stack([_plain_forward_ad(x.select(in_dim, i), y, t) for i in range(x.shape[in_dim])])


def test_the_issue_case_two_vmaps_with_chunks():
    """vmap(vmap(jvp over y), in_dims=(2, None), out_dims=-4, chunk_size=2), in_dims=(3, None),
    chunk_size=2) with x (2, 4, 2, 1), as the issue gives it."""
    x, y, t = torch.randn(2, 4, 2, 1, dtype=D), torch.randn(3, dtype=D), torch.randn(3, dtype=D)

    def inner(x, y):
        h = x.unsqueeze(1).clone()
        h[..., 0] = y[0]
        return h

    f = lambda x, y: functx.jvp(lambda yy: inner(x, yy), (y,), (t,))[1]
    got = functx.vmap(functx.vmap(f, in_dims=(2, None), out_dims=-4, chunk_size=2), in_dims=(3, None), chunk_size=2)(x, y)
    expected = torch.zeros(1, 2, 2, 1, 4, dtype=D)  # h's tangent: t[0] in the written column
    expected[..., 0] = t[0]
    torch.testing.assert_close(got, expected)


@settings(max_examples=40, deadline=None)
@given(
    in_dim=st.integers(0, 1),
    chunk_size=st.sampled_from([None, 1, 2]),
    batch=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_writes_into_views_under_vmap_of_jvp(in_dim, chunk_size, batch, seed):
    g = torch.Generator().manual_seed(seed)
    shape = [3, 3]
    shape[in_dim] = batch
    x = torch.randn(*shape, dtype=D, generator=g)
    y, t = torch.randn(2, dtype=D, generator=g), torch.randn(2, dtype=D, generator=g)
    got = functx.vmap(_jvp_in_y, in_dims=(in_dim, None, None), chunk_size=chunk_size)(x, y, t)
    torch.testing.assert_close(got, _per_sample(x, in_dim, y, t))


def test_jacfwd_of_chunked_vmap_with_conv_and_in_place_squeeze():
    """The issue's second case: jacfwd(vmap(k, in_dims=(0, -1), chunk_size=2), argnums=1)."""

    def k(x, y):
        a = x * y[0]
        w = y[:3].reshape(1, 1, 3).expand(2, 1, 3)
        c = F.conv1d(a.reshape(1, 1, -1), w)
        d = c.clone()
        d.squeeze_(0)
        e = d[torch.tensor([0, 1])]
        return torch.logsumexp(e.flatten(), 0) + torch.dot(x, x)

    x, y = torch.randn(3, 5, dtype=D), torch.randn(4, 3, dtype=D)
    got = functx.jacfwd(functx.vmap(k, in_dims=(0, -1), chunk_size=2), argnums=1)(x, y)
    expected = torch.zeros(3, 4, 3, dtype=D)
    for i in range(3):
        expected[i, :, i] = torch.autograd.functional.jacobian(lambda v: k(x[i], v), y[:, i])
    torch.testing.assert_close(got, expected)


def test_jit_of_chunked_vmap_of_jvp_of_a_view():
    """Under functx.jit (fake, functional tensors) the second chunk of a batched primal has a
    storage offset that functionalization's zeros lose (found by the jit fuzzer)."""
    kernel = torch.randn(1, 1, 3, dtype=D)

    def f(x, s):
        return functx.jvp(lambda v: torch.exp(0.5 * F.conv1d(v.reshape(1, 1, 4), kernel, padding=1).reshape(4)) + s.sum(), (x,), (torch.ones(4, dtype=D),))[1]

    g = functx.vmap(f, in_dims=(0, None), chunk_size=2)
    x, s = torch.randn(3, 4, dtype=D), torch.randn(3, dtype=D)
    expected = torch.stack([torch.autograd.functional.jvp(lambda v: torch.exp(0.5 * F.conv1d(v.reshape(1, 1, 4), kernel, padding=1).reshape(4)), xi, torch.ones(4, dtype=D))[1] for xi in x])
    torch.testing.assert_close(g(x, s), expected)
    torch.testing.assert_close(functx.jit(g)(x, s), expected)


# -- conjugate and negative views, and Functions returning views, under forward mode ----------
# vmap over jvp with an unbatched primal runs torch's forward AD on the plain primal with
# vmap's BatchedTensor tangents; torch's checks of a view's tangent read bits those wrappers
# do not carry (a conj view is materialized under vmap), and refused these programs, which
# torch.func computes. jacfwd (a wrapped level) took `x.conj().real` for resolved.
SPECTRAL = {
    "power spectrum X * conj(X)": lambda z: (torch.fft.fft(z) * torch.fft.fft(z).conj()).real,
    "conj().real": lambda z: torch.fft.fft(z).conj().real,
    "conj().imag": lambda z: torch.fft.fft(z).conj().imag,
    "irfft of conj": lambda z: torch.fft.irfft(torch.fft.rfft(z).conj()),
    "hfft": torch.fft.hfft,
    "ihfft().real": lambda z: torch.fft.ihfft(z).real,
    "ifft().imag": lambda z: torch.fft.ifft(z).imag,
    "a negative view (conj * 1j)": lambda z: (torch.fft.fft(z).conj() * 1j).real,
}


@pytest.mark.parametrize("name", list(SPECTRAL))
def test_forward_mode_through_conjugate_views_matches_reverse_mode_jacobian(name):
    f = SPECTRAL[name]
    x = torch.linspace(-1.0, 2.0, 6, dtype=D).sin()
    expected = torch.autograd.functional.jacobian(f, x)  # plain torch, reverse mode
    basis = torch.eye(6, dtype=D)
    torch.testing.assert_close(functx.jacfwd(f)(x), expected)
    columns = functx.vmap(lambda t: functx.jvp(f, (x,), (t,))[1], out_dims=1)(basis)
    torch.testing.assert_close(columns, expected)
    # primal batched too (the direct level over vmap's physical values)
    xs = torch.stack([x, 2 * x])
    rows = functx.vmap(lambda a: functx.jvp(f, (a,), (a.cos(),))[1])(xs)
    for k in range(2):
        torch.testing.assert_close(rows[k], torch.autograd.functional.jvp(f, xs[k], xs[k].cos())[1])


class _SelectRow(torch.autograd.Function):
    """A Function whose forward returns a view of its input, its jvp the same view."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, i):
        return x[i]

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.i = inputs[1]

    @staticmethod
    def backward(ctx, g):
        raise AssertionError("not used by forward mode")

    @staticmethod
    def jvp(ctx, tx, _):
        return _SelectRow.apply(tx, ctx.i)


def test_vmap_of_jvp_of_a_function_returning_a_view_with_an_unbatched_primal():
    x, ts = torch.randn(3, 4, dtype=D), torch.randn(5, 3, 4, dtype=D)
    got = functx.vmap(lambda t: functx.jvp(lambda a: _SelectRow.apply(a, 1) * a[0], (x,), (t,))[1])(ts)
    expected = ts[:, 1] * x[0] + x[1] * ts[:, 0]  # product rule, by hand
    torch.testing.assert_close(got, expected)
