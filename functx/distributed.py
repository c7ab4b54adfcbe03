"""Multi-process training with `torch.distributed`: DP-SGD across ranks, ensembles sharded
across ranks, and functx's batching rules for torch's functional collectives.

Three parts, all built on an initialised process group (`torch.distributed.init_process_group`;
`torchrun` sets the environment for it) and working with any backend ("gloo" on CPUs,
"nccl" on GPUs: tensors on each rank's own device, `torch.cuda.set_device(local_rank)`):

- **DP-SGD across ranks** (`clipped_grad`, `noised_sum`): every rank clips the per-sample
  gradients of its own slice of the batch (`functx.dp.clipped_grad`'s kernels, or
  `vmap(grad)` with `method="vmap"`), the clipped sums of all ranks are added by ONE
  all-reduce (all gradients flattened into one buffer), and the Gaussian noise
  N(0, (σ·C)²) is added once: the group's first rank draws it from its `generator` and adds
  it to its own sums before the all-reduce. The result is the same tensor on every rank,
  and equals `functx.dp.clipped_grad` of one process on the concatenated batch with the
  same `generator` seed (up to the rounding of the summation order).
- **Ensembles sharded across ranks** (`shard_ensemble_state`, `gather_predictions`): each
  rank keeps a contiguous slice of the members of a stacked state (`stack_module_state`,
  `functx.nn.vmap_init`) or of a `functx.nn.Ensemble`, trains it on its own, and the
  members' predictions are gathered in member order.
- **Batching rules for `torch.distributed._functional_collectives`**: code written for one
  sample that calls `all_reduce`, `all_gather_tensor` / `all_gather_single`,
  `reduce_scatter_tensor` / `reduce_scatter_single`, `all_to_all_single`, `broadcast`,
  their coalesced forms and `wait_tensor` works under `functx.vmap`: each collective runs
  ONCE on the physical (batched) tensor, with the batch dim moved where the collective
  leaves it alone (all-reduce and broadcast are elementwise: anywhere; gathers, scatters
  and all-to-all work on dim 0 of the sample: the batch goes to dim 1). Every rank must
  call a collective with the same batch size, as it must call it with the same shapes
  outside vmap (the rules: `functx/vmap/rules/collectives.py`, which `functx.vmap` imports
  the first time it meets one of these ops: this module need not be imported). Gradients come from torch's own
  autograd formulas for these ops (torch >= 2.13 registers them on the `_c10d_functional`
  ops: all_reduce(sum) <-> all_reduce(sum), all_gather <-> reduce_scatter(sum)), which
  functx.grad, vjp, jacrev, vmap(grad) and grad(vmap) use; as in torch, the gradient is
  that of the sum of every rank's loss. Forward mode (jvp, jacfwd, hessian, linearize), which
  torch does not give these ops (its forward AD drops their tangents: zeros), is functx's: a
  collective is linear, so the output's tangent is the same collective of every rank's
  tangent (`functx/ad/collectives.py`, through functx/ad/library_ops.py); all_reduce with
  max/min is not, and is an error. Second derivatives (hessian, jacrev(jacrev),
  vmap(grad(grad))) are right; under vmap torch's double backward of a collective (an
  old-style autograd.Function) runs once per sample, with a PerformanceWarning.

Under vmap, an `AsyncCollectiveTensor` (what the Python wrappers return, waiting on first
use) is waited on at once. The in-place and `out=` forms (`all_reduce_`, `broadcast_`,
`*_out`) and the point-to-point ops (`isend`, `irecv`, `batch_p2p_ops`) are refused under
vmap with an error naming the out-of-place form: run once per sample, they would be read
before the collective finished.
"""

from __future__ import annotations

from collections.abc import Callable

import optree
import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from .ad import collectives as _forward_rules  # noqa: F401  (the collectives' forward-mode rules)
from .dp import _check_clip_arguments
from .vmap.rules import collectives as _batching_rules  # noqa: F401  (the collectives' batching rules)

if not dist.is_available():  # pragma: no cover - torch built without distributed support
    raise ImportError(
        "functx.distributed needs torch.distributed, which this build of torch does not have "
        "(torch.distributed.is_available() is False); install a torch build with distributed support"
    )

import torch.distributed._functional_collectives as funcol  # noqa: E402  (registers the _c10d_functional ops)

__all__ = ["clipped_grad", "noised_sum", "shard_ensemble_state", "gather_predictions"]


