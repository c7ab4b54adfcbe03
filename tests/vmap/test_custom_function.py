"""torch.autograd.Function under functx.vmap: the vmap staticmethod, generate_vmap_rule,
the errors torch.func gives, and old-style Functions run per sample
(functx/vmap/custom_function.py). References: loops over samples with no transform."""

import warnings

import optree
import pytest
import torch

import functx
from functx.vmap import BatchedTensor, custom_function
from tests.autograd_functions import (
    BadVmapReturn,
    BothVmapRules,
    Cube,
    KwargOnly,
    Mul,
    NoVmapSupport,
    NumpyTanh,
    OldStyleSTE,
    SortWithIndices,
)

D = torch.float64


def loop(f, *xs):
    return torch.stack([f(*sample) for sample in zip(*xs)])


def test_vmap_staticmethod_gets_info_and_in_dims():
    x = torch.randn(4, 3, dtype=D)
    NumpyTanh.vmap_calls.clear()
    torch.testing.assert_close(functx.vmap(NumpyTanh.apply)(x), torch.tanh(x))
    torch.testing.assert_close(functx.vmap(NumpyTanh.apply, in_dims=1, randomness="different")(x), torch.tanh(x).T)
    assert NumpyTanh.vmap_calls == [(4, "error", (0,)), (3, "different", (1,))]  # in_dims as given to vmap
    # nested: each level calls the staticmethod once, the inner one sees the outer's physical
    NumpyTanh.vmap_calls.clear()
    torch.testing.assert_close(functx.vmap(functx.vmap(NumpyTanh.apply))(x), torch.tanh(x))
    assert [c[0] for c in NumpyTanh.vmap_calls] == [3, 4]


def test_vmap_staticmethod_with_tuple_outputs_and_out_dims():
    x = torch.randn(4, 5, dtype=D)
    values, indices = functx.vmap(lambda v: SortWithIndices.apply(v, True))(x)
    expected = x.sort(dim=-1, descending=True)
    torch.testing.assert_close(values, expected.values)
    assert torch.equal(indices, expected.indices)
    values = functx.vmap(lambda v: SortWithIndices.apply(v, False)[0], in_dims=1)(x)
    torch.testing.assert_close(values, x.T.sort(dim=-1).values)


def test_generate_vmap_rule_forward_backward_and_unbatched_inputs():
    xs, y = torch.randn(4, 3, dtype=D), torch.randn(3, dtype=D)
    torch.testing.assert_close(functx.vmap(Mul.apply, in_dims=(0, None))(xs, y), xs * y)
    torch.testing.assert_close(functx.vmap(lambda x: Cube.apply(x, 2.0))(xs), 2 * xs**3)
    # gradient w.r.t. the unbatched input: the sum over the batch of per-sample gradients
    g_y = functx.grad(lambda y: functx.vmap(Mul.apply, in_dims=(0, None))(xs, y).sum())(y)
    torch.testing.assert_close(g_y, xs.sum(0))
    g_xs, g_y = functx.grad(lambda a, b: (functx.vmap(Mul.apply, in_dims=(0, None))(a, b) ** 2).sum(), argnums=(0, 1))(xs, y)
    torch.testing.assert_close(g_xs, 2 * xs * y**2)
    torch.testing.assert_close(g_y, (2 * xs**2 * y).sum(0))
    # forward mode through the generated rule
    tangent = torch.randn_like(xs)
    _, t = functx.jvp(lambda a: functx.vmap(Mul.apply, in_dims=(0, None))(a, y), (xs,), (tangent,))
    torch.testing.assert_close(t, tangent * y)
    # plain autograd through vmap of a generated rule, against a loop
    leaf = xs.clone().requires_grad_()
    functx.vmap(lambda x: Cube.apply(x, 2.0))(leaf).sum().backward()
    torch.testing.assert_close(leaf.grad, 6 * xs**2)


