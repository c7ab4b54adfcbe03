"""Check `functx.functionalize` on one op_db OpInfo: plain torch and torch.func as oracles.

For an OpInfo with an in-place variant (`x.add_(y)`) and each of its float32 CPU samples,
the function under test writes in place four ways:

  intermediate   into a clone of the input (`y = x.clone(); y.add_(...); return y`);
  input          into the input itself (functionalize must copy the result back);
  view           into a view of a bigger intermediate (`base[1]`), so the write reaches
                 the base through a `*_scatter`;
  input view     into a view of an input that is a bigger tensor (`x[1]`).

For a view op (its first output aliases its input, measured by running it) the function
writes through the view (`v.mul_(2)`) of a clone, and of the input, and returns base and
view. Each function runs three times on fresh clones of the sample: plain, under
`functx.functionalize` and under `torch.func.functionalize`, with the same seed (random
in-place ops draw the same numbers); outputs and the inputs afterwards must agree. Then
`make_fx(functx.functionalize(f))` must trace a graph with no mutation but the copies back
into the inputs, and, for remove="mutations_and_views", with no view op either.

Plain torch is the oracle (torch.func is not always right: `atleast_1d` returns its
input, and torch.func's result then misses the write). torch.func is the oracle instead
for ops where functionalization knowingly differs from plain torch (writes into views
whose elements overlap). When plain torch raises for a sample (a write into an expanded
view), functionalize may raise or not, and only its graph is checked.
"""

from __future__ import annotations

import functools

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as torch_pytree

import functx

REMOVES = ("mutations", "mutations_and_views")


@functools.cache
def op_db():
    from torch.testing._internal.common_methods_invocations import op_db as db

    return db


