"""functx.functionalize: semantics, graphs and errors, against plain torch and torch.func."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import functx
from functx.core.interpreter import current_stack

from .opdb_support import mutations_in

REMOVES = ("mutations", "mutations_and_views")


def _clones(*args):
    return [a.clone() for a in args]


def _calls(graph) -> list[str]:
    """The ops a graph calls, by name without overload (`add.Scalar` and `add.Tensor` are the
    same computation: functx redispatches `x + 1` as add.Scalar, see functionalize/scalars.py)."""
    return [n.target.overloadpacket.__name__ for n in graph.nodes if n.op == "call_function" and hasattr(n.target, "overloadpacket")]


def assert_like_plain(f, *args, remove="mutations"):
    """functionalize(f) returns what f returns and leaves the inputs as f leaves them."""
    plain_args, our_args = _clones(*args), _clones(*args)
    expected = f(*plain_args)
    got = functx.functionalize(f, remove=remove)(*our_args)
    torch.testing.assert_close(got, expected)
    for p, o in zip(plain_args, our_args):
        assert p.shape == o.shape
        torch.testing.assert_close(o, p)
    return got


# -- the examples of torch.func.functionalize's documentation -------------------------------------
def intermediate_mutation(a):
    b = a + 1
    c = b.view(-1)
    c.add_(1)
    return b


def input_mutation_through_view(a):
    b = a.view(-1)
    b.add_(1)
    return a


def buffer_writes(a):
    z = torch.zeros(3, 4)
    z[0] = a[0]
    z[1:, 1:].add_(a[1:, 1:])
    idx = torch.zeros(2, dtype=torch.long)
    idx[1] = 2
    return z.index_select(0, idx)


def select_and_slice_writes(a):
    y = a.clone()
    y[0].mul_(2)
    y[:, 1:].sin_()
    y.t()[2].zero_()
    return y


def out_argument(a, out):
    torch.mul(a, 2, out=out)
    return out.sum()


GRAPH_CASES = [intermediate_mutation, input_mutation_through_view, buffer_writes, select_and_slice_writes, out_argument]


@pytest.mark.parametrize("remove", REMOVES)
@pytest.mark.parametrize("f", GRAPH_CASES, ids=lambda f: f.__name__)
def test_values_and_graph_as_torch_func(f, remove):
    args = [torch.randn(3, 4) for _ in range(f.__code__.co_argcount)]
    assert_like_plain(f, *args, remove=remove)
    ours = make_fx(functx.functionalize(f, remove=remove))(*_clones(*args)).graph
    theirs = make_fx(torch.func.functionalize(f, remove=remove))(*_clones(*args)).graph
    assert mutations_in(ours, remove) == []
    assert mutations_in(theirs, remove) == []  # the checker agrees with torch.func's graphs
    assert _calls(ours) == _calls(theirs)


def test_documented_graphs():
    x = torch.randn(2)
    assert _calls(make_fx(functx.functionalize(intermediate_mutation))(x).graph) == ["add", "view", "add", "view", "view"]
    graph = make_fx(functx.functionalize(input_mutation_through_view, remove="mutations_and_views"))(x).graph
    assert _calls(graph) == ["view_copy", "add", "view_copy", "view_copy", "copy_"]
    copy = [n for n in graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.copy_.default]
    assert copy[0].args[0].op == "placeholder"  # the copy back into the input, last


def test_views_stay_views_with_remove_mutations_only():
    x = torch.randn(2, 3)
    out = functx.functionalize(lambda x: x.view(-1))(x)
    assert out._base is x  # as torch.func: the output is a view of the input
    out = functx.functionalize(lambda x: x.view(-1), remove="mutations_and_views")(x)
    assert out._base is None
    assert functx.functionalize(lambda x: x)(x) is x


# -- inputs written by the function ---------------------------------------------------------------
def test_input_data_mutation_copied_back():
    def f(x, y):
        x.mul_(2)
        y[1].add_(x[0])
        return x + y

    assert_like_plain(f, torch.randn(3), torch.randn(2, 3))
    graph = make_fx(functx.functionalize(f))(torch.randn(3), torch.randn(2, 3)).graph
    copies = [n for n in graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.copy_.default]
    assert len(copies) == 2 and all(n.args[0].op == "placeholder" for n in copies)


def test_unwritten_inputs_are_not_copied():
    graph = make_fx(functx.functionalize(lambda x: x.view(-1).sin()))(torch.randn(2, 3)).graph
    assert "copy_" not in _calls(graph)


@pytest.mark.parametrize("remove", REMOVES)
def test_input_metadata_mutation(remove):
    def f(x):
        x.transpose_(0, 1)
        x.unsqueeze_(0)
        return x * 1

    x = torch.randn(2, 3)
    ours = x.clone()
    out = functx.functionalize(f, remove=remove)(ours)
    theirs = x.clone()
    torch.func.functionalize(f, remove=remove)(theirs)
    assert ours.shape == theirs.shape == (1, 3, 2)
    assert ours.stride() == theirs.stride()
    torch.testing.assert_close(ours, x.t().unsqueeze(0))
    torch.testing.assert_close(out, x.t().unsqueeze(0))


def test_input_as_strided_in_place():
    """The final value is a view of the input itself: only its metadata changes (torch.func
    also copies it onto itself, which torch refuses for these overlapping views)."""

    def f(x):
        x.as_strided_((2, 2), (1, 2))
        return x * 1

    x = torch.arange(10.0)
    assert_like_plain(f, x)
    with pytest.raises(RuntimeError, match="single memory location"):
        torch.func.functionalize(f)(x.clone())
    graph = make_fx(functx.functionalize(f))(x.clone()).graph
    assert mutations_in(graph, "mutations") == []


def test_input_resized():
    def f(x):
        x.resize_(6)
        x.fill_(1.0)
        return x

    x = torch.randn(2, 3)
    ours = x.clone()
    functx.functionalize(f)(ours)
    assert ours.shape == (6,) and bool((ours == 1).all())


def test_pytree_and_keyword_inputs():
    def f(d, scale, *, out):
        d["a"].add_(scale)
        d["b"][0].mul_(scale)
        out.copy_(d["a"] + d["b"][1])
        return {"sum": out.sum(), "n": 3}

    def args():
        return {"a": torch.ones(3), "b": [torch.ones(3), torch.full((3,), 2.0)]}, 2.0

    plain, ours = args(), args()
    out_plain, out_ours = torch.zeros(3), torch.zeros(3)
    expected = f(*plain, out=out_plain)
    got = functx.functionalize(f)(*ours, out=out_ours)
    assert got["n"] == 3 and torch.equal(got["sum"], expected["sum"])
    assert torch.equal(out_ours, out_plain)
    assert torch.equal(ours[0]["a"], plain[0]["a"]) and torch.equal(ours[0]["b"][0], plain[0]["b"][0])


def test_out_argument_resized():
    def f(x):
        out = torch.empty(0)
        torch.add(x, 1, out=out)
        return out

    assert_like_plain(f, torch.randn(2, 3))
    assert mutations_in(make_fx(functx.functionalize(f))(torch.randn(2, 3)).graph, "mutations") == []


def test_multiple_out_arguments():
    def f(x):
        values, indices = torch.empty(2), torch.empty(2, dtype=torch.long)
        torch.max(x, 1, out=(values, indices))
        values.add_(indices)
        return values, indices

    assert_like_plain(f, torch.randn(2, 3))


# -- tensors from outside the function --------------------------------------------------------------
def test_write_into_captured_tensor_of_inside_value_refused():
    captured = torch.zeros(3)

    def f(x):
        captured.add_(x)
        return x

    with pytest.raises(RuntimeError, match="not made inside the functionalized function"):
        functx.functionalize(f)(torch.ones(3))
    with pytest.raises(RuntimeError, match="mutating a non-functional tensor"):
        torch.func.functionalize(f)(torch.ones(3))
    assert current_stack() == ()


def test_write_into_captured_tensor_of_outside_value_passes_through():
    captured = torch.zeros(3)

    def f(x):
        captured.add_(1)  # nothing of the function: runs as is (torch.func the same)
        return x * 2

    functx.functionalize(f)(torch.ones(3))
    assert torch.equal(captured, torch.ones(3))


def test_clone_of_captured_tensor_is_functionalized():
    captured = torch.ones(3)

    def f(x):
        y = captured.clone()
        y.add_(x)
        return y

    assert_like_plain(f, torch.randn(3))
    assert mutations_in(make_fx(functx.functionalize(f))(torch.randn(3)).graph, "mutations") == []


def test_tensor_escaping_the_function():
    kept = []

    def f(x):
        y = x * 2
        y.add_(1)
        kept.append(y)
        return x.sum()

    functx.functionalize(f)(torch.ones(3))
    assert torch.equal(kept[0] + 1, torch.full((3,), 4.0))


# -- Python values from tensors, data-dependent ops -----------------------------------------------
def test_python_values_inside():
    def f(x):
        y = x.clone()
        y.add_(1)
        return y.tolist(), y.sum().item(), repr(y).startswith("FunctionalizedTensor"), int(y.argmax())

    assert functx.functionalize(f)(torch.tensor([1.0, 3.0])) == ([2.0, 4.0], 6.0, True, 1)


def test_data_dependent_ops():
    def f(x):
        y = x.clone()
        y[y < 0] = 0.0
        return y.nonzero(), torch.tensor_split(y, torch.tensor([1, 3]))[1]

    assert_like_plain(f, torch.randn(5))


def test_tensor_split_with_tensor_points():
    """torch.func fails here: torch's C++ composite reads the points' data from the functional
    tensor; functx passes them as ints."""
    f = lambda x, idx: torch.tensor_split(x * 1, idx)[1]
    x, idx = torch.arange(6.0), torch.tensor([2, 4])
    assert torch.equal(functx.functionalize(f)(x, idx), f(x, idx))
    with pytest.raises(RuntimeError):
        torch.func.functionalize(f)(x, idx)


def test_inplace_op_without_functionalize_kernel():
    """polygamma_ has no Functionalize kernel (torch.func fails): polygamma, then a copy."""

    def f(x):
        y = x.clone()
        y.polygamma_(1)
        return y

    x = torch.rand(4) + 0.5
    assert_like_plain(f, x)
    assert _calls(make_fx(functx.functionalize(f))(x).graph) == ["clone", "polygamma", "copy"]
    with pytest.raises(RuntimeError, match="non-ATen"):
        torch.func.functionalize(f)(x)


def test_random_inplace_ops_draw_the_same_numbers():
    def f(x):
        y = x.clone()
        y.normal_()
        y[0].uniform_()
        return y.bernoulli_(0.5)

    x = torch.randn(3, 4)
    torch.manual_seed(3)
    expected = f(x)
    torch.manual_seed(3)
    assert torch.equal(functx.functionalize(f)(x), expected)


def test_complex_and_conj_views():
    def through_conj(x):
        y = x.clone()
        y.conj().mul_(1j)
        return y * 2

    def through_real(x):
        y = x.clone()
        torch.view_as_real(y)[..., 0].add_(1)
        return y

    def both(x):
        return through_real(through_conj(x))

    x = torch.randn(3, dtype=torch.complex64)
    assert_like_plain(through_conj, x)
    assert_like_plain(through_real, x)
    assert_like_plain(both, x)

    def conj_then_real(x):  # torch's functionalization: the base is left a lazy conj after the
        y = x.clone()  # write through .conj(), and view_as_real refuses it (torch.func the same)
        y.conj().mul_(1j)
        torch.view_as_real(y)[..., 0].add_(1)
        return y

    for transform in (functx.functionalize, torch.func.functionalize):
        with pytest.raises(RuntimeError, match="unresolved conjugated"):
            transform(conj_then_real)(x)


def test_number_arguments_keep_their_dtype_rules():
    def f(x, i):
        return x + 1, x * 2.5, i + 1, i * 2.5, i + True, x.half() + 1e-4, x.half()[0] + 2, i / 2

    assert_like_plain(f, torch.randn(3), torch.arange(3))
    out = functx.functionalize(f)(torch.randn(3), torch.arange(3))
    expected = f(torch.randn(3), torch.arange(3))
    assert [o.dtype for o in out] == [e.dtype for e in expected]


def test_nested_functionalize():
    def inner(y):
        y.add_(1).mul_(2)
        return y.sum()

    def f(x):
        v = x.view(-1)
        s = functx.functionalize(inner)(v)
        return x, s

    assert_like_plain(f, torch.randn(2, 3))
    assert_like_plain(functx.functionalize(f), torch.randn(2, 3))
    graph = make_fx(functx.functionalize(functx.functionalize(f)))(torch.randn(2, 3)).graph
    assert mutations_in(graph, "mutations") == []


def test_autograd_outside_records_through():
    """Plain autograd outside any functx transform sees through functionalize, as with
    torch.func."""
    a = torch.randn(3, requires_grad=True)
    f = lambda a: (a.clone().mul_(a)).sin().sum()
    (ours,) = torch.autograd.grad(functx.functionalize(f)(a), a)
    (expected,) = torch.autograd.grad(f(a), a)
    torch.testing.assert_close(ours, expected)


# -- errors, and the state left behind --------------------------------------------------------------
@pytest.mark.parametrize("remove", ["bad", "mutation", None, 0, "views"])
def test_bad_remove_as_torch_func(remove):
    with pytest.raises(RuntimeError) as ours:
        functx.functionalize(torch.sin, remove=remove)
    with pytest.raises(RuntimeError) as theirs:
        torch.func.functionalize(torch.sin, remove=remove)
    assert str(ours.value) == str(theirs.value)


def test_remove_is_keyword_only():
    with pytest.raises(TypeError):
        functx.functionalize(torch.sin, "mutations")


def test_stack_and_thread_state_restored_after_an_exception():
    reapply = torch._C._functionalization_reapply_views_tls()

    def f(x):
        y = x.view(-1)
        y.add_(1)
        assert current_stack() and type(current_stack()[-1]).__name__ == "FunctionalizeInterpreter"
        raise ValueError("boom")

    for remove in REMOVES:
        with pytest.raises(ValueError, match="boom"):
            functx.functionalize(f, remove=remove)(torch.ones(2, 2))
        assert current_stack() == ()
        assert torch._C._functionalization_reapply_views_tls() == reapply
    assert not torch._C._is_torch_function_mode_enabled()  # the factory-lifting mode is gone
    x = torch.ones(3)
    assert torch.equal(functx.functionalize(lambda x: x.add_(1))(x), torch.full((3,), 2.0))
    assert torch.equal(x, torch.full((3,), 2.0))


def test_error_inside_an_op_leaves_the_input_alone():
    def f(x):
        x.add_(1)
        x.view(5)  # wrong size: raises
        return x

    x = torch.ones(2, 2)
    with pytest.raises(RuntimeError):
        functx.functionalize(f)(x)
    assert torch.equal(x, torch.ones(2, 2))  # nothing copied back (torch.func the same)
    assert current_stack() == ()


def test_wraps_the_function():
    def my_function(x):
        """doc"""
        return x

    g = functx.functionalize(my_function)
    assert g.__name__ == "my_function" and g.__doc__ == "doc"


def test_public_api_covers_torch_func():
    assert set(torch.func.__all__) <= set(dir(functx))
    assert {"functionalize", "rearrange"} <= set(functx.__all__)


@pytest.mark.parametrize("remove", REMOVES)
def test_layouts_as_plain_torch(remove):
    """Views report the layout of views, and results of ops on them the layout plain torch
    gives them, also when views are copies (torch.func reports the copies' layouts): code that
    decides by layout (`reshape`, `is_contiguous`) decides as it would without functionalize."""

    def f(x):
        t = x.t()
        y = t * 2 + 1
        r = y.reshape(-1)  # a copy: y is not contiguous
        r.add_(100)  # so this does not reach y
        return t.is_contiguous(), t.stride(), y.stride(), y.is_contiguous(), y, x[1:].storage_offset()

    x = torch.randn(3, 4)
    assert functx.functionalize(f, remove=remove)(x.clone())[:4] == f(x.clone())[:4]
    got, expected = functx.functionalize(f, remove=remove)(x.clone()), f(x.clone())
    torch.testing.assert_close(got[4], expected[4])
    assert got[5] == expected[5] == 4
