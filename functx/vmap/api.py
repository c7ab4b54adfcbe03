"""`functx.vmap`: same signature and semantics as `torch.func.vmap`."""

from __future__ import annotations

import functools

import torch

from typing import Optional

from ..core import pytree
from ..core.type_aliases import Function, InDims, OutDims
from ..core.containers import is_container
from .containers import chunks_of, container_leaf, mapped_size
from .interpreter import VmapInterpreter
from ..core import config
from ..core.errors import NeedsPerSampleValues, user_facing
from .nested import join_samples, map_per_sample, nested_batch_size, per_sample_reason, raise_written_before_fallback
from .mapping import describe_leaf, flatten_in_dims, map_at_level, name_of, out_dims_per_leaf
from .randomness import RANDOMNESS_MODES, check_randomness


def vmap(
    func: Function,
    in_dims: InDims = 0,
    out_dims: OutDims = 0,
    randomness: str = "error",
    *,
    chunk_size: Optional[int] = None,
) -> Function:
    """Vectorize `func` over a batch dimension of its inputs: `vmap(func)(*args)` runs `func`
    once on batched inputs and returns what a loop over the batch would stack.

    `func` is written for one example; vmap maps it over dimension `in_dims` of its inputs
    and stacks the results along `out_dims`, without a Python loop (one batched call per
    op, each op through its batching rule). Nested `vmap`s map over several dimensions;
    `vmap` composes with every other transform (`vmap(grad(f))`: per-sample gradients).

    How it behaves (details in the guide's [semantics](../semantics.md)):

    - **Inside `func` a mapped tensor looks like one example**: `x.shape`, `x.dim()` and
      `x.size(0)` are an example's; ops on it run batched. Tensors not mapped (`None`,
      captured, made inside with `torch.zeros(...)`) are shared by every example.
    - **Keyword arguments** are passed to every example unmapped; map a value by passing
      it positionally.
    - **Python control flow on a value** (`if x.sum() > 0`, `.item()`, `float(x)`) cannot
      run batched: functx runs `func` once per example and stacks the results (with a
      `functx.PerformanceWarning`; `functx.set_vmap_fallback("error")` refuses it instead,
      as torch.func does). `torch.where(cond, a, b)` computes both branches batched.
    - **In-place writes** into a mapped tensor (or one made from it) are per example; a
      batched value written into an unbatched tensor raises, because every example would
      write the same memory.
    - **Random ops** follow `randomness`; under "different" each example draws its own
      numbers (not the numbers a loop would draw: the generator is consumed differently).
    - **Tensors that escape** `func` (stored in a global, a closure, an attribute) cannot be
      used after vmap returns: return them instead.
    - **Cost**: one batched op per op of `func`, so vmap over B examples is usually far
      cheaper than B calls; `chunk_size` trades speed for memory.

    Args:
        func (Callable): the function to map. Its arguments and outputs may be tensors or
            pytrees of them (tuples, lists, dicts, namedtuples, registered containers);
            non-tensor arguments are passed through.
        in_dims (int | None | tuple, default 0): per positional argument, the dimension to
            map over, or None (not mapped: every example sees the whole argument). An int
            applies to every argument; a tuple (one entry per argument) may nest like the
            arguments (a prefix of their pytree). Keyword arguments are never mapped.
        out_dims (int | None | tuple, default 0): where each output gets the batch
            dimension (None: the output must be the same for every example, and is
            returned once), as an int or a pytree prefix of the outputs.
        randomness (str, default "error"): what random ops (`torch.rand`, dropout) do
            inside `func`: "error" refuses them, "different" draws independently per
            example, "same" draws once and shares it across the batch.
        chunk_size (int | None, default None): run at most this many examples at a time
            (bounds memory; results concatenated). With `randomness="same"` every chunk
            sees the same random numbers.

    Returns:
        Callable: the vectorized function, taking the same arguments as `func` with the
        mapped dimensions added, and returning `func`'s outputs with a batch dimension at
        `out_dims`.

    Raises:
        ValueError: bad `in_dims` / `out_dims` (not matching the arguments or outputs,
            out of range, on a non-tensor), no mapped tensor, mapped sizes that differ,
            `chunk_size` < 1 ([error catalogue: vmap arguments](../errors.md#vmap-arguments)).
        RuntimeError: `func` writes a batched value into an unbatched tensor, uses
            randomness with `randomness="error"`, or returns something that is not a
            tensor ([vmap inside the function](../errors.md#vmap-inside-the-function)).

    Examples:
        Per-example dot products, the second argument shared:

        >>> import torch, functx
        >>> x, y = torch.randn(4, 3), torch.randn(3)
        >>> functx.vmap(torch.dot, in_dims=(0, None))(x, y).shape
        torch.Size([4])

        Pytrees in and out, the batch dimension moved on output:

        >>> def f(inputs):
        ...     return {"sum": inputs["a"] + inputs["b"], "max": inputs["a"].max()}
        >>> out = functx.vmap(f, out_dims={"sum": 1, "max": 0})({"a": torch.ones(5, 2), "b": torch.zeros(5, 2)})
        >>> out["sum"].shape, out["max"].shape
        (torch.Size([2, 5]), torch.Size([5]))

        Nested maps (all pairs) and randomness:

        >>> functx.vmap(functx.vmap(torch.mul, in_dims=(None, 0)), in_dims=(0, None))(torch.ones(2), torch.ones(3)).shape
        torch.Size([2, 3])
        >>> noisy = functx.vmap(lambda t: t + torch.rand(()), randomness="same")(torch.zeros(3))
        >>> bool((noisy == noisy[0]).all())
        True
        >>> different = functx.vmap(lambda t: t + torch.rand(()), randomness="different")(torch.zeros(3))
        >>> bool((different == different[0]).all())
        False

        `in_dims` mirrors the arguments' structure (here: the first tuple's tensors mapped
        over dims 0 and None, then a tensor mapped over its last dim):

        >>> def g(pair, t):
        ...     a, b = pair
        ...     return a @ b + t
        >>> a, b, t = torch.randn(4, 2, 3), torch.randn(3, 2), torch.randn(2, 4)
        >>> functx.vmap(g, in_dims=((0, None), -1))((a, b), t).shape
        torch.Size([4, 2, 2])

        Per-sample gradients of a model's loss (the most common use), checked against a
        loop over the samples:

        >>> model = torch.nn.Linear(3, 1)
        >>> params = {k: v.detach() for k, v in model.named_parameters()}
        >>> def loss(params, x, y):
        ...     prediction = functx.functional_call(model, params, (x[None],))
        ...     return ((prediction - y) ** 2).mean()
        >>> xs, ys = torch.randn(8, 3), torch.randn(8, 1)
        >>> per_sample = functx.vmap(functx.grad(loss), in_dims=(None, 0, 0))(params, xs, ys)
        >>> per_sample["weight"].shape
        torch.Size([8, 1, 3])
        >>> loop = torch.stack([functx.grad(loss)(params, x, y)["weight"] for x, y in zip(xs, ys)])
        >>> torch.allclose(per_sample["weight"], loop)
        True

        An ensemble: the same model with 4 sets of weights, on one shared batch:

        >>> models = [torch.nn.Linear(3, 2) for _ in range(4)]
        >>> weights, buffers = functx.stack_module_state(models)
        >>> def run(weights, buffers, x):
        ...     return functx.functional_call(models[0], (weights, buffers), (x,))
        >>> functx.vmap(run, in_dims=(0, 0, None))(weights, buffers, torch.randn(5, 3)).shape
        torch.Size([4, 5, 2])

        `chunk_size` bounds memory and gives the same result; keyword arguments are not
        mapped; an unmapped output (`out_dims=None`) is returned once:

        >>> x = torch.randn(6, 3)
        >>> torch.equal(functx.vmap(torch.sum, chunk_size=4)(x), functx.vmap(torch.sum)(x))
        True
        >>> functx.vmap(lambda t, *, scale: t * scale)(x, scale=torch.tensor(2.0)).shape
        torch.Size([6, 3])
        >>> mean, shared = functx.vmap(lambda t: (t.mean(), torch.ones(2)), out_dims=(0, None))(x)
        >>> mean.shape, shared.shape
        (torch.Size([6]), torch.Size([2]))

        Control flow on a value: `torch.where` stays batched; a Python `if` runs per example
        (warning) and gives the loop's answer:

        >>> relu = functx.vmap(lambda t: torch.where(t > 0, t, torch.zeros_like(t)))
        >>> relu(torch.tensor([-1.0, 2.0])).tolist()
        [0.0, 2.0]
        >>> import warnings
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore", functx.PerformanceWarning)
        ...     functx.vmap(lambda t: t if t > 0 else -t)(torch.tensor([-1.0, 2.0])).tolist()
        [1.0, 2.0]

    Differences from torch.func:
        An op without a batching rule, or a Python `if` on a sample's value (`.item()`,
        `bool(x)`), runs once per example with a `functx.PerformanceWarning` where
        torch.func raises (`functx.set_vmap_fallback("error")` restores the error;
        `functx.explain` lists what ran per sample). Nested (jagged) tensors and
        containers with a batch size (TensorDict) are mapped too. An output whose shape
        differs per example (with the per-example fallback) can be returned as a nested
        tensor (`functx.set_vmap_fallback("warn", ragged="nested")`). A `vmap` rule's
        `out_dims` are checked against the batch size (torch.func returns garbage for a
        wrong one). Everything else (arguments, defaults, error types and messages) is
        torch.func's.
    """
    check_randomness(randomness)
    if chunk_size is not None and not (isinstance(chunk_size, int) and chunk_size > 0):
        raise ValueError(f"vmap: chunk_size should be None or greater than 0. (got {chunk_size})")

    @user_facing
    @functools.wraps(func)
    def vmapped(*args, **kwargs):
        return _vmap_call(func, in_dims, out_dims, randomness, chunk_size, args, kwargs)

    return vmapped


