"""`functx.checkpoint(f, policy=...)`: activation checkpointing with JAX-style policies.

`jax.checkpoint` (`jax.remat`) with a policy keeps, of the function's intermediate values,
those the policy names, and recomputes the rest in the backward. torch's non-reentrant
`torch.utils.checkpoint.checkpoint` does the same with a selective-checkpoint `context_fn`
(`create_selective_checkpoint_contexts`): a dispatch mode around the forward asks a policy
about each ATen op's output, keeps the outputs it says to keep, and in the recomputation
hands them back instead of running the op. `checkpoint` is that, in JAX's terms: a policy is
`policy(op, *args, **kwargs) -> bool` (keep this op's output?), `policy=None` keeps nothing
(JAX's default). The module is named for torch's "selective checkpoint", which also keeps
it apart from the `checkpoint_policies` namespace it defines.

What functx changes in torch's selective checkpoint:
- its modes see plain tensors only (`PlainTensorsOnly`, core/dispatch_modes.py): entered
  inside `vmap(grad(f))` torch's modes met vmap's wrapper tensors and raised
  `ModeInsideTransformError`; now they see the plain-tensor ops functx runs, so the policy
  judges each op as it runs on the whole batch (a sample's `x @ w` with `w` shared is one
  `mm` over the batch's rows; with both batched, a `bmm`);
- the recomputation may run more than once (second derivatives: `hessian`, `grad(grad)`,
  a create_graph backward differentiated again), where torch raises (`_Recomputing`);
- a kept value written into after it was kept is recomputed, where torch raises
  (`_written_since`);
- outputs of in-place ops, factories and views are never kept (`_worth_saving`).

Where it applies: where torch's checkpoint runs inside functx's transforms
(ad/checkpointing.py), i.e. with no transform, under the outermost `grad` / `vjp` /
`jacrev`, `jvp`, `hessian`, `vmap(grad(f))`, ... Under a wrapped level (`grad(hessian(f))`,
`vmap(hessian(f))`, ...) and under a `vmap` inside a `grad` (`grad(vmap(f))`) `f` runs
unchecked: the derivatives are right, the policy is not asked, nothing is recomputed and no
memory is saved.

`checkpoint_name(x, name)` runs an op of its own, `functx::checkpoint_name(x, name)` (a
copy of `x`), so that the policy sees the name among the op's arguments; an
autograd.Function around it makes its derivative the identity in both modes and batches it
under vmap.

    >>> import torch, functx
    >>> f = functx.checkpoint(lambda x: torch.sin(torch.sin(x)), policy=functx.checkpoint_policies.dots_saveable)
    >>> torch.allclose(functx.grad(lambda x: f(x).sum())(torch.zeros(2)), torch.ones(2))
    True
"""

from __future__ import annotations

import functools
import weakref
from typing import Callable

import torch
import torch.utils.checkpoint as _checkpoint
from torch import Tensor
from torch.utils import _pytree as pytree

from ..core.dispatch_modes import PlainTensorsOnly
from ..vmap.rules import user_rules

__all__ = ["checkpoint", "checkpoint_name", "checkpoint_policies"]

Policy = Callable[..., bool]  # policy(op, *args, **kwargs) -> save op's output?


def _check_policy(policy, what: str, none_keeps_nothing: bool = False) -> None:
    """`policy` is callable, or a clear TypeError naming `what`; "or None" is offered where
    None is accepted (`functx.checkpoint`'s policy)."""
    if not callable(policy):
        alternative = " or None" if none_keeps_nothing else ""
        raise TypeError(
            f"{what}: expected a callable policy(op, *args, **kwargs) -> bool (e.g. "
            f"functx.checkpoint_policies.dots_saveable){alternative}, got {type(policy).__name__}"
        )


def _context_fn(policy: Policy):
    """torch's `context_fn` for `policy`: the selective-checkpoint dispatch modes, with the
    JAX-style bool turned into torch's CheckpointPolicy. MUST_SAVE (not PREFER_SAVE) and
    PREFER_RECOMPUTE are what torch's own bool form gives."""

    def torch_policy(ctx, op, *args, **kwargs):
        save = policy(op, *args, **kwargs) and _worth_saving(op, args, kwargs, ctx.op_output)
        return _checkpoint.CheckpointPolicy.MUST_SAVE if save else _checkpoint.CheckpointPolicy.PREFER_RECOMPUTE

    def context_fn():
        caching, cached = _checkpoint.create_selective_checkpoint_contexts(torch_policy)
        return PlainTensorsOnly(caching), _Recomputing(cached)

    return context_fn


