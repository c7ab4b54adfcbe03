"""Every model of the zoo under per-sample gradients, a Jacobian-vector product, a
Hessian-vector product (forward-over-reverse) and ensembling, against plain torch.autograd
on a copy of the model run as its reference program (Python control flow, no checkpointing),
in float64 (issue 30's measure: 100% correct).

- per-sample gradients: `vmap(grad(loss))` against a loop of `torch.autograd.grad`, one
  sample at a time;
- JVP with respect to the weights: `functx.jvp` (forward mode) against the double-backward
  identity J v = d/du <Jᵀu, v> (reverse mode only);
- HVP: `jvp(grad(loss))` against `autograd.grad` of <∇loss, v> with `create_graph`;
- ensembling: `vmap` over `stack_module_state` of three models against each model's call.
"""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel

import functx
from tests.zoo.models import NAMES, as_reference, make

TOLERANCE = dict(rtol=1e-7, atol=1e-9)


def _state(module):
    return {k: v.detach() for k, v in module.named_parameters()}, {k: v for k, v in module.named_buffers()}


class _Reference(torch.nn.Module):
    """A copy of a module running its reference program, attention by torch's math backend
    (plain torch ops: the fused CPU kernel has no double backward)."""

    def __init__(self, module):
        super().__init__()
        self.module = as_reference(copy.deepcopy(module))

    def forward(self, x):
        with sdpa_kernel([SDPBackend.MATH]):
            return self.module(x)


def _reference(module):
    """The reference of `module` and its parameters (leaves that require grad)."""
    reference = _Reference(module)
    return reference, [p for p in reference.parameters()]


def _grad(output, inputs, *args, **kwargs):
    """torch.autograd.grad, with zeros for inputs the output does not use (a branch not taken)."""
    return torch.autograd.grad(output, inputs, *args, allow_unused=True, materialize_grads=True, **kwargs)


def _directions(params):
    g = torch.Generator().manual_seed(1)
    return {k: torch.randn(p.shape, dtype=p.dtype, generator=g) for k, p in params.items()}


def _assert_trees_close(actual, expected, what):
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], **TOLERANCE, msg=lambda m: f"{what}, {key}: {m}")


@pytest.fixture(autouse=True)
def _expected_fallbacks():
    """The zoo's per-sample loops warn once (functx.PerformanceWarning); that is the point."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", functx.PerformanceWarning)
        yield


@pytest.mark.parametrize("name", NAMES)
def test_per_sample_gradients(name):
    _check_per_sample_gradients(name, lambda f: f)


# the models that take a path of their own through the trace (a checkpoint, the per-sample
# loop, a control-flow operator, an autograd.Function, a recurrent layer); the rest: -m slow
_JIT_IN_CI = ["gpt2_checkpoint", "gpt2_functx_checkpoint", "data_dependent_if", "mamba_scan", "neural_ode_while", "moe_topk", "lstm_lm", "old_style_function"]


@pytest.mark.parametrize("name", [n if n in _JIT_IN_CI else pytest.param(n, marks=pytest.mark.slow) for n in NAMES])
def test_per_sample_gradients_jitted(name):
    """functx.jit of the per-sample gradients: traced once, replayed on a second batch (or run
    eagerly where torch.compile refuses the program, with a warning): the loop's values."""
    _check_per_sample_gradients(name, functx.jit, calls=2)


