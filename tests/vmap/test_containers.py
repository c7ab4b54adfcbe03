"""vmap over containers that carry a batch size (functx/core/containers.py), with a user's
own registered type: in_dims / out_dims address a dim of the container's batch shape, never
its leaves' own dims. Reference: the function looped over the container's slices along the
mapped dim (float64), results stacked at out_dims.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functx
from functx.core.containers import forget

D = torch.float64


class Batch:
    """A dict of tensors whose leading dims are `shape` (its batch shape)."""

    def __init__(self, data, shape):
        self.data, self.shape = dict(data), torch.Size(shape)
        for k, v in self.data.items():
            assert v.shape[: len(self.shape)] == self.shape, (k, v.shape, self.shape)

    def select(self, dim, i):
        """One element along batch dim `dim` (the loop's slice)."""
        return Batch({k: v.select(dim, i) for k, v in self.data.items()}, self.shape[:dim] + self.shape[dim + 1 :])

    def split(self, size, dim):
        n = self.shape[dim]
        return [
            Batch({k: v.narrow(dim, s, min(size, n - s)) for k, v in self.data.items()},
                  self.shape[:dim] + (min(size, n - s),) + self.shape[dim + 1 :])
            for s in range(0, n, size)
        ]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.cat:  # vmap's chunks joined
            parts, dim = args[0], kwargs.get("dim", args[1] if len(args) > 1 else 0)
            dim %= len(parts[0].shape)
            shape = list(parts[0].shape)
            shape[dim] = sum(p.shape[dim] for p in parts)
            return Batch({k: torch.cat([p.data[k] for p in parts], dim) for k in parts[0].data}, shape)
        return NotImplemented


@pytest.fixture(autouse=True, scope="module")
def _batch_registered():
    kind = functx.register_batched_container(
        Batch,
        batch_shape=lambda b: b.shape,
        add_batch_dim=lambda b, dim, m: Batch({k: m.batch(v, dim) for k, v in b.data.items()}, b.shape[:dim] + b.shape[dim + 1 :]),
        remove_batch_dim=lambda b, dim, m: Batch(
            {k: m.unbatch(v, dim) for k, v in b.data.items()}, b.shape[:dim] + (m.size,) + b.shape[dim:]
        ),
    )
    yield
    forget(kind)


def _stack(batches, dim):
    first = batches[0]
    return Batch({k: torch.stack([b.data[k] for b in batches], dim) for k in first.data}, first.shape[:dim] + (len(batches),) + first.shape[dim:])


def _loop(f, b, in_dim, out_dim):
    in_dim %= len(b.shape)
    outs = [f(b.select(in_dim, i)) for i in range(b.shape[in_dim])]
    out_dim %= len(outs[0].shape) + 1
    return _stack(outs, out_dim)


def _assert_same(actual, expected):
    assert isinstance(actual, Batch)
    assert actual.shape == expected.shape
    assert actual.data.keys() == expected.data.keys()
    for k in expected.data:
        torch.testing.assert_close(actual.data[k], expected.data[k])


def _f(b):
    """Per element: each leaf's own features reduced or kept, mixed with another leaf."""
    x, y = b.data["x"], b.data["y"]
    z = x.sin() * 2 + y.sum(-1, keepdim=True).unsqueeze(-1)
    return Batch({"z": z, "w": y.exp()}, b.shape)


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 3), min_size=1, max_size=3),
    features=st.integers(1, 3),
    data=st.data(),
    chunk=st.sampled_from([None, 1, 2]),
)
def test_vmap_maps_over_a_dim_of_the_batch_shape(shape, features, data, chunk):
    rank = len(shape)
    in_dim = data.draw(st.integers(-rank, rank - 1), label="in_dim")
    out_dim = data.draw(st.integers(-rank, rank - 1), label="out_dim")  # outside: rank dims
    b = Batch({"x": torch.randn(*shape, features, 2, dtype=D), "y": torch.randn(*shape, features, dtype=D)}, shape)
    out = functx.vmap(_f, in_dims=in_dim, out_dims=out_dim, chunk_size=chunk)(b)
    _assert_same(out, _loop(_f, b, in_dim, out_dim))


