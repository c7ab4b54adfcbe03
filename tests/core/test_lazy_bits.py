"""core/lazy_bits.py: torch's lazy bits (conjugate and negative views, efficient zeros) of
plain tensors meeting level tensors. Each answer is compared with the per-sample loop of
plain torch, where torch's own kernels answer."""

import pytest
import torch

import functx

aten = torch.ops.aten
D = torch.float64


def _zero(*shape, dtype=D):
    return torch._efficientzerotensor(shape, dtype=dtype)


@pytest.mark.parametrize(
    "op, zero_first, zero_shape",
    [
        (aten.mul.Tensor, True, (3,)),
        (aten.mul.Tensor, False, (2, 3)),
        (aten.div.Tensor, True, (3,)),  # 0 / x: zero
        (aten.div.Tensor, False, (3,)),  # x / 0: inf, whatever x is
        (aten.linalg_cross.default, False, (3,)),
        (aten.dot.default, True, (3,)),
        (aten.vdot.default, False, (3,)),
    ],
)
def test_an_efficient_zero_beside_a_batched_tensor_answers_through_the_level(op, zero_first, zero_shape):
    """torch's ZeroTensor kernel answers from the shapes alone, with a plain tensor; beside a
    vmap level's tensor functx's answers with the level's tensor (batched, per-sample equal
    to torch's answer), so autograd's record of the op stays at the wrappers."""
    xs = torch.randn(4, 3, dtype=D)
    if op is aten.mul.Tensor and not zero_first:
        xs = torch.randn(4, 2, 3, dtype=D)
    z = _zero(*zero_shape)
    call = (lambda x: op(z, x)) if zero_first else (lambda x: op(x, z))
    got = functx.vmap(call)(xs)
    expected = torch.stack([call(x) for x in xs])
    assert not got._is_zerotensor() and got.shape == expected.shape
    torch.testing.assert_close(got, expected, equal_nan=True)


def test_callers_gradient_through_a_jacobian_of_a_jvp_with_structural_zero_tangents():
    """jacrev(jvp(jacrev(tanh(sin x)))) under the caller's autograd: the jvp's formulas leave
    efficient-zero tangents in the graph, and the outer jacrev's backward multiplies a row
    of its vmap by one. torch's ZeroTensor kernel answered a plain zero, recorded by autograd
    on the row's wrapper; the caller's backward then unpacked the dead row (DeadLevelError).
    Against plain torch.autograd with create_graph and forward AD."""
    import torch.autograd.forward_ad as fwAD

    x = torch.randn(3, dtype=D, requires_grad=True)
    t = torch.randn(3, dtype=D)
    f = lambda v: torch.tanh(torch.sin(v))

    def inner_jvp(v):
        return functx.jvp(functx.jacrev(f), (v,), (t,))[1]

    got = functx.jacrev(inner_jvp)(x)
    (got_caller,) = torch.autograd.grad(got.sin().sum(), x)

    def jvp_of_jacobian(v):  # plain: forward AD over reverse, row by row
        with fwAD.dual_level():
            dual = fwAD.make_dual(v, t)
            out = f(dual)
            rows = [torch.autograd.grad(out[i], dual, create_graph=True)[0] for i in range(3)]
            return torch.stack([fwAD.unpack_dual(r).tangent for r in rows])

    y = jvp_of_jacobian(x)
    expected = torch.stack([torch.autograd.grad(y.reshape(-1)[i], x, create_graph=True)[0] for i in range(9)]).reshape(3, 3, 3)
    (expected_caller,) = torch.autograd.grad(expected.sin().sum(), x)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got_caller, expected_caller)


D = torch.float64
# products of a negative view (`z.conj().imag` is one), each a function R^(2x3) -> tensor
NEG_PRODUCTS = {
    "mm": lambda m: torch.mm(m.mT, m),
    "bmm": lambda m: torch.bmm(m[None], m.mT[None]),
    "mv": lambda m: torch.mv(m, m[0]),
    "dot": lambda m: torch.dot(m[0], m[1]).reshape(1),
    "addmm": lambda m: torch.addmm(m[0], m.mT, m),
    "addmv": lambda m: torch.addmv(m[:, 0], m, m[1]),
    "baddbmm": lambda m: torch.baddbmm(m.mT[None] @ m[None], m.mT[None], m[None]),
    "addr": lambda m: torch.addr(m.mT @ m, m[0], m[1]),
    "matmul": lambda m: m @ m[0],
}


@pytest.mark.parametrize("name", sorted(NEG_PRODUCTS))
@pytest.mark.parametrize("view", ["conj_imag", "neg_view"])
def test_matrix_products_of_a_negative_view_keep_its_path_at_second_order(name, view):
    """`z.conj().imag` is a lazy negative view; torch's Negative fallback materialized it below
    autograd, and under jacrev(jacrev) the second derivative of `m.mT @ m` came out zero."""
    product = NEG_PRODUCTS[name]

    def f(x):
        m = (x * (1 + 2j)).conj().imag if view == "conj_imag" else torch._neg_view(x * 2)
        return product(m)

    x = torch.randn(2, 3, dtype=D)
    reference = torch.autograd.functional.jacobian(lambda y: torch.autograd.functional.jacobian(f, y, create_graph=True), x)
    torch.testing.assert_close(functx.jacrev(functx.jacrev(f))(x), reference)
    if view == "conj_imag":  # (jacfwd over `torch._neg_view` meets torch's view-layout assert, issue 27)
        torch.testing.assert_close(functx.jacfwd(functx.jacrev(f))(x), reference)
    out, vjp_fn = functx.vjp(functx.jacrev(f), x)
    ct = torch.randn(out.shape, dtype=D)
    torch.testing.assert_close(vjp_fn(ct)[0], torch.tensordot(ct, reference, dims=ct.dim()))
