"""Pooling, upsampling (F.interpolate), padding, sliding windows (F.unfold / F.fold) and
grid sampling (F.grid_sample).

Each of these ops works on every sample (C, *spatial) on its own and takes either one
sample or a stack (N, C, *spatial) of them. Under vmap the batch B is folded into N: a
logical (N, C, *spatial) runs as one physical (B*N, C, *spatial) call, and a logical
(C, *spatial) lets B play N. The indices that max pooling returns count positions inside
one channel plane, so folding leaves them right. The backward ops, which reach vmap
under `vmap(grad(...))`, fold every sample-shaped tensor argument the same way.

How F.* reaches these ops (torch 2.x): max_pool1d / avg_pool1d / adaptive_*_pool1d go
through their 2d op on an unsqueezed input; lp_pool is pow + avg_pool + pointwise ops;
F.interpolate(mode="area") is adaptive_avg_pool; F.pad(mode="circular") is slices and
copies; the `.vec` upsample overloads and `aten.pad` are composite and never arrive;
F.affine_grid is composite (affine_grid_generator decomposes), F.grid_sample reaches
grid_sampler_2d / grid_sampler_3d.
"""

import torch

from ...core.errors import op_name
from ..batched_tensor import VMAP_RULES
from ..templates import materialize

aten = torch.ops.aten


# -- the fold ------------------------------------------------------------------------------
def _check_rank(op, rank, feature_rank, n_required):
    allowed = (feature_rank + 1,) if n_required else (feature_rank, feature_rank + 1)
    if rank not in allowed:
        expected = " or ".join(f"{r}D" for r in allowed)
        raise RuntimeError(f"{op_name(op)}: expected a {expected} input (N, C, ...), but got a {rank}D one")


def _unfold(interp, out, batch, n):
    """Wrap an op's result, splitting a folded leading B*N back into (B, N)."""

    def one(t):
        return interp.wrap(t.unflatten(0, (batch, n))) if isinstance(t, torch.Tensor) else t

    if isinstance(out, torch.Tensor):
        return one(out)
    return type(out)(one(t) for t in out)


def _dense(interp, x):
    """The physical value of x, an unbatched x expanded over the batch and copied: some
    kernels crash on the stride-0 batch dim of a bare expand (adaptive_max_pool3d_backward
    segfaults in torch 2.x), and folding the expanded dim into N copies anyway."""
    return x._value if interp.is_batched(x) else materialize(interp, x).contiguous()


def _fold_call(interp, op, args, kwargs, samples, feature_rank, n_required, fold_always=()):
    """Run `op` once with B folded into N in the tensor arguments at `samples` (all laid
    out like the sample: (N, C, ...) or (C, ...)); unbatched ones are expanded first.
    Arguments at `fold_always` have a leading N even for a single sample (it is 1)."""
    rank, n = args[samples[0]].dim(), args[samples[0]].shape[0]
    _check_rank(op, rank, feature_rank, n_required)
    args = list(args)
    has_n = rank == feature_rank + 1
    for i in samples:
        args[i] = _dense(interp, args[i]).flatten(0, 1) if has_n else _dense(interp, args[i])
    for i in fold_always:
        args[i] = _dense(interp, args[i]).flatten(0, 1)
    out = op(*args, **kwargs)
    return _unfold(interp, out, interp.batch_size, n) if has_n else interp.wrap_all(out)


def fold_rule(op, *, feature_rank, samples=(0,), n_required=False):
    """Rule for an op on (N, C, *spatial) or (C, *spatial) samples (`feature_rank` is the
    rank without N); with `n_required` the op only accepts the stacked form."""

    def rule(interp, *args, **kwargs):
        return _fold_call(interp, op, args, kwargs, samples, feature_rank, n_required)

    rule.__name__ = f"fold_{op.__name__}"
    return rule


def _register_fold(ops_and_ranks, samples=(0,), n_required=False):
    for op, feature_rank in ops_and_ranks:
        VMAP_RULES.set(op, fold_rule(op, feature_rank=feature_rank, samples=samples, n_required=n_required))


# -- pooling -------------------------------------------------------------------------------
_register_fold(
    [
        (aten.max_pool2d_with_indices.default, 3),
        (aten.max_pool3d_with_indices.default, 4),
        (aten.avg_pool2d.default, 3),
        (aten.avg_pool3d.default, 4),
        (aten._adaptive_avg_pool2d.default, 3),
        (aten._adaptive_avg_pool3d.default, 4),
        (aten.adaptive_max_pool2d.default, 3),
        (aten.adaptive_max_pool3d.default, 4),
    ]
)
# (grad_output, self)
_register_fold(
    [
        (aten.avg_pool2d_backward.default, 3),
        (aten.avg_pool3d_backward.default, 4),
        (aten._adaptive_avg_pool2d_backward.default, 3),
        (aten._adaptive_avg_pool3d_backward.default, 4),
    ],
    samples=(0, 1),
)
# (self, indices) and (grad_output, self, indices)
_register_fold([(aten.max_unpool2d.default, 3), (aten.max_unpool3d.default, 4)], samples=(0, 1))
_register_fold(
    [(aten.adaptive_max_pool2d_backward.default, 3), (aten.adaptive_max_pool3d_backward.default, 4)],
    samples=(0, 1, 2),
)
_register_fold(
    [(aten.max_pool2d_with_indices_backward.default, 3), (aten.max_pool3d_with_indices_backward.default, 4)],
    samples=(0, 1, 7),
)
_register_fold(
    [(aten.fractional_max_pool2d_backward.default, 3), (aten.fractional_max_pool3d_backward.default, 4)],
    samples=(0, 1, 4),
)


