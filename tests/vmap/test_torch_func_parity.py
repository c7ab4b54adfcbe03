"""Places where functx answered differently from torch.func / plain PyTorch, tried as a
user would: each compared with plain torch (per-sample loops, torch.autograd) and, where
its semantics are the ones functx promises, torch.func."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import functx
from functx.core import current_stack


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_jacrev_of_gelu(approximate, dtype):
    """float32 gelu_backward on the CPU fails on broadcasting operands (oneDNN), which a
    batched cotangent against an unbatched input gave it."""
    f = lambda t: F.gelu(t, approximate=approximate)
    x = torch.randn(5, dtype=dtype)
    expected = torch.autograd.functional.jacobian(f, x)
    torch.testing.assert_close(functx.jacrev(f)(x), expected)
    torch.testing.assert_close(functx.jacfwd(f)(x), expected)
    xs = torch.randn(3, 4, dtype=dtype)
    torch.testing.assert_close(
        functx.vmap(functx.jacrev(f))(xs), torch.stack([torch.autograd.functional.jacobian(f, r) for r in xs])
    )
    g = lambda t: f(t).sum()
    torch.testing.assert_close(
        functx.hessian(g)(x.double()), torch.autograd.functional.hessian(g, x.double()), atol=1e-10, rtol=1e-7
    )


@pytest.mark.filterwarnings("ignore::functx.PerformanceWarning")
def test_nested_tensor_errors_leave_the_stack_clean():
    """Nested inputs run once per sample (tests/vmap/test_nested.py); an error in the third
    sample's call, or a refused in_dim, leaves no level behind."""
    nt = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3), torch.randn(1, 3)], layout=torch.jagged)
    with pytest.raises(RuntimeError, match="Nested tensors can only be vmapped over dim=0"):
        functx.vmap(torch.sin, in_dims=1)(nt)
    assert current_stack() == ()

    def f(x):
        if x.shape[0] == 1:
            raise KeyError("third")
        return x

    with pytest.raises(KeyError, match="third"):
        functx.vmap(f)(nt)
    assert current_stack() == ()
    torch.testing.assert_close(functx.vmap(torch.sin)(torch.ones(2)), torch.ones(2).sin())


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_none_outputs_are_leaves_with_their_own_out_dim(chunk_size):
    """torch.func flattens outputs with None as a leaf: `out_dims=(None, 0)` for `(None, v)`."""
    x = torch.randn(3)
    out = functx.vmap(lambda v: (None, v * 2), out_dims=(None, 0), chunk_size=chunk_size)(x)
    assert out[0] is None
    torch.testing.assert_close(out[1], x * 2)
    for out_dims in (0, (0, 0)):
        with pytest.raises(ValueError, match="must only return Tensors"):
            functx.vmap(lambda v: (None, v), out_dims=out_dims, chunk_size=chunk_size)(x)
    assert current_stack() == ()
