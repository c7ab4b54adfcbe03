"""In-place writes of differentiated values into buffers made inside the function, under
nested transforms (functx/ad/lifting.py): second derivatives through them are right, and a
write into a tensor from outside the function (a captured tensor) is refused by every AD
level as torch.func refuses it. References: plain torch.autograd with create_graph (one tape, no levels),
closed forms, torch.func."""

import pytest
import torch
import torch.func as tf

import functx
from functx.core.interpreter import current_stack

D = torch.float64


def autograd_second(f, a):
    """d^2 f / da^2 by plain torch.autograd (create_graph)."""
    a = a.clone().requires_grad_()
    (g,) = torch.autograd.grad(f(a), a, create_graph=True)
    (h,) = torch.autograd.grad(g.sum(), a)
    return h


def mul_into_ones(a):
    return torch.sin(torch.ones((), dtype=D).mul_(a))


def add_into_zeros(a):
    return torch.sin(torch.zeros(3, dtype=D).add_(a)).sum()


def copy_into_empty(a):
    return torch.sin(torch.empty(3, dtype=D).copy_(a)).sum()


def setitem(a):
    h = torch.zeros(3, dtype=D)
    h[0] = a
    return torch.sin(h).sum()


def setitem_through_views(a):
    h = torch.zeros(2, 3, dtype=D)
    row = h[1]
    row[2] = a * a  # through a view of a view
    h[0, 0] = a
    return (torch.sin(h) * torch.arange(6, dtype=D).view(2, 3)).sum()


def index_put_like(a):
    buf = torch.zeros(4, dtype=D)
    buf[torch.tensor([1, 3])] = torch.stack([a, a.exp()])
    return buf.pow(3).sum()


FUNCTIONS = [mul_into_ones, add_into_zeros, copy_into_empty, setitem, setitem_through_views, index_put_like]


@pytest.mark.parametrize("f", FUNCTIONS, ids=lambda f: f.__name__)
def test_grad_of_grad_through_a_fresh_buffer(f):
    a = torch.tensor(0.5, dtype=D)
    want = autograd_second(f, a)
    torch.testing.assert_close(functx.grad(functx.grad(f))(a), want)
    torch.testing.assert_close(functx.hessian(f)(a), want)
    torch.testing.assert_close(functx.jacfwd(functx.grad(f))(a), want)
    torch.testing.assert_close(functx.jacfwd(functx.jacfwd(f))(a), want)
    torch.testing.assert_close(functx.jvp(functx.grad(f), (a,), (torch.ones((), dtype=D),))[1], want)


def test_issue_values():
    a = torch.tensor(0.5)
    torch.testing.assert_close(functx.grad(functx.grad(mul_into_ones))(a.double()), -torch.sin(a.double()))
    torch.testing.assert_close(functx.grad(functx.grad(lambda a: torch.sin(torch.ones(()).mul_(a))))(a), -torch.sin(a))


def test_hessian_through_a_copied_vector_input():
    x = torch.randn(3, dtype=D)

    def f(v):
        buf = torch.zeros(3, dtype=D)
        buf.copy_(v)
        return (buf.sin() * buf).sum()

    torch.testing.assert_close(functx.hessian(f)(x), tf.hessian(f)(x))
    torch.testing.assert_close(functx.hessian(f)(x), torch.diag(2 * x.cos() - x * x.sin()))


@pytest.mark.parametrize("outer", ["jacfwd", "hessian"])
def test_write_into_a_captured_tensor_is_refused(outer):
    """A wrapped level refuses (jacfwd's jvp level and the grad inside it, hessian's inner
    jacrev): the captured tensor would carry the level's history."""
    captured = torch.zeros(3, dtype=D)

    def f(a):
        captured.copy_(a)  # a tensor from outside the function
        return captured.sin().sum()

    x = torch.randn(3, dtype=D)
    with pytest.raises(RuntimeError, match="captured tensor"):
        if outer == "jacfwd":
            functx.jacfwd(functx.grad(f))(x)
        else:
            functx.hessian(f)(x)
    assert current_stack() == ()