def _check_and_batch_size(func, in_dims, spec, leaves, flat_dims):
    """`(batch size, layout)`: layout is that of the nested inputs (torch.jagged where any is
    jagged), None where there are none."""
    sizes = []
    nested_layout = None
    for i, (arg, dim) in enumerate(zip(leaves, flat_dims)):
        if dim is None:
            continue
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise ValueError(
                f"vmap({name_of(func)}, in_dims={in_dims}, ...)(<inputs>): Got in_dim={dim} for "
                f"an input but in_dim must be either an integer dimension or None."
            )
        if not isinstance(arg, torch.Tensor) and is_container(arg):
            flat_dims[i], size = mapped_size(name_of(func), in_dims, describe_leaf(spec, i), arg, dim)
            sizes.append((i, size))
            continue
        if not isinstance(arg, torch.Tensor):
            raise ValueError(
                f"vmap({name_of(func)}, in_dims={in_dims}, ...)(<inputs>): Got in_dim={dim} for "
                f"an input but the input is of type {type(arg)}. We cannot vmap over non-Tensor "
                f"arguments, please use None as the respective in_dim"
            )
        if arg.is_nested:
            sizes.append((i, nested_batch_size(name_of(func), in_dims, describe_leaf(spec, i), arg, dim)))
            flat_dims[i] = 0
            nested_layout = torch.jagged if torch.jagged in (nested_layout, arg.layout) else arg.layout
            continue
        if arg.layout is not torch.strided:
            raise NotImplementedError(
                f"vmap({name_of(func)}, in_dims={in_dims}, ...)(<inputs>): {describe_leaf(spec, i)} is a "
                f"{arg.layout} tensor; functx.vmap maps over strided and nested tensors. Call "
                f"`.to_dense()` on it first."
            )
        if not -arg.dim() <= dim < max(arg.dim(), 1) or arg.dim() == 0:
            raise ValueError(
                f"vmap({name_of(func)}, in_dims={in_dims}, ...)(<inputs>): Got in_dim={dim} for "
                f"some input, but that input ({describe_leaf(spec, i)}) is a Tensor of "
                f"dimensionality {arg.dim()} so expected in_dim to satisfy "
                f"-{arg.dim()} <= in_dim < {arg.dim()}."
            )
        sizes.append((i, arg.size(dim)))
    if not sizes:
        raise ValueError(
            f"vmap({name_of(func)}, in_dims={in_dims}, ...)(<inputs>): at least one input must "
            f"be a Tensor with an in_dim that is not None (vmap: Expected at least one Tensor "
            f"to vmap over)."
        )
    batch_size = sizes[0][1]
    if any(size != batch_size for _, size in sizes):
        detail = ", ".join(f"{describe_leaf(spec, i)} has size {s}" for i, s in sizes)
        raise ValueError(
            f"vmap: Expected all tensors to have the same size in the mapped dimension, got "
            f"sizes {[s for _, s in sizes]} for the mapped dimension ({detail})."
        )
    return batch_size, nested_layout


