"""In-place writes of differentiated values into buffers made inside the function, under
nested transforms (functx/ad/lifting.py): second derivatives through them are right, and a
write into a tensor from outside the function (a captured tensor) is refused as torch.func
refuses it. References: plain torch.autograd with create_graph (one tape, no levels),
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


@pytest.mark.parametrize("outer", ["grad", "jvp"])
def test_write_into_a_captured_tensor_is_refused(outer):
    captured = torch.zeros(3, dtype=D)

    def f(a):
        captured.copy_(a)  # a tensor from outside the function
        return captured.sin().sum()

    x = torch.randn(3, dtype=D)
    inner = functx.grad(f)
    with pytest.raises(RuntimeError, match="captured tensor"):
        if outer == "grad":
            functx.grad(lambda v: inner(v).sum())(x)
        else:
            functx.jvp(inner, (x,), (torch.ones_like(x),))
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
