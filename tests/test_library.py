"""User-defined operators under functx: `torch.library.custom_op` with `register_autograd`
under grad at every level, batching rules from `functx.library.register_vmap` and from
`torch.library.register_vmap` (functx/library.py, functx/vmap/rules/custom_ops.py)."""

import numpy as np
import pytest
import torch

import functx

D = torch.float64


@torch.library.custom_op("functx_tests::numpy_sin", mutates_args=())
def numpy_sin(x: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.sin(x.detach().cpu().numpy())).to(x.device)


@numpy_sin.register_fake
def _(x):
    return torch.empty_like(x)


def _sin_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _sin_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return grad * torch.cos(x)


numpy_sin.register_autograd(_sin_backward, setup_context=_sin_setup)

torch_rule_calls = []


@torch.library.register_vmap("functx_tests::numpy_sin")
def _numpy_sin_vmap(info, in_dims, x):
    torch_rule_calls.append((info.batch_size, in_dims))
    return numpy_sin(x), in_dims[0]


def test_custom_op_under_grad_at_every_level():
    x = torch.randn(3, 4, dtype=D)
    loss = lambda v: numpy_sin(v).sum()
    torch.testing.assert_close(functx.grad(loss)(x), x.cos())
    torch.testing.assert_close(functx.grad(lambda v: functx.grad(loss)(v).sum())(x), -x.sin())
    torch.testing.assert_close(functx.vmap(functx.grad(loss))(x), x.cos())
    torch.testing.assert_close(functx.grad(lambda v: functx.vmap(loss)(v).sum())(x), x.cos())
    torch.testing.assert_close(functx.vjp(numpy_sin, x)[1](torch.ones_like(x))[0], x.cos())
    torch.testing.assert_close(functx.jacrev(numpy_sin)(x[0]), torch.diag(x[0].cos()))
    torch.testing.assert_close(functx.hessian(lambda v: numpy_sin(v).sum())(x[0]), torch.diag(-x[0].sin()))


def test_torch_registered_vmap_rule_is_used():
    x = torch.randn(5, 4, dtype=D)
    torch_rule_calls.clear()
    with functx.vmap_fallback("error"):
        torch.testing.assert_close(functx.vmap(numpy_sin)(x), x.sin())
        torch.testing.assert_close(functx.vmap(numpy_sin, in_dims=1)(x), x.sin().T)
    assert torch_rule_calls == [(5, (0,)), (4, (1,))]  # the in_dim as passed, as torch.func gives it


_lib = torch.library.Library("functx_tests", "FRAGMENT")
_lib.define("scaled_add(Tensor x, Tensor y, float alpha) -> Tensor")
_lib.impl("scaled_add", lambda x, y, alpha: x + alpha * y, "CompositeExplicitAutograd")


def test_functx_library_rule_for_a_library_defined_op_and_late_registration():
    op = torch.ops.functx_tests.scaled_add.default
    xs, y = torch.randn(4, 3, dtype=D), torch.randn(3, dtype=D)
    with pytest.warns(functx.PerformanceWarning, match="functx_tests::scaled_add"):
        torch.testing.assert_close(functx.vmap(op, in_dims=(0, None, None))(xs, y, 2.0), xs + 2 * y)
    calls = []

    @functx.library.register_vmap("functx_tests::scaled_add")
    def rule(info, in_dims, x, y, alpha):
        calls.append(in_dims)
        x = x if in_dims[0] is not None else x.expand(info.batch_size, *x.shape)
        y = y if in_dims[1] is not None else y.expand(info.batch_size, *y.shape)
        return op(x, y, alpha), 0

    with functx.vmap_fallback("error"):  # the rule registered after the op's first vmap is used
        torch.testing.assert_close(functx.vmap(op, in_dims=(0, None, None))(xs, y, 2.0), xs + 2 * y)
        torch.testing.assert_close(functx.vmap(op, in_dims=(None, 0, None))(y, xs, 0.5), y + 0.5 * xs)
    assert calls == [(0, None, None), (None, 0, None)]