def _storages(tree) -> set:
    found: set[int | None] = set()
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, Tensor):
            try:
                found.add(leaf.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):  # no storage (sparse, ...): keep nothing
                found.add(None)
    return found


def _worth_saving(op, args, kwargs, output) -> bool:
    """Whether an op's output, which the policy would keep, is worth keeping: not the output
    of an in-place or `out=` op (the write is rerun), of a factory (no tensor inputs), or a
    view of an input (by storage: `_unsafe_view` is a view its schema does not declare):
    those cost nothing to recompute and keeping them keeps no memory from being freed. (Views
    are also what functx's batching rules reshape in place, `squeeze_` on an `_unsafe_view`
    under vmap, which torch's cache took for a write.)"""
    schema = getattr(op, "_schema", None)  # a higher-order operator has none: not kept
    if schema is None or schema.is_mutable:
        return False
    inputs = _storages((args, kwargs))
    return bool(inputs) and not (_storages(output) & inputs)


class _Recomputing:
    """The recomputation's context: torch's cached-values mode, seeing plain tensors only.

    torch's mode hands each kept value out once and then raises ("You are only allowed to
    backward once on any region computed under selective activation checkpoint"), but a
    second derivative recomputes the region again: plain `torch.autograd.grad(...,
    create_graph=True)` then a second grad raises, and so did functx's `hessian`,
    `jacrev(jacrev)`, `grad(grad)` under every policy that keeps something. JAX
    differentiates its `checkpoint` to any order. Here each entry restarts torch's count of
    ops, and a later recomputation gets the kept values again where they are still alive
    (the first recomputation's graph holds them), each as a fresh `detach()` (autograd
    attaches a recomputation's graph to the tensor it is handed: two may not share one);
    the ones that died are recomputed, which is always right. Held weakly, the kept values
    go at their first use as with torch's mode: held strongly they outlived it and raised
    the peak of per-sample gradients through `dots_saveable` by 13%."""

    def __init__(self, cached):
        self.cached = cached
        self.standin = PlainTensorsOnly(cached)
        self.kept = None  # the cache as the forward left it, held weakly

    def __enter__(self):
        storage = self.cached.storage
        if self.kept is None:
            for entries in storage.values():
                for i, entry in entries.items():
                    if _written_since(entry):
                        entries[i] = _checkpoint._RECOMPUTE
            self.kept = {
                key: {i: _held_weakly(entry) for i, entry in entries.items()} for key, entries in storage.items()
            }
        else:
            for key, entries in self.kept.items():
                storage[key] = {i: _handed_out_again(entry) for i, entry in entries.items()}
        self.cached.func_counter.clear()
        return self.standin.__enter__()

    def __exit__(self, *exc):
        return self.standin.__exit__(*exc)


def _written_since(entry) -> bool:
    """Whether a kept value was written into after it was kept (`dropout`'s `empty_like`,
    filled by `bernoulli_`; a user's `h = x @ w; h.relu_()`): torch's cache raises there
    ("has been mutated"); the op is recomputed instead, as without a policy (the writes,
    never kept, run again after it)."""
    if entry is _checkpoint._RECOMPUTE:
        return False
    kept = pytree.tree_leaves(entry, is_leaf=lambda leaf: isinstance(leaf, _checkpoint._VersionWrapper))
    return any(k.version is not None and k.val._version != k.version for k in kept)


def _held_weakly(entry):
    """A cache entry (a pytree of torch's `_VersionWrapper`s, or its "recompute" marker) with
    each value replaced by a function returning it (None once a tensor has died)."""
    if entry is _checkpoint._RECOMPUTE:
        return entry
    hold = lambda kept: weakref.ref(kept.val) if isinstance(kept.val, Tensor) else (lambda value=kept.val: value)
    return pytree.tree_map_only(_checkpoint._VersionWrapper, hold, entry)


def _handed_out_again(entry):
    """The entry of `_held_weakly`'s as torch's cache holds it, with fresh detached tensors,
    or the "recompute" marker where a tensor died."""
    if entry is _checkpoint._RECOMPUTE:
        return entry
    values = pytree.tree_map(lambda held: held(), entry)
    if any(value is None for value in pytree.tree_leaves(values)):
        return _checkpoint._RECOMPUTE
    return pytree.tree_map(lambda value: _checkpoint._VersionWrapper(_checkpoint._detach_helper(value)), values)


