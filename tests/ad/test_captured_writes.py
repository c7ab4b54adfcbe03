"""In-place writes into tensors from outside the transformed function (captured tensors).

Issue 26 item 6 and issue 27: the *direct* AD levels (the outermost `grad`/`vjp`/`jacrev`,
`vmap(grad)`, `vmap(jvp)`, an outermost `jvp` of plain primals, a `grad` over those:
functx/ad/direct_reverse.py, direct_forward.py) record on the values themselves, and no
dispatch-level check saw a write there: `captured.copy_(x)` under `functx.grad` was accepted
and left the caller's `captured` holding the level's graph (`grad_fn=<CopyBackwards>`, or
`CopySlices` through a view `captured[0:2].copy_(x)`); under `jvp` it was accepted too.
torch.func refuses all of them ("would mutate a captured Tensor"), and functx's wrapped
levels did. Now every AD level refuses a write of a differentiated value into a captured
tensor before anything is written (lifting.CapturedWrites), while the writes torch allows
and that leave the caller's tensors as plain torch would keep working: constants, detached
values, values of tensors tracked outside, and anything written into tensors the function
made itself. References: torch.func (which refuses), plain torch.autograd in float64.
"""

import pytest
import torch
import torch.func as tf

import functx
from functx.core.interpreter import current_stack

D = torch.float64


def _write(kind, captured, x):
    """Write (a value of) the differentiated `x` into `captured` the way `kind` says."""
    if kind == "copy_":
        captured.copy_(x)
    elif kind == "setitem":
        captured[0] = x[0]
    elif kind == "view copy_":  # issue 27: through a view of the captured tensor
        captured[0:2].copy_(x[:2])
    elif kind == "view of view mul_":
        view = captured[1:]
        view[1:].mul_(x[2:])
    elif kind == "add_":
        captured.add_(x)
    elif kind == "iadd":
        c = captured
        c += x
    elif kind == "index_put_":
        captured.index_put_((torch.tensor([0, 2]),), x[:2])
    elif kind == "out=":
        torch.mul(x, 2, out=captured)
    else:
        raise AssertionError(kind)


KINDS = ["copy_", "setitem", "view copy_", "view of view mul_", "add_", "iadd", "index_put_", "out="]


def _run(name, f, x):
    """Run `f` (R^3 -> scalar) under the composition `name`."""
    t = torch.ones(3, dtype=D)
    if name == "grad":
        return functx.grad(f)(x)
    if name == "vjp":
        return functx.vjp(f, x)
    if name == "jvp":
        return functx.jvp(f, (x,), (t,))
    if name == "jacrev":
        return functx.jacrev(f)(x)
    if name == "jacfwd":
        return functx.jacfwd(f)(x)
    if name == "hessian":
        return functx.hessian(f)(x)
    if name == "vmap(grad)":
        return functx.vmap(functx.grad(f))(torch.stack([x, 2 * x]))
    if name == "vmap(grad) unbatched input":
        return functx.vmap(functx.grad(lambda p, s: f(p) * s), in_dims=(None, 0))(x, torch.ones(2, dtype=D))
    if name == "vmap(jvp)":
        return functx.vmap(lambda p: functx.jvp(f, (p,), (t,)))(torch.stack([x, 2 * x]))
    if name == "grad(grad)":
        return functx.grad(lambda v: functx.grad(f)(v).sum())(x)
    if name == "jvp(grad)":
        return functx.jvp(functx.grad(f), (x,), (t,))
    if name == "vjp(grad)":
        return functx.vjp(functx.grad(f), x)
    if name == "jvp(jvp)":
        return functx.jvp(lambda v: functx.jvp(f, (v,), (t,))[1], (x,), (t,))
    raise AssertionError(name)