def op_id(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def inplace_ops():
    return [op for op in op_db() if op.inplace_variant is not None and op.supports_dtype(torch.float32, "cpu")]


def samples(op, limit):
    """The first `limit` float32 CPU samples whose input is a tensor. Calls the OpInfo's
    generator directly: `op.sample_inputs` crawls the call stack for every sample (slow
    under pytest)."""
    torch.manual_seed(0)
    out = []
    for s in op.sample_inputs_func(op, "cpu", torch.float32, False):
        if not isinstance(s.input, torch.Tensor):
            continue
        out.append(s)
        if len(out) == limit:
            break
    return out


def _clone(tree):
    return torch_pytree.tree_map_only(torch.Tensor, lambda t: t.clone(), tree)


# -- the functions under test ------------------------------------------------------------------
def inplace_functions(op):
    """name -> f(x, args, kwargs) writing with op's in-place variant (see module docstring)."""
    inplace = op.inplace_variant

    def intermediate(x, args, kwargs):
        y = x.clone()
        inplace(y, *args, **kwargs)
        return y

    def into_input(x, args, kwargs):
        inplace(x, *args, **kwargs)
        return x * 1

    def through_view(x, args, kwargs):
        base = torch.zeros(2, *x.shape, dtype=x.dtype)
        view = base[1]
        view.copy_(x)
        inplace(view, *args, **kwargs)
        return base

    def into_input_view(big, args, kwargs):
        inplace(big[1], *args, **kwargs)
        return big.sum()

    return {"intermediate": intermediate, "input": into_input, "view": through_view, "input view": into_input_view}


def view_functions(op):
    def first(out):
        return out[0] if isinstance(out, (tuple, list)) else out

    def intermediate(x, args, kwargs):
        y = x.clone() * 1
        v = first(op.op(y, *args, **kwargs))
        v.mul_(2)
        return y, v

    def into_input(x, args, kwargs):
        v = first(op.op(x, *args, **kwargs))
        v.add_(1)
        return v

    return {"view intermediate": intermediate, "view input": into_input}


def is_view_op(op, sample) -> bool:
    """Whether the op's (first) output aliases its input, measured on a sample."""
    try:
        out = op.op(sample.input, *sample.args, **sample.kwargs)
    except Exception:
        return False
    out = out[0] if isinstance(out, (tuple, list)) and out else out
    return (
        isinstance(out, torch.Tensor)
        and out.numel() > 0
        and sample.input.numel() > 0
        and torch._C._is_alias_of(out, sample.input)
    )


def call_args(name, sample):
    x = sample.input
    if name == "input view":
        x = torch.stack([torch.zeros_like(x), x]) if x.dim() < 6 else None
    return x, sample.args, sample.kwargs


# -- running and comparing ---------------------------------------------------------------------
def _run(f, x, args, kwargs):
    x, args, kwargs = _clone((x, args, kwargs))
    torch.manual_seed(1234)
    try:
        out = f(x, args, kwargs)
    except Exception as e:  # noqa: BLE001 - the oracle's outcome, compared below
        return e, None
    return None, (out, (x, args, kwargs))


def _same(a, b) -> bool:
    la, sa = torch_pytree.tree_flatten(a)
    lb, sb = torch_pytree.tree_flatten(b)
    if sa != sb:
        return False
    for u, v in zip(la, lb):
        if isinstance(u, torch.Tensor):
            if not isinstance(v, torch.Tensor) or u.shape != v.shape or u.dtype != v.dtype:
                return False
            if not torch.allclose(u, v, equal_nan=True, rtol=1e-4, atol=1e-5):
                return False
        elif u != v and not (u != u and v != v):
            return False
    return True


def check(f, x, args, kwargs, remove, *, like_torch_func=False) -> str | None:
    """None if functx.functionalize(f) agrees with the oracles (see the module docstring);
    otherwise a description of what went wrong. `like_torch_func`: the op is one where
    functionalization knowingly differs from plain torch (KNOWN_DEVIATIONS in test_op_db.py),
    so torch.func alone is the oracle."""
    plain_err, plain = _run(f, x, args, kwargs)
    ours_err, ours = _run(functx.functionalize(f, remove=remove), x, args, kwargs)
    theirs_err, theirs = _run(torch.func.functionalize(f, remove=remove), x, args, kwargs)
    if plain_err is not None:
        # Plain torch refuses writes into memory that several elements share (an expanded
        # view): functionalization can do them (through the view's inverse, a sum for
        # `expand`), but the values are then nobody's reference (torch.func's differ: it
        # drops some of those writes). Only the graph is checked.
        return None if ours_err is not None else check_graph(f, x, args, kwargs, remove)
    if like_torch_func:
        if ours_err is not None:
            if theirs_err is None:
                return f"functionalize raises {type(ours_err).__name__}: {ours_err}; torch.func does not"
            return None
        if theirs_err is not None:
            return f"torch.func raises ({theirs_err}), functionalize does not"
        oracle, name = theirs, "torch.func.functionalize"
    else:
        if ours_err is not None:
            return f"functionalize raises {type(ours_err).__name__}: {ours_err}"
        oracle, name = plain, "plain torch"
    if not _same(oracle[0], ours[0]):
        return f"outputs differ from {name}"
    if not _same(oracle[1], ours[1]):
        return f"inputs after the call differ from {name}"
    return check_graph(f, x, args, kwargs, remove)


def mutations_in(graph, remove, *, constant_views_ok=False) -> list[str]:
    """The graph's nodes that mutate something other than an input's final copy-back, and for
    remove="mutations_and_views" its view ops (`constant_views_ok`: but views of constants
    that no input reaches: jacrev's and jacfwd's basis, which functx builds itself)."""
    placeholders = {n for n in graph.nodes if n.op == "placeholder"}
    reached = _reached_from(graph, placeholders) if constant_views_ok else None
    bad = []
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if _on_meta(node):  # vmap's shape checks on meta tensors (functx bookkeeping, no data)
            continue
        schema = node.target._schema
        if schema.is_mutable:
            copy_back = node.target in (
                torch.ops.aten.copy_.default,
                torch.ops.aten.as_strided_.default,
                torch.ops.aten.resize_.default,
            ) and (node.args[0] in placeholders or _is_copy_back_target(node.args[0], placeholders))
            if not copy_back:
                bad.append(str(node.target))
        elif remove == "mutations_and_views" and any(r.alias_info is not None for r in schema.returns):
            if reached is None or node in reached:
                bad.append(str(node.target))
    return bad


def _reached_from(graph, sources) -> set:
    reached = set(sources)
    for node in graph.nodes:  # topological order
        if any(arg in reached for arg in node.all_input_nodes):
            reached.add(node)
    return reached


def _on_meta(node) -> bool:
    value = node.meta.get("val")
    value = value[0] if isinstance(value, (tuple, list)) and value else value
    return isinstance(value, torch.Tensor) and value.device.type == "meta"


def _is_copy_back_target(node, placeholders) -> bool:
    """`copy_(as_strided_(input, ...), final)`: the copy-back after a metadata change."""
    return (
        getattr(node, "op", None) == "call_function"
        and node.target in (torch.ops.aten.as_strided_.default, torch.ops.aten.resize_.default)
        and node.args[0] in placeholders
    )


def check_graph(f, x, args, kwargs, remove) -> str | None:
    flat, spec = torch_pytree.tree_flatten((x, args, kwargs))
    positions = [i for i, leaf in enumerate(flat) if isinstance(leaf, torch.Tensor)]

    def flat_f(*tensors):
        leaves = list(flat)
        for i, t in zip(positions, tensors):
            leaves[i] = t
        return f(*torch_pytree.tree_unflatten(leaves, spec))

    tensors = [flat[i].clone() for i in positions]
    torch.manual_seed(1234)
    try:
        graph = make_fx(functx.functionalize(flat_f, remove=remove))(*tensors).graph
    except Exception as e:  # noqa: BLE001
        try:  # a data-dependent op (`narrow` with a tensor start) cannot be traced at all
            make_fx(torch.func.functionalize(flat_f, remove=remove))(*[t.clone() for t in tensors])
        except Exception:  # noqa: BLE001
            return None
        return f"make_fx raises {type(e).__name__}: {e}; it traces torch.func.functionalize"
    bad = mutations_in(graph, remove)
    if bad:
        return f"graph has {'mutations' if remove == 'mutations' else 'mutations or views'}: {bad}"
    return None