def checkpoint(fun: Callable, *, policy: Policy | None = None, preserve_rng_state: bool = True) -> Callable:
    """`fun`, with its activations recomputed in the backward pass instead of kept, except
    those `policy` keeps: JAX's `jax.checkpoint(fun, policy=...)` over torch's non-reentrant
    `torch.utils.checkpoint.checkpoint`. The values and derivatives are those of `fun`.

    What the policy decides applies where torch's checkpoint runs inside functx's
    transforms: with no transform, under the outermost `grad` / `vjp` / `jacrev` / `jvp`,
    `hessian`, `vmap(grad(f))`. Under `grad(vmap(f))` and the wrapped levels
    (`grad(hessian(f))`, `vmap(hessian(f))`, ...) `fun` runs unchecked: right derivatives,
    no memory saved (docs/semantics.md, "Activation checkpointing").

    Args:
        fun (Callable): the function to checkpoint; it takes and returns tensors (pytrees
            of them, and keyword arguments, as `torch.utils.checkpoint.checkpoint` allows).
        policy (Callable[..., bool] | None, default None): `policy(op, *args, **kwargs) ->
            bool`, asked once about every ATen op `fun` runs in the forward (`op` an
            `OpOverload` such as `torch.ops.aten.mm.default`, with the op's arguments):
            True keeps that op's output for the backward, False recomputes it. Outputs of
            in-place ops, factories and views are recomputed whatever it says. None keeps
            nothing, as `jax.checkpoint`'s default and plain
            `torch.utils.checkpoint.checkpoint`. Ready-made policies are in
            `functx.checkpoint_policies`. Under `torch.compile` (and `functx.jit`) it is
            not asked: the compiler decides what to keep.
        preserve_rng_state (bool, default True): replay the forward's random state in the
            recomputation (so dropout draws the same mask), as torch's checkpoint.

    Returns:
        Callable: a function with `fun`'s arguments and outputs (and its `__name__`) that
        runs `fun` under the checkpoint at each call.

    Raises:
        TypeError: `fun` is not callable, or `policy` is neither callable nor None
            ([error catalogue: checkpoint](../errors.md#checkpoint-checkpoint_name-checkpoint_policies)).
        torch.utils.checkpoint.CheckpointError: in the backward, the recomputation ran
            other ops or made tensors of other shapes than the forward (`fun` depends on
            state that changed between the two, a counter, a global flag); a
            `RuntimeError`.
        Exception: whatever `policy` raises, at the call of the returned function.

    Examples:
        The gradient is that of `fun`; the policy is asked about each op once, in the
        forward:

        >>> import torch, functx
        >>> w = torch.linspace(-1.0, 1.0, 9).reshape(3, 3)
        >>> x = torch.linspace(0.0, 1.0, 6).reshape(2, 3)
        >>> asked = []
        >>> def keep_products(op, *args, **kwargs):
        ...     asked.append(str(op))
        ...     return op is torch.ops.aten.mm.default
        >>> layer = functx.checkpoint(lambda w: torch.tanh(x @ w).sum(), policy=keep_products)
        >>> torch.allclose(functx.grad(layer)(w), functx.grad(lambda w: torch.tanh(x @ w).sum())(w))
        True
        >>> asked
        ['aten.mm.default', 'aten.tanh.default', 'aten.sum.default']

        Per-sample gradients through a checkpointed layer that keeps its matrix products
        (`dots_saveable`) and recomputes the `tanh`:

        >>> layer = functx.checkpoint(lambda w, x: torch.tanh(x @ w), policy=functx.checkpoint_policies.dots_saveable)
        >>> loss = lambda w, x: layer(w, x).sum()
        >>> per_sample = functx.vmap(functx.grad(loss), in_dims=(None, 0))(w, x)
        >>> plain = lambda w, x: torch.tanh(x @ w).sum()
        >>> per_sample.shape, torch.allclose(per_sample[1], functx.grad(plain)(w, x[1]))
        (torch.Size([2, 3, 3]), True)

        Second derivatives through kept values (torch's own selective checkpoint raises
        "Trying to backward an extra time"):

        >>> g = lambda x: x.sin().sin().sum()
        >>> f = functx.checkpoint(g, policy=functx.checkpoint_policies.everything_saveable)
        >>> torch.allclose(functx.hessian(f)(x[1]), functx.hessian(g)(x[1]))
        True

    Differences from torch.func:
        torch.func has no checkpoint, and its `grad` / `vjp` / `jacrev` / `hessian` refuse
        torch's non-reentrant `torch.utils.checkpoint.checkpoint` ("don't yet support saved
        tensor hooks"). Outside them, torch's `checkpoint(fun, *args, use_reentrant=False,
        context_fn=...)` runs `fun` at once (functx returns a function, as JAX), with a
        policy made by `create_selective_checkpoint_contexts(policy_fn)`, where
        `policy_fn(ctx, op, *args, **kwargs)` returns a `CheckpointPolicy` (functx's
        returns a bool). torch's selective checkpoint raises on a second derivative through
        the region ("Trying to backward an extra time") and, by default, when a kept value
        was written into in place ("has been mutated"); functx's differentiates to any
        order and recomputes such a value.
    """
    if not callable(fun):
        raise TypeError(f"functx.checkpoint: expected a callable fun, got {type(fun).__name__}")
    context_fn = _checkpoint.noop_context_fn
    if policy is not None:
        _check_policy(policy, "functx.checkpoint's policy argument", none_keeps_nothing=True)
        context_fn = _context_fn(policy)

    @functools.wraps(fun, updated=())  # (a module's __dict__ is not the function's)
    def checkpointed(*args, **kwargs):
        # traced (torch.compile, functx.jit): dynamo cannot trace the policy's modes; the
        # compiler decides what to keep (its own rematerialization), the values are the same
        if torch.compiler.is_compiling():
            return _checkpoint.checkpoint(fun, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **kwargs)
        return _checkpoint.checkpoint(
            fun, *args, use_reentrant=False, context_fn=context_fn, preserve_rng_state=preserve_rng_state, **kwargs
        )

    return checkpointed