COMPOSITIONS = [
    "grad", "vjp", "jvp", "jacrev", "jacfwd", "hessian", "vmap(grad)", "vmap(grad) unbatched input",
    "vmap(jvp)", "grad(grad)", "jvp(grad)", "vjp(grad)", "jvp(jvp)",
]  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", COMPOSITIONS)
def test_a_differentiated_value_written_into_a_captured_tensor_is_refused(name, kind):
    """Was accepted by the direct levels (grad, vjp, jvp, jacrev, vmap(grad), vmap(jvp) with
    batched... , grad(grad), jvp(grad), vjp(grad)), leaving the caller's tensor with the
    level's `grad_fn` (CopyBackwards / CopySlices / AddBackward0). Now refused as torch.func
    refuses it, before the write: the caller's tensor keeps its value and has no history."""
    captured = torch.arange(3, dtype=D) + 10
    before = captured.clone()

    def f(x):
        _write(kind, captured, x)
        return (captured * x).sum()

    x = torch.randn(3, dtype=D)
    if kind == "out=" and name in ("jacfwd", "jvp(jvp)"):  # a wrapped jvp level refuses out= first
        with pytest.raises(RuntimeError, match="out="):
            _run(name, f, x)
    else:
        with pytest.raises(RuntimeError, match="would mutate a captured Tensor") as info:
            _run(name, f, x)
        assert "captured tensor" in str(info.value) and "clone()" in str(info.value)  # says how to fix it
    assert current_stack() == ()
    assert torch.equal(captured, before)
    assert captured.grad_fn is None and not captured.requires_grad
    assert torch.autograd.forward_ad.unpack_dual(captured).tangent is None


@pytest.mark.parametrize("kind", ["copy_", "setitem", "view copy_", "add_"])
@pytest.mark.parametrize("name", ["grad", "vjp", "jvp", "jacrev", "jacfwd", "hessian", "vmap(grad)"])
def test_torch_func_refuses_the_same_writes(name, kind):
    """The oracle: torch.func raises a RuntimeError for each of these too (the same wording
    is in functx's message)."""
    captured = torch.arange(3, dtype=D) + 10

    def f(x):
        _write(kind, captured, x)
        return (captured * x).sum()

    x = torch.randn(3, dtype=D)
    run = {
        "grad": lambda: tf.grad(f)(x),
        "vjp": lambda: tf.vjp(f, x),
        "jvp": lambda: tf.jvp(f, (x,), (x,)),
        "jacrev": lambda: tf.jacrev(f)(x),
        "jacfwd": lambda: tf.jacfwd(f)(x),
        "hessian": lambda: tf.hessian(f)(x),
        "vmap(grad)": lambda: tf.vmap(tf.grad(f))(torch.stack([x, x])),
    }[name]
    with pytest.raises(RuntimeError, match="mutate a captured Tensor"):
        run()


@pytest.mark.parametrize("name", ["grad", "jvp", "vmap(grad)"])
def test_a_call_returning_the_captured_tensor_itself_does_not_make_it_the_functions(name):
    """`captured.add_(1)`, `captured.contiguous()`, `captured.to(dtype)` return the captured
    tensor itself: it is still not the function's, and a later differentiated write into
    it is refused (first draft of the check took them for tensors the function made)."""
    captured = torch.zeros(3, dtype=D)

    def f(x):
        captured.add_(1)
        captured.contiguous()
        captured.to(D)
        captured.copy_(x)
        return (captured * x).sum()

    with pytest.raises(RuntimeError, match="captured Tensor"):
        _run(name, f, torch.randn(3, dtype=D))
    assert captured.grad_fn is None and captured.tolist() == [1.0, 1.0, 1.0]


def test_a_captured_tensor_batched_by_an_outer_vmap_is_refused_too():
    """`vmap(lambda c, x: grad(...c.copy_(x)...)(x))(C, X)`: `c` is batched (it is the
    caller's `C`), so vmap's batched-into-unbatched check did not fire, and the user's `C`
    came back with `grad_fn=<CopyBackwards>`."""
    C = torch.zeros(2, 3, dtype=D)

    def f(c, x):
        def inner(x):
            c.copy_(x)
            return (c * x).sum()

        return functx.grad(inner)(x)

    with pytest.raises(RuntimeError, match="captured Tensor"):
        functx.vmap(f)(C, torch.randn(2, 3, dtype=D))
    assert torch.equal(C, torch.zeros(2, 3, dtype=D)) and C.grad_fn is None
    assert current_stack() == ()


