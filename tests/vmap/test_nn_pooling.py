"""vmap of pooling, interpolation, padding and F.unfold/F.fold
(functx/vmap/rules/nn_pooling.py) against per-sample loops.

Every case runs with inputs of shape (N, C, *spatial) and, where the op accepts it,
(C, *spatial) (the vmap batch then plays N), with the batch dim at 0 and at the last dim,
under `vmap_fallback("error")`, which proves that no per-sample loop ran. The backward
ops (what vmap(grad(...)) runs) are called directly, with each set of their
sample-shaped arguments batched.
"""

import itertools

import pytest
import torch
import torch.nn.functional as F

import functx
from functx import vmap
from .loop_reference import loop, stack_tree, batched_inputs, check  # noqa: F401

B = 3  # batch size of every test
f64 = torch.float64
aten = torch.ops.aten


# -- the check -------------------------------------------------------------------------------
def randn(*shape):
    return lambda: torch.randn(*shape, dtype=f64)


def with_patterns(cases):
    """pytest params: every case times every non-empty set of batched arguments."""
    for name, fn, makers in cases:
        for pattern in itertools.product((False, True), repeat=len(makers)):
            if any(pattern):
                label = "".join("b" if p else "u" for p in pattern)
                yield pytest.param(fn, makers, pattern, id=f"{name}-{label}")


def op(fn, *args, **kwargs):
    """fn(x, *args, **kwargs) as a function of x alone."""
    return lambda x: fn(x, *args, **kwargs)


DIMS = pytest.mark.parametrize("dim", [0, -1], ids=["dim0", "dimlast"])
STACKED = {1: (2, 3, 8), 2: (2, 3, 7, 6), 3: (2, 2, 5, 4, 6)}  # (N, C, *spatial) per spatial rank


def shapes(spatial, with_unbatched=True):
    """(id, sample shape) for a stacked input and, where accepted, one without N."""
    yield "NC", STACKED[spatial]
    if with_unbatched:
        yield "C", STACKED[spatial][1:]


def single_input_cases(table, with_unbatched=True):
    for name, spatial, fn in table:
        for label, shape in shapes(spatial, with_unbatched):
            yield pytest.param(fn, shape, id=f"{name}-{label}")


# -- pooling -------------------------------------------------------------------------------
POOLING = [
    ("max_pool1d", 1, op(F.max_pool1d, 3, stride=2, padding=1)),
    ("max_pool1d_indices", 1, op(F.max_pool1d, 2, return_indices=True)),
    ("max_pool2d", 2, op(F.max_pool2d, 2)),
    ("max_pool2d_indices_ceil", 2, op(F.max_pool2d, 3, stride=2, dilation=(1, 2), ceil_mode=True, return_indices=True)),
    ("max_pool3d_indices", 3, op(F.max_pool3d, 2, padding=1, return_indices=True)),
    ("avg_pool1d", 1, op(F.avg_pool1d, 3, stride=2, padding=1, count_include_pad=False)),
    ("avg_pool2d", 2, op(F.avg_pool2d, (2, 3), ceil_mode=True)),
    ("avg_pool2d_divisor", 2, op(F.avg_pool2d, 2, padding=1, divisor_override=3)),
    ("avg_pool3d", 3, op(F.avg_pool3d, 2, stride=(1, 2, 2))),
    ("adaptive_avg_pool1d", 1, op(F.adaptive_avg_pool1d, 3)),
    ("adaptive_avg_pool2d", 2, op(F.adaptive_avg_pool2d, (3, 4))),
    ("adaptive_avg_pool2d_global", 2, op(F.adaptive_avg_pool2d, 1)),
    ("adaptive_avg_pool3d", 3, op(F.adaptive_avg_pool3d, (2, 3, 2))),
    ("adaptive_max_pool1d", 1, op(F.adaptive_max_pool1d, 3, return_indices=True)),
    ("adaptive_max_pool2d", 2, op(F.adaptive_max_pool2d, (3, 2), return_indices=True)),
    ("adaptive_max_pool3d", 3, op(F.adaptive_max_pool3d, 2)),
    ("lp_pool1d", 1, op(F.lp_pool1d, 2, 3, stride=2)),
    ("lp_pool2d", 2, op(F.lp_pool2d, 2, 3)),
    ("lp_pool3d", 3, op(F.lp_pool3d, 2, 2)),
]


@DIMS
@pytest.mark.parametrize("fn, shape", list(single_input_cases(POOLING)))
def test_pooling(fn, shape, dim):
    check(fn, (randn(*shape),), dim=dim)