def test_vmap_errors_like_torch_func():
    x = torch.randn(2, 3)
    with pytest.raises(RuntimeError, match="does not have vmap support"):
        functx.vmap(NoVmapSupport.apply)(x)
    with pytest.raises(RuntimeError, match="both generate_vmap_rule=True and an overridden vmap"):
        functx.vmap(BothVmapRules.apply)(x)
    with pytest.raises(RuntimeError, match="two returns"):
        functx.vmap(BadVmapReturn.apply)(x)
    with pytest.raises(NotImplementedError, match="kwarg-only Tensor"):
        functx.vmap(lambda v: KwargOnly.apply(v, scale=torch.tensor(2.0)))(x)
    assert functx.core.current_stack() == ()
    # unbatched use is plain torch
    torch.testing.assert_close(NoVmapSupport.apply(x), 2 * x)


def test_old_style_function_runs_per_sample_with_one_warning():
    x = torch.randn(5, 4, dtype=D) * 2
    custom_function._warned.discard(OldStyleSTE)  # the warning is once per Function and process
    with pytest.warns(functx.PerformanceWarning, match="OldStyleSTE is an old-style"):
        out = functx.vmap(OldStyleSTE.apply)(x)
    torch.testing.assert_close(out, torch.round(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error", functx.PerformanceWarning)  # only once per Function
        torch.testing.assert_close(functx.vmap(OldStyleSTE.apply, in_dims=1)(x), torch.round(x).T)
    w = torch.randn(4, dtype=D)
    expected = loop(lambda s: w * (s.abs() <= 2).to(D), x)
    got = functx.grad(lambda v: (functx.vmap(OldStyleSTE.apply)(v) * w).sum())(x)
    torch.testing.assert_close(got, expected)


# -- what a vmap staticmethod is given, and what it may return: torch.func as the oracle --
def _comparable(dim, value):
    """What is compared of a value a vmap staticmethod is given: a plain tensor with its
    batch dim (`dim`) moved first, under the grad levels below (functx's may be direct,
    torch.func's never are); a tensor of a vmap level below, which is not compared outside
    its transform: its logical shape."""
    if not isinstance(value, torch.Tensor):
        return value
    while True:
        if torch._C._functorch.is_gradtrackingtensor(value):
            value = torch._C._functorch.get_unwrapped(value)
        elif isinstance(value, functx.core.LevelTensor) and not isinstance(value, BatchedTensor):
            value = value._value
        else:
            break
    if isinstance(value, functx.core.LevelTensor) or torch._C._functorch.is_functorch_wrapped_tensor(value):
        return ("a tensor of a level below", tuple(value.shape), dim)
    return value.detach() if dim is None else value.movedim(dim, 0).detach().clone()


def _recording_function():
    """A Function whose vmap staticmethod records what it is given: `(info, in_dims, per
    argument leaf: (in_dim, the physical value with its batch dim moved first))`, and
    applies itself again to the first batched tensor (so a vmap level below records too).
    Its output is twice the first tensor among the arguments."""
    calls = []

    class Record(torch.autograd.Function):
        @staticmethod
        def forward(x, extra=None, *rest):
            return 2 * optree.tree_leaves((x, extra, rest))[0]

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.n_inputs = len(inputs)

        @staticmethod
        def backward(ctx, grad):
            return (2 * grad,) + (None,) * (ctx.n_inputs - 1)

        @staticmethod
        def vmap(info, in_dims, *args):
            leaves = (optree.tree_leaves(tree, none_is_leaf=True) for tree in (in_dims, args))
            pairs = list(zip(*leaves))
            calls.append((info, in_dims, [(d, _comparable(d, v)) for d, v in pairs]))
            dim, first = next((d, v) for d, v in pairs if d is not None)
            return Record.apply(first), dim

    return Record, calls


def _grad_for(vmap):
    return functx.grad if vmap is functx.vmap else torch.func.grad


def _in_dims_cases(F):
    """Where functx gives what torch.func gives: vmap's in_dim for an input handed on as is
    (also written in place first; each vmap level its own; each chunk), 0 after ops that
    move torch.func's batch dim first too."""
    g = torch.Generator().manual_seed(0)
    x, y, x3 = (torch.randn(*shape, dtype=D, generator=g) for shape in ((3, 4), (4,), (2, 3, 4)))
    return {
        "int in_dims=1": (lambda vmap: vmap(F.apply, in_dims=1)(x)),
        "in_dims=-1": (lambda vmap: vmap(F.apply, in_dims=-1)(x)),
        "in_dims=-2 is 0": (lambda vmap: vmap(F.apply, in_dims=-2)(x)),
        "tuple with None": (lambda vmap: vmap(F.apply, in_dims=(0, None))(x, y)),
        "tuple (1, 0)": (lambda vmap: vmap(F.apply, in_dims=(1, 0))(x, x.T)),
        "negative in a tuple, 3-d": (lambda vmap: vmap(F.apply, in_dims=(-2, None))(x3, y)),
        "nested tuple in_dims": (lambda vmap: vmap(lambda t: F.apply(t[0], [t[1]]), in_dims=((1, 0),))((x, x.T))),
        "dict in_dims": (
            lambda vmap: vmap(lambda d: F.apply(d["a"], d["b"]), in_dims=({"a": 1, "b": -1},))({"a": x, "b": x})
        ),
        "list of tensors, in_dims (1, 0)": (lambda vmap: vmap(lambda a, b: F.apply([a, b]), in_dims=(1, 0))(x, x.T)),
        "the same input twice": (lambda vmap: vmap(lambda a: F.apply(a, a), in_dims=1)(x)),
        "written in place first": (lambda vmap: vmap(lambda a: F.apply(a.add_(1)), in_dims=1)(x.clone())),
        "after a binary op (x * 2): 0": (lambda vmap: vmap(lambda a: F.apply(a * 2), in_dims=1)(x)),
        "after a binary op (2 * x): 0": (lambda vmap: vmap(lambda a: F.apply(2 * a), in_dims=1)(x)),
        "after a binary op (x + x): 0": (lambda vmap: vmap(lambda a: F.apply(a + a), in_dims=1)(x)),
        "after a view: 0": (lambda vmap: vmap(lambda a: F.apply(a[0:2]), in_dims=1)(x)),
        "after a reduction: 0": (lambda vmap: vmap(lambda a: F.apply(a.sum(0)), in_dims=2)(x3)),
        "chunk_size, each chunk": (lambda vmap: vmap(F.apply, in_dims=1, chunk_size=2)(x3[0].T)),
        "chunk_size 1": (lambda vmap: vmap(F.apply, in_dims=-1, chunk_size=1)(x3[:, 0, :2])),
        "nested, each level its own": (lambda vmap: vmap(vmap(F.apply, in_dims=1), in_dims=2)(x3)),
        "nested, negative": (lambda vmap: vmap(vmap(F.apply, in_dims=-1), in_dims=-1)(x3)),
        "nested, inner 0": (lambda vmap: vmap(vmap(F.apply), in_dims=1)(x3)),
        "nested, outer 0": (lambda vmap: vmap(vmap(F.apply, in_dims=1))(x3)),
        "nested, batched at the outer level only": (
            lambda vmap: vmap(lambda a: vmap(lambda b: F.apply(a, b), in_dims=1)(x3[0]), in_dims=1)(x)
        ),
        "nested, after a binary op": (
            lambda vmap: vmap(vmap(lambda a: F.apply(a * 1), randomness="same"), in_dims=1)(x3)
        ),
        "under grad": (lambda vmap: _grad_for(vmap)(lambda a: vmap(F.apply, in_dims=1)(a).sum())(x)),
        "default filled in": (lambda vmap: vmap(F.apply)(x)),
        "keyword bound": (lambda vmap: vmap(lambda a: F.apply(a, extra=[y[:3], a]), in_dims=1)(x)),
        "list of tensors and non-tensors": (lambda vmap: vmap(lambda a, b: F.apply([a, b], 3, "s", None, 2.5))(x, x)),
        "dict and nested tuple, unbatched first": (
            lambda vmap: vmap(lambda a, b: F.apply(y[:3], {"b": (b, y[:3], 1), "a": a}), in_dims=(1, 0))(x, x.T)
        ),
        "batched only inside a container": (lambda vmap: vmap(lambda a: F.apply(y[:3], [a]), in_dims=1)(x)),
        "randomness same": (lambda vmap: vmap(F.apply, randomness="same")(x)),
        "randomness different, in_dims 2": (lambda vmap: vmap(F.apply, in_dims=2, randomness="different")(x3)),
    }


def _in_dims_cases_where_functx_gives_0(F):
    """Where torch.func keeps its batch dim where it was and functx, which keeps it first,
    gives 0 (a correct `vmap` staticmethod reads the dims, so both work): `{name: (case,
    torch.func's ints in in_dims)}`."""
    g = torch.Generator().manual_seed(1)
    x, x3 = (torch.randn(*shape, dtype=D, generator=g) for shape in ((3, 4), (2, 3, 4)))
    return {
        "after a unary pointwise op": ((lambda vmap: vmap(lambda a: F.apply(a.sin()), in_dims=1)(x)), [1]),
        "after clone": ((lambda vmap: vmap(lambda a: F.apply(a.clone()), in_dims=1)(x)), [1]),
        "after an in-place view op": ((lambda vmap: vmap(lambda a: F.apply(a.t_()), in_dims=2)(x3.clone())), [2]),
        # functx's grad inside vmap differentiates new batched tensors (ad/direct_reverse.py)
        "inside grad": ((lambda vmap: vmap(_grad_for(vmap)(lambda a: F.apply(a).sum()), in_dims=1)(x)), [1]),
    }


def _assert_same_calls(ours, theirs, functx_dims=None):
    """The calls of two recording Functions agree: VmapInfo, in_dims' type and structure (a
    tuple per positional argument, containers mirrored, None for non-tensors and unbatched
    tensors), the ints in in_dims (or, for functx, those of `functx_dims`, one per call) and
    the physical values."""
    assert len(ours) == len(theirs) >= 1
    for call, ((info, in_dims, leaves), (t_info, t_in_dims, t_leaves)) in enumerate(zip(ours, theirs)):
        assert type(info).__name__ == "VmapInfo" and info._fields == t_info._fields and info == t_info
        assert type(in_dims) is tuple
        assert optree.tree_structure(in_dims, none_is_leaf=True) == optree.tree_structure(t_in_dims, none_is_leaf=True)
        if functx_dims is None:
            assert in_dims == t_in_dims and repr(in_dims) == repr(t_in_dims)  # ints, not bools
        for (d, v), (t_d, t_v) in zip(leaves, t_leaves, strict=True):
            assert (d is None) == (t_d is None)
            if d is not None:
                assert type(d) is int and type(t_d) is int and t_d >= 0
                if functx_dims is not None:
                    assert d == functx_dims[call]
            if isinstance(t_v, torch.Tensor):
                torch.testing.assert_close(v, t_v)
            elif isinstance(t_v, tuple):  # a tensor of a level below
                assert v[:2] == t_v[:2]
            else:
                assert v == t_v


@pytest.mark.parametrize("case", list(_in_dims_cases(None)))
def test_vmap_staticmethod_gets_in_dims_and_info_as_torch_func_gives_them(case):
    theirs_f, theirs = _recording_function()
    ours_f, ours = _recording_function()
    expected = _in_dims_cases(theirs_f)[case](torch.func.vmap)
    got = _in_dims_cases(ours_f)[case](functx.vmap)
    torch.testing.assert_close(got, expected)
    _assert_same_calls(ours, theirs)


@pytest.mark.parametrize("case", list(_in_dims_cases_where_functx_gives_0(None)))
def test_vmap_staticmethod_gets_0_where_torch_func_kept_its_batch_dim_in_place(case):
    theirs_f, theirs = _recording_function()
    ours_f, ours = _recording_function()
    run, torch_dims = _in_dims_cases_where_functx_gives_0(theirs_f)[case]
    expected = run(torch.func.vmap)
    got = _in_dims_cases_where_functx_gives_0(ours_f)[case][0](functx.vmap)
    torch.testing.assert_close(got, expected)
    assert [d for c in theirs for d in optree.tree_leaves(c[1]) if d is not None] == torch_dims
    _assert_same_calls(ours, theirs, functx_dims=[0] * len(ours))


def test_vmap_staticmethod_gets_the_tensor_passed_to_vmap():
    """As in torch.func: the very tensor passed to vmap, and, returned with its in_dim as
    out_dim, the batched input itself. After an inner grad level's in-place write into the
    batched input (which lifts its value): the current value."""
    seen = []

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, grad):
            return grad

        @staticmethod
        def vmap(info, in_dims, x):
            seen.append((in_dims, x))
            return x, in_dims[0]

    x = torch.randn(3, 4, dtype=D)
    for vmap in (torch.func.vmap, functx.vmap):
        seen.clear()
        same = []
        vmap(lambda a: same.append(Identity.apply(a) is a) or a, in_dims=1)(x)
        assert seen[0][0] == (1,) and seen[0][1] is x and same == [True]
    # An inner grad level writing its differentiated input into the batched input (a tensor
    # from outside that grad) is refused, as torch.func refuses it (issue 26: such writes
    # used to be recorded on the caller's tensor).
    w = torch.randn(3, dtype=D)

    def per_sample(a):
        def inner(v):
            a.mul_(v)
            return (Identity.apply(a) * v).sum()

        return functx.grad(inner)(w)

    outside = x.clone()
    with pytest.raises(RuntimeError, match="would mutate a captured Tensor"):
        functx.vmap(per_sample, in_dims=1)(outside)
    assert torch.equal(outside, x) and outside.grad_fn is None


def _returning(rule):
    """A Function whose vmap staticmethod returns `rule(x)`, x the physical input with its
    batch dim first."""

    class Returns(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return 2 * x

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, grad):
            return 2 * grad

        @staticmethod
        def vmap(info, in_dims, x):
            return rule(2 * x.movedim(in_dims[0], 0))

    return Returns


# rule(p) for p of physical shape (3, 4), batch size 3
BAD_OUT_DIMS = {
    "more out_dims than outputs": (RuntimeError, lambda p: ((p, p), (0, 0, 0))),
    "list out_dims for tuple outputs": (RuntimeError, lambda p: ((p, p), [0, 0])),
    "tuple out_dims for list outputs": (RuntimeError, lambda p: ([p, p], (0, 0))),
    "(0,) for one output": (RuntimeError, lambda p: (p, (0,))),
    "[0] for one output": (RuntimeError, lambda p: (p, [0])),
    "one out_dim for two outputs": (RuntimeError, lambda p: ((p, p), (0,))),
    "too deep": (RuntimeError, lambda p: ((p, p), (0, (0,)))),
    "wrong dict key": (RuntimeError, lambda p: ({"a": p}, {"b": 0})),
    "str out_dim": (TypeError, lambda p: (p, "0")),
    "float out_dim": (TypeError, lambda p: (p, 0.0)),
    "str inside a tuple": (TypeError, lambda p: ((p, p), (0, "a"))),
    "out_dim == rank": (IndexError, lambda p: (p, 2)),
    "out_dim far out of range": (IndexError, lambda p: (p, 5)),
}


@pytest.mark.parametrize("case", list(BAD_OUT_DIMS))
def test_bad_out_dims_are_rejected_like_torch_func(case):
    error, rule = BAD_OUT_DIMS[case]
    x = torch.randn(3, 4, dtype=D)
    f = lambda v: optree.tree_leaves(_returning(rule).apply(v))[0]
    with pytest.raises(error):
        torch.func.vmap(f)(x)
    with pytest.raises(error, match="vmap staticmethod of Returns") as caught:
        functx.vmap(f)(x)
    assert "out_dims" in str(caught.value)
    assert functx.core.current_stack() == ()
    torch.testing.assert_close(functx.vmap(torch.sin)(x), torch.sin(x))


GOOD_OUT_DIMS = {
    "int for a list": lambda p: ([p, p + 1], 0),
    "int for a subtree": lambda p: (((p, p + 1), p + 2), (0, 0)),
    "dict": lambda p: ({"a": p, "b": p.T}, {"a": 0, "b": 1}),
    "negative": lambda p: (p.movedim(0, -1), -1),
    "bool True is 1": lambda p: (p.T, True),
    "integer tensor": lambda p: (p, torch.tensor(0)),
    "None: the same for every sample": lambda p: (p, None),
    "None for one output": lambda p: ((p, p[0]), (0, None)),
    "non-tensor output, its out_dim ignored": lambda p: ((p, 7), (0, 0)),
    "None output": lambda p: ((p, None), (0, None)),
}


@pytest.mark.parametrize("case", list(GOOD_OUT_DIMS))
def test_out_dims_torch_func_accepts_give_its_results(case):
    x = torch.randn(3, 4, dtype=D)
    rule = GOOD_OUT_DIMS[case]
    F = _returning(rule)
    tensors = lambda v: [o for o in optree.tree_leaves(F.apply(v)) if isinstance(o, torch.Tensor)]
    expected = torch.func.vmap(tensors)(x)
    torch.testing.assert_close(functx.vmap(tensors)(x), expected)
    # and the structure, non-tensors included
    describe = lambda o: "tensor" if isinstance(o, torch.Tensor) else repr(o)
    structure = lambda v: (optree.tree_map(describe, F.apply(v), none_is_leaf=True), v)
    expected = torch.func.vmap(structure, out_dims=(None, 0))(x)[0]
    assert functx.vmap(structure, out_dims=(None, 0))(x)[0] == expected


@pytest.mark.parametrize(
    "case, rule, error, message",
    [
        # torch.func wraps a dim below -rank around (-3 on a 2-d output acts as -1)
        ("below -rank", lambda p: (p, -3), IndexError, "out of range"),
        # torch.func fails deep inside (ValueError: SmallVector unable to grow)
        ("0-d output", lambda p: (p.sum(), 0), IndexError, "out of range"),
        # torch.func does not check the size: garbage of the wrong batch size
        ("wrong dim", lambda p: (p, 1), RuntimeError, "has size 4 in its out_dim 1, but the batch size is 3"),
        ("wrong batch size", lambda p: (p[:2], 0), RuntimeError, "has size 2 in its out_dim 0"),
    ],
)
def test_out_dims_torch_func_does_not_check_are_rejected(case, rule, error, message):
    x = torch.randn(3, 4, dtype=D)
    with pytest.raises(error, match=message):
        functx.vmap(_returning(rule).apply)(x)
    assert functx.core.current_stack() == ()
    torch.testing.assert_close(functx.vmap(torch.sin)(x), torch.sin(x))


def test_containers_of_tensors_reach_the_vmap_rules():
    """`F.apply([a, b], w)`: the Function is batched by its rule (not its forward's ops run
    on batched tensors), with the generated rule too, against a loop; and old-style
    Functions with containers run per sample."""

    class ListMul(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(xs, w):
            return xs[0] * xs[1] * w

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0][0], inputs[0][1])

        @staticmethod
        def backward(ctx, grad):
            a, b = ctx.saved_tensors
            return None, 100 * grad * a * b  # not the true derivative: seen only if used

    a, b, w = (torch.randn(3, 4, dtype=D) for _ in range(3))
    f = lambda a, b, w: ListMul.apply([a, b], w)
    torch.testing.assert_close(functx.vmap(f, in_dims=(0, 0, None))(a, b, w[0]), loop(lambda a, b: f(a, b, w[0]), a, b))
    torch.testing.assert_close(functx.vmap(f, in_dims=(0, None, None))(a, b[0], w[0]), a * b[0] * w[0])
    # the custom backward of the generated rule (only w gets a gradient, as in torch.func)
    g = functx.vmap(functx.grad(lambda a, b, w: f(a, b, w).sum(), argnums=2))(a, b, w)
    torch.testing.assert_close(g, 100 * a * b)
    torch.testing.assert_close(g, torch.func.vmap(torch.func.grad(lambda a, b, w: f(a, b, w).sum(), argnums=2))(a, b, w))

    class OldListMul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, xs, w):
            return xs[0] * xs[1] * w

        @staticmethod
        def backward(ctx, grad):
            return None, grad

    with pytest.warns(functx.PerformanceWarning):
        out = functx.vmap(lambda a, b: OldListMul.apply([a, b], w[0]))(a, b)
    torch.testing.assert_close(out, a * b * w[0])