def test_a_tensor_made_by_an_outer_transform_is_captured_for_an_inner_one():
    """Made inside the outer function but outside the inner one: torch.func refuses the
    inner level's write into it, and so does functx (it used to record it)."""
    x = torch.randn(3, dtype=D)

    def outer(x):
        h = x * 2

        def inner(y):
            h.copy_(y)
            return (h * y).sum()

        return functx.grad(inner)(x).sum()

    with pytest.raises(RuntimeError, match="captured Tensor"):
        functx.grad(outer)(x)
    assert current_stack() == ()


def test_an_input_that_is_not_differentiated_is_the_functions_own():
    """`grad(f)(x, buf)` differentiates x only: `buf` is an argument of the function, not a
    captured tensor, and torch.func computes it (issue 27: functx refused it). The value is
    right, `buf` holds the written value afterwards and, under grad, none of the level's
    history (torch.func keeps that on its wrapper). Under hessian (wrapped levels: the
    argument is a constant wrapper of the level, `ADLevel.own`) it works too."""
    buf = torch.zeros(3, dtype=D)

    def f(x, buf):
        buf.copy_(x)
        return (buf * x).sum()

    x = torch.randn(3, dtype=D)
    torch.testing.assert_close(functx.grad(f)(x, buf), 2 * x)
    assert torch.equal(buf, x) and buf.grad_fn is None and not buf.requires_grad
    other = torch.zeros(3, dtype=D)
    torch.testing.assert_close(functx.hessian(f)(x, other), 2 * torch.eye(3, dtype=D))
    assert torch.equal(other.detach(), x)
    assert current_stack() == ()


# -- what stays allowed -----------------------------------------------------------------------
def _autograd_grad(f, x):
    x = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(f(x), x)
    return g


@pytest.mark.parametrize("name", ["grad", "vjp", "jvp", "jacrev", "hessian", "vmap(grad)", "grad(grad)", "jvp(grad)"])
def test_values_that_are_not_differentiated_may_be_written_into_captured_tensors(name):
    """A constant, a detached value, the captured tensor's own value: nothing of the level
    is written, the caller's tensor ends as plain torch leaves it (no history), and the
    derivatives are plain torch.autograd's."""
    captured = torch.zeros(3, dtype=D)
    count = torch.zeros((), dtype=D)

    def f(x):
        captured.copy_(torch.ones(3, dtype=D))
        if not name.startswith("vmap"):  # (under vmap a batched value: vmap refuses it)
            captured.add_(x.detach())
        captured.mul_(2)
        captured[0:2] = torch.full((2,), 5.0, dtype=D)
        count.add_(1)
        return (captured.detach() * x.sin()).sum()

    x = torch.randn(3, dtype=D)
    _run(name, f, x)
    assert captured.grad_fn is None and not captured.requires_grad
    if name == "grad":
        want_captured = torch.cat([torch.full((2,), 5.0, dtype=D), 2 * (1 + x[2:])])
        torch.testing.assert_close(captured, want_captured)
        torch.testing.assert_close(functx.grad(f)(x), _autograd_grad(f, x))
    assert current_stack() == ()
    assert count.item() >= 1


def test_a_value_of_a_tensor_tracked_outside_may_be_written_as_plain_torch_writes_it():
    """`captured.copy_(w * 2)` with `w` a parameter closed over (not differentiated by the
    level): the write belongs to the caller's graph, as without the transform; the level's
    leaves never reach `captured`. (torch.func refuses it: its levels wrap every result.)"""
    w = torch.randn(3, dtype=D, requires_grad=True)
    captured = torch.zeros(3, dtype=D)

    def f(x):
        captured.copy_(w * 2)
        return (captured * x).sum()

    x = torch.randn(3, dtype=D)
    g = functx.grad(f)(x)
    torch.testing.assert_close(g, 2 * w.detach())
    (dw,) = torch.autograd.grad(captured.sum(), w)  # the caller's graph: d(2w)/dw
    torch.testing.assert_close(dw, torch.full((3,), 2.0, dtype=D))


