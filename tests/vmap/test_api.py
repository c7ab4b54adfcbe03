"""vmap's API surface: in_dims/out_dims pytrees, nesting, chunking, kwargs, errors."""

import pytest
import torch

import functx
from functx import vmap


def loop(f, *args, in_dims=0):
    """Reference: call f per batch element and stack (in_dims: one int/None per arg)."""
    dims = in_dims if isinstance(in_dims, tuple) else (in_dims,) * len(args)
    size = next(a.size(d) for a, d in zip(args, dims) if d is not None)
    return torch.stack([f(*(a if d is None else a.select(d, i) for a, d in zip(args, dims))) for i in range(size)])


def test_unbatched_argument_and_trailing_in_dim():
    x, y = torch.randn(3, 5), torch.randn(3)
    torch.testing.assert_close(vmap(torch.mul, in_dims=(1, None))(x, y), loop(torch.mul, x, y, in_dims=(1, None)))


def test_negative_in_dim_and_out_dims():
    x = torch.randn(2, 3, 4)
    out = vmap(lambda a: a * 2, in_dims=-1, out_dims=1)(x)
    torch.testing.assert_close(out, (x * 2).movedim(-1, 0).movedim(0, 1))


def test_pytree_inputs_and_outputs():
    x, y = torch.randn(4, 3), torch.randn(3, 4)

    def f(d, pair):
        return {"sum": d["a"] + pair[0], "prod": d["a"] * pair[1]}

    out = vmap(f, in_dims=({"a": 0}, (None, 1)), out_dims={"sum": 0, "prod": 1})({"a": x}, (y[:, 0], y))
    torch.testing.assert_close(out["sum"], x + y[:, 0])
    torch.testing.assert_close(out["prod"], (x * y.T).T)


def test_kwargs_are_not_batched():
    x = torch.randn(4, 3)
    out = vmap(lambda a, *, scale: a * scale)(x, scale=torch.tensor(2.0))
    torch.testing.assert_close(out, x * 2)


@pytest.mark.parametrize("depth", [2, 3])
def test_nested_vmap_any_depth(depth):
    x = torch.randn(*([2] * depth), 3)
    f = torch.sin
    for _ in range(depth):
        f = vmap(f)
    torch.testing.assert_close(f(x), torch.sin(x))


def test_nested_vmap_mixed_in_dims():
    x, y = torch.randn(4, 3), torch.randn(5, 4, 3)
    f = vmap(vmap(lambda a, b: a * b, in_dims=(None, 0)), in_dims=(0, 1))
    torch.testing.assert_close(f(x, y), x[:, None, :] * y.transpose(0, 1))


def test_unbatched_output_is_broadcast():
    x, w = torch.randn(4, 3), torch.randn(2)
    out = vmap(lambda a: w * 3)(x)
    torch.testing.assert_close(out, (w * 3).expand(4, 2))


def test_out_dims_none_for_unbatched_output():
    x, w = torch.randn(4, 3), torch.randn(2)
    out, same = vmap(lambda a: (a.sum(), w), out_dims=(0, None))(x)
    assert same is w
    torch.testing.assert_close(out, x.sum(1))


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 10])
def test_chunk_size_matches_unchunked(chunk_size):
    x, y = torch.randn(7, 3), torch.randn(3, 7)
    f = vmap(lambda a, b: (a * b).sum(), in_dims=(0, 1), chunk_size=chunk_size)
    torch.testing.assert_close(f(x, y), (x * y.T).sum(1))


def test_chunks_see_same_randomness():
    x = torch.zeros(6, 3)
    out = vmap(lambda a: a + torch.randn(3), randomness="same", chunk_size=2)(x)
    torch.testing.assert_close(out, out[0].expand(6, 3))


def test_function_name_and_docs_are_kept():
    def my_function(x):
        """doc"""
        return x

    assert vmap(my_function).__name__ == "my_function"
    assert vmap(my_function).__doc__ == "doc"


def test_plain_autograd_flows_through_vmap():
    x = torch.randn(4, 3, requires_grad=True)
    vmap(lambda a: (a.sin() * a).sum())(x).sum().backward()
    torch.testing.assert_close(x.grad, x.detach().cos() * x.detach() + x.detach().sin())