# -- process groups ----------------------------------------------------------------------
def _process_group(group, api: str):
    """`group`, or the default group, checked: a clear error when there is none."""
    if not dist.is_initialized():
        raise RuntimeError(
            f"functx.distributed.{api}: torch.distributed is not initialised. Call "
            f"torch.distributed.init_process_group(backend='gloo') (CPU) or backend='nccl' (GPU) on every "
            f"process first (under torchrun, init_process_group() reads the rank and world size from the "
            f"environment); in a single process, use functx.dp.clipped_grad instead."
        )
    if group is None:
        return dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"functx.distributed.{api}: group must be a torch.distributed.ProcessGroup (e.g. from "
            f"torch.distributed.new_group) or None for the default group, got {type(group).__name__}"
        )
    return group


# -- DP-SGD ------------------------------------------------------------------------------
def clipped_grad(
    module: nn.Module,
    loss_fn: Callable,
    inputs,
    targets,
    *,
    max_norm: float,
    noise_multiplier: float = 0.0,
    generator: torch.Generator | None = None,
    params: dict[str, Tensor] | None = None,
    group: dist.ProcessGroup | None = None,
    method: str = "kernels",
) -> tuple[dict[str, Tensor], Tensor]:
    """The DP-SGD gradient of a batch split across the ranks of `group`: the clipped sums of
    every rank's samples, added up, plus N(0, (σ·max_norm)²) noise drawn once; the same on
    every rank.

    Each rank passes its own slice of the batch (slices may differ in size). The result equals
    `functx.dp.clipped_grad(module, loss_fn, all_inputs, all_targets, ...)` of one process on
    the concatenation of the ranks' slices in rank order, with the same `generator` seed
    (to the rounding of the summation order): each rank clips its samples with
    `functx.dp.clipped_grad` (no noise), one all-reduce adds the sums (`noised_sum`: every
    gradient in one buffer per dtype), and the noise is drawn by the group's first rank from
    its `generator` (the other ranks' generators are not used) and added before the
    all-reduce, so it is added once and every rank ends with the same gradient. Divide by
    the global batch size yourself, as with `functx.dp.clipped_grad`. Call it on every rank
    of `group`, with the same `max_norm`, `noise_multiplier`, `method` and the same model
    (the same parameters on every rank: DP-SGD steps keep them so).

    Args:
        module (torch.nn.Module): the model, as for `functx.dp.clipped_grad`.
        loss_fn (Callable): `loss_fn(module(*inputs), targets)` -> one loss per sample,
            shape (B_local,) (`reduction="none"`).
        inputs (Tensor | tuple): this rank's slice of the batch: a tensor or a tuple of
            positional arguments of the forward, batch first.
        targets (Any): this rank's targets, passed to `loss_fn` as they are.
        max_norm (float): the clipping norm C (keyword-only), > 0.
        noise_multiplier (float, default 0.0): σ, >= 0; 0 for no noise.
        generator (torch.Generator | None, default None): for the noise; read on the group's
            first rank only (None: that rank's global generator).
        params (dict[str, Tensor] | None, default None): functional state instead of the
            module's own parameters, as for `functx.dp.clipped_grad`.
        group (torch.distributed.ProcessGroup | None, default None): the process group;
            None: the default group.
        method (str, default "kernels"): "kernels": `functx.dp.clipped_grad`, which never
            materialises the per-sample gradients (its per-layer kernels; layers it has none
            for go by `vmap` of their own vjp). "vmap": per-sample gradients by
            `functx.vmap(functx.grad(...))` of the module called on one sample at a time (a
            batch of one), clipped and summed: for models `functx.dp.clipped_grad` refuses (a
            parameter used outside its module's forward, a layer that does not keep the
            batch first). Both give the same gradient.

    Returns:
        tuple[dict[str, Tensor], Tensor]: `(grads, norms)`: parameter name -> the summed,
        clipped, noised gradient (the same on every rank); and this rank's (B_local,)
        per-sample gradient norms before clipping (not gathered: gather them with
        `torch.distributed.all_gather` if needed).

    Raises:
        RuntimeError: torch.distributed is not initialised (no default process group).
        TypeError: `group` is not a `ProcessGroup`; `params` is not a dict.
        ValueError: `method` is not "kernels" or "vmap"; `max_norm` is not a positive number
            or `noise_multiplier` is not a number >= 0 (a bool, None or NaN is refused;
            checked before any work, for either method); with `method="vmap"`, a loss not
            of shape (1,) for a batch of one, a BatchNorm in training mode, or `inputs`
            without a tensor
            ([error catalogue: functx.distributed](../errors.md#functxdistributed)).
            With `method="kernels"`, every error of `functx.dp.clipped_grad`
            ([error catalogue: functx.dp.clipped_grad](../errors.md#functxdpclipped_grad)).

    Examples:
        A world of one process (under torchrun the same code runs on every rank, each with
        its own slice of the batch): the result is `functx.dp.clipped_grad`'s, noise included.

        >>> import torch, torch.distributed as dist, functx
        >>> import torch.nn.functional as F
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        >>> x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
        >>> loss = lambda out, y: F.cross_entropy(out, y, reduction="none")
        >>> grads, norms = functx.distributed.clipped_grad(model, loss, x, y, max_norm=1.0,
        ...     noise_multiplier=1.0, generator=torch.Generator().manual_seed(0))
        >>> single, _ = functx.dp.clipped_grad(model, loss, x, y, max_norm=1.0,
        ...     noise_multiplier=1.0, generator=torch.Generator().manual_seed(0))
        >>> all(torch.allclose(grads[n], single[n]) for n in single), norms.shape
        (True, torch.Size([16]))

        `method="vmap"` gives the same gradient from materialised per-sample gradients:

        >>> by_vmap, _ = functx.distributed.clipped_grad(model, loss, x, y, max_norm=1.0,
        ...     noise_multiplier=1.0, generator=torch.Generator().manual_seed(0), method="vmap")
        >>> all(torch.allclose(grads[n], by_vmap[n], atol=1e-6) for n in grads)
        True
        >>> dist.destroy_process_group()

    Differences from torch.func:
        torch.func has no DP-SGD and no distributed API. With torch.func each rank computes
        per-sample gradients with `vmap(grad(...))`, clips and sums them, all-reduces every
        gradient with `torch.distributed.all_reduce`, and adds the noise on one rank (or uses
        Opacus's `DifferentiallyPrivateDistributedDataParallel`). This function does it with
        one all-reduce of a flat buffer, draws the noise once on the group's first rank, and
        gives the gradient `functx.dp.clipped_grad` gives on the whole batch in one process.
    """
    group = _process_group(group, "clipped_grad")
    _check_clip_arguments(max_norm, noise_multiplier, "functx.distributed.clipped_grad")  # before any work
    if method == "kernels":
        from . import dp

        sums, norms = dp.clipped_grad(module, loss_fn, inputs, targets, max_norm=max_norm, params=params)
    elif method == "vmap":
        sums, norms = _vmap_clipped_sums(module, loss_fn, inputs, targets, max_norm, params)
    else:
        raise ValueError(f"functx.distributed.clipped_grad: method must be 'kernels' or 'vmap', got {method!r}")
    grads = noised_sum(sums, max_norm=max_norm, noise_multiplier=noise_multiplier, generator=generator, group=group)
    return grads, norms