@pytest.mark.parametrize("name", ["grad", "jacrev", "hessian", "grad(grad)", "jvp(grad)", "vmap(grad)", "jvp"])
def test_writes_into_tensors_the_function_made_keep_working(name):
    """Factories, clones, results of ops on captured tensors, views of them, results of a
    transform called inside: the function's own, written with differentiated values.
    Values against plain torch.autograd (float64)."""
    captured = torch.tensor([0.5, -1.0, 2.0], dtype=D)
    # Results of ops on captured tensors are the function's own at the direct levels (as in
    # torch.func); a wrapped level (hessian's inner ones) and vmap (unbatched) refuse them.
    results_of_ops = name in ("grad", "jacrev", "grad(grad)", "jvp(grad)", "jvp")

    def f(x):
        h = torch.zeros_like(x) if name == "vmap(grad)" else torch.zeros(3, dtype=D)
        h[0] = x[0]
        h[1:].copy_(x[1:] * x[0])
        c = captured.clone() * torch.ones_like(x)
        c.mul_(x)
        d = captured * 2
        if results_of_ops:
            d[2:] = x[2:].exp()
        inner = functx.grad(lambda v: (v**3).sum())(x)
        inner.mul_(x)
        return (h.sin() * c + d + inner).sum()

    x = torch.randn(3, dtype=D)
    if name == "grad":
        torch.testing.assert_close(functx.grad(f)(x), _autograd_grad(f, x))
    elif name == "grad(grad)":
        v = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(f(v), v, create_graph=True)
        (want,) = torch.autograd.grad(g.sum(), v)
        torch.testing.assert_close(functx.grad(lambda y: functx.grad(f)(y).sum())(x), want)
    elif name == "hessian":
        torch.testing.assert_close(functx.hessian(f)(x), torch.autograd.functional.hessian(f, x))
    elif name == "jacrev":
        torch.testing.assert_close(functx.jacrev(f)(x), _autograd_grad(f, x))
    elif name == "jvp":
        t = torch.randn(3, dtype=D)
        torch.testing.assert_close(functx.jvp(f, (x,), (t,))[1], (_autograd_grad(f, x) * t).sum())
    elif name == "jvp(grad)":
        t = torch.randn(3, dtype=D)
        want = torch.autograd.functional.hessian(f, x) @ t
        torch.testing.assert_close(functx.jvp(functx.grad(f), (x,), (t,))[1], want)
    else:
        xs = torch.stack([x, 2 * x])
        want = torch.stack([_autograd_grad(f, r) for r in xs])
        torch.testing.assert_close(functx.vmap(functx.grad(f))(xs), want)
    torch.testing.assert_close(captured, torch.tensor([0.5, -1.0, 2.0], dtype=D))
    assert captured.grad_fn is None
    assert current_stack() == ()


def test_batch_norm_running_statistics_of_a_captured_module_are_still_updated():
    """BatchNorm in training mode writes its running statistics (the module's own buffers,
    captured) in place: not a differentiated value, so it stays allowed under the outermost
    grad, as in plain torch (values: plain torch on a copy of the module)."""
    bn = torch.nn.BatchNorm1d(3).double()
    ref = torch.nn.BatchNorm1d(3).double()
    x = torch.randn(5, 3, dtype=D)
    params = {k: v.detach() for k, v in bn.named_parameters()}
    g = functx.grad(lambda p: functx.nn.functional_call(bn, p, (x,)).pow(2).sum())(params)
    p = {k: v.detach().requires_grad_() for k, v in ref.named_parameters()}
    want = torch.autograd.grad(torch.func.functional_call(ref, p, (x,)).pow(2).sum(), list(p.values()))
    torch.testing.assert_close(list(g.values()), list(want))
    torch.testing.assert_close(bn.running_mean, ref.running_mean)
    torch.testing.assert_close(bn.running_var, ref.running_var)
    assert bn.running_mean.grad_fn is None and int(bn.num_batches_tracked) == 1