# -- errors, as torch.func words them -----------------------------------------------
@pytest.mark.parametrize(
    "call, match",
    [
        (lambda x: vmap(torch.sin, in_dims=[0])(x), "expected `in_dims` to be int or a"),
        (lambda x: vmap(torch.sin, in_dims="0")(x), "expected `in_dims` to be int or a"),
        (lambda x: vmap(torch.add, in_dims=(0, 0, 0))(x, x), "in_dims is not compatible with the structure"),
        (lambda x: vmap(torch.add, in_dims=((0,), 0))(x, x), "in_dims is not compatible with the structure"),
        (lambda x: vmap(torch.sin, in_dims=2)(x), r"so expected in_dim to satisfy -2 <= in_dim < 2"),
        (lambda x: vmap(torch.sin, in_dims=(1.5,))(x), "in_dim must be either an integer dimension or None"),
        (lambda x: vmap(lambda a, n: a, in_dims=(0, 0))(x, 3), "We cannot vmap over non-Tensor arguments"),
        (lambda x: vmap(torch.sin, in_dims=(None,))(x), "at least one input must be a Tensor"),
        (lambda x: vmap(torch.sin)(), "got no inputs"),
        (lambda x: vmap(lambda a: 1)(x), "must only return Tensors, got type <class 'int'>"),
        (lambda x: vmap(torch.sin, out_dims=None)(x), "can not return a BatchedTensor when out_dim is None"),
        (lambda x: vmap(lambda a: (a, a), out_dims=(0, 0, 0))(x), "out_dims is not compatible with the structure"),
        (lambda x: vmap(torch.sin, out_dims="x")(x), "`out_dims` must be an int, None or a python collection"),
        (lambda x: vmap(torch.sin, chunk_size=0)(x), "chunk_size should be None or greater than 0"),
    ],
)
def test_bad_arguments_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call(torch.randn(4, 3))


@pytest.mark.parametrize(
    "call, shown",
    [
        (
            lambda x: vmap(torch.add, in_dims=(0, 0, 0))(x, x),
            "in_dims=(0, 0, 0) against the inputs (Tensor(4, 3), Tensor(4, 3)) (3 entries for 2 inputs)",
        ),
        (
            lambda x: vmap(lambda p, y: p["w"] * y, in_dims=({"v": 0}, 0))({"w": x}, x),
            "in_dims=({'v': 0}, 0) against the inputs ({'w': Tensor(4, 3)}, Tensor(4, 3))",
        ),
        (
            lambda x: vmap(lambda a: (a, a), out_dims=(0, 0, 0))(x),
            "out_dims=(0, 0, 0) against the outputs (Tensor(3), Tensor(3)) (3 entries for 2 outputs)",
        ),
        (
            lambda x: vmap(lambda a: {"u": a}, out_dims={"v": 0})(x),
            "out_dims={'v': 0} against the outputs {'u': Tensor(3)}",
        ),
    ],
)
def test_structure_mismatches_show_the_users_structures(call, shown):
    """Issue 27: the user's in_dims / out_dims and the inputs / outputs (per-sample shapes for
    outputs), written as Python, not optree's PyTreeSpec; torch.func's first sentence kept."""
    with pytest.raises(ValueError, match="is not compatible with the structure of") as info:
        call(torch.randn(4, 3))
    assert shown in str(info.value)
    assert "PyTreeSpec" not in str(info.value)


def test_mismatched_batch_sizes_name_sizes_and_arguments():
    with pytest.raises(ValueError, match=r"got sizes \[4, 5\].*args\[0\] has size 4, args\[1\] has size 5"):
        vmap(torch.add)(torch.randn(4, 3), torch.randn(5, 3))


def test_out_dim_out_of_range():
    with pytest.raises(IndexError, match="out_dim 3 is out of range"):
        vmap(torch.sin, out_dims=3)(torch.randn(4, 3))


def test_bad_randomness_is_a_runtime_error():
    with pytest.raises(RuntimeError, match="Only allowed values for randomness"):
        vmap(torch.sin, randomness="sometimes")


def test_stack_is_restored_after_an_exception_inside_vmap():
    def boom(a):
        raise KeyError("user error")

    with pytest.raises(KeyError):
        vmap(boom)(torch.randn(2))
    assert functx.core.current_stack() == ()
    with pytest.raises(KeyError):
        vmap(vmap(boom))(torch.randn(2, 2))
    assert functx.core.current_stack() == ()