# -- torch.library custom ops with a rule from torch.library.register_vmap: the same in_dims --
_op_rule_calls = []


@torch.library.custom_op("functx_custom_function_tests::scale", mutates_args=())
def _scale(x: torch.Tensor, y: torch.Tensor, k: float) -> torch.Tensor:
    return x * y * k


@_scale.register_fake
def _(x, y, k):
    return torch.empty_like(x)


@torch.library.register_vmap("functx_custom_function_tests::scale")
def _(info, in_dims, x, y, k):
    _op_rule_calls.append((info.batch_size, in_dims))
    x, y = (v if d is None else v.movedim(d, 0) for v, d in zip((x, y), in_dims))
    if in_dims[0] is None:
        x = x.expand(info.batch_size, *x.shape)
    return _scale(x, y, k), 0


@torch.library.custom_op("functx_custom_function_tests::weighted_sum", mutates_args=())
def _weighted_sum(xs: list[torch.Tensor], w: torch.Tensor) -> torch.Tensor:
    return sum(xs) * w


@_weighted_sum.register_fake
def _(xs, w):
    return torch.empty_like(xs[0])


@torch.library.register_vmap("functx_custom_function_tests::weighted_sum")
def _(info, in_dims, xs, w):
    _op_rule_calls.append((info.batch_size, in_dims))
    xs = [x.expand(info.batch_size, *x.shape) if d is None else x.movedim(d, 0) for x, d in zip(xs, in_dims[0])]
    return _weighted_sum(xs, w if in_dims[1] is None else w.movedim(in_dims[1], 0)), 0