def test_the_check_leaves_after_the_function_and_after_an_exception():
    """The check is a TorchFunctionMode while the function runs: gone after the transform
    returns or raises (writes after it are plain torch's)."""
    from torch.overrides import _get_current_function_mode_stack

    modes = len(_get_current_function_mode_stack())
    captured = torch.zeros(3, dtype=D)

    def bad(x):
        captured.copy_(x)
        return x.sum()

    with pytest.raises(RuntimeError, match="captured Tensor"):
        functx.grad(bad)(torch.randn(3, dtype=D))
    assert len(_get_current_function_mode_stack()) == modes
    functx.grad(lambda x: x.sum())(torch.randn(3, dtype=D))
    functx.jvp(lambda x: x.sin(), (torch.randn(3, dtype=D),), (torch.randn(3, dtype=D),))
    assert len(_get_current_function_mode_stack()) == modes
    assert current_stack() == ()


def _write_into_argument(x, y):
    y.copy_(x * 2)
    return (y * y).sum()


@pytest.mark.parametrize("transform", ["grad", "jacrev", "vmap(grad)"])
def test_writing_into_a_non_differentiated_argument_is_a_valid_program(transform):
    """Issue 27: the transformed function's own arguments are not captured tensors:
    `y.copy_(x * 2)` with argnums=0 runs in torch.func (it wraps every tensor argument at
    the level); against plain autograd (d/dx of sum((2x)^2) = 8x), and the argument holds
    the written value afterwards, as plain torch and torch.func leave it."""
    x = torch.randn(3, dtype=torch.float64)
    y = torch.zeros(3, dtype=torch.float64)
    if transform == "grad":
        result = functx.grad(_write_into_argument)(x, y)
    elif transform == "jacrev":
        result = functx.jacrev(_write_into_argument)(x, y)
    else:
        xs, ys = torch.randn(4, 3, dtype=torch.float64), torch.zeros(4, 3, dtype=torch.float64)
        result = functx.vmap(functx.grad(_write_into_argument))(xs, ys)
        torch.testing.assert_close(result, 8 * xs)
        torch.testing.assert_close(ys, 2 * xs)
        assert current_stack() == ()
        return
    torch.testing.assert_close(result, 8 * x)
    torch.testing.assert_close(y.detach(), 2 * x)
    assert current_stack() == ()


# Every way a non-differentiated argument reaches a level (direct and wrapped, reverse and
# forward): `value(x, y)` writes 2x (or x * z) into y and returns sum((y * y)) or y's sine.
# Reference: the closed form of the written-into program's derivative; afterwards y holds the
# written primal value (what plain torch and torch.func leave) and no level's history.
def _copy_into(x, y):
    y.copy_(x * 2)
    return torch.sin(y) * x


def _setitem_into(x, y, z):
    x[:2] = y * z
    return torch.sin(x)


def _jacobian_copy_into(x):  # d/dx sin(2x) * x
    return torch.diag(2 * torch.cos(2 * x) * x + torch.sin(2 * x))


WRITE_STACKS = {
    "jacfwd": lambda x, y: functx.jacfwd(_copy_into)(x, y),
    "jacrev": lambda x, y: functx.jacrev(_copy_into)(x, y),
    "jacfwd(chunk_size=1)": lambda x, y: functx.jacfwd(_copy_into, chunk_size=1)(x, y),
    "jvp(jacfwd)": lambda x, y: functx.jvp(lambda v: functx.jacfwd(_copy_into)(v, y), (x,), (torch.ones_like(x),))[0],
    "jacrev(chunk_size=1)": lambda x, y: functx.jacrev(_copy_into, chunk_size=1)(x, y),
    "jacfwd(jacfwd) diagonal": lambda x, y: torch.diag(
        functx.jacfwd(lambda v: torch.diagonal(functx.jacfwd(_copy_into)(v, y)))(x).diagonal() * 0 + 1
    ) * _jacobian_copy_into(x),
}
# at a direct reverse level the caller's tensor keeps the write's history until vjp_fn has
# run (torch records it there, as plain torch would); grad drops it (`_drop_recorded_writes`)
KEEPS_HISTORY = {"jacrev", "jacrev(chunk_size=1)"}