@pytest.mark.parametrize("outer", ["grad", "vjp", "jvp"])
def test_write_into_a_captured_tensor_under_levels_on_values(outer):
    """A grad right inside an outermost grad/vjp/jvp is direct on the values (choose.py), as
    the outermost grad is. Such levels used to record the write as plain torch does, leaving
    the captured tensor holding the level's graph; they now refuse it as wrapped levels and
    torch.func do (lifting.CapturedWrites), before anything is written. The full matrix of
    transforms is in tests/ad/test_captured_writes.py."""
    captured = torch.zeros(3, dtype=D)

    def f(a):
        captured.copy_(a)
        return captured.sin().sum()

    x = torch.randn(3, dtype=D)
    t = torch.randn(3, dtype=D)
    inner = functx.grad(f)
    with pytest.raises(RuntimeError, match="captured Tensor"):
        if outer == "grad":
            functx.grad(lambda v: (inner(v) * t).sum())(x)
        elif outer == "jvp":
            functx.jvp(inner, (x,), (t,))
        else:
            functx.vjp(inner, x)
    assert torch.equal(captured, torch.zeros(3, dtype=D))
    assert captured.grad_fn is None and not captured.requires_grad
    assert current_stack() == ()


def test_constant_writes_into_a_captured_tensor_are_fine():
    count = torch.zeros((), dtype=D)

    def f(a):
        count.add_(1)  # no differentiated value is written
        return (a * a).sum()

    x = torch.randn(3, dtype=D)
    torch.testing.assert_close(functx.grad(functx.grad(lambda v: f(v)))(torch.tensor(1.0, dtype=D)), torch.tensor(2.0, dtype=D))
    torch.testing.assert_close(functx.hessian(f)(x), 2 * torch.eye(3, dtype=D))
    assert count.item() >= 2


@pytest.mark.parametrize("transform", ["grad_of_grad", "jvp_of_jvp", "hessian"])
def test_an_exception_leaves_the_stack_and_torch_function_modes_as_they_were(transform):
    from torch.overrides import _get_current_function_mode_stack

    def f(a):
        torch.zeros(2, dtype=D)  # lifted while the wrapped level runs
        raise ValueError("inside")

    x = torch.tensor(0.5, dtype=D)
    run = {
        "grad_of_grad": lambda: functx.grad(functx.grad(f))(x),
        "jvp_of_jvp": lambda: functx.jvp(lambda v: functx.jvp(f, (v,), (v,))[1], (x,), (x,)),
        "hessian": lambda: functx.hessian(f)(x),
    }[transform]
    modes = len(_get_current_function_mode_stack())
    with pytest.raises(ValueError, match="inside"):
        run()
    assert current_stack() == ()
    assert len(_get_current_function_mode_stack()) == modes
    assert type(torch.zeros(2)) is torch.Tensor  # nothing lifts any more


# -- under vmap: an unbatched differentiated input written into the function's own buffer ----
def _copy_into_buffer(p, x):
    arr = torch.empty(4, dtype=D)
    arr.copy_(p)
    return (arr.sin() * x).sum()


def _setitem_into_buffer(p, x):
    h = torch.zeros(4, dtype=D)
    h[0] = p[1]
    h[1:] = p[1:] * 2
    return (h.sin() * x).sum()


def _jvp_of(f):
    return lambda p, x: functx.jvp(lambda q: f(q, x), (p,), (torch.ones_like(p),))[1]


PER_SAMPLE = {
    "vmap(grad)": lambda f: functx.vmap(functx.grad(f), in_dims=(None, 0)),
    "vmap(jacrev)": lambda f: functx.vmap(functx.jacrev(f), in_dims=(None, 0)),
    "vmap(hessian)": lambda f: functx.vmap(functx.hessian(f), in_dims=(None, 0)),
    "vmap(jacfwd)": lambda f: functx.vmap(functx.jacfwd(f), in_dims=(None, 0)),
    "vmap(jvp)": lambda f: functx.vmap(_jvp_of(f), in_dims=(None, 0)),
    "vmap(vmap(grad))": lambda f: functx.vmap(functx.vmap(functx.grad(f), in_dims=(None, 0)), in_dims=(None, 0)),
}