def test_lp_pool_positive_input():
    """lp_pool with an odd or fractional norm needs positive inputs to be finite."""
    check(op(F.lp_pool2d, 1.5, 2), (lambda: torch.rand(2, 3, 6, 6, dtype=f64) + 0.1,))
    check(op(F.lp_pool1d, 3, 2), (lambda: torch.rand(3, 6, dtype=f64) + 0.1,), dim=-1)


def max_unpool(spatial, kernel):
    pool, unpool = {2: (F.max_pool2d, F.max_unpool2d), 3: (F.max_pool3d, F.max_unpool3d)}[spatial]

    def fn(x):
        values, indices = pool(x, kernel, return_indices=True)
        return unpool(values, indices, kernel, output_size=x.shape[-spatial:])

    return fn


@DIMS
@pytest.mark.parametrize("spatial", [2, 3])
@pytest.mark.parametrize("unbatched", [False, True], ids=["NC", "C"])
def test_max_unpool(spatial, unbatched, dim):
    shape = STACKED[spatial][1:] if unbatched else STACKED[spatial]
    check(max_unpool(spatial, 2), (randn(*shape),), dim=dim)


def test_max_unpool_unbatched_indices():
    """Batched values scattered by shared indices."""
    x = torch.randn(2, 3, 6, 6, dtype=f64)
    _, indices = F.max_pool2d(x, 2, return_indices=True)
    fn = lambda values, indices: F.max_unpool2d(values, indices, 2)
    check(fn, (randn(2, 3, 3, 3), lambda: indices), pattern=(True, False))


FRACTIONAL = [
    ("fractional_max_pool2d", F.fractional_max_pool2d, (2, 3, 7, 6), (2, 3, 2), (3, 3)),
    ("fractional_max_pool3d", F.fractional_max_pool3d, (2, 2, 5, 6, 5), (2, 2, 3), (3, 4, 3)),
]


def fractional_cases():
    for name, pool, x_shape, samples_shape, output_size in FRACTIONAL:
        fn = lambda x, s, pool=pool, size=output_size: pool(
            x, 2, output_size=size, return_indices=True, _random_samples=s
        )
        yield name, fn, (randn(*x_shape), lambda shape=samples_shape: torch.rand(shape, dtype=f64))
        unbatched = (1, *samples_shape[1:])  # a single sample still draws (1, C, spatial)
        yield f"{name}_C", fn, (randn(*x_shape[1:]), lambda shape=unbatched: torch.rand(shape, dtype=f64))


@DIMS
@pytest.mark.parametrize("fn, makers, pattern", list(with_patterns(fractional_cases())))
def test_fractional_max_pool_given_random_samples(fn, makers, pattern, dim):
    check(fn, makers, pattern, dim)


def test_fractional_max_pool_draws_per_element_samples():
    x = torch.randn(B, 2, 3, 8, 8)
    with functx.vmap_fallback("error"):
        out = vmap(op(F.fractional_max_pool2d, 2, output_size=4), randomness="different")(x)
    assert out.shape == (B, 2, 3, 4, 4)


# -- interpolation ---------------------------------------------------------------------------
INTERPOLATION = [
    ("nearest1d", 1, op(F.interpolate, scale_factor=2.0)),
    ("nearest2d_size", 2, op(F.interpolate, size=(5, 9))),
    ("nearest3d", 3, op(F.interpolate, scale_factor=(1.5, 2.0, 0.5))),
    ("nearest_exact1d", 1, op(F.interpolate, size=5, mode="nearest-exact")),
    ("nearest_exact2d", 2, op(F.interpolate, scale_factor=1.7, mode="nearest-exact")),
    ("nearest_exact3d", 3, op(F.interpolate, size=(3, 5, 4), mode="nearest-exact")),
    ("linear", 1, op(F.interpolate, scale_factor=1.5, mode="linear")),
    ("linear_align", 1, op(F.interpolate, size=11, mode="linear", align_corners=True)),
    ("bilinear", 2, op(F.interpolate, size=(9, 4), mode="bilinear")),
    ("bilinear_align", 2, op(F.interpolate, scale_factor=2.0, mode="bilinear", align_corners=True)),
    ("bilinear_antialias", 2, op(F.interpolate, size=(3, 4), mode="bilinear", antialias=True)),
    ("bicubic", 2, op(F.interpolate, scale_factor=(1.5, 2.0), mode="bicubic")),
    ("bicubic_align", 2, op(F.interpolate, size=5, mode="bicubic", align_corners=True)),
    ("bicubic_antialias", 2, op(F.interpolate, size=(4, 3), mode="bicubic", antialias=True)),
    ("lanczos", 2, op(F.interpolate, size=(5, 4), mode="lanczos", antialias=True)),
    ("trilinear", 3, op(F.interpolate, size=(6, 3, 7), mode="trilinear")),
    ("trilinear_align", 3, op(F.interpolate, scale_factor=2.0, mode="trilinear", align_corners=True)),
    ("area1d", 1, op(F.interpolate, size=5, mode="area")),
    ("area2d", 2, op(F.interpolate, scale_factor=0.5, mode="area")),
    ("area3d", 3, op(F.interpolate, size=(2, 3, 4), mode="area")),
    ("upsample_module_bilinear", 2, torch.nn.Upsample(scale_factor=2, mode="bilinear")),
]