def test_register_vmap_rejects_what_is_not_an_operator():
    with pytest.raises(TypeError, match="expected an operator"):
        functx.library.register_vmap(lambda x: x, lambda *a: a)
    with pytest.raises(ValueError, match="like 'mylib::op'"):
        functx.library.register_vmap("no_namespace", lambda *a: a)


# -- registering again, keyword-only tensors, rules that are not functions ----------------
@torch.library.custom_op("functx_tests::triple", mutates_args=())
def triple(x: torch.Tensor) -> torch.Tensor:
    return 3 * x


triple.register_autograd(lambda ctx, grad: 3 * grad, setup_context=lambda ctx, inputs, output: None)


def _recording_rule(calls, name):
    def rule(info, in_dims, x):
        calls.append(name)
        return triple(x), in_dims[0]

    return rule


def test_registering_a_rule_again_replaces_it_at_once_under_every_level():
    """A second `register_vmap` for an op vmap already ran replaces the first rule at the
    op's next call (the first one used to stay: it was kept in the rule table on first use),
    at a plain vmap level, one under a grad level, one carrying a direct grad level
    (`vmap(grad(f))`: the overrides' lookup), and inside a vmap that already ran the op."""
    xs, w = torch.randn(4, 3, dtype=D), torch.randn(3, dtype=D)
    loss = lambda v: (triple(v) * w).sum()
    runs = {
        "vmap": lambda: functx.vmap(triple)(xs),
        "grad(vmap)": lambda: functx.grad(lambda v: functx.vmap(loss)(v).sum())(xs),
        "vmap(grad)": lambda: functx.vmap(functx.grad(loss))(xs),
    }
    expected = {
        "vmap": torch.stack([3 * x for x in xs]),
        "grad(vmap)": torch.stack([3 * w for _ in xs]),
        "vmap(grad)": torch.stack([3 * w for _ in xs]),
    }
    for name in ("first", "second", "third"):
        calls = []
        functx.library.register_vmap(triple, _recording_rule(calls, name))
        with functx.vmap_fallback("error"):
            for run, f in runs.items():
                calls.clear()
                torch.testing.assert_close(f(), expected[run])
                assert calls and set(calls) == {name}, (run, calls)

    # inside one vmap call: the op's second call uses the rule registered after the first
    seen = []

    def body(x):
        functx.library.register_vmap(triple, _recording_rule(seen, "before"))
        y = triple(x)
        functx.library.register_vmap(triple, _recording_rule(seen, "after"))
        return triple(y)

    torch.testing.assert_close(functx.vmap(body)(xs), torch.stack([9 * x for x in xs]))
    assert seen == ["before", "after"]


@torch.library.custom_op("functx_tests::quadruple", mutates_args=())
def quadruple(x: torch.Tensor) -> torch.Tensor:
    return 4 * x


def test_a_rule_registered_again_with_torch_library_replaces_it():
    xs = torch.randn(4, 3, dtype=D)
    calls = []
    for name in ("first", "second"):
        torch.library.register_vmap(
            quadruple, lambda info, in_dims, x, name=name: (calls.append(name) or quadruple(x), in_dims[0])
        )
        calls.clear()
        with functx.vmap_fallback("error"):
            torch.testing.assert_close(functx.vmap(quadruple)(xs), torch.stack([4 * x for x in xs]))
        assert calls == [name]


_lib.define("kw_add(Tensor x, *, Tensor y) -> Tensor")
_lib.impl("kw_add", lambda x, *, y: x + y, "CompositeExplicitAutograd")
_lib.define("kw_add.pair(Tensor x, Tensor y) -> Tensor")
_lib.impl("kw_add.pair", lambda x, y: x + y, "CompositeExplicitAutograd")
_lib.define("kw_scale(Tensor x, *, float k) -> Tensor")
_lib.impl("kw_scale", lambda x, *, k: x * k, "CompositeExplicitAutograd")