def _vmap_call(func, in_dims, out_dims, randomness, chunk_size, args, kwargs):
    leaves, flat_dims, spec = flatten_in_dims(func, in_dims, args)
    batch_size, nested_layout = _check_and_batch_size(func, in_dims, spec, leaves, flat_dims)
    if nested_layout is not None:  # samples of different shapes: one call per sample (vmap/nested.py)
        return map_per_sample(func, leaves, flat_dims, spec, batch_size, randomness, out_dims, kwargs, nested_layout, "")
    if chunk_size is None or chunk_size >= batch_size:
        return _vmap_once(func, leaves, flat_dims, spec, batch_size, randomness, out_dims, kwargs)
    return _vmap_chunked(func, leaves, flat_dims, spec, batch_size, randomness, out_dims, kwargs, chunk_size)


def _vmap_once(func, leaves, flat_dims, spec, batch_size, randomness, out_dims, kwargs):
    interp = VmapInterpreter(batch_size, randomness)
    state = torch.get_rng_state() if randomness != "error" else None  # (error: nothing could draw)
    versions = [x._version for x in leaves if isinstance(x, torch.Tensor) and not x.is_inference()]
    try:
        return map_at_level(interp, func, leaves, flat_dims, spec, out_dims, kwargs)
    except NeedsPerSampleValues as error:
        if error.interp is not interp or config.fallback == "error":
            raise
        if versions != [x._version for x in leaves if isinstance(x, torch.Tensor) and not x.is_inference()]:
            raise_written_before_fallback(func, error)
        # Python needs one sample's value (`if x > 0`, `.item()`) or shape: run it per sample,
        # from the random state the batched attempt started with (vmap/nested.py)
        if state is not None:
            torch.set_rng_state(state)
        reason = per_sample_reason(error)
    layout = torch.jagged if config.ragged == "nested" else None  # for outputs of different shapes
    return map_per_sample(func, leaves, flat_dims, spec, batch_size, randomness, out_dims, kwargs, layout, reason)