# ---- checkpoint_name: an op the policy sees, with the name among its arguments ----


@torch.library.custom_op("functx::checkpoint_name", mutates_args=())
def _checkpoint_name_op(x: Tensor, name: str) -> Tensor:
    # a copy: a custom op's output may not alias its input (torch checks it)
    return x.clone()


@_checkpoint_name_op.register_fake
def _(x, name):
    return torch.empty_like(x)


# vmap: per element the same op, the batch dim where it was (a copy keeps the layout)
user_rules.register(_checkpoint_name_op._opoverload, lambda info, in_dims, x, name: (_checkpoint_name_op(x, name), in_dims[0]))


class _Named(torch.autograd.Function):
    """The op's derivatives: the identity, in both modes, batched by vmap as the op is."""

    @staticmethod
    def forward(x, name):
        return _checkpoint_name_op(x, name)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad, None

    @staticmethod
    def jvp(ctx, tangent, _):
        return tangent

    @staticmethod
    def vmap(info, in_dims, x, name):
        return _Named.apply(x, name), in_dims[0]


_NAME_OP = _checkpoint_name_op._opoverload


def checkpoint_name(x: Tensor, name: str) -> Tensor:
    """`x`, named `name` for the policies of `functx.checkpoint`
    (`checkpoint_policies.save_only_these_names(name)` keeps it for the backward instead of
    recomputing it): JAX's `jax.ad_checkpoint.checkpoint_name`.

    It runs an op of its own, `functx::checkpoint_name(x, name)`, which the policy is asked
    about with the name among its arguments. Its value is a copy of `x` and its derivative
    is the identity under every transform (`grad`, `jvp`, `vmap`, ...). Outside a
    checkpointed function it only costs the copy.

    Args:
        x (Tensor): the value to name.
        name (str): the name the policies match
            (`save_only_these_names`, `save_any_names_but_these`).

    Returns:
        Tensor: a copy of `x` (equal values, its own storage), differentiable as `x` is.

    Raises:
        TypeError: `name` is not a str, or `x` is not a tensor
            ([error catalogue: checkpoint](../errors.md#checkpoint-checkpoint_name-checkpoint_policies)).

    Examples:
        Keep the named `sin` for the backward, recompute the rest:

        >>> import torch, functx
        >>> policy = functx.checkpoint_policies.save_only_these_names("hidden")
        >>> f = functx.checkpoint(lambda x: functx.checkpoint_name(x.sin(), "hidden").cos(), policy=policy)
        >>> x = torch.tensor([0.5])
        >>> torch.allclose(functx.grad(lambda x: f(x).sum())(x), -x.sin().sin() * x.cos())
        True

        The value is a copy and the derivative the identity:

        >>> y = functx.checkpoint_name(x, "h")
        >>> torch.equal(y, x), y.data_ptr() == x.data_ptr()
        (True, False)
        >>> functx.jvp(lambda x: functx.checkpoint_name(x, "h"), (x,), (torch.ones(1),))[1]
        tensor([1.])

    Differences from torch.func:
        torch has no way to name a value for a checkpoint policy: a policy of
        `torch.utils.checkpoint.create_selective_checkpoint_contexts` matches ops (and
        their arguments) only, so its users pick values by op (`aten.mm`) or wrap the value
        in a custom op of their own.
    """
    if not isinstance(name, str):
        raise TypeError(f"functx.checkpoint_name: name must be a str, got {type(name).__name__}")
    if not isinstance(x, Tensor):
        raise TypeError(f"functx.checkpoint_name: expected a Tensor to name, got {type(x).__name__}")
    return _Named.apply(x, name)