def _fractional_max_pool_rule(op, feature_rank):
    """fractional_max_pool(self, kernel_size, output_size, random_samples): the random
    samples (N, C, spatial) are drawn by F.fractional_max_pool* (with N = 1 for a single
    sample), so given them the op is deterministic and folds like any pooling."""

    def rule(interp, self, kernel_size, output_size, random_samples):
        args = (self, kernel_size, output_size, random_samples)
        return _fold_call(interp, op, args, {}, (0,), feature_rank, False, fold_always=(3,))

    return rule


VMAP_RULES.set(aten.fractional_max_pool2d.default, _fractional_max_pool_rule(aten.fractional_max_pool2d.default, 3))
VMAP_RULES.set(aten.fractional_max_pool3d.default, _fractional_max_pool_rule(aten.fractional_max_pool3d.default, 4))


# -- upsampling (F.interpolate) -----------------------------------------------------------------
_UPSAMPLE = [  # (forward op, its backward, spatial rank)
    (aten.upsample_nearest1d, aten.upsample_nearest1d_backward, 1),
    (aten.upsample_nearest2d, aten.upsample_nearest2d_backward, 2),
    (aten.upsample_nearest3d, aten.upsample_nearest3d_backward, 3),
    (aten._upsample_nearest_exact1d, aten._upsample_nearest_exact1d_backward, 1),
    (aten._upsample_nearest_exact2d, aten._upsample_nearest_exact2d_backward, 2),
    (aten._upsample_nearest_exact3d, aten._upsample_nearest_exact3d_backward, 3),
    (aten.upsample_linear1d, aten.upsample_linear1d_backward, 1),
    (aten.upsample_bilinear2d, aten.upsample_bilinear2d_backward, 2),
    (aten.upsample_bicubic2d, aten.upsample_bicubic2d_backward, 2),
    (aten.upsample_trilinear3d, aten.upsample_trilinear3d_backward, 3),
    (aten._upsample_bilinear2d_aa, aten._upsample_bilinear2d_aa_backward, 2),
    (aten._upsample_bicubic2d_aa, aten._upsample_bicubic2d_aa_backward, 2),
]
if hasattr(aten, "_upsample_lanczos2d_aa"):  # mode="lanczos", new in torch 2.13
    _UPSAMPLE.append((aten._upsample_lanczos2d_aa, aten._upsample_lanczos2d_aa_backward, 2))


def _upsample_backward_rule(op):
    """upsample_*_backward(grad_output, output_size, input_size, ...): input_size names
    the logical (N, C, *spatial) input, so its N becomes B*N with the fold."""

    def rule(interp, grad_output, output_size, input_size, *args, **kwargs):
        _check_rank(op, grad_output.dim(), len(input_size) - 1, True)
        folded = grad_output._value.flatten(0, 1)
        n = input_size[0]
        input_size = [interp.batch_size * n, *input_size[1:]]
        return _unfold(interp, op(folded, output_size, input_size, *args, **kwargs), interp.batch_size, n)

    rule.__name__ = f"fold_{op.__name__}"
    return rule


for _forward, _backward, _spatial in _UPSAMPLE:
    _register_fold([(_forward.default, _spatial + 1)], n_required=True)
    VMAP_RULES.set(_backward.default, _upsample_backward_rule(_backward.default))


# -- padding (F.pad) -----------------------------------------------------------------------------
_register_fold(
    [
        (aten.reflection_pad1d.default, 2),
        (aten.reflection_pad2d.default, 3),
        (aten.reflection_pad3d.default, 4),
        (aten.replication_pad1d.default, 2),
        (aten.replication_pad2d.default, 3),
        (aten.replication_pad3d.default, 4),
    ]
)
_register_fold(
    [
        (aten.reflection_pad1d_backward.default, 2),
        (aten.reflection_pad2d_backward.default, 3),
        (aten.reflection_pad3d_backward.default, 4),
        (aten.replication_pad1d_backward.default, 2),
        (aten.replication_pad2d_backward.default, 3),
        (aten.replication_pad3d_backward.default, 4),
    ],
    samples=(0, 1),
)


