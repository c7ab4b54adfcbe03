"""One derivative operator per AD transform, for functions from a 0-d tensor to a 0-d tensor,
so that any chain of transforms can be written once and built from functx or torch.func."""

import torch

DERIVATIVES = ("jvp", "jacfwd", "grad", "jacrev", "vjp")


def derivative(lib, name):
    """d/dx of a function from a 0-d tensor to a 0-d tensor, by the transform `name` of `lib`."""
    if name == "jvp":
        return lambda f, x: lib.jvp(f, (x,), (torch.ones_like(x),))[1]
    if name == "grad":
        return lambda f, x: lib.grad(f)(x)
    if name == "vjp":

        def by_vjp(f, x):
            out, pullback = lib.vjp(f, x)
            return pullback(torch.ones_like(out))[0]

        return by_vjp
    jacobian = getattr(lib, name)
    # Through 1-element vectors, so that these tests see only what the levels do with the
    # closure; Jacobians of 0-d -> 0-d functions are test_mixed_partials.test_zero_dim_jacobians'.
    return lambda f, x: jacobian(lambda v: f(v.reshape(())).reshape(1))(x.reshape(1)).reshape(())
