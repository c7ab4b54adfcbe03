"""torch's control-flow operators under functx's transforms: `torch.cond`,
`while_loop`, `scan`, `associative_scan` and `torch._higher_order_ops.map`.

Outside a transform torch runs these operators by compiling them whole (an eager call goes
through `torch.compile`), and dynamo cannot trace functx's level tensors. Inside a
transform functx runs each one as the Python it means instead: a loop or a branch over the
user's functions, whose torch calls reach every live level like any other call. So the AD
levels record the loop as it runs (reverse mode through a `while_loop` or a `scan` is
reverse mode through its iterations, the trip count known once it ran; forward mode pushes
tangents through each), and a vmap level maps each iteration. Two things differ from a
plain loop, where a control value differs between the samples of a vmap level (a batched
predicate, which one Python `bool` cannot hold), as in `jax.lax`:

- `cond`: both branches run on the whole batch and each sample takes its branch's outputs
  (`torch.where`); the branches must then return the same shapes and dtypes.
- `while_loop`: the loop runs while any sample's predicate holds; a sample whose predicate
  is false keeps its carry (each iteration's new carry is taken only where the predicate
  holds), so every sample ends with the values its own loop would end with.

How a call gets here: torch's eager entry (`torch._higher_order_ops.utils.
_hop_compile_and_call`, which every one of these operators goes through) is replaced by
one that, inside a transform, calls the operator eagerly (`patches.py` lists the change);
the operator's call reaches functx's one torch-function mode (`torch_function.py`), which
runs it as Python from `RUN_AS_PYTHON`. `associative_scan(combine_mode="generic")` never
takes that entry: torch runs its algorithm eagerly, calling the combine function through
`torch.vmap`, whose ops on functx's tensors reach their levels as usual.

Example:
    >>> import torch, functx
    >>> def f(x):
    ...     return torch.cond(x.sum() > 0, lambda x: x * 2, lambda x: -x, (x,))
    >>> functx.vmap(f)(torch.tensor([[1.0], [-3.0]]))
    tensor([[2.],
            [3.]])
"""

from __future__ import annotations

import torch
import torch._higher_order_ops.utils as _hop_utils
from torch._higher_order_ops.associative_scan import associative_scan_op
from torch._higher_order_ops.cond import cond_op
from torch._higher_order_ops.map import map_impl
from torch._higher_order_ops.scan import scan_op
from torch._higher_order_ops.while_loop import while_loop_op

from . import pytree
from .errors import NeedsPerSampleValues
from .interpreter import top_interpreter
from .patches import patch
from .torch_function import RUN_AS_PYTHON, seen_by_outer


def _one_value(pred):
    """`bool(pred)`, or None where the samples of a vmap level hold different values."""
    try:
        return bool(pred)
    except NeedsPerSampleValues:
        return None


def any_sample(pred) -> bool:
    """Whether `pred` holds for any sample of every vmap level it is batched at: each level
    that cannot give one value hands over its samples (one row each), reduced with `any`."""
    while True:
        try:
            return bool(pred)
        except NeedsPerSampleValues as error:
            if error.samples is None:
                raise
            pred = error.samples.any()


def _check_predicate(pred, what: str):
    if isinstance(pred, bool):
        return
    if not (isinstance(pred, torch.Tensor) and pred.numel() == 1 and pred.dtype == torch.bool):
        raise RuntimeError(f"{what} must return a boolean scalar tensor or a bool, but got {pred!r}")


def _select(pred, chosen, other, what: str):
    """Per sample, `chosen` where `pred` holds and `other` elsewhere (two trees of one shape)."""
    chosen_leaves, chosen_spec = pytree.tree_flatten(chosen)
    other_leaves, other_spec = pytree.tree_flatten(other)
    if chosen_spec != other_spec:
        raise RuntimeError(
            f"{what}: the predicate differs between the samples of a vmap, so both run and each "
            f"sample takes its own; they must return the same structure, but returned "
            f"{chosen_spec} and {other_spec}."
        )
    pred = pred.reshape(()) if isinstance(pred, torch.Tensor) else pred
    selected = []
    for a, b in zip(chosen_leaves, other_leaves):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.shape != b.shape or a.dtype != b.dtype:
                raise RuntimeError(
                    f"{what}: the predicate differs between the samples of a vmap, so both run "
                    f"and each sample takes its own outputs; those must have one shape and "
                    f"dtype, but got {tuple(a.shape)} {a.dtype} and {tuple(b.shape)} {b.dtype}."
                )
            selected.append(torch.where(pred, a, b))
        elif isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or a != b:
            raise RuntimeError(
                f"{what}: the predicate differs between the samples of a vmap, so each sample "
                f"takes its own outputs, but {a!r} and {b!r} are not tensors of one shape: "
                f"return tensors (a Python number is one value for every sample)."
            )
        else:
            selected.append(a)
    return chosen_spec.unflatten(selected)