def _vmap_chunked(func, leaves, flat_dims, spec, batch_size, randomness, out_dims, kwargs, chunk_size):
    split = [None if d is None else chunks_of(x, chunk_size, d) for x, d in zip(leaves, flat_dims)]
    n_chunks = (batch_size + chunk_size - 1) // chunk_size
    rng_state = torch.get_rng_state() if randomness == "same" else None
    chunk_outputs = []
    for c in range(n_chunks):
        if rng_state is not None:
            torch.set_rng_state(rng_state)
        chunk_leaves = [x if s is None else s[c] for x, s in zip(leaves, split)]
        size = min(chunk_size, batch_size - c * chunk_size)
        chunk_outputs.append(_vmap_once(func, chunk_leaves, flat_dims, spec, size, randomness, out_dims, kwargs))
    keep_whole = container_leaf()
    flat_chunks = [pytree.tree_flatten(o, none_is_leaf=True, is_leaf=keep_whole) for o in chunk_outputs]
    out_spec = flat_chunks[0][1]
    flat_out_dims = out_dims_per_leaf(func, out_dims, chunk_outputs[0], len(flat_chunks[0][0]), keep_whole)
    merged = [
        flat_chunks[0][0][i] if d is None else _concatenated(func, out_dims, i, [fc[0][i] for fc in flat_chunks], d)
        for i, d in enumerate(flat_out_dims)
    ]
    return pytree.tree_unflatten(out_spec, merged)


def _concatenated(func, out_dims, index, chunks, out_dim):
    """One output of every chunk, joined: concatenated, or where the chunks' samples differ
    in shape (each chunk's per-sample run gave a nested tensor, or stacked samples of
    another shape than the next chunk's), the samples of all chunks joined as one
    per-sample run joins them (an error unless `set_vmap_fallback(ragged="nested")`)."""
    if not all(isinstance(c, torch.Tensor) for c in chunks):  # containers with a batch size concatenate
        return torch.cat(chunks, dim=out_dim)
    if not any(c.is_nested for c in chunks):
        if len({c.shape[:out_dim] + c.shape[out_dim + 1 :] for c in chunks}) == 1:
            return torch.cat(chunks, dim=out_dim)
    samples = [sample for chunk in chunks for sample in chunk.unbind(out_dim)]
    layout = torch.jagged if config.ragged == "nested" else None
    return join_samples(name_of(func), out_dims, index, samples, out_dim, layout)


__all__ = ["vmap", "RANDOMNESS_MODES"]