def _op_cases():
    g = torch.Generator().manual_seed(2)
    x, y, x3 = (torch.randn(*shape, dtype=D, generator=g) for shape in ((3, 4), (3,), (2, 3, 4)))
    return {
        "in_dims (1, None)": lambda vmap: vmap(_scale, in_dims=(1, None, None))(x, y, 2.0),
        "in_dims (1, 0)": lambda vmap: vmap(_scale, in_dims=(1, 0, None))(x, x.T, 2.0),
        "in_dims (-1, None)": lambda vmap: vmap(_scale, in_dims=(-1, None, None))(x, y, 2.0),
        "keywords": lambda vmap: vmap(lambda a: _scale(a, y=a, k=2.0), in_dims=1)(x),
        "after a binary op: 0": lambda vmap: vmap(lambda a: _scale(a * 2, y, 2.0), in_dims=1)(x),
        "chunk_size": lambda vmap: vmap(lambda a: _scale(a, y, 2.0), in_dims=1, chunk_size=3)(x),
        "nested": lambda vmap: vmap(vmap(lambda a: _scale(a, a, 2.0), in_dims=1), in_dims=2)(x3),
        "list of tensors [1, 0]": lambda vmap: vmap(lambda a, b: _weighted_sum([a, b], y), in_dims=(1, 0))(x, x.T),
        "list of tensors [1, None]": lambda vmap: vmap(lambda a: _weighted_sum([a, y], y), in_dims=1)(x),
        "list unbatched, then 1": lambda vmap: vmap(lambda a: _weighted_sum([y, y], a), in_dims=1)(x),
    }


