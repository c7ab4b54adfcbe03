"""Tensor semantics user code can observe inside transforms, as torch.func shows them:
`tolist`/`item` on grad-level tensors, `contiguous()` and transposes keeping identity and
layout, `cat` keeping `requires_grad`, `new_empty_strided` keeping the strides asked for,
`requires_grad` of inputs, results and fresh tensors. Each observation is recorded inside
the transform, for functx and torch.func (the oracle) alike, and compared."""

from __future__ import annotations

import pytest
import torch
import torch.func

import functx


def _observe(lib, transform, probe, x):
    seen = []

    def f(t):
        seen.append(probe(t))
        return t.sum()

    if transform == "grad":
        lib.grad(f)(x)
    elif transform == "vjp":
        lib.vjp(f, x)
    elif transform == "jvp":
        lib.jvp(f, (x,), (torch.ones_like(x),))
    elif transform == "vmap_grad":
        lib.vmap(lib.grad(f))(x.expand(2, *x.shape).clone())
    elif transform == "grad_grad":
        lib.grad(lib.grad(f))(x) if x.dim() == 0 else lib.grad(lambda t: lib.grad(f)(t).sum())(x)
    return seen


PROBES = {
    "tolist": lambda t: t.tolist(),
    "item of an element": lambda t: round(t[0, 0].item(), 5),
    "contiguous is identity": lambda t: t.contiguous() is t,
    "t().t() strides": lambda t: (t.t().stride(), t.t().t().stride(), t.t().is_contiguous()),
    "contiguous of a transpose": lambda t: (t.t().contiguous().is_contiguous(), t.t().contiguous().stride()),
    "cat requires_grad": lambda t: (torch.cat([t, torch.ones(1, 3)]).requires_grad, torch.cat([torch.ones(1), torch.ones(2)]).requires_grad),
    "requires_grad": lambda t: (t.requires_grad, (t * 2).requires_grad, torch.ones(2).requires_grad, t.detach().requires_grad),
    "new_empty_strided": lambda t: t.new_empty_strided((2, 3), (1, 2)).stride(),
}


# a batched tensor has no single Python value: tolist/item under vmap raise in both
# libraries (test_tolist_under_vmap_is_refused_like_torch_func)
_CASES = [
    (transform, probe)
    for transform in ("grad", "vjp", "jvp", "vmap_grad", "grad_grad")
    for probe in PROBES
    if not (transform == "vmap_grad" and probe in ("tolist", "item of an element"))
]


@pytest.mark.parametrize("transform, probe", _CASES, ids=[f"{p}-{t}" for t, p in _CASES])
def test_observations_inside_transforms_match_torch_func(transform, probe):
    x = torch.arange(6.0).view(2, 3) / 7
    expected = _observe(torch.func, transform, PROBES[probe], x)
    actual = _observe(functx, transform, PROBES[probe], x)
    assert actual == expected


@pytest.mark.filterwarnings("ignore::functx.PerformanceWarning")
def test_tolist_under_vmap():
    """torch.func refuses; functx runs the function per sample (tests/vmap/test_per_sample_fallback.py),
    or refuses as torch.func with the fallback mode "error"."""
    with pytest.raises(RuntimeError):
        torch.func.vmap(lambda t: (t.tolist(), t)[1])(torch.ones(2, 3))
    x = torch.randn(2, 3)
    torch.testing.assert_close(functx.vmap(lambda t: t * len(t.tolist()))(x), x * 3)
    with functx.vmap_fallback("error"), pytest.raises(RuntimeError, match="tolist"):
        functx.vmap(lambda t: (t.tolist(), t)[1])(torch.ones(2, 3))


CONJ_PROBES = {
    "conj": lambda t: t.conj().is_conj(),
    "conj of conj": lambda t: t.conj().conj().is_conj(),
    "resolved": lambda t: t.conj().resolve_conj().is_conj(),
    "input": lambda t: t.is_conj(),
}


@pytest.mark.parametrize("transform", ["vmap", "grad", "vjp", "jvp", "vmap_grad"])
@pytest.mark.parametrize("probe", list(CONJ_PROBES), ids=list(CONJ_PROBES))
def test_conj_bit_as_torch_func_reports_it(transform, probe):
    x = torch.randn(2, 3, dtype=torch.complex128)

    def observe(lib):
        seen = []

        def f(t):
            seen.append(CONJ_PROBES[probe](t))
            return (t.conj() * t).real.sum() if transform != "vmap" else t

        if transform == "vmap":
            lib.vmap(f)(x)
        elif transform == "grad":
            lib.grad(f)(x)
        elif transform == "vjp":
            lib.vjp(f, x)
        elif transform == "jvp":
            lib.jvp(f, (x,), (torch.ones_like(x),))
        else:
            lib.vmap(lib.grad(f))(x)
        return seen

    assert observe(functx) == observe(torch.func)


@pytest.mark.parametrize(
    "f",
    [
        lambda a, b: a.conj() * b,
        lambda a, b: a.conj().resolve_conj() + b,
        lambda a, b: torch.dot(a.conj(), b),
        lambda a, b: a.conj()[1:] * b[:-1],
        lambda a, b: b.clone().copy_(a.conj()),
        lambda a, b: torch.cat([a.conj(), b.conj().conj()]),
    ],
)
def test_conj_values_under_vmap_and_grad(f):
    """The reported bit must not change any value: vmap against a loop; grad of a real loss
    against plain torch.autograd."""
    a, b = torch.randn(4, 3, dtype=torch.complex128), torch.randn(4, 3, dtype=torch.complex128)
    torch.testing.assert_close(functx.vmap(f)(a, b), torch.stack([f(x, y) for x, y in zip(a, b)]))
    loss = lambda x, y: f(x, y).abs().sum()
    a0 = a[0].clone().requires_grad_()
    (expected,) = torch.autograd.grad(loss(a0, b[0]), a0)
    torch.testing.assert_close(functx.grad(loss)(a[0], b[0]), expected)
