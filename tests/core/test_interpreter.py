"""The interpreter stack: unique levels, per-thread stacks, restoration, escaped values."""

import threading

import pytest
import torch

import functx
from functx import vmap
from functx.core.errors import DeadLevelError
from functx.core import current_stack, interpreting
from functx.core.interpreter import Interpreter


def test_levels_are_unique_and_never_reused():
    seen = set()
    for _ in range(5):
        with interpreting(Interpreter()) as interp:
            assert interp.level not in seen
            seen.add(interp.level)
        assert not interp.alive


def test_stack_is_restored_after_exception_in_nested_levels():
    with pytest.raises(ValueError):
        with interpreting(Interpreter()):
            with interpreting(Interpreter()):
                raise ValueError
    assert current_stack() == ()


def test_stack_seen_inside_vmap_is_one_level_per_vmap():
    depths = []

    def f(x):
        depths.append(len(current_stack()))
        return x

    vmap(vmap(f))(torch.randn(2, 2))
    assert depths == [2]


def test_threads_do_not_see_each_others_levels():
    barrier = threading.Barrier(2)
    seen = {}

    def worker(name):
        def f(x):
            barrier.wait(timeout=10)  # both threads are inside their vmap now
            seen[name] = current_stack()
            barrier.wait(timeout=10)
            return x * 2

        out = vmap(f)(torch.arange(3.0))
        seen[name + "_out"] = out

    threads = [threading.Thread(target=worker, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen["a"]) == 1 and len(seen["b"]) == 1
    assert seen["a"][0] is not seen["b"][0]
    torch.testing.assert_close(seen["a_out"], torch.arange(3.0) * 2)


def test_escaped_batched_tensor_is_refused_with_a_clear_error():
    """Its shape says one sample, its value holds the batch: any op on it would give a
    result that disagrees with its metadata, so vmap names the mistake (torch.func too)."""
    leaked = []

    def f(x):
        leaked.append(x * 2)
        return x

    vmap(f)(torch.arange(6.0).view(3, 2))
    escaped = leaked[0]
    assert escaped.shape == (2,)
    for use in (lambda e: e.sum(), lambda e: e + 1, lambda e: torch.cat([e, e]), lambda e: e.clone()):
        with pytest.raises(DeadLevelError, match="escaped the vmapped function"):
            use(escaped)
    assert current_stack() == ()


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("store", ["slice", "whole", "transposed view", "p * 3", "sin(p).sum()", "nan"])
def test_an_escaped_unbatched_input_of_vmap_grad_stands_for_its_value(store, requires_grad):
    """Issue 27 (dattri): inside `vmap(grad(f), in_dims=(None, 0))` the unbatched parameter
    is batched by the grad level (an expand, for per-element gradients), which torch.func
    never does; a slice of it stored in a dict and read after the call raised
    DeadLevelError in functx and is the plain value in torch.func. Every element of such a
    view is the same memory, so it stands for that value; a value computed from it (`p * 3`)
    has every element equal and a graph to the finished level's leaf only: it stands for
    its value too. Where p requires grad, what escaped keeps its graph to the caller's p, as
    torch.func's does: the caller's gradient through it equals plain autograd's on `make(p)`
    (it had no graph: "element 0 of tensors does not require grad")."""
    stored = {}
    make = {
        "slice": lambda p: p[0:2],
        "whole": lambda p: p,
        "transposed view": lambda p: p.view(2, 2).t(),
        "p * 3": lambda p: p * 3,
        "sin(p).sum()": lambda p: torch.sin(p).sum(),
        "nan": lambda p: torch.where(p > 0, p.log(), p),
    }[store]

    def f(p, x):
        stored["w"] = make(p)
        return (p * x).sum()

    p = torch.randn(4, requires_grad=requires_grad)
    xs = torch.randn(3, 4)
    grads = vmap(functx.grad(f), in_dims=(None, 0))(p, xs)
    if requires_grad:  # connected to the caller's graph: the gradient of each sample is x_i
        grads = grads.detach()
    torch.testing.assert_close(grads, xs)
    expected = make(p.detach())
    torch.testing.assert_close(stored["w"] * 2, expected * 2, equal_nan=True)
    assert stored["w"].shape == expected.shape
    if requires_grad:
        weights = torch.linspace(0.5, 1.5, expected.numel()).reshape(expected.shape)
        (got,) = torch.autograd.grad(torch.nan_to_num(stored["w"] * weights).sum(), p)
        (want,) = torch.autograd.grad(torch.nan_to_num(make(p) * weights).sum(), p)
        torch.testing.assert_close(got, want)
    assert current_stack() == ()


def test_an_escaped_value_of_a_batched_input_still_raises_under_vmap_grad():
    """What depends on the batched input differs between elements: refused, as torch.func does."""
    stored = {}

    def f(p, x):
        stored["px"] = p * x
        return (p * x).sum()

    vmap(functx.grad(f), in_dims=(None, 0))(torch.randn(4), torch.randn(3, 4))
    with pytest.raises(DeadLevelError, match="escaped"):
        stored["px"] + 1


def test_tensor_escaping_an_inner_vmap_into_an_enclosing_grad_is_refused():
    """Escaping into an enclosing grad lost its derivative (torch.func: an internal assert)."""
    leaked = []

    def inner(x):
        y = x * 2
        leaked.append(y)
        return y

    def outer(w):
        vmap(inner)(w)
        return leaked[-1].sum()

    with pytest.raises(DeadLevelError, match="escaped"):
        functx.grad(outer)(torch.ones(3, 4))
    assert current_stack() == ()


@pytest.mark.parametrize("recurse", [True, False])
def test_debug_unwrap_as_torch_func(recurse):
    """The tensor under the wrappers: under vmap of vmap, the rank of what is unwrapped (one
    level or all) is torch.func's; under jvp the primal, under grad the value; a plain tensor
    is returned as it is."""
    import torch.func as tf

    def ranks(lib):
        return lib.vmap(lib.vmap(lambda t: torch.tensor(lib.debug_unwrap(t, recurse=recurse).dim())))(torch.randn(2, 3, 4))

    torch.testing.assert_close(ranks(functx), ranks(tf))
    x = torch.randn(3)
    seen = []
    functx.jvp(lambda t: (seen.append(functx.debug_unwrap(t, recurse=recurse)), t.sin())[1], (x,), (torch.ones(3),))
    functx.grad(lambda t: functx.grad(lambda u: (seen.append(functx.debug_unwrap(u)), u.sin().sum())[1])(t).sum())(x)
    for value in seen:
        assert type(value) is torch.Tensor
        torch.testing.assert_close(value.detach(), x)
    plain = torch.ones(2)
    assert functx.debug_unwrap(plain) is plain