@pytest.mark.parametrize("stack", sorted(WRITE_STACKS))
def test_a_write_into_a_non_differentiated_argument_under_every_stack(stack):
    x = torch.randn(3, dtype=D)
    y = torch.zeros(3, dtype=D)
    torch.testing.assert_close(WRITE_STACKS[stack](x, y), _jacobian_copy_into(x))
    torch.testing.assert_close(y.detach(), 2 * x)
    assert stack in KEEPS_HISTORY or (y.grad_fn is None and not y.requires_grad)
    assert current_stack() == ()


@pytest.mark.parametrize("outer", ["vmap", "none"])
@pytest.mark.parametrize("transform", ["jacfwd", "jacrev"])
def test_a_write_of_two_differentiated_arguments_into_a_third(transform, outer):
    """`x[:2] = y * z` with argnums=(1, 2): the Jacobians of sin(x) in y and z, through the
    write (rows 0 and 1: cos(y z) z and cos(y z) y on the diagonal, row 2 zero)."""
    jac = getattr(functx, transform)(_setitem_into, argnums=(1, 2))
    y, z = torch.randn(2, dtype=D), torch.randn(2, dtype=D)

    def expected(y, z):
        c = torch.cos(y * z)
        dy, dz = torch.zeros(4, 2, dtype=D), torch.zeros(4, 2, dtype=D)
        dy[:2] = torch.diag(c * z)
        dz[:2] = torch.diag(c * y)
        return dy, dz

    if outer == "none":
        x = torch.zeros(4, dtype=D)
        got = jac(x, y, z)
        for g, e in zip(got, expected(y, z)):
            torch.testing.assert_close(g, e)
        torch.testing.assert_close(x[:2], y * z)
    else:
        xs, ys, zs = torch.zeros(3, 4, dtype=D), torch.randn(3, 2, dtype=D), torch.randn(3, 2, dtype=D)
        got = functx.vmap(jac)(xs, ys, zs)
        for k in range(3):
            for g, e in zip(got, expected(ys[k], zs[k])):
                torch.testing.assert_close(g[k], e)
        torch.testing.assert_close(xs[:, :2], ys * zs)
    assert current_stack() == ()


@pytest.mark.parametrize("transform", ["vmap(jacfwd)", "vmap(jacrev)", "vmap(hessian)", "jacfwd(vmap)"])
def test_a_write_into_a_batched_non_differentiated_argument(transform):
    xs, ys = torch.randn(4, 3, dtype=D), torch.zeros(4, 3, dtype=D)
    if transform == "jacfwd(vmap)":
        got = functx.jacfwd(functx.vmap(_copy_into))(xs, ys)  # (4, 3, 4, 3): blocks on the diagonal
        got = torch.stack([got[k, :, k] for k in range(4)])
    elif transform == "vmap(hessian)":
        got = functx.vmap(functx.hessian(lambda a, b: _copy_into(a, b).sum()))(xs, ys)
        expected = torch.stack([torch.diag(4 * torch.cos(2 * x) - 4 * x * torch.sin(2 * x)) for x in xs])
        torch.testing.assert_close(got, expected)
        torch.testing.assert_close(ys, 2 * xs)
        return
    else:
        got = functx.vmap(getattr(functx, transform[5:-1])(_copy_into))(xs, ys)
    torch.testing.assert_close(got, torch.stack([_jacobian_copy_into(x) for x in xs]))
    torch.testing.assert_close(ys, 2 * xs)
    assert current_stack() == ()


