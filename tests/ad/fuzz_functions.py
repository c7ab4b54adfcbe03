"""torch.autograd.Function families for the differential fuzzer (test_fuzz_transforms.py).

Every Function computes the same binary map, `f(x, y) = x * y + sin(x)` with `y`
broadcasting to `x` (`y` may be `x` itself), so the fuzzer's reference runs that math in
plain torch (`reference`) and each family differs only in how torch / functx / torch.func
reach it:

- `plain`:     torch forward, `setup_context`, `backward`, `jvp`; no vmap support (vmap
               raises, as in torch.func);
- `numpy`:     NumPy forward (`torch.as_tensor(np.sin(x.detach().numpy()) + ...)`),
               `backward`, `jvp`, and a `vmap` staticmethod that moves the batch dims to the
               front and calls `apply` again on the batched tensors;
- `generated`: `generate_vmap_rule = True`, torch forward, `backward`, `jvp`;
- `fwdonly`:   `generate_vmap_rule = True` and a `jvp` staticmethod only (no backward:
               reverse transforms raise, as in torch.func);
- `nojvp`:     `generate_vmap_rule = True` and `backward` only (torch.func's forward
               transforms raise; functx's take the double-VJP identity through `backward`);
- `nested`:    `generate_vmap_rule = True`, torch forward, `backward` and `jvp` that apply
               another Function (`_Product`,
               whose own `backward` and `jvp` apply it again): a Function applied inside a
               Function's derivative, at every level (jvp(jvp) of one lost its second
               derivative where both jvp levels wrapped: zero);
- `oldstyle`:  `forward(ctx, x, y)` with `backward` (torch.func refuses old-style Functions
               under every transform; functx runs them under grad/vjp, per element under
               vmap, and under forward transforms by the double-VJP identity).

`backward` and `jvp` are written in differentiable torch ops on the saved inputs, so every
order of derivative goes through them.
"""

import numpy as np
import torch

from tests.autograd_functions import Mul


def reference(x, y):
    return x * y + torch.sin(x)


def _backward(x, y, g):
    gx = g * (y + torch.cos(x))
    gy = (g * x).sum_to_size(y.shape)
    return gx, gy


def _jvp(x, y, tx, ty):
    out = torch.zeros_like(x * y)
    if tx is not None:
        out = out + tx * (y + torch.cos(x))
    if ty is not None:
        out = out + ty * x
    return out


class _Saving(torch.autograd.Function):
    @staticmethod
    def setup_context(ctx, inputs, output):
        x, y = inputs
        ctx.save_for_backward(x, y)
        ctx.save_for_forward(x, y)


class PlainFn(_Saving):
    @staticmethod
    def forward(x, y):
        return reference(x, y)

    @staticmethod
    def backward(ctx, g):
        return _backward(*ctx.saved_tensors, g)

    @staticmethod
    def jvp(ctx, tx, ty):
        return _jvp(*ctx.saved_tensors, tx, ty)


class NumpyFn(_Saving):
    @staticmethod
    def forward(x, y):
        # resolved first, as NumPy code must be written: `.numpy()` refuses a lazy negative
        # view (`fft(v).conj().imag` is one), in plain torch as under every transform
        xn, yn = x.detach().resolve_neg().numpy(), y.detach().resolve_neg().numpy()
        return torch.as_tensor(np.sin(xn) + xn * yn)

    @staticmethod
    def backward(ctx, g):
        return _backward(*ctx.saved_tensors, g)

    @staticmethod
    def jvp(ctx, tx, ty):
        return _jvp(*ctx.saved_tensors, tx, ty)

    @staticmethod
    def vmap(info, in_dims, x, y):
        xd, yd = in_dims
        x = x.movedim(xd, 0) if xd is not None else x.expand(info.batch_size, *x.shape)
        if yd is not None:  # batch dim first, then y's own dims right-aligned against x's
            y = y.movedim(yd, 0)
            y = y.reshape(y.shape[:1] + (1,) * (x.dim() - y.dim()) + y.shape[1:])
        return NumpyFn.apply(x, y), 0


class GeneratedFn(_Saving):
    generate_vmap_rule = True

    @staticmethod
    def forward(x, y):
        return reference(x, y)

    @staticmethod
    def backward(ctx, g):
        return _backward(*ctx.saved_tensors, g)

    @staticmethod
    def jvp(ctx, tx, ty):
        return _jvp(*ctx.saved_tensors, tx, ty)


class ForwardOnlyFn(_Saving):
    generate_vmap_rule = True

    @staticmethod
    def forward(x, y):
        return reference(x, y)

    @staticmethod
    def jvp(ctx, tx, ty):
        return _jvp(*ctx.saved_tensors, tx, ty)


class NoJvpFn(_Saving):
    generate_vmap_rule = True

    @staticmethod
    def forward(x, y):
        return reference(x, y)

    @staticmethod
    def backward(ctx, g):
        return _backward(*ctx.saved_tensors, g)


class _Product(Mul):
    """a * b (b broadcasting to a), whose derivatives apply it again (forward, context and
    vmap rule: tests/autograd_functions.Mul's)."""

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return _Product.apply(g, b), _Product.apply(g, a).sum_to_size(b.shape)

    @staticmethod
    def jvp(ctx, ta, tb):
        a, b = ctx.saved_tensors
        out = torch.zeros_like(a * b)
        if ta is not None:
            out = out + _Product.apply(ta, b)
        if tb is not None:
            out = out + _Product.apply(a, tb)
        return out


class NestedFn(_Saving):
    generate_vmap_rule = True

    @staticmethod
    def forward(x, y):
        return reference(x, y)

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        return _Product.apply(g, y + torch.cos(x)), _Product.apply(g, x).sum_to_size(y.shape)

    @staticmethod
    def jvp(ctx, tx, ty):
        x, y = ctx.saved_tensors
        out = torch.zeros_like(x * y)
        if tx is not None:
            out = out + _Product.apply(tx, y + torch.cos(x))
        if ty is not None:
            out = out + _Product.apply(x, ty)
        return out


class OldStyleFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y):
        ctx.save_for_backward(x, y)
        return reference(x, y)

    @staticmethod
    def backward(ctx, g):
        return _backward(*ctx.saved_tensors, g)


FUNCTIONS = {
    "plain": PlainFn,
    "numpy": NumpyFn,
    "generated": GeneratedFn,
    "fwdonly": ForwardOnlyFn,
    "nojvp": NoJvpFn,
    "nested": NestedFn,
    "oldstyle": OldStyleFn,
}