def noised_sum(
    sums: dict[str, Tensor],
    *,
    max_norm: float,
    noise_multiplier: float = 0.0,
    generator: torch.Generator | None = None,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Tensor]:
    """Σ over the ranks of `group` of each rank's clipped gradient sums, plus N(0, (σ·max_norm)²)
    noise added once; the same on every rank.

    The DP-SGD reduction for clipped sums made any way (e.g. per-sample gradients from
    `functx.vmap(functx.grad(...))`, clipped and summed by your own code). All tensors of one
    dtype and device go into one flat buffer and are added by ONE all-reduce. The group's
    first rank draws the noise from `generator` (in the dict's order and the way
    `functx.dp.clipped_grad` draws it, so the noise equals the one-process noise for the same
    `generator` seed) and adds it to its own sums before the all-reduce. Only that rank's
    `generator` (or, with None, its global generator) advances: pass a dedicated generator
    if other code relies on the ranks' global generators staying in step. Call it on every
    rank of `group`.

    Args:
        sums (dict[str, Tensor]): name -> this rank's clipped sum (the same names, order,
            shapes and dtypes on every rank).
        max_norm (float): the clipping norm C (keyword-only), > 0.
        noise_multiplier (float, default 0.0): σ, >= 0; 0 for no noise.
        generator (torch.Generator | None, default None): for the noise; read on the group's
            first rank only (None: that rank's global generator).
        group (torch.distributed.ProcessGroup | None, default None): the process group;
            None: the default group.

    Returns:
        dict[str, Tensor]: a new dict (the caller's tensors are not changed): name -> the
        total, in the order of `sums`; the tensors are views of the reduced buffer.

    Raises:
        RuntimeError: torch.distributed is not initialised (no default process group).
        TypeError: `group` is not a `ProcessGroup`; `sums` is not a dict of tensors.
        ValueError: `max_norm` is not a positive number or `noise_multiplier` is not a
            number >= 0 (a bool, None or NaN is refused)
            ([error catalogue: functx.distributed](../errors.md#functxdistributed)).

    Examples:
        A world of one process, where the total is the rank's own sums:

        >>> import torch, torch.distributed as dist, functx
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> sums = {"w": torch.ones(2, 3)}
        >>> total = functx.distributed.noised_sum(sums, max_norm=1.0)
        >>> total["w"].tolist()
        [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]

        The noise is σ·C times standard normal numbers drawn from `generator`:

        >>> noisy = functx.distributed.noised_sum(sums, max_norm=2.0, noise_multiplier=0.5,
        ...                                       generator=torch.Generator().manual_seed(0))
        >>> noise = 1.0 * torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
        >>> torch.allclose(noisy["w"], sums["w"] + noise), sums["w"].sum().item()  # sums unchanged
        (True, 6.0)
        >>> dist.destroy_process_group()

    Differences from torch.func:
        torch.func has no distributed API. A torch.func user all-reduces each clipped sum
        with `torch.distributed.all_reduce` (one call per tensor, in place) and adds noise on
        one rank by hand. `noised_sum` does one all-reduce per dtype and device, leaves the
        caller's tensors unchanged, and draws the noise as `functx.dp.clipped_grad` does.
    """
    group = _process_group(group, "noised_sum")
    _check_clip_arguments(max_norm, noise_multiplier, "functx.distributed.noised_sum")
    if not isinstance(sums, dict) or not all(isinstance(g, Tensor) for g in sums.values()):
        raise TypeError("functx.distributed.noised_sum: sums must be a dict of parameter name -> tensor")
    buffers: dict = {}  # (dtype, device) -> [names]
    for name, g in sums.items():
        buffers.setdefault((g.dtype, g.device), []).append(name)
    flat: dict = {}
    views: dict = {}
    for key, names in buffers.items():
        flat[key] = buffer = torch.cat([sums[n].detach().reshape(-1) for n in names])
        offset = 0
        for n in names:
            numel = sums[n].numel()
            views[n] = buffer[offset : offset + numel].view(sums[n].shape)
            offset += numel
    out = {n: views[n] for n in sums}
    if noise_multiplier > 0 and dist.get_rank(group) == 0:
        from .dp import _add_noise

        _add_noise(out, noise_multiplier * max_norm, generator)  # views: into the buffers
    for buffer in flat.values():
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)
    return out