def _check_per_sample_gradients(name, wrap, calls=1):
    model = make(name)
    params, buffers = _state(model.module)

    def loss(params, x, y):
        out = functx.functional_call(model.module, (params, buffers), (x.unsqueeze(0),))
        return model.loss(out, y.unsqueeze(0))

    per_sample_grads = wrap(functx.vmap(functx.grad(loss), in_dims=(None, 0, 0)))
    for _ in range(calls):  # the last batch is checked (a jit's replay)
        x, y = model.batch(3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the eager fallback's warning
            actual = per_sample_grads(params, x, y)

    reference, leaves = _reference(model.module)
    per_sample = [_grad(model.loss(reference(x[i : i + 1]), y[i : i + 1]), leaves) for i in range(len(x))]
    expected = {key: torch.stack([grads[j] for grads in per_sample]) for j, key in enumerate(params)}
    _assert_trees_close(actual, expected, f"{name}: per-sample gradients")


@pytest.mark.parametrize("name", NAMES)
def test_jvp_in_the_weights(name):
    model = make(name)
    x, _ = model.batch(3)
    params, buffers = _state(model.module)
    tangents = _directions(params)

    out, actual = functx.jvp(lambda p: functx.functional_call(model.module, (p, buffers), (x,)), (params,), (tangents,))

    reference, leaves = _reference(model.module)
    expected_out = reference(x)
    u = torch.zeros_like(expected_out, requires_grad=True)
    vjp = _grad(expected_out, leaves, u, create_graph=True)
    (expected,) = torch.autograd.grad(vjp, u, list(tangents.values()))
    torch.testing.assert_close(out, expected_out.detach(), **TOLERANCE)
    torch.testing.assert_close(actual, expected, **TOLERANCE, msg=lambda m: f"{name}: JVP: {m}")


@pytest.mark.parametrize("name", NAMES)
def test_hessian_vector_product(name):
    model = make(name)
    x, y = model.batch(3)
    params, buffers = _state(model.module)
    tangents = _directions(params)

    def loss(p):
        return model.loss(functx.functional_call(model.module, (p, buffers), (x,)), y)

    _, actual = functx.jvp(functx.grad(loss), (params,), (tangents,))

    reference, leaves = _reference(model.module)
    gradient = _grad(model.loss(reference(x), y), leaves, create_graph=True)
    inner = sum((g * v).sum() for g, v in zip(gradient, tangents.values()))
    expected = dict(zip(params, _grad(inner, leaves)))
    _assert_trees_close(actual, expected, f"{name}: HVP")


@pytest.mark.parametrize("name", NAMES)
def test_ensembling(name):
    members = [make(name) for _ in range(3)]  # different weights: the seed moves on
    x, _ = members[0].batch(2)
    params, buffers = functx.stack_module_state([m.module for m in members])
    base = members[0].module

    actual = functx.vmap(lambda p, b: functx.functional_call(base, (p, b), (x,)), in_dims=(0, 0))(params, buffers)

    expected = torch.stack([_Reference(m.module)(x) for m in members]).detach()
    torch.testing.assert_close(actual, expected, **TOLERANCE, msg=lambda m: f"{name}: ensemble: {m}")


@pytest.mark.parametrize("name", NAMES)
def test_vectorizes_as_documented(name):
    """Per-sample gradients run every op batched (`functx.explain`), except in the models
    that say why not (Python control flow on values, data-dependent shapes)."""
    model = make(name)
    x, y = model.batch(2)
    params, buffers = _state(model.module)

    def loss(params, x, y):
        return model.loss(functx.functional_call(model.module, (params, buffers), (x.unsqueeze(0),)), y.unsqueeze(0))

    explained = functx.explain(functx.vmap(functx.grad(loss), in_dims=(None, 0, 0)))(params, x, y)
    assert explained.vectorized == (model.fallback is None), str(explained)


# -- random transforms over random models ------------------------------------------------

FLOAT_INPUT = [name for name in NAMES if make(name).batch(1)[0].is_floating_point()]
TRANSFORMS = ["grad_of_vmap", "vjp", "input_grad", "vmap_jvp_input", "vmap_jacfwd_input", "vmap_hvp_input", "vmap_hessian_input"]


def _per_sample_reference(model, x, y, compute):
    """`compute(reference, x_i, y_i)` for each sample, stacked (leaf by leaf for tuples)."""
    reference, _ = _reference(model.module)
    rows = [compute(reference, x[i : i + 1], y[i : i + 1]) for i in range(len(x))]
    return torch.stack(rows)


@settings(max_examples=int(os.environ.get("FUNCTX_FUZZ_EXAMPLES", 25)), deadline=None)
@given(
    name=st.sampled_from(NAMES),
    transform=st.sampled_from(TRANSFORMS),
    n=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_random_transforms_of_random_models(name, transform, n, seed):
    """A model and a transform drawn at random (input-side transforms for models whose input
    is not tokens), against plain autograd on the reference program: reverse-over-reverse
    for second order, the double-backward identity for forward mode."""
    if transform not in ("grad_of_vmap", "vjp"):
        assume(name in FLOAT_INPUT)
    torch.manual_seed(seed)
    model = make(name)
    x, y = model.batch(n)
    params, buffers = _state(model.module)
    g = torch.Generator().manual_seed(seed)

    def sample_out(p, x):
        return functx.functional_call(model.module, (p, buffers), (x.unsqueeze(0),)).squeeze(0)

    def sample_loss(p, x, y):
        return model.loss(functx.functional_call(model.module, (p, buffers), (x.unsqueeze(0),)), y.unsqueeze(0))

    if transform == "grad_of_vmap":  # the gradient of a sum of per-sample losses
        actual = functx.grad(lambda p: functx.vmap(sample_loss, in_dims=(None, 0, 0))(p, x, y).sum())(params)
        reference, leaves = _reference(model.module)
        total = sum(model.loss(reference(x[i : i + 1]), y[i : i + 1]) for i in range(n))
        _assert_trees_close(actual, dict(zip(params, _grad(total, leaves))), f"{name}: grad(vmap)")
        return
    if transform == "vjp":  # the pullback of a random cotangent of the batch's output
        out, pullback = functx.vjp(lambda p: functx.functional_call(model.module, (p, buffers), (x,)), params)
        cotangent = torch.randn(out.shape, dtype=out.dtype, generator=g)
        (actual,) = pullback(cotangent)
        reference, leaves = _reference(model.module)
        expected = dict(zip(params, _grad(reference(x), leaves, cotangent)))
        _assert_trees_close(actual, expected, f"{name}: vjp")
        return
    direction = torch.randn(x.shape, dtype=x.dtype, generator=g)
    if transform == "input_grad":  # saliency: per-sample gradients in the input
        actual = functx.vmap(functx.grad(sample_loss, argnums=1), in_dims=(None, 0, 0))(params, x, y)

        def compute(reference, xi, yi):
            xi = xi.clone().requires_grad_()
            return _grad(model.loss(reference(xi), yi), xi)[0][0]

    elif transform == "vmap_jvp_input":
        _, actual = functx.vmap(lambda x, v: functx.jvp(lambda x: sample_out(params, x), (x,), (v,)))(x, direction)
        rows = iter(direction)

        def compute(reference, xi, yi):
            xi = xi.clone().requires_grad_()
            out = reference(xi)
            u = torch.zeros_like(out, requires_grad=True)
            (vjp,) = _grad(out, xi, u, create_graph=True)
            return _grad(vjp, u, next(rows).unsqueeze(0))[0][0]

    elif transform == "vmap_jacfwd_input":
        actual = functx.vmap(functx.jacfwd(lambda x: sample_out(params, x)))(x)

        def compute(reference, xi, yi):
            with sdpa_kernel([SDPBackend.MATH]):
                return torch.autograd.functional.jacobian(lambda u: reference.module(u.unsqueeze(0)).squeeze(0), xi[0])

    elif transform == "vmap_hessian_input":  # jacfwd(jacrev) in the input, per sample
        actual = functx.vmap(functx.hessian(sample_loss, argnums=1), in_dims=(None, 0, 0))(params, x, y)

        def compute(reference, xi, yi):
            with sdpa_kernel([SDPBackend.MATH]):
                return torch.autograd.functional.hessian(lambda u: model.loss(reference.module(u.unsqueeze(0)), yi), xi[0])

    else:  # vmap_hvp_input: forward-over-reverse in the input, per sample
        _, actual = functx.vmap(
            lambda x, y, v: functx.jvp(lambda x: functx.grad(sample_loss, argnums=1)(params, x, y), (x,), (v,))
        )(x, y, direction)
        rows = iter(direction)

        def compute(reference, xi, yi):
            xi = xi.clone().requires_grad_()
            (gradient,) = _grad(model.loss(reference(xi), yi), xi, create_graph=True)
            return _grad((gradient * next(rows).unsqueeze(0)).sum(), xi)[0][0]

    expected = _per_sample_reference(model, x, y, compute)
    torch.testing.assert_close(actual, expected, **TOLERANCE, msg=lambda m: f"{name}: {transform}: {m}")