@pytest.mark.parametrize("case", list(_op_cases()))
def test_custom_op_vmap_rule_gets_in_dims_as_torch_func_gives_them(case):
    _op_rule_calls.clear()
    expected = _op_cases()[case](torch.func.vmap)
    theirs = list(_op_rule_calls)
    _op_rule_calls.clear()
    with functx.vmap_fallback("error"):
        got = _op_cases()[case](functx.vmap)
    torch.testing.assert_close(got, expected)
    assert _op_rule_calls == theirs and repr(_op_rule_calls) == repr(theirs)


def test_custom_op_vmap_rule_gets_0_after_a_unary_op_where_torch_func_gives_the_in_dim():
    x, y = torch.randn(3, 4, dtype=D), torch.randn(3, dtype=D)
    _op_rule_calls.clear()
    expected = torch.func.vmap(lambda a: _scale(a.sin(), y, 2.0), in_dims=1)(x)
    assert _op_rule_calls == [(4, (1, None, None))]
    _op_rule_calls.clear()
    torch.testing.assert_close(functx.vmap(lambda a: _scale(a.sin(), y, 2.0), in_dims=1)(x), expected)
    assert _op_rule_calls == [(4, (0, None, None))]


class _SortWithIndices(torch.autograd.Function):
    """sort along the last dim, returning (values, indices); its jvp gives None for the
    integer indices (as torch's own SortGenVmap test Function does)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        values, indices = torch.sort(x, dim=-1)
        return values, indices

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(output[1])
        ctx.save_for_forward(output[1])

    @staticmethod
    def backward(ctx, grad_values, _grad_indices):
        (indices,) = ctx.saved_tensors
        return torch.zeros_like(grad_values).scatter(-1, indices, grad_values)

    @staticmethod
    def jvp(ctx, tangent):
        (indices,) = ctx.saved_tensors
        return torch.gather(tangent, -1, indices), None


def test_generated_vmap_rule_of_a_jvp_returning_none_for_an_integer_output():
    """vmap(jvp) of a generate_vmap_rule Function whose jvp returns None for its integer
    output raised "`inner` must only return Tensors" (op-db SortGenVmap, vmap_jvp and
    vmap_jvp_vjp). Reference: plain forward AD of torch.sort per tangent."""
    x = torch.randn(4, 5, dtype=torch.float64)
    tangents = torch.randn(3, 4, 5, dtype=torch.float64)
    got = functx.vmap(lambda t: functx.jvp(lambda v: _SortWithIndices.apply(v)[0], (x,), (t,))[1])(tangents)
    import torch.autograd.forward_ad as fwAD

    expected = []
    for t in tangents:
        with fwAD.dual_level():
            expected.append(fwAD.unpack_dual(torch.sort(fwAD.make_dual(x, t), dim=-1)[0]).tangent)
    torch.testing.assert_close(got, torch.stack(expected))
    xs = torch.randn(3, 4, 5, dtype=torch.float64)
    got = functx.vmap(lambda v, t: functx.jvp(lambda u: _SortWithIndices.apply(u)[0], (v,), (t,))[1])(xs, tangents)
    expected = []
    for v, t in zip(xs, tangents):
        with fwAD.dual_level():
            expected.append(fwAD.unpack_dual(torch.sort(fwAD.make_dual(v, t), dim=-1)[0]).tangent)
    torch.testing.assert_close(got, torch.stack(expected))


def test_old_style_function_follows_the_fallback_setting():
    """`set_vmap_fallback` holds for old-style Functions as for ops without a rule: "silent"
    runs them per sample without a warning, "error" refuses them (both used to warn once
    and run per sample)."""
    x = torch.randn(5, 4, dtype=D) * 2
    custom_function._warned.discard(OldStyleSTE)
    with functx.vmap_fallback("silent"), warnings.catch_warnings():
        warnings.simplefilter("error", functx.PerformanceWarning)
        torch.testing.assert_close(functx.vmap(OldStyleSTE.apply)(x), loop(OldStyleSTE.apply, x))
    assert OldStyleSTE not in custom_function._warned  # so "warn" still warns once, later
    with functx.vmap_fallback("error"):
        with pytest.raises(NotImplementedError, match="OldStyleSTE is an old-style.*fallback is switched off"):
            functx.vmap(OldStyleSTE.apply)(x)
    assert functx.core.current_stack() == ()
    with pytest.warns(functx.PerformanceWarning, match="OldStyleSTE is an old-style"):
        torch.testing.assert_close(functx.vmap(OldStyleSTE.apply)(x), loop(OldStyleSTE.apply, x))


class _OldStyleKeywordAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y=None):
        return x + (0 if y is None else y)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def test_old_style_function_refuses_tensors_passed_by_keyword():
    """The per-sample loop slices positional arguments only: a batched tensor passed by
    keyword went whole to each sample's forward, and a BatchedTensor of the wrong shape
    escaped. Refused, as for new-style Functions (torch.func's error)."""
    x, y = torch.randn(2, 3, dtype=D), torch.randn(2, 3, dtype=D)
    with pytest.raises(NotImplementedError, match="kwarg-only Tensor"):
        functx.vmap(lambda x, y: _OldStyleKeywordAdd.apply(x, y=y))(x, y)
    assert functx.core.current_stack() == ()
    with functx.vmap_fallback("silent"):  # by position it runs per sample
        out = functx.vmap(lambda x, y: _OldStyleKeywordAdd.apply(x, y))(x, y)
        torch.testing.assert_close(out, loop(lambda a, b: _OldStyleKeywordAdd.apply(a, b), x, y))
        # an unbatched tensor by keyword is the same in every sample's call: allowed
        out = functx.vmap(lambda x: _OldStyleKeywordAdd.apply(x, y=y[0]))(x)
        torch.testing.assert_close(out, loop(lambda a: _OldStyleKeywordAdd.apply(a, y=y[0]), x))