@DIMS
@pytest.mark.parametrize("fn, shape", list(single_input_cases(INTERPOLATION, with_unbatched=False)))
def test_interpolate(fn, shape, dim):
    check(fn, (randn(*shape),), dim=dim)


def test_upsample_needs_the_sample_dim():
    """The aten upsample ops want (N, C, ...); the vmap batch must not stand in for N."""
    with pytest.raises(RuntimeError, match="expected a 4D input"):
        vmap(lambda x: aten.upsample_nearest2d.default(x, [4, 4]))(torch.randn(B, 3, 2, 2))


# -- padding ---------------------------------------------------------------------------------
PADDING = [
    ("constant1d", 1, op(F.pad, (1, 2), value=1.5)),
    ("constant2d_negative", 2, op(F.pad, (1, -1, 0, 2))),
    ("constant_all_dims", 2, op(F.pad, (1, 1, 2, 0, 1, 0))),
    ("reflect1d", 1, op(F.pad, (2, 3), mode="reflect")),
    ("reflect2d", 2, op(F.pad, (1, 2, 3, 0), mode="reflect")),
    ("reflect3d", 3, op(F.pad, (1, 2, 0, 1, 2, 1), mode="reflect")),
    ("replicate1d", 1, op(F.pad, (3, 1), mode="replicate")),
    ("replicate2d", 2, op(F.pad, (0, 2, 1, 1), mode="replicate")),
    ("replicate3d", 3, op(F.pad, (1, 1, 2, 0, 0, 3), mode="replicate")),
    ("circular1d", 1, op(F.pad, (2, 1), mode="circular")),
    ("circular2d", 2, op(F.pad, (1, 2, 2, 1), mode="circular")),
    ("circular3d", 3, op(F.pad, (1, 0, 0, 1, 2, 2), mode="circular")),
]


@DIMS
@pytest.mark.parametrize("fn, shape", list(single_input_cases(PADDING)))
def test_pad(fn, shape, dim):
    check(fn, (randn(*shape),), dim=dim)


def test_constant_pad_longer_than_the_logical_rank_is_an_error():
    """Physically there is one more dim (the batch), which must not take padding."""
    with pytest.raises(RuntimeError, match="Length of pad"):
        vmap(lambda x: aten.constant_pad_nd.default(x, [1, 1, 1, 1]))(torch.randn(B, 4))


# -- F.unfold / F.fold -----------------------------------------------------------------------
SLIDING = [
    ("unfold", (2, 3, 6, 5), op(F.unfold, (2, 3), dilation=(2, 1), padding=1, stride=(1, 2))),
    ("unfold_C", (3, 6, 5), op(F.unfold, 2)),
    ("fold", (2, 12, 6), op(F.fold, (5, 6), 2, stride=2)),
    ("fold_C", (12, 6), op(F.fold, (5, 6), 2, stride=2)),
]


@DIMS
@pytest.mark.parametrize("fn, shape", [pytest.param(fn, shape, id=name) for name, shape, fn in SLIDING])
def test_sliding_windows(fn, shape, dim):
    check(fn, (randn(*shape),), dim=dim)


# -- nested vmap -------------------------------------------------------------------------------
NESTED = [  # (name, fn, sample shape inside both levels)
    ("max_pool2d_indices", op(F.max_pool2d, 2, return_indices=True), (3, 4, 4)),
    ("adaptive_avg_pool3d", op(F.adaptive_avg_pool3d, 2), (2, 3, 4, 4, 4)),
    ("bilinear", op(F.interpolate, scale_factor=2.0, mode="bilinear"), (2, 3, 4, 4)),
    ("reflect", op(F.pad, (1, 2, 2, 1), mode="reflect"), (3, 4, 4)),
    ("constant", op(F.pad, (1, 2), value=-1.0), (4, 4)),
]


