"""has_aux with non-tensor aux, and the AD transforms under torch.no_grad() (issue 12).

torch.func is the oracle for errors and for which results require grad; values against
torch.autograd."""

import pytest
import torch
import torch.func as tf

import functx
from functx.core import current_stack

D = torch.float64
X0 = torch.randn(3, dtype=D, generator=torch.Generator().manual_seed(1))


# -- aux holds tensors only ------------------------------------------------------------------
def aux_of(T, api, aux):
    """Call transform `api` of module T (functx or torch.func) on a function returning `aux`."""
    x = X0.clone()
    scalar = lambda x: (x.sin().sum(), aux)
    vector = lambda x: (x.sin(), aux)
    if api == "grad":
        return T.grad(scalar, has_aux=True)(x)[1]
    if api == "grad_and_value":
        return T.grad_and_value(scalar, has_aux=True)(x)[1][1]
    if api == "vjp":
        return T.vjp(vector, x, has_aux=True)[2]
    if api == "jacrev":
        return T.jacrev(vector, has_aux=True)(x)[1]
    if api == "jacfwd":
        return T.jacfwd(vector, has_aux=True)(x)[1]
    if api == "jvp":
        return T.jvp(vector, (x,), (x,), has_aux=True)[2]
    if api == "vmap(grad)":
        return T.vmap(T.grad(scalar, has_aux=True))(x[None])[1]
    raise ValueError(api)


APIS = ["grad", "grad_and_value", "vjp", "jacrev", "jacfwd", "jvp", "vmap(grad)"]
REFUSED = [None, 1, 2.5, True, "s", [None], [X0, None], (X0, {"k": 3}), {"k": None}]


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("aux", REFUSED, ids=repr)
def test_non_tensor_aux_is_refused_as_torch_func_does(api, aux):
    with pytest.raises(RuntimeError) as theirs:
        aux_of(tf, api, aux)
    with pytest.raises(RuntimeError, match="Expected tensors, got unsupported type") as ours:
        aux_of(functx, api, aux)
    assert str(ours.value).endswith(str(theirs.value))  # torch.func's words, naming the same type
    # beyond torch.func (issue 27): the transform, what aux must be, and where the leaf is
    transform = {"grad": "grad_and_value", "vmap(grad)": "grad_and_value"}.get(api, api)
    assert str(ours.value).startswith(transform)
    assert "with has_aux=True: aux must be tensors or pytrees of tensors (got " in str(ours.value)
    assert " at aux" in str(ours.value)


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize(
    "aux",
    [X0, torch.tensor(3), (X0, {"a": [X0 * 2]}), [], (), {}],
    ids=["tensor", "int tensor", "nested", "empty list", "empty tuple", "empty dict"],
)
def test_tensor_aux_is_accepted(api, aux):
    ours, theirs = aux_of(functx, api, aux), aux_of(tf, api, aux)
    assert type(ours) is type(theirs)
    torch.testing.assert_close(ours, theirs)


# -- torch.no_grad() -----------------------------------------------------------------------
def leaf():
    return X0.clone().requires_grad_()


def test_vjp_under_no_grad_called_outside():
    """The forward under no_grad is not recorded for the outside; the vjp_fn called outside
    it is: its result requires grad and differentiates like cos(x) does."""
    for T in (functx, tf):
        x = leaf()
        with torch.no_grad():
            out, vjp_fn = T.vjp(torch.sin, x)
        (g,) = vjp_fn(torch.ones(3, dtype=D))
        assert not out.requires_grad and g.requires_grad
        torch.testing.assert_close(g, X0.cos())
        torch.testing.assert_close(torch.autograd.grad(g.sum(), x)[0], -X0.sin())


def test_vjp_under_no_grad_called_inside():
    for T in (functx, tf):
        x = leaf()
        with torch.no_grad():
            out, vjp_fn = T.vjp(torch.sin, x)
            (g,) = vjp_fn(torch.ones(3, dtype=D))
        assert not out.requires_grad and not g.requires_grad
        torch.testing.assert_close(g, X0.cos())


def test_vjp_under_no_grad_forward_values_are_constants_outside():
    """Values the forward computed under no_grad are constants for the outside graph:
    for sin(x) * x the cotangent is cos(x) x + sin(x), with sin(x) a constant, so its
    derivative is cos(x) - sin(x) x (torch.func's answer too)."""
    expected = X0.cos() - X0.sin() * X0
    for T in (functx, tf):
        x = leaf()
        with torch.no_grad():
            out, vjp_fn = T.vjp(lambda v: v.sin() * v, x)
        (g,) = vjp_fn(torch.ones(3, dtype=D))
        torch.testing.assert_close(g, X0.cos() * X0 + X0.sin())
        torch.testing.assert_close(torch.autograd.grad(g.sum(), x)[0], expected)


def test_vjp_under_no_grad_closing_over_a_parameter():
    w0 = torch.randn(3, 3, dtype=D)
    results = []
    for T in (functx, tf):
        w = w0.clone().requires_grad_()
        with torch.no_grad():
            out, vjp_fn = T.vjp(lambda v: w @ v, X0)
        (g,) = vjp_fn(torch.ones(3, dtype=D))
        assert not out.requires_grad and g.requires_grad
        torch.testing.assert_close(g, w0.T @ torch.ones(3, dtype=D))
        results.append(torch.autograd.grad(g.sum(), w)[0])
    torch.testing.assert_close(results[0], results[1])
    torch.testing.assert_close(results[0], torch.ones(3, 3, dtype=D))  # d/dw sum(wᵀ 1) = 1