# ---- the policies ----

_aten = torch.ops.aten


def _packets(*names: str) -> frozenset:
    """The aten op packets of `names` that this torch has."""
    return frozenset(getattr(_aten, name) for name in names if hasattr(_aten, name))


# Matrix products without a batch dim (JAX: dot_general with no batch dimensions). `linear`
# and `matmul` are composite (they reach the policy as the products they decompose into),
# listed in case they arrive whole.
_DOTS_NO_BATCH = _packets("mm", "addmm", "_addmm_activation", "mv", "addmv", "dot", "vdot", "linear")
# ... with batch dims, convolutions (JAX: dot_general, conv_general_dilated)
_DOTS = _DOTS_NO_BATCH | _packets(
    "bmm", "baddbmm", "addbmm", "convolution", "_convolution", "convolution_overrideable",
    "mkldnn_convolution", "cudnn_convolution", "miopen_convolution", "_slow_conv2d_forward",
    "slow_conv3d_forward", "slow_conv_dilated2d", "slow_conv_dilated3d", "slow_conv_transpose2d",
    "slow_conv_transpose3d", "_nnpack_spatial_convolution", "matmul", "scaled_dot_product_attention",
)  # fmt: skip


def _packet(op):
    return getattr(op, "overloadpacket", None)  # None for a higher-order operator


def _is_dot(op) -> bool:
    # the fused attention kernels (_scaled_dot_product_flash_attention_for_cpu, ..._efficient_
    # attention, ..._cudnn_attention, _math...) are attention's matrix products
    return _packet(op) in _DOTS or str(getattr(op, "_name", "")).startswith("aten::_scaled_dot_product_")