def test_containers_mix_with_tensors_and_prefixes():
    b = Batch({"x": torch.randn(4, 3, 2, dtype=D)}, (4, 3))
    t = torch.randn(3, 4, dtype=D)

    def f(pair, t):
        b, scale = pair
        return Batch({"x": b.data["x"] * t[:, None]}, b.shape), t.sum()

    out, total = functx.vmap(f, in_dims=((0, None), 1), out_dims=(1, 0))(((b, 2.0)), t)
    expected = _stack([Batch({"x": b.data["x"][i] * t[:, i][:, None]}, (3,)) for i in range(4)], 1)
    _assert_same(out, expected)
    torch.testing.assert_close(total, t.sum(0))


def test_a_container_not_mapped_goes_in_whole():
    b = Batch({"x": torch.randn(2, 3, dtype=D)}, (2,))
    out = functx.vmap(lambda x, b: x + b.data["x"].sum(), in_dims=(0, None))(torch.arange(5.0, dtype=D), b)
    torch.testing.assert_close(out, torch.arange(5.0, dtype=D) + b.data["x"].sum())


def test_per_sample_gradients_of_a_container_batch():
    """grad inside vmap w.r.t. a tensor, the data arriving as a container, against a loop of
    torch.autograd.grad per element."""
    b = Batch({"x": torch.randn(5, 3, dtype=D), "y": torch.randn(5, dtype=D)}, (5,))
    w = torch.randn(3, dtype=D)
    loss = lambda w, b: ((b.data["x"] @ w - b.data["y"]) ** 2).sum()
    out = functx.vmap(functx.grad(loss), in_dims=(None, 0))(w, b)
    expected = []
    for i in range(5):
        wi = w.clone().requires_grad_()
        expected.append(torch.autograd.grad(loss(wi, b.select(0, i)), wi)[0])
    torch.testing.assert_close(out, torch.stack(expected))


# -- bad input: what is wrong and how to fix it ---------------------------------------------
def test_an_in_dim_outside_the_batch_shape_is_refused_naming_it():
    b = Batch({"x": torch.randn(2, 3, 4)}, (2,))  # leaves have 3 dims, the batch shape 1
    with pytest.raises(ValueError, match=r"in_dim=1 for args\[0\], a Batch with batch size \[2\]"):
        functx.vmap(lambda b: b.data["x"], in_dims=1)(b)
    with pytest.raises(ValueError, match="no batch dims"):
        functx.vmap(lambda b: b.data["x"])(Batch({"x": torch.randn(2)}, ()))


def test_mismatched_sizes_across_containers_are_refused():
    a, b = Batch({"x": torch.randn(2, 3)}, (2,)), Batch({"x": torch.randn(3, 3)}, (3,))
    with pytest.raises(ValueError, match="same size in the mapped dimension"):
        functx.vmap(lambda a, b: a.data["x"] + b.data["x"])(a, b)


def test_an_out_dim_outside_the_batch_shape_is_refused():
    b = Batch({"x": torch.randn(2, 3, 4)}, (2, 3))
    with pytest.raises(IndexError, match="out_dim 2 is out of range for a Batch"):
        functx.vmap(lambda b: b, out_dims=2)(b)


def test_registration_checks_its_arguments():
    with pytest.raises(TypeError, match="must be callable"):
        functx.register_batched_container(Batch, batch_shape=None, add_batch_dim=len, remove_batch_dim=len)
    with pytest.raises(TypeError, match="a class, a tuple of classes or a predicate"):
        functx.register_batched_container(3, batch_shape=len, add_batch_dim=len, remove_batch_dim=len)