@pytest.mark.parametrize("transform", ["grad", "hessian", "jacfwd", "jacrev(jacrev)"])
def test_a_non_differentiated_argument_still_leaves_torch(transform):
    """A non-differentiated argument is a constant wrapper at a wrapped level (ADLevel.own):
    `.numpy()`, `np.asarray` and `.tolist()` of it still give its values, as before it was
    wrapped (torch.func raises there)."""
    import numpy as np

    def f(x, y, idx):
        scale = torch.as_tensor(y.numpy() * 2) + torch.as_tensor(np.asarray(y))
        return (x[idx.tolist()] * scale[idx.tolist()]).pow(2).sum()

    x, y, idx = torch.randn(3, dtype=D), torch.randn(3, dtype=D), torch.tensor([0, 2])
    mask = torch.tensor([1.0, 0.0, 1.0], dtype=D)
    grad = 2 * x * (3 * y) ** 2 * mask
    if transform == "grad":
        torch.testing.assert_close(functx.grad(f)(x, y, idx), grad)
    elif transform == "jacfwd":
        torch.testing.assert_close(functx.jacfwd(functx.grad(f))(x, y, idx), torch.diag(2 * (3 * y) ** 2 * mask))
    else:
        hess = functx.hessian(f) if transform == "hessian" else functx.jacrev(functx.jacrev(f))
        torch.testing.assert_close(hess(x, y, idx), torch.diag(2 * (3 * y) ** 2 * mask))
    assert current_stack() == ()


@pytest.mark.parametrize("case", ["caller requires grad", "a view, grad(grad) with a closure", "vjp(vjp) with a closure", "grad(grad) with a closure"])
def test_a_write_into_a_differentiated_input_is_refused(case):
    """torch refuses an in-place write into a leaf that requires grad, and torch.func into
    its level's input. A direct level's leaf for an input the caller (or an outer level)
    tracks is a view of it, which torch lets be written: the gradient then came out with
    respect to the written value (grad of sum(2 v) written in place as 1, not 2). Refused."""
    x = torch.randn(3, dtype=D)
    if case == "caller requires grad":
        x.requires_grad_()
        run = lambda: functx.grad(lambda v: v.mul_(2).sum())(x)
    elif case == "a view, grad(grad) with a closure":
        inner = lambda y: (y[1:].mul_(2), torch.sin(y))[1].sum()
        run = lambda: functx.grad(lambda a: functx.grad(inner)(a * a).sum())(x)
    elif case == "vjp(vjp) with a closure":

        def outer(a):
            _, fn = functx.vjp(lambda y: torch.sin(y.mul_(2)), a * (1 + 0.5 * torch.sin(a)))
            return fn(torch.ones(3, dtype=D))[0]

        run = lambda: functx.vjp(outer, x)
    else:
        run = lambda: functx.grad(lambda a: functx.grad(lambda y: torch.sin(y.mul_(2)).sum())(a * a).sum())(x)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad is being used in an in-place operation"):
        run()
    assert current_stack() == ()
    # writes into a copy stay allowed, and are right
    torch.testing.assert_close(functx.grad(lambda v: v.clone().mul_(2).sum())(x.detach()), torch.full((3,), 2.0, dtype=D))


def test_writes_into_values_computed_from_a_connected_input_stay_allowed():
    """The leaf check is for the leaf and its views only: a value computed from it (`v * 2`)
    and views of that value may be written, as in plain torch, with the caller's tensor
    requiring grad (the level's leaf is then a view of it); a captured view of the caller's
    tensor written with a constant stays allowed too."""
    x = torch.randn(3, dtype=D, requires_grad=True)

    def f(v):
        y = v * 2
        y[1:].mul_(3)
        return y.sum()

    torch.testing.assert_close(functx.grad(f)(x), torch.tensor([2.0, 6.0, 6.0], dtype=D))
    buf = torch.zeros(3, dtype=D)
    torch.testing.assert_close(functx.grad(lambda v: (buf[1:].add_(1), (v * v).sum())[1])(x), 2 * x.detach())
    assert current_stack() == ()