class checkpoint_policies:  # noqa: N801  (a namespace, spelled as JAX's jax.checkpoint_policies)
    """Ready-made policies for `functx.checkpoint`, named as JAX's `jax.checkpoint_policies`.
    Each is `policy(op, *args, **kwargs) -> bool`: keep `op`'s output for the backward?

    - `nothing_saveable`: recompute everything (what `policy=None` does).
    - `everything_saveable`: keep every op's output (no recomputation; it keeps more than
      no checkpointing would, as torch notes for selective checkpointing).
    - `dots_saveable`: keep the outputs of matrix products, convolutions and fused attention
      (`mm`, `addmm`, `bmm`, `baddbmm`, `convolution`, `_scaled_dot_product_*attention*`,
      ...), recompute the cheap elementwise ops between them.
    - `dots_with_no_batch_dims_saveable`: keep only matrix products without a batch dim
      (`mm`, `addmm`, `mv`, `dot`, ...: not `bmm`, convolutions or attention), as JAX's keeps
      only `dot_general`s without batch dims. Under `vmap` a product is judged as it runs
      on the batch: a sample's `x @ w` with `w` shared is one `mm`, with both batched a `bmm`.
    - `save_only_these_names(*names)`: keep only values named by `functx.checkpoint_name`
      with one of `names`.
    - `save_any_names_but_these(*names)`: keep named values whose name is not in `names`.
    - `save_from_both_policies(policy_1, policy_2)`: keep what either policy keeps.

    It is a namespace: use its attributes on the class (`checkpoint_policies.dots_saveable`);
    an instance, `checkpoint_policies()`, has the same ones.

    Raises:
        TypeError: `save_only_these_names` / `save_any_names_but_these` given a name that is
            not a str; `save_from_both_policies` given a policy that is not callable
            ([error catalogue: checkpoint](../errors.md#checkpoint-checkpoint_name-checkpoint_policies)).

    Examples:
        Each policy answers for one op (and its arguments):

        >>> import torch, functx
        >>> p = functx.checkpoint_policies
        >>> p.dots_saveable(torch.ops.aten.bmm.default), p.dots_with_no_batch_dims_saveable(torch.ops.aten.bmm.default)
        (True, False)
        >>> both = p.save_from_both_policies(p.dots_with_no_batch_dims_saveable, p.save_only_these_names("h"))
        >>> both(torch.ops.aten.mm.default), both(torch.ops.functx.checkpoint_name.default, torch.zeros(1), "h")
        (True, True)

        In `functx.checkpoint`, `dots_saveable` keeps `x @ w` and recomputes the `tanh`; the
        gradient is that without checkpointing:

        >>> w = torch.linspace(-1.0, 1.0, 9).reshape(3, 3)
        >>> x = torch.linspace(0.0, 1.0, 6).reshape(2, 3)
        >>> layer = functx.checkpoint(lambda w: torch.tanh(x @ w).sum(), policy=p.dots_saveable)
        >>> torch.allclose(functx.grad(layer)(w), functx.grad(lambda w: torch.tanh(x @ w).sum())(w))
        True

        `functx.checkpoint_policies.nothing_saveable` recomputes everything (the plain
        checkpoint), `everything_saveable` recomputes nothing:

        >>> functx.checkpoint_policies.nothing_saveable(torch.ops.aten.mm.default)
        False
        >>> functx.checkpoint_policies.everything_saveable(torch.ops.aten.mm.default)
        True

    Differences from torch.func:
        torch has no ready-made policies: a policy for
        `torch.utils.checkpoint.create_selective_checkpoint_contexts` is a list of ops to
        keep or a function `policy_fn(ctx, op, *args, **kwargs)` returning a
        `CheckpointPolicy` (`MUST_SAVE`, `PREFER_RECOMPUTE`, ...); functx's return a bool
        (True: torch's `MUST_SAVE`, False: `PREFER_RECOMPUTE`). Of JAX's policies, the
        offloading ones (`save_and_offload_only_these_names`,
        `offload_dot_with_no_batch_dims`) are absent.
    """

    @staticmethod
    def nothing_saveable(op, *args, **kwargs) -> bool:
        """Save nothing: recompute every op in the backward."""
        return False

    @staticmethod
    def everything_saveable(op, *args, **kwargs) -> bool:
        """Save every op's output: nothing is recomputed."""
        return True

    @staticmethod
    def dots_saveable(op, *args, **kwargs) -> bool:
        """Save matrix products, convolutions and fused attention."""
        return _is_dot(op)

    @staticmethod
    def dots_with_no_batch_dims_saveable(op, *args, **kwargs) -> bool:
        """Save matrix products without a batch dim (`mm`, `addmm`, `mv`, `dot`; not `bmm`)."""
        return _packet(op) in _DOTS_NO_BATCH

    @staticmethod
    def save_only_these_names(*names: str) -> Policy:
        """Save the values `functx.checkpoint_name` named with one of `names`, nothing else."""
        wanted = _names(names, "save_only_these_names")
        return lambda op, *args, **kwargs: op is _NAME_OP and args[1] in wanted

    @staticmethod
    def save_any_names_but_these(*names: str) -> Policy:
        """Save the values `functx.checkpoint_name` named, except those named one of `names`."""
        unwanted = _names(names, "save_any_names_but_these")
        return lambda op, *args, **kwargs: op is _NAME_OP and args[1] not in unwanted

    @staticmethod
    def save_from_both_policies(policy_1: Policy, policy_2: Policy) -> Policy:
        """Save what `policy_1` or `policy_2` saves. Both must be policies (callables); None,
        which `functx.checkpoint` takes for "keep nothing", is refused here: pass the other
        policy alone, or `functx.checkpoint_policies.nothing_saveable`."""
        _check_policy(policy_1, "functx.checkpoint_policies.save_from_both_policies's policy_1")
        _check_policy(policy_2, "functx.checkpoint_policies.save_from_both_policies's policy_2")
        return lambda op, *args, **kwargs: policy_1(op, *args, **kwargs) or policy_2(op, *args, **kwargs)


def _names(names, what: str) -> frozenset:
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"functx.checkpoint_policies.{what}: names must be str, got {type(name).__name__}")
    return frozenset(names)
