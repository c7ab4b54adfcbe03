"""The interpreter stack: unique levels, per-thread stacks, restoration, escaped values."""

import threading

import pytest
import torch

from functx import vmap
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


def test_escaped_batched_tensor_acts_as_its_physical_value():
    leaked = []

    def f(x):
        leaked.append(x)
        return x

    vmap(f)(torch.arange(6.0).view(3, 2))
    escaped = leaked[0]
    torch.testing.assert_close(escaped + 1, torch.arange(6.0).view(3, 2) + 1)