@pytest.mark.parametrize("fn, shape", [pytest.param(fn, shape, id=name) for name, fn, shape in NESTED])
@pytest.mark.parametrize("inner_dim", [0, -1])
def test_nested(fn, shape, inner_dim):
    """Two vmap levels: the inner level's fold runs on values of the outer level."""
    outer, inner = 2, 3
    x = torch.randn(outer, inner, *shape, dtype=f64).movedim(1, 1 if inner_dim == 0 else -1)
    with functx.vmap_fallback("error"):
        out = vmap(vmap(fn, in_dims=inner_dim))(x)
    expected = stack_tree([stack_tree([fn(x[o].select(inner_dim, i)) for i in range(inner)]) for o in range(outer)])
    torch.testing.assert_close(out, expected)


# -- backward ops (what vmap(grad(...)) runs) -----------------------------------------------
def pool_backward(forward, backward, options, backward_takes_options):
    """Backward of `forward(x, *options)` as a function of (grad_output, x); the indices
    that max pooling's backward needs are computed from x inside the vmapped function."""

    def fn(grad_output, x):
        out = forward(x, *options)
        indices = (out[1],) if isinstance(out, tuple) else ()
        return backward(grad_output, x, *(options if backward_takes_options else ()), *indices)

    return fn


POOL_BACKWARD = [  # (name, forward, backward, options, backward takes the options, spatial rank)
    (
        "max_pool2d",
        aten.max_pool2d_with_indices.default,
        aten.max_pool2d_with_indices_backward.default,
        ([2, 2], [2, 1], [1, 0], [1, 1], True),
        True,
        2,
    ),
    (
        "max_pool3d",
        aten.max_pool3d_with_indices.default,
        aten.max_pool3d_with_indices_backward.default,
        ([2, 2, 2], [2, 2, 2], [0, 0, 0], [1, 1, 1], False),
        True,
        3,
    ),
    (
        "avg_pool2d",
        aten.avg_pool2d.default,
        aten.avg_pool2d_backward.default,
        ([2, 3], [2, 2], [1, 1], False, True, None),
        True,
        2,
    ),
    (
        "avg_pool3d",
        aten.avg_pool3d.default,
        aten.avg_pool3d_backward.default,
        ([2, 2, 2], [1, 2, 2], [0, 0, 0], True, False, None),
        True,
        3,
    ),
    (
        "adaptive_avg_pool2d",
        aten._adaptive_avg_pool2d.default,
        aten._adaptive_avg_pool2d_backward.default,
        ([3, 2],),
        False,
        2,
    ),
    (
        "adaptive_avg_pool3d",
        aten._adaptive_avg_pool3d.default,
        aten._adaptive_avg_pool3d_backward.default,
        ([2, 3, 2],),
        False,
        3,
    ),
    (
        "adaptive_max_pool2d",
        aten.adaptive_max_pool2d.default,
        aten.adaptive_max_pool2d_backward.default,
        ([3, 2],),
        False,
        2,
    ),
    (
        "adaptive_max_pool3d",
        aten.adaptive_max_pool3d.default,
        aten.adaptive_max_pool3d_backward.default,
        ([2, 3, 2],),
        False,
        3,
    ),
    ("reflection_pad1d", aten.reflection_pad1d.default, aten.reflection_pad1d_backward.default, ([2, 1],), True, 1),
    (
        "reflection_pad2d",
        aten.reflection_pad2d.default,
        aten.reflection_pad2d_backward.default,
        ([2, 1, 0, 2],),
        True,
        2,
    ),
    (
        "reflection_pad3d",
        aten.reflection_pad3d.default,
        aten.reflection_pad3d_backward.default,
        ([1, 1, 0, 2, 1, 0],),
        True,
        3,
    ),
    ("replication_pad1d", aten.replication_pad1d.default, aten.replication_pad1d_backward.default, ([2, 1],), True, 1),
    (
        "replication_pad2d",
        aten.replication_pad2d.default,
        aten.replication_pad2d_backward.default,
        ([2, 1, 0, 2],),
        True,
        2,
    ),
    (
        "replication_pad3d",
        aten.replication_pad3d.default,
        aten.replication_pad3d_backward.default,
        ([1, 1, 0, 2, 1, 0],),
        True,
        3,
    ),
]


def pool_backward_cases():
    for name, forward, backward, options, takes_options, spatial in POOL_BACKWARD:
        fn = pool_backward(forward, backward, options, takes_options)
        for label, shape in shapes(spatial):
            out_shape = forward(torch.randn(shape, dtype=f64), *options)
            out_shape = (out_shape[0] if isinstance(out_shape, tuple) else out_shape).shape
            yield f"{name}-{label}", fn, (randn(*out_shape), randn(*shape))