def _vmap_clipped_sums(module, loss_fn, inputs, targets, max_norm, params):
    """`functx.dp.clipped_grad`'s (sums, norms), no noise, by `vmap(grad)` of the module
    called on one sample at a time (a batch of one) through `functional_call`."""
    from .ad import grad
    from .nn.functional_call import _untie, functional_call, tied_groups
    from .vmap import vmap

    for name, sub in module.named_modules():
        if isinstance(sub, nn.modules.batchnorm._BatchNorm) and sub.training:
            raise ValueError(
                f"functx.distributed.clipped_grad: {name or 'the module'} ({type(sub).__name__}) mixes the samples "
                f"of a batch in training mode, so per-sample gradients are not defined; replace it "
                f"(GroupNorm, LayerNorm) or put it in eval mode"
            )
    if params is not None and not isinstance(params, dict):
        raise TypeError(f"functx.distributed.clipped_grad: params must be a dict of name -> tensor, got {type(params).__name__}")
    given = _untie(module, params) if params is not None else {}
    if params is None:
        diff = {n: p.detach() for n, p in module.named_parameters() if p.requires_grad}
    else:
        diff = {n: given[n].detach() for n, _ in module.named_parameters() if n in given and given[n].is_floating_point()}
    tied = {name: group for group in tied_groups(module) for name in group}
    covered = {m for n in diff for m in tied.get(n, [n])}
    everything = {
        **dict(module.named_parameters(remove_duplicate=False)),
        **dict(module.named_buffers(remove_duplicate=False)),
        **given,
    }
    fixed = {n: t.detach() if isinstance(t, Tensor) else t for n, t in everything.items() if n not in covered}
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    tensors = [a for a in inputs if isinstance(a, Tensor)]
    if not tensors or tensors[0].dim() == 0:
        raise ValueError("functx.distributed.clipped_grad: inputs must include a tensor with the batch first")
    batch = tensors[0].shape[0]

    def one(t):
        return t.unsqueeze(0) if isinstance(t, Tensor) else t

    def sample_loss(diff_params, sample_inputs, sample_targets):
        out = functional_call(module, (diff_params, fixed), tuple(one(a) for a in sample_inputs))
        loss = loss_fn(out, optree.tree_map(one, sample_targets))
        if not isinstance(loss, Tensor) or tuple(loss.shape) != (1,):
            got = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
            raise ValueError(
                f"functx.distributed.clipped_grad: loss_fn must return one loss per sample (a batch of one "
                f"gave {got}, expected (1,)): use the loss with reduction='none'"
            )
        return loss.sum()

    in_dims = (None, tuple(0 if isinstance(a, Tensor) else None for a in inputs), 0)
    per_sample = vmap(grad(sample_loss), in_dims=in_dims, randomness="different")(diff, inputs, targets)
    dtype = next(iter(diff.values())).dtype if diff else torch.get_default_dtype()
    device = next(iter(diff.values())).device if diff else tensors[0].device
    norms_sq = torch.zeros(batch, dtype=dtype, device=device)
    for g in per_sample.values():
        norms_sq = norms_sq + g.reshape(batch, -1).pow(2).sum(1).to(dtype)
    norms = norms_sq.sqrt()
    clip = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    sums = {n: torch.tensordot(clip.to(g.dtype), g, dims=1) for n, g in per_sample.items()}
    return sums, norms