@VMAP_RULES.register(aten.constant_pad_nd.default)
def _constant_pad_nd(interp, x, pad, *value, **kwargs):
    """Pads count from the last dim, so the batch dim in front is never touched; only the
    check that the pads fit the logical rank must be made here."""
    if len(pad) > 2 * x.dim():
        raise RuntimeError(
            f"Length of pad should be no more than twice the number of dimensions of the input. "
            f"Pad length is {len(pad)} while the input has {x.dim()} dimensions."
        )
    return interp.wrap(aten.constant_pad_nd.default(x._value, pad, *value, **kwargs))


# -- sliding windows (F.unfold / F.fold) -------------------------------------------------------------
# im2col: (N, C, H, W) -> (N, C*kh*kw, L); col2im: (N, C*kh*kw, L) -> (N, C, H, W).
_register_fold([(aten.im2col.default, 3), (aten.col2im.default, 2)])


# -- grid sampling (F.grid_sample) ---------------------------------------------------------------
# grid_sampler_{2,3}d(input (N, C, *in_spatial), grid (N, *out_spatial, k), mode, padding,
# align_corners) -> (N, C, *out_spatial): each output point reads the input of its own sample
# at one grid point, for all channels alike. So B has three places to go: into C when only
# the input is batched (the channels share the grid), into the first output dim when only the
# grid is batched (output points are independent), into N when both are.
def _check_grid(input, grid, spatial):
    """grid_sampler's own checks on the logical shapes: the kernel would see (and name) the
    folded physical ones, which no sample has."""
    sizes = f"input with sizes {list(input.shape)} and grid with sizes {list(grid.shape)}"
    if input.dim() != spatial + 2 or grid.dim() != spatial + 2:
        raise RuntimeError(
            f"grid_sampler(): expected 4D or 5D input and grid with same number of dimensions, but got {sizes}"
        )
    if input.shape[0] != grid.shape[0]:
        raise RuntimeError(f"grid_sampler(): expected grid and input to have same batch size, but got {sizes}")
    if grid.shape[-1] != spatial:
        raise RuntimeError(
            f"grid_sampler(): expected grid to have size {spatial} in last dimension, but got grid with sizes "
            f"{list(grid.shape)}"
        )


def _grid_sampler_rule(op, spatial):
    def rule(interp, input, grid, *args):
        _check_grid(input, grid, spatial)
        batch = interp.batch_size
        if not interp.is_batched(grid):
            folded = input._value.movedim(0, 1).flatten(1, 2)
            out = op(folded, grid, *args)
            return interp.wrap(out.unflatten(1, (batch, input.shape[1])).movedim(1, 0))
        if not interp.is_batched(input):
            folded = grid._value.movedim(0, 1).flatten(1, 2)
            out = op(input, folded, *args)
            return interp.wrap(out.unflatten(2, (batch, grid.shape[1])).movedim(2, 0))
        out = op(input._value.flatten(0, 1), grid._value.flatten(0, 1), *args)
        return interp.wrap(out.unflatten(0, (batch, input.shape[0])))

    rule.__name__ = f"fold_{op.__name__}"
    return rule


def _grid_sampler_backward_rule(op, spatial):
    """(grad_output, input, grid, mode, padding, align_corners, output_mask) -> (grad_input,
    grad_grid). grad_input sums over output points and grad_grid over channels, so the
    forward's folds into C and into the output dims hold only where the gradient that would
    sum over the merged elements is not asked for (per-sample gradients w.r.t. the input
    alone, or the grid alone); otherwise B folds into N, unbatched arguments expanded."""

    def rule(interp, grad_output, input, grid, mode, padding, align_corners, output_mask):
        _check_rank(op, grad_output.dim(), spatial + 1, True)
        batch = interp.batch_size
        options = (mode, padding, align_corners)
        if not interp.is_batched(grid) and not output_mask[1]:
            go, x = (_dense(interp, t).movedim(0, 1).flatten(1, 2) for t in (grad_output, input))
            grad_input = op(go, x, grid, *options, [True, False])[0]
            return interp.wrap(grad_input.unflatten(1, (batch, input.shape[1])).movedim(1, 0)), None
        if not interp.is_batched(input) and not output_mask[0]:
            go = _dense(interp, grad_output).movedim(0, 2).flatten(2, 3)
            g = _dense(interp, grid).movedim(0, 1).flatten(1, 2)
            grad_grid = op(go, input, g, *options, [False, True])[1]
            return None, interp.wrap(grad_grid.unflatten(1, (batch, grid.shape[1])).movedim(1, 0))
        args = (grad_output, input, grid, *options, output_mask)
        return _fold_call(interp, op, args, {}, (0, 1, 2), spatial + 1, True)

    rule.__name__ = f"fold_{op.__name__}"
    return rule


for _forward, _backward, _spatial in [
    (aten.grid_sampler_2d, aten.grid_sampler_2d_backward, 2),
    (aten.grid_sampler_3d, aten.grid_sampler_3d_backward, 3),
]:
    VMAP_RULES.set(_forward.default, _grid_sampler_rule(_forward.default, _spatial))
    VMAP_RULES.set(_backward.default, _grid_sampler_backward_rule(_backward.default, _spatial))