def _per_sample_reference(name, f, p, x):
    """Plain torch.autograd, one sample at a time (the vmap(vmap) case: both batch dims)."""
    if name == "vmap(vmap(grad))":
        return torch.stack([_per_sample_reference("vmap(grad)", f, p, xi) for xi in x])
    rows = []
    for xi in x:
        q = p.clone().requires_grad_()
        if name == "vmap(jvp)":
            rows.append(torch.autograd.functional.jvp(lambda v: f(v, xi), q.detach(), torch.ones_like(p))[1])
        elif name == "vmap(hessian)":
            rows.append(torch.autograd.functional.hessian(lambda v: f(v, xi), q.detach()))
        else:
            (g,) = torch.autograd.grad(f(q, xi), q)
            rows.append(g)
    return torch.stack(rows)


@pytest.mark.parametrize("f", [_copy_into_buffer, _setitem_into_buffer], ids=["copy_", "setitem"])
@pytest.mark.parametrize("name", list(PER_SAMPLE))
def test_unbatched_differentiated_input_written_into_a_fresh_buffer_under_vmap(name, f):
    """issue 12: `arr = torch.empty(4); arr.copy_(p)` under vmap(grad(f), in_dims=(None, 0))
    was refused as batched-into-unbatched (the direct level batches p for its per-element
    derivatives); the function's own buffers are now batched with it."""
    p = torch.randn(4, dtype=D)
    x = torch.randn(3, 4, dtype=D)
    if name == "vmap(vmap(grad))":
        x = torch.randn(2, 3, 4, dtype=D)
    torch.testing.assert_close(PER_SAMPLE[name](f)(p, x), _per_sample_reference(name, f, p, x))
    assert current_stack() == ()


def test_buffers_stay_unbatched_where_no_input_was_batched_for_its_derivative():
    """All differentiated inputs batched: writing one into a fresh buffer stays refused, as
    torch.func refuses it (nothing was batched behind the user's back)."""
    def f(x):
        arr = torch.empty(4, dtype=D)
        arr.copy_(x)
        return arr.sin().sum()

    x = torch.randn(3, 4, dtype=D)
    with pytest.raises(RuntimeError):
        tf.vmap(tf.grad(f))(x)
    with pytest.raises(RuntimeError, match="not batched"):
        functx.vmap(functx.grad(f))(x)
    assert current_stack() == ()


def test_untouched_fresh_constants_may_still_be_written_into_captured_tensors():
    """The buffers batched for a direct level stand for the factory's value while nothing
    wrote into them: writing them into a tensor from outside the function works, as it did
    before they were batched (torch.func refuses any such write inside grad); once written
    into, they differ per element, and the write is refused."""
    captured = torch.full((4,), 7.0, dtype=D)

    def f(p, x):
        buf = torch.zeros(4, dtype=D)
        captured.copy_(torch.ones(4, dtype=D))
        captured.add_(torch.full((4,), 2.0, dtype=D))
        return ((buf + p).sin() * x).sum()

    p, x = torch.randn(4, dtype=D), torch.randn(3, 4, dtype=D)
    torch.testing.assert_close(functx.vmap(functx.grad(f), in_dims=(None, 0))(p, x), p.cos() * x)
    torch.testing.assert_close(captured, torch.full((4,), 3.0, dtype=D))

    def h(p, x):
        buf = torch.zeros(4, dtype=D)
        buf.copy_(p)  # each element's buffer now holds its own copy of p
        captured.copy_(buf)
        return (buf * x).sum()

    # the grad level refuses it first, as torch.func does (a differentiated value written
    # into a captured tensor); vmap's batched-into-unbatched error came before
    with pytest.raises(RuntimeError, match="captured Tensor"):
        functx.vmap(functx.grad(h), in_dims=(None, 0))(p, x)
    torch.testing.assert_close(captured, torch.full((4,), 3.0, dtype=D))  # nothing written
    assert current_stack() == ()