def test_vjp_with_aux_under_no_grad():
    for T in (functx, tf):
        x = leaf()
        with torch.no_grad():
            out, vjp_fn, aux = T.vjp(lambda v: (v.sin(), v.cos()), x, has_aux=True)
        (g,) = vjp_fn(torch.ones(3, dtype=D))
        assert not out.requires_grad and not aux.requires_grad and g.requires_grad
        torch.testing.assert_close(aux, X0.cos())


def _inner_no_grad(v):
    with torch.no_grad():
        c = v.cos()  # a constant for every level
    return c * v.sin()


SCENARIOS = {
    "grad under no_grad": lambda T: T.grad(lambda v: v.sin().sum())(leaf()),
    "grad_and_value under no_grad": lambda T: T.grad_and_value(lambda v: v.sin().sum())(leaf()),
    "jacrev under no_grad": lambda T: T.jacrev(torch.sin)(leaf()),
    "jacfwd under no_grad": lambda T: T.jacfwd(torch.sin)(leaf()),
    "hessian under no_grad": lambda T: T.hessian(lambda v: v.sin().sum())(leaf()),
    "jvp under no_grad": lambda T: T.jvp(torch.sin, (leaf(),), (torch.ones(3, dtype=D),)),
    "vmap(grad) under no_grad": lambda T: T.vmap(T.grad(lambda v: v.sin().sum()))(leaf()[None]),
}
INNER = {  # outside any no_grad, a function that uses no_grad itself
    "grad, inner no_grad": lambda T: T.grad(lambda v: _inner_no_grad(v).sum())(leaf()),
    "jacrev, inner no_grad": lambda T: T.jacrev(_inner_no_grad)(leaf()),
    "jacfwd, inner no_grad": lambda T: T.jacfwd(_inner_no_grad)(leaf()),
    "grad of a no_grad grad": lambda T: T.grad(
        lambda v: (_no_grad_call(lambda: T.grad(lambda y: (y**3).sum())(v)) * v).sum()
    )(X0),
}


def _no_grad_call(f):
    with torch.no_grad():
        return f()


def _flat(result):
    return result if isinstance(result, tuple) else (result,)


@pytest.mark.parametrize("name", list(SCENARIOS) + list(INNER))
def test_no_grad_scenarios_match_torch_func(name):
    make = SCENARIOS.get(name) or INNER[name]
    if name in SCENARIOS:
        with torch.no_grad():
            ours, theirs = _flat(make(functx)), _flat(make(tf))
    else:
        ours, theirs = _flat(make(functx)), _flat(make(tf))
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b)
        assert a.requires_grad == b.requires_grad


def test_inner_no_grad_values():
    """d/dx [c · sin x] with c = cos x a constant: c · cos x (torch.autograd on the same)."""
    x = leaf()
    expected = torch.autograd.grad((X0.cos() * x.sin()).sum(), x)[0]
    torch.testing.assert_close(functx.grad(lambda v: _inner_no_grad(v).sum())(X0), expected)
    torch.testing.assert_close(functx.jacrev(_inner_no_grad)(X0), torch.diag(expected))


# -- .backward() inside a transform (issue 27): a clear error, never torch's misleading one --


def _calls_backward(x):
    loss = (x**2).sum()
    loss.backward()
    return loss


BACKWARD_INSIDE = {
    "grad": lambda x: functx.grad(_calls_backward)(x),
    "grad_and_value": lambda x: functx.grad_and_value(_calls_backward)(x),
    "vjp": lambda x: functx.vjp(_calls_backward, x),
    "jacrev": lambda x: functx.jacrev(_calls_backward)(x),
    "hessian": lambda x: functx.hessian(_calls_backward)(x),
    "grad(grad)": lambda x: functx.grad(lambda y: functx.grad(_calls_backward)(y).sum())(x),
    "vmap(grad)": lambda x: functx.vmap(functx.grad(_calls_backward))(x.expand(2, 3)),
    "jvp": lambda x: functx.jvp(_calls_backward, (x,), (x,)),
    "jacfwd": lambda x: functx.jacfwd(_calls_backward)(x),
}


@pytest.mark.parametrize("api", sorted(BACKWARD_INSIDE))
def test_backward_inside_a_transform_says_what_to_use(api):
    x = torch.randn(3)
    outside = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"the transformed function called \.backward\(\).*torch\.autograd\.grad"):
        BACKWARD_INSIDE[api](x * outside.detach())
    assert current_stack() == ()
    assert outside.grad is None


def test_backward_outside_transforms_and_inside_vmap_alone_still_work():
    """Plain torch, and `.backward()` inside vmap on a tensor from outside (beyond torch.func):
    the sum over the batch of the per-element gradients, as a loop would accumulate."""
    xs = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(3)
    functx.vmap(lambda xi: (xi * w).pow(2).sum().backward() or xi.detach())(xs)
    torch.testing.assert_close(xs.grad, 2 * xs.detach() * w**2)
    xs.grad = None
    (xs * 2).sum().backward()
    torch.testing.assert_close(xs.grad, torch.full((4, 3), 2.0))