def test_register_vmap_refuses_keyword_only_tensor_arguments():
    """The rule's in_dims has no entry for a keyword-only tensor: it used to get the batched
    tensor itself in kwargs, and a BatchedTensor of the wrong shape escaped vmap. Refused at
    registration, as torch.library.register_vmap does; the op then runs per sample."""
    from functx.vmap import fallback
    from functx.vmap.rules.user_rules import REGISTERED

    op = torch.ops.functx_tests.kw_add
    rule = lambda info, in_dims, x, y: (x + y, 0)
    for target in ("functx_tests::kw_add", op, op.default):
        with pytest.raises(NotImplementedError, match="kwarg-only Tensor args.*Got: functx_tests::kw_add"):
            functx.library.register_vmap(target, rule)
    assert op.default not in REGISTERED and op.pair not in REGISTERED  # nothing, not even the other overload
    x, y = torch.ones(2, 3, dtype=D), torch.arange(6.0, dtype=D).reshape(3, 2)
    fallback._warned.discard(op.default)  # (it warns once per op and process)
    with pytest.warns(functx.PerformanceWarning, match="kw_add"):
        out = functx.vmap(lambda x, y: op(x, y=y), in_dims=(0, 1))(x, y)
    assert type(out) is torch.Tensor
    torch.testing.assert_close(out, torch.stack([op(x[b], y=y[:, b]) for b in range(2)]))
    # keyword-only arguments that are not tensors are fine
    calls = []

    @functx.library.register_vmap("functx_tests::kw_scale")
    def scale_rule(info, in_dims, x, *, k):
        calls.append((in_dims, k))
        return torch.ops.functx_tests.kw_scale(x, k=k), in_dims[0]

    with functx.vmap_fallback("error"):
        out = functx.vmap(lambda x: torch.ops.functx_tests.kw_scale(x, k=2.5), in_dims=1)(y)
    torch.testing.assert_close(out, torch.stack([y[:, b] * 2.5 for b in range(2)]))
    assert calls == [((1,), 2.5)]


def test_a_rule_never_gets_a_batched_keyword_only_tensor():
    """Should such a rule be in the registry anyway (functx's own registrations go to it
    directly), the call is refused rather than given a batched tensor without its in_dim."""
    from functx.vmap.rules import user_rules

    op = torch.ops.functx_tests.kw_add.default
    user_rules.register(op, lambda info, in_dims, x, y: (x + y, 0))
    try:
        x, y = torch.ones(2, 3, dtype=D), torch.arange(6.0, dtype=D).reshape(3, 2)
        with pytest.raises(NotImplementedError, match="batched tensor in a keyword-only argument"):
            functx.vmap(lambda x, y: op(x, y=y), in_dims=(0, 1))(x, y)
        # unbatched at this level, it is an ordinary argument
        out = functx.vmap(lambda x: op(x, y=y[:, 0]))(x)
        torch.testing.assert_close(out, torch.stack([x[b] + y[:, 0] for b in range(2)]))
    finally:
        del user_rules.REGISTERED[op]


def test_register_vmap_refuses_a_rule_that_is_not_callable():
    xs = torch.randn(4, 3, dtype=D)
    calls = []
    functx.library.register_vmap(triple, _recording_rule(calls, "kept"))
    with pytest.raises(TypeError, match="register_vmap: the rule must be callable.*got int"):
        functx.library.register_vmap(triple, 5)
    with pytest.raises(TypeError, match="must be callable.*got str"):
        functx.library.register_vmap(triple)("not a rule")
    with functx.vmap_fallback("error"):  # the rule before stays
        torch.testing.assert_close(functx.vmap(triple)(xs), 3 * xs)
    assert calls == ["kept"]


@torch.library.custom_op("functx_tests::quintuple", mutates_args=())
def quintuple(x: torch.Tensor) -> torch.Tensor:
    return 5 * x


def test_a_torch_registered_rule_that_is_not_callable_is_named():
    torch.library.register_vmap(quintuple, 5)  # torch accepts it
    with pytest.raises(TypeError, match="torch.library.register_vmap for functx_tests::quintuple is not callable"):
        functx.vmap(quintuple)(torch.randn(4, 3))
