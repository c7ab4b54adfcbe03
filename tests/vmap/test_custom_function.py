"""torch.autograd.Function under functx.vmap: the vmap staticmethod, generate_vmap_rule,
the errors torch.func gives, and old-style Functions run per sample
(functx/vmap/custom_function.py). References: loops over samples with no transform."""

import warnings

import pytest
import torch

import functx
from functx.vmap import custom_function
from tests.autograd_functions import (
    BadVmapReturn,
    BothVmapRules,
    Cube,
    KwargOnly,
    Mul,
    NoVmapSupport,
    NumpyTanh,
    OldStyleSTE,
    SortWithIndices,
)

D = torch.float64


def loop(f, *xs):
    return torch.stack([f(*sample) for sample in zip(*xs)])


def test_vmap_staticmethod_gets_info_and_in_dims():
    x = torch.randn(4, 3, dtype=D)
    NumpyTanh.vmap_calls.clear()
    torch.testing.assert_close(functx.vmap(NumpyTanh.apply)(x), torch.tanh(x))
    torch.testing.assert_close(functx.vmap(NumpyTanh.apply, in_dims=1, randomness="different")(x), torch.tanh(x).T)
    assert NumpyTanh.vmap_calls == [(4, "error", (0,)), (3, "different", (0,))]
    # nested: each level calls the staticmethod once, the inner one sees the outer's physical
    NumpyTanh.vmap_calls.clear()
    torch.testing.assert_close(functx.vmap(functx.vmap(NumpyTanh.apply))(x), torch.tanh(x))
    assert [c[0] for c in NumpyTanh.vmap_calls] == [3, 4]


def test_vmap_staticmethod_with_tuple_outputs_and_out_dims():
    x = torch.randn(4, 5, dtype=D)
    values, indices = functx.vmap(lambda v: SortWithIndices.apply(v, True))(x)
    expected = x.sort(dim=-1, descending=True)
    torch.testing.assert_close(values, expected.values)
    assert torch.equal(indices, expected.indices)
    values = functx.vmap(lambda v: SortWithIndices.apply(v, False)[0], in_dims=1)(x)
    torch.testing.assert_close(values, x.T.sort(dim=-1).values)


def test_generate_vmap_rule_forward_backward_and_unbatched_inputs():
    xs, y = torch.randn(4, 3, dtype=D), torch.randn(3, dtype=D)
    torch.testing.assert_close(functx.vmap(Mul.apply, in_dims=(0, None))(xs, y), xs * y)
    torch.testing.assert_close(functx.vmap(lambda x: Cube.apply(x, 2.0))(xs), 2 * xs**3)
    # gradient w.r.t. the unbatched input: the sum over the batch of per-sample gradients
    g_y = functx.grad(lambda y: functx.vmap(Mul.apply, in_dims=(0, None))(xs, y).sum())(y)
    torch.testing.assert_close(g_y, xs.sum(0))
    g_xs, g_y = functx.grad(lambda a, b: (functx.vmap(Mul.apply, in_dims=(0, None))(a, b) ** 2).sum(), argnums=(0, 1))(xs, y)
    torch.testing.assert_close(g_xs, 2 * xs * y**2)
    torch.testing.assert_close(g_y, (2 * xs**2 * y).sum(0))
    # forward mode through the generated rule
    tangent = torch.randn_like(xs)
    _, t = functx.jvp(lambda a: functx.vmap(Mul.apply, in_dims=(0, None))(a, y), (xs,), (tangent,))
    torch.testing.assert_close(t, tangent * y)
    # plain autograd through vmap of a generated rule, against a loop
    leaf = xs.clone().requires_grad_()
    functx.vmap(lambda x: Cube.apply(x, 2.0))(leaf).sum().backward()
    torch.testing.assert_close(leaf.grad, 6 * xs**2)


def test_vmap_errors_like_torch_func():
    x = torch.randn(2, 3)
    with pytest.raises(RuntimeError, match="does not have vmap support"):
        functx.vmap(NoVmapSupport.apply)(x)
    with pytest.raises(RuntimeError, match="both generate_vmap_rule=True and an overridden vmap"):
        functx.vmap(BothVmapRules.apply)(x)
    with pytest.raises(RuntimeError, match="two returns"):
        functx.vmap(BadVmapReturn.apply)(x)
    with pytest.raises(NotImplementedError, match="kwarg-only Tensor"):
        functx.vmap(lambda v: KwargOnly.apply(v, scale=torch.tensor(2.0)))(x)
    assert functx.core.current_stack() == ()
    # unbatched use is plain torch
    torch.testing.assert_close(NoVmapSupport.apply(x), 2 * x)


def test_old_style_function_runs_per_sample_with_one_warning():
    x = torch.randn(5, 4, dtype=D) * 2
    custom_function._warned.discard(OldStyleSTE)  # the warning is once per Function and process
    with pytest.warns(functx.PerformanceWarning, match="OldStyleSTE is an old-style"):
        out = functx.vmap(OldStyleSTE.apply)(x)
    torch.testing.assert_close(out, torch.round(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error", functx.PerformanceWarning)  # only once per Function
        torch.testing.assert_close(functx.vmap(OldStyleSTE.apply, in_dims=1)(x), torch.round(x).T)
    w = torch.randn(4, dtype=D)
    expected = loop(lambda s: w * (s.abs() <= 2).to(D), x)
    got = functx.grad(lambda v: (functx.vmap(OldStyleSTE.apply)(v) * w).sum())(x)
    torch.testing.assert_close(got, expected)