# -- ensembles ---------------------------------------------------------------------------
def _member_range(members: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank `rank`'s members: `torch.tensor_split(range(members), world_size)[rank]`."""
    size, extra = divmod(members, world_size)
    start = rank * size + min(rank, extra)
    return start, start + size + (1 if rank < extra else 0)


def shard_ensemble_state(state, rank: int | None = None, world_size: int | None = None):
    """This rank's slice of a stacked ensemble: the members
    `torch.tensor_split(range(M), world_size)[rank]` (contiguous, in rank order; when M is
    not a multiple of the world size the first ranks get one member more).

    The result has the structure of `state` with each tensor sliced and copied into a new
    leaf (`requires_grad` as the original's), ready for an optimizer. A
    `functx.nn.Ensemble` gives a new `Ensemble` of its local members (same `in_dims` and
    `randomness`). Every rank must build the same full state first (e.g. the same seed), or
    load it. With `rank` and `world_size` given the function is pure (no process group
    needed). Gather the members' predictions with `gather_predictions`.

    Args:
        state (Any): a pytree of stacked tensors whose dim 0 is the member (the
            `(params, buffers)` of `functx.stack_module_state` or `functx.nn.vmap_init`, a
            dict, a tensor), all with the same member count M, or a `functx.nn.Ensemble`.
        rank (int | None, default None): this rank, 0 <= rank < world_size; None: the
            default process group's rank.
        world_size (int | None, default None): the number of ranks, at most M; None: the
            default process group's size. Give both `rank` and `world_size`, or neither.

    Returns:
        Any: `state`'s structure with this rank's members (a new `Ensemble` for an
        `Ensemble`).

    Raises:
        RuntimeError: neither `rank` nor `world_size` given and torch.distributed is not
            initialised.
        TypeError: `rank` or `world_size` is not an int (a bool counts as not); a leaf of
            `state` is not a tensor.
        ValueError: only one of `rank` and `world_size` given; not 0 <= rank < world_size;
            `state` holds no tensors; a 0-dim tensor, or tensors with different member
            counts; fewer members than ranks
            ([error catalogue: functx.distributed](../errors.md#functxdistributed)).

    Examples:
        >>> import torch, functx
        >>> _ = torch.manual_seed(0)
        >>> models = [torch.nn.Linear(3, 2) for _ in range(5)]
        >>> params, buffers = functx.stack_module_state(models)
        >>> mine, _ = functx.distributed.shard_ensemble_state((params, buffers), rank=1, world_size=2)
        >>> mine["weight"].shape, torch.equal(mine["weight"], params["weight"][3:])
        (torch.Size([2, 2, 3]), True)
        >>> mine["weight"].is_leaf, mine["weight"].requires_grad
        (True, True)

        The ranks' slices are contiguous and cover the members in order:

        >>> slices = [functx.distributed.shard_ensemble_state(params, r, 3)["bias"] for r in range(3)]
        >>> [len(s) for s in slices], torch.equal(torch.cat(slices), params["bias"])
        ([2, 2, 1], True)

        An `Ensemble` gives an `Ensemble` of the local members:

        >>> ensemble = functx.nn.Ensemble(models)
        >>> local = functx.distributed.shard_ensemble_state(ensemble, rank=0, world_size=2)
        >>> len(local), torch.allclose(local(torch.ones(1, 3)), ensemble(torch.ones(1, 3))[:3])
        (3, True)

    Differences from torch.func:
        torch.func has no distributed API. A torch.func user slices the stacked state of
        `torch.func.stack_module_state` by hand (`t[start:stop]` per tensor, then detached
        copies for an optimizer). `shard_ensemble_state` picks the slice from the process
        group (or `rank` / `world_size`), copies it into new leaves, and also shards a
        `functx.nn.Ensemble`.
    """
    if rank is None or world_size is None:
        if rank is not None or world_size is not None:
            raise ValueError("functx.distributed.shard_ensemble_state: give both rank and world_size, or neither")
        _process_group(None, "shard_ensemble_state")
        rank, world_size = dist.get_rank(), dist.get_world_size()
    for what, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"functx.distributed.shard_ensemble_state: {what} must be an int, got {type(value).__name__}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"functx.distributed.shard_ensemble_state: need 0 <= rank < world_size, got rank={rank}, world_size={world_size}"
        )
    from .nn import Ensemble

    if isinstance(state, Ensemble):
        module = state.stacked
        params, buffers = shard_ensemble_state(
            (dict(module.named_parameters()), dict(module.named_buffers())), rank, world_size
        )
        # one member is the template: it has the members' shapes (the stacked module has N more)
        return Ensemble.from_state(state.member(0), params, buffers, in_dims=state.in_dims, randomness=state.randomness)
    leaves = optree.tree_leaves(state)
    if not leaves:
        raise ValueError("functx.distributed.shard_ensemble_state: the state holds no tensors")
    bad = [type(t).__name__ for t in leaves if not isinstance(t, Tensor)]
    if bad:
        raise TypeError(
            f"functx.distributed.shard_ensemble_state: state must be a pytree of stacked tensors (as "
            f"functx.stack_module_state returns), found {bad[0]}"
        )
    members = {t.shape[0] if t.dim() else None for t in leaves}
    if None in members or len(members) > 1:
        raise ValueError(
            f"functx.distributed.shard_ensemble_state: every tensor of the state must have the members on dim 0, "
            f"with one member count; got leading sizes {sorted(map(str, members))}"
        )
    (count,) = members
    assert count is not None  # (refused above)
    if count < world_size:
        raise ValueError(
            f"functx.distributed.shard_ensemble_state: {count} members cannot be sharded across {world_size} ranks "
            f"(each rank needs at least one member): use at most {count} ranks or at least {world_size} members"
        )
    start, stop = _member_range(count, rank, world_size)

    def shard(t: Tensor) -> Tensor:
        return t[start:stop].detach().clone().requires_grad_(t.requires_grad)

    return optree.tree_map(shard, state)