def run_cond(pred, true_fn, false_fn, operands):
    """`torch.cond`: the branch `pred` picks, or both and a per-sample select under vmap."""
    _check_predicate(pred, "torch.cond's predicate")
    taken = _one_value(pred)
    if taken is None:
        return _select(pred, true_fn(*operands), false_fn(*operands), "torch.cond's branches")
    return (true_fn if taken else false_fn)(*operands)


def run_while_loop(cond_fn, body_fn, carried_inputs, additional_inputs=(), **_):
    """`while_loop`: body after body while the predicate holds; under vmap, while it holds
    for any sample, each keeping its carry once its own predicate is false."""
    if not isinstance(carried_inputs, (tuple, list)):
        raise RuntimeError(f"carried_inputs must be a tuple or list but got {type(carried_inputs)}")
    carry = tuple(carried_inputs)
    while True:
        pred = cond_fn(*carry, *additional_inputs)
        _check_predicate(pred, "while_loop's cond_fn")
        every_sample = _one_value(pred)
        if every_sample is False or (every_sample is None and not any_sample(pred)):
            return tuple(value.clone() if isinstance(value, torch.Tensor) else value for value in carry)
        new = body_fn(*carry, *additional_inputs)
        if not isinstance(new, (tuple, list)) or len(new) != len(carry):
            raise RuntimeError(
                f"while_loop's body_fn must return a tuple of {len(carry)} values (one per "
                f"carried input), but returned {new!r:.200}"
            )
        for old, value in zip(carry, new):
            if isinstance(old, torch.Tensor) and (
                not isinstance(value, torch.Tensor) or value.shape != old.shape or value.dtype != old.dtype
            ):
                raise RuntimeError(
                    f"while_loop's body_fn must return each carried value with its shape and "
                    f"dtype: got {_describe(value)} for a carried {_describe(old)}."
                )
        carry = tuple(new) if every_sample else tuple(_select(pred, tuple(new), carry, "while_loop's body_fn"))


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    return repr(value)


def run_scan(combine_fn, init, xs, additional_inputs=()):
    """`scan` (over dim 0; torch's `scan` moves the user's dim there and flips for `reverse`):
    the carry through every slice, each step's outputs stacked."""
    carry = list(init)
    steps = []
    result = None
    for i in range(xs[0].shape[0]):
        result = combine_fn(*carry, *[x[i] for x in xs], *additional_inputs)
        leaves = pytree.tree_leaves(result)
        carry, outputs = leaves[: len(init)], leaves[len(init) :]
        steps.append(outputs)
    leaves, spec = pytree.tree_flatten(result)
    stacked = [torch.stack(column) for column in zip(*steps)]
    return spec.unflatten(carry + stacked)


def run_map(f, xs, args):
    """`torch._higher_order_ops.map`: `f` on each slice of `xs` along dim 0, stacked."""
    results = [f(*[x[i] for x in xs], *args) for i in range(xs[0].shape[0])]
    leaves, spec = pytree.tree_flatten(results[0])
    columns = zip(*(pytree.tree_leaves(result) for result in results))
    return spec.unflatten([torch.stack(column) for column in columns])


def run_associative_scan(combine_fn, xs, additional_inputs=()):
    """`associative_scan` with a pointwise combine function (over dim 0): in log2(n) steps,
    each combining every element with the one `2**k` before it (Hillis and Steele); equal
    to the sequential scan for an associative `combine_fn`."""
    leaves = list(xs)
    n = leaves[0].shape[0]
    step = 1
    while step < n:
        combined = pytree.tree_leaves(
            combine_fn(*[x[:-step] for x in leaves], *[x[step:] for x in leaves], *additional_inputs)
        )
        leaves = [torch.cat([x[:step], c]) for x, c in zip(leaves, combined)]
        step *= 2
    return leaves


RUN_AS_PYTHON.update(
    {
        cond_op: run_cond,
        while_loop_op: run_while_loop,
        scan_op: run_scan,
        map_impl: run_map,
        associative_scan_op: run_associative_scan,
    }
)


def _compile_outside_transforms(fn, args, kwargs=None):
    """torch's eager entry of its control-flow operators, which compiles them whole; inside a
    transform, the operator called eagerly (functx's mode takes it, below)."""
    if top_interpreter() is None:
        return _torch_compile_and_call(fn, args, kwargs)
    with seen_by_outer():  # functx's mode on torch's stack, to receive the operator's call
        return fn(*args, **(kwargs or {}))


_torch_compile_and_call = patch(
    _hop_utils,
    "_hop_compile_and_call",
    _compile_outside_transforms,
    "inside a functx transform, torch's control-flow operators run as the Python they mean "
    "(core/control_flow.py): dynamo cannot trace functx's level tensors",
)