@DIMS
@pytest.mark.parametrize("fn, makers, pattern", list(with_patterns(pool_backward_cases())))
def test_pool_backward(fn, makers, pattern, dim):
    check(fn, makers, pattern, dim)


def test_fractional_max_pool_backward():
    samples = torch.rand(2, 3, 2, dtype=f64)

    def fn(grad_output, x):
        _, indices = aten.fractional_max_pool2d.default(x, [2, 2], [3, 3], samples)
        return aten.fractional_max_pool2d_backward.default(grad_output, x, [2, 2], [3, 3], indices)

    for pattern in ((True, False), (False, True), (True, True)):
        check(fn, (randn(2, 3, 3, 3), randn(2, 3, 7, 6)), pattern)


UPSAMPLE_BACKWARD = [  # (name, backward op, output_size, sample input size, options)
    ("nearest1d", aten.upsample_nearest1d_backward.default, [7], [2, 3, 4], (None,)),
    ("nearest2d", aten.upsample_nearest2d_backward.default, [5, 6], [2, 3, 4, 3], (None, None)),
    ("nearest_exact3d", aten._upsample_nearest_exact3d_backward.default, [3, 4, 5], [2, 2, 2, 3, 2], ()),
    ("linear1d", aten.upsample_linear1d_backward.default, [7], [2, 3, 4], (True,)),
    ("bilinear2d", aten.upsample_bilinear2d_backward.default, [5, 6], [2, 3, 4, 3], (False,)),
    ("bicubic2d", aten.upsample_bicubic2d_backward.default, [5, 6], [2, 3, 4, 3], (True,)),
    ("trilinear3d", aten.upsample_trilinear3d_backward.default, [3, 4, 5], [2, 2, 2, 3, 2], (False,)),
    ("bilinear2d_aa", aten._upsample_bilinear2d_aa_backward.default, [3, 2], [2, 3, 5, 4], (False,)),
    ("lanczos2d_aa", aten._upsample_lanczos2d_aa_backward.default, [3, 2], [2, 3, 5, 4], (False,)),
]


@DIMS
@pytest.mark.parametrize(
    "backward, output_size, input_size, options", [pytest.param(*case[1:], id=case[0]) for case in UPSAMPLE_BACKWARD]
)
def test_upsample_backward(backward, output_size, input_size, options, dim):
    fn = lambda grad_output: backward(grad_output, output_size, input_size, *options)
    check(fn, (randn(*input_size[:2], *output_size),), dim=dim)


# -- end to end: per-sample gradients ---------------------------------------------------------
def interpolate(x, **options):
    """F.interpolate, also for a single (C, H, W) image (it only takes (N, C, H, W))."""
    if x.dim() == 3:
        return F.interpolate(x.unsqueeze(0), **options).squeeze(0)
    return F.interpolate(x, **options)


def image_pipeline(x):
    """A chain of every family in this file, as a small CNN would use it."""
    h = F.max_pool2d(x, 2, return_indices=True)[0]
    h = interpolate(h, scale_factor=2.0, mode="bilinear")
    h = F.pad(h, (1, 2, 2, 1), mode="reflect")
    h = F.adaptive_max_pool2d(h, 4) + F.adaptive_avg_pool2d(h, 4)
    h = F.avg_pool2d(F.pad(h, (1, 1, 1, 1), mode="replicate"), 2)
    h = interpolate(h, size=(5, 6), mode="nearest") + interpolate(h, size=(5, 6), mode="bicubic")
    h = h + interpolate(h, size=(5, 6), mode="bilinear", antialias=True)
    return F.fold(F.unfold(h, 2), (5, 6), 2)


@pytest.mark.parametrize("unbatched", [False, True], ids=["NC", "C"])
def test_vmap_of_grad_through_pooling_interpolation_and_padding(unbatched):
    """functx.vmap(functx.grad(f)) runs every backward op of these families batched."""
    shape = (3, 8, 8) if unbatched else (2, 3, 8, 8)
    x, scale = torch.randn(B, *shape, dtype=f64), torch.randn(3, 1, 1, dtype=f64)

    def loss(x, scale):
        return (image_pipeline(x) * scale).pow(2).sum()

    with functx.vmap_fallback("error"):
        grads = vmap(functx.grad(loss))(x, scale.expand(B, *scale.shape))
    for i in range(B):
        xi = x[i].clone().requires_grad_()
        (expected,) = torch.autograd.grad(loss(xi, scale), xi)
        torch.testing.assert_close(grads[i], expected)