def gather_predictions(local, group: dist.ProcessGroup | None = None, dim: int = 0):
    """The predictions of every rank's members, concatenated along `dim` in rank order: with
    `shard_ensemble_state`'s slices, the predictions of the whole ensemble in member order.

    Ranks may hold different numbers of members; every other dim must agree. The result is
    the same on every rank and is differentiable (as `torch.distributed._functional_collectives`'
    all-gather: the gradient that reaches each rank's `local` is the sum of every rank's).
    Call it on every rank of `group`.

    Args:
        local (Tensor | pytree of Tensor): this rank's predictions, one member per index of
            `dim`; each rank gives the same structure, with the same dtypes and the same
            sizes except along `dim`.
        group (torch.distributed.ProcessGroup | None, default None): the process group;
            None: the default group.
        dim (int, default 0): the members' dim (negative counts from the end).

    Returns:
        Tensor | pytree of Tensor: `local`'s structure, each tensor the concatenation along
        `dim` of every rank's, in rank order.

    Raises:
        RuntimeError: torch.distributed is not initialised (no default process group).
        TypeError: `group` is not a `ProcessGroup`; `local` is not a tensor or a non-empty
            pytree of tensors.
        IndexError: `dim` is out of range for a tensor of `local`.
        ValueError: the ranks' predictions differ in structure, dtype, or a size other than
            along `dim` (raised on every rank)
            ([error catalogue: functx.distributed](../errors.md#functxdistributed)).

    Examples:
        A world of one process, where the gathered predictions are the rank's own:

        >>> import torch, torch.distributed as dist, functx
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> _ = torch.manual_seed(0)
        >>> models = [torch.nn.Linear(3, 2) for _ in range(4)]
        >>> params, buffers = functx.distributed.shard_ensemble_state(functx.stack_module_state(models))
        >>> predict = lambda p, b: torch.func.functional_call(models[0], (p, b), (torch.ones(5, 3),))
        >>> local = torch.func.vmap(predict)(params, buffers)
        >>> gathered = functx.distributed.gather_predictions(local)
        >>> gathered.shape, torch.allclose(gathered[2], models[2](torch.ones(5, 3)))
        (torch.Size([4, 5, 2]), True)

        A pytree, members on dim 1; the gradient flows back to `local`:

        >>> mean = torch.ones(2, 4, requires_grad=True)
        >>> out = functx.distributed.gather_predictions({"mean": mean, "logits": torch.zeros(3, 4, 5)}, dim=1)
        >>> out["mean"].shape, out["logits"].shape
        (torch.Size([2, 4]), torch.Size([3, 4, 5]))
        >>> torch.autograd.grad(3 * out["mean"].sum(), mean)[0][0].tolist()
        [3.0, 3.0, 3.0, 3.0]
        >>> dist.destroy_process_group()

    Differences from torch.func:
        torch.func has no distributed API. A torch.func user gathers tensor by tensor, with
        `torch.distributed.all_gather` (into tensors the caller allocates, no gradient) or
        `torch.distributed._functional_collectives.all_gather_tensor` (the same size on every
        rank). `gather_predictions` takes pytrees and different member counts per rank,
        checks that the ranks agree, and is differentiable.
    """
    group = _process_group(group, "gather_predictions")
    leaves, spec = optree.tree_flatten(local)
    if not leaves or not all(isinstance(t, Tensor) for t in leaves):
        raise TypeError("functx.distributed.gather_predictions: local must be a tensor or a pytree of tensors")
    for t in leaves:
        if not -t.dim() <= dim < t.dim():
            raise IndexError(
                f"functx.distributed.gather_predictions: dim {dim} is out of range for predictions of shape {tuple(t.shape)}"
            )
    moved = [t.movedim(dim, 0) for t in leaves]
    world_size = dist.get_world_size(group)
    mine = [(tuple(t.shape), str(t.dtype)) for t in moved]
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, mine, group=group)
    for r, theirs in enumerate(everyone):
        if len(theirs) != len(mine) or any(a[1:] != b[1:] or sa != sb for (a, sa), (b, sb) in zip(theirs, mine)):
            raise ValueError(
                f"functx.distributed.gather_predictions: rank {r} gave predictions of shapes/dtypes {theirs} (members "
                f"on dim 0) but rank {dist.get_rank(group)} gave {mine}: every rank must give the same structure, "
                f"dtypes and shapes except along dim {dim}"
            )
    gathered = []
    for i, t in enumerate(moved):
        sizes = [theirs[i][0][0] for theirs in everyone]
        most = max(sizes)
        if t.shape[0] < most:
            t = torch.cat([t, t.new_zeros((most - t.shape[0], *t.shape[1:]))])
        out = funcol.all_gather_single(t.contiguous(), 0, group)
        if isinstance(out, funcol.AsyncCollectiveTensor):
            out = out.wait()
        chunks = out.view(world_size, most, *t.shape[1:])
        gathered.append(torch.cat([chunks[r, : sizes[r]] for r in range(world_size)]).movedim(0, dim))
    return optree.tree_unflatten(spec, gathered)
