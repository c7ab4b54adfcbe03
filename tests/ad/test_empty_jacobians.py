"""jacrev / jacfwd / hessian with empty inputs or outputs (issue 12): the Jacobian of an
empty tensor is an empty block shaped `output.shape + input.shape`, as torch.func gives it.
Shapes are checked against torch.func (the oracle), values of the non-empty blocks against
torch.autograd.functional.jacobian."""

import optree
import pytest
import torch
import torch.func as tf
from torch.autograd.functional import jacobian as autograd_jacobian

import functx

D = torch.float64


def shapes(tree):
    return optree.tree_map(lambda t: tuple(t.shape), tree)


def assert_same(ours, expected):
    """Same structure, shapes and dtypes; close values (nothing to compare in empty blocks)."""
    assert optree.tree_structure(ours) == optree.tree_structure(expected)
    for a, b in zip(optree.tree_leaves(ours), optree.tree_leaves(expected)):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b)


JACOBIANS = [functx.jacrev, functx.jacfwd]
JACOBIAN_IDS = ["jacrev", "jacfwd"]
EMPTY_CASES = [  # (function, input): empty input, empty output, both
    (torch.sin, (0,)),
    (torch.sin, (0, 2)),
    (lambda x: x[:0], (3,)),
    (lambda x: x[:, :0], (2, 3)),
    (lambda x: x.sum(), (0,)),
    (lambda x: x.sin().sum(0), (0, 3)),
    (lambda x: x * 2, (0,)),
]


@pytest.mark.parametrize("jac", JACOBIANS, ids=JACOBIAN_IDS)
@pytest.mark.parametrize("f, shape", EMPTY_CASES)
@pytest.mark.parametrize("chunk_size", [None, 1, 2])
def test_empty_input_or_output(jac, f, shape, chunk_size):
    x = torch.randn(shape, dtype=D)
    ours = jac(f, chunk_size=chunk_size)(x)
    # torch.func (chunk_size=None: its jacrev asserts with chunk_size=1 on no rows)
    expected = tf.jacrev(f)(x)
    assert_same(ours, expected)
    assert ours.shape == f(x).shape + x.shape
    if ours.numel():
        torch.testing.assert_close(ours, autograd_jacobian(f, x))


@pytest.mark.parametrize("jac", JACOBIANS, ids=JACOBIAN_IDS)
@pytest.mark.parametrize("chunk_size", [None, 1, 2])
def test_argnums_tuple_with_an_empty_input(jac, chunk_size):
    f = lambda x, y: x.sin().sum() + (y**2).sum()
    x, y = torch.randn(0, dtype=D), torch.randn(2, dtype=D)
    ours = jac(f, argnums=(0, 1), chunk_size=chunk_size)(x, y)
    assert_same(ours, tf.jacrev(f, argnums=(0, 1))(x, y))
    torch.testing.assert_close(ours[1], autograd_jacobian(lambda y: f(x, y), y))


@pytest.mark.parametrize("jac", JACOBIANS, ids=JACOBIAN_IDS)
@pytest.mark.parametrize("chunk_size", [None, 1, 2])
def test_several_outputs_one_empty(jac, chunk_size):
    f = lambda x, y: (x.sin() * y.sum(), y[:0] * x.sum())
    x, y = torch.randn(3, dtype=D), torch.randn(2, dtype=D)
    ours = jac(f, argnums=(0, 1), chunk_size=chunk_size)(x, y)
    assert_same(ours, tf.jacrev(f, argnums=(0, 1))(x, y))
    assert shapes(ours) == (((3, 3), (3, 2)), ((0, 3), (0, 2)))
    expected = autograd_jacobian(lambda x, y: f(x, y)[0], (x, y))  # the non-empty output's
    torch.testing.assert_close(ours[0], expected)


@pytest.mark.parametrize("jac", JACOBIANS, ids=JACOBIAN_IDS)
@pytest.mark.parametrize("chunk_size", [None, 1, 2])
def test_empty_with_has_aux(jac, chunk_size):
    x = torch.randn(0, dtype=D)
    f = lambda x: (x.sin(), {"c": x.cos(), "n": torch.tensor(3.0, dtype=D)})
    ours, aux = jac(f, has_aux=True, chunk_size=chunk_size)(x)
    # torch.func's jacrev gives the shapes; its jacfwd has an IndexError here (aux[0] of no columns)
    expected, expected_aux = tf.jacrev(f, has_aux=True)(x)
    assert_same(ours, expected)
    assert_same(aux, f(x)[1])
    assert_same(aux, expected_aux)

    y = torch.randn(3, dtype=D)
    g = lambda x: (x[:0], x.cos())  # empty output, non-empty aux
    ours, aux = jac(g, has_aux=True, chunk_size=chunk_size)(y)
    expected, expected_aux = tf.jacrev(g, has_aux=True)(y)
    assert_same(ours, expected)
    assert_same(aux, y.cos())


@pytest.mark.parametrize("chunk_size", [None, 1, 2])
def test_hessian_of_empty_input(chunk_size):
    f = lambda x: x.sin().sum()
    x = torch.randn(0, dtype=D)
    assert_same(functx.hessian(f, chunk_size=chunk_size)(x), tf.hessian(f)(x))
    g = lambda x, y: (x**2).sum() * y.sum()
    x, y = torch.randn(0, dtype=D), torch.randn(2, dtype=D)
    ours = functx.hessian(g, argnums=(0, 1), chunk_size=chunk_size)(x, y)
    assert_same(ours, tf.hessian(g, argnums=(0, 1))(x, y))
    assert shapes(ours) == (((0, 0), (0, 2)), ((2, 0), (2, 2)))


@pytest.mark.parametrize("jac", JACOBIANS, ids=JACOBIAN_IDS)
@pytest.mark.parametrize("f, shape", EMPTY_CASES)
def test_vmap_of_empty_jacobians(jac, f, shape):
    xs = torch.randn(4, *shape, dtype=D)
    ours = functx.vmap(jac(f))(xs)
    assert_same(ours, tf.vmap(tf.jacrev(f))(xs))
    if ours.numel():
        torch.testing.assert_close(ours, torch.stack([autograd_jacobian(f, x) for x in xs]))


def test_vmap_of_jacrev_with_argnums_and_one_empty_output():
    f = lambda x, y: (x.sin() * y.sum(), y[:0] * x.sum())
    xs, y = torch.randn(4, 3, dtype=D), torch.randn(2, dtype=D)
    for jac in JACOBIANS:
        ours = functx.vmap(jac(f, argnums=(0, 1)), in_dims=(0, None))(xs, y)
        assert_same(ours, tf.vmap(tf.jacrev(f, argnums=(0, 1)), in_dims=(0, None))(xs, y))
