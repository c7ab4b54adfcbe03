"""torch.compile over functx transforms: teach dynamo to stage a transform call whole.

Dynamo traces Python bytecode; it cannot trace functx's dispatcher (tensor subclasses made
per op, a level stack). So at every transform's entry point (`_vmap_call`,
`_grad_and_value_call`, `_jacrev_call`, `_jacfwd_call`, `jvp`, `vjp`, `linearize`: every
public transform goes through one of them) dynamo does what it does for torch's own
higher-order ops:
1. it traces the user's function into a subgraph (the *body*), on the arguments the
   function would see (per-sample slices for vmap), lifting what the function closes over
   (module parameters, captured tensors) to body inputs;
2. it puts one node in the graph: a `StagedCall` (staged_call.py) called with the body and
   the call's tensors, which applies the transform to the body when the graph runs.
Transforms nest: `vmap(grad(f))` gives a vmap node whose body holds a grad node. Backends
`aot_eager` and `inductor` trace through the node (functx dissolves into ATen ops), so
the compiled graph is flat and differentiable. Anything dynamo cannot trace in the body
(a graph break inside it) makes the whole transform call a graph break: it then runs
eagerly, so values stay right.

Dynamo's internals are used as they stand in torch 2.13 (`speculate_subgraph`,
`trace_rules`); `install()` runs when `torch._dynamo` is imported (see `__init__.py`).
"""

from __future__ import annotations

import inspect

import torch
import torch.utils._pytree as torch_pytree
from torch._dynamo import trace_rules
from torch._dynamo.exc import TorchRuntimeError, UserError, unimplemented
from torch._dynamo.utils import _make_inlined, unpack_iterable
from torch._dynamo.variables import (
    ConstantVariable,
    FunctoolsPartialVariable,
    ListVariable,
    SymNodeVariable,
    TupleVariable,
    UserFunctionVariable,
    VariableTracker,
)
from torch._dynamo.variables.builder import SourcelessBuilder, wrap_fx_proxy
from torch._dynamo.variables.higher_order_ops import make_attr, speculate_subgraph

from ..ad import forward, reverse
from ..core.patches import patch
from ..functionalize import api as functionalize_api
from ..nn.functional_call import _merge_dicts
from ..vmap import api as vmap_api
from .staged_call import StagedCall


def _unsupported(what, why, from_exc=None):
    unimplemented(
        gb_type=f"functx: {what} cannot be staged",
        context=what,
        explanation=why,
        hints=["The call runs eagerly (correct, not compiled); the functx issue tracker wants to hear of it."],
        **({} if from_exc is None else {"from_exc": from_exc}),
    )


# Errors dynamo raises while tracing a body or running a staged call on fake tensors that are
# not graph breaks (a guard on data, an error of the user's function): they make the call a
# graph break too, so that it runs eagerly and an error is the eager one, worded as it is there.
_TRACE_ERRORS = (UserError, TorchRuntimeError)


def _constant(vt, name):
    vt = vt.realize()  # a transform compiled as the frame itself: its closure cells are lazy
    if isinstance(vt, (TupleVariable, ListVariable)):  # (in_dims=(None, 0): lazy items too)
        return type(vt.python_type()())(_constant(item, name) for item in vt.items)
    if isinstance(vt, SymNodeVariable):  # an int made symbolic (dynamic=True): specialized, guarded
        return vt.evaluate_expr()
    if not vt.is_python_constant():
        _unsupported(name, f"`{name}` must be a Python constant under torch.compile, got {vt}")
    return vt.as_python_constant()


def _items(vt, name):
    if isinstance(vt, (TupleVariable, ListVariable)):
        return list(vt.items)
    _unsupported(name, f"expected a tuple of arguments, got {vt}")


def _keyword_items(vt):
    if vt is None:
        return {}
    if isinstance(vt, ConstantVariable) and vt.as_python_constant() is None:
        return {}
    return dict(vt.keys_as_python_constant())


def _flatten(tx, items):
    """Leaves (VariableTrackers) and torch pytree spec of a tuple of arguments."""
    leaves_vt, spec_vt = unpack_iterable(tx, _make_inlined(tx, torch_pytree.tree_flatten)(TupleVariable(list(items))))
    return unpack_iterable(tx, leaves_vt), spec_vt


def _unflatten(tx, leaves, spec_vt):
    return _make_inlined(tx, torch_pytree.tree_unflatten)(ListVariable(list(leaves)), spec_vt)


def _per_sample_args(tx, args, in_dims):
    """What vmap's function sees: each batched leaf with its batch dim selected away."""
    leaves, spec_vt = _flatten(tx, args)
    spec = spec_vt.as_python_constant()
    dims = [in_dims] * spec.num_leaves if isinstance(in_dims, int) else torch_pytree._broadcast_to_and_flatten(in_dims, spec)
    if dims is None:
        _unsupported("vmap", "in_dims do not match the arguments' structure (eager vmap raises the error)")
    sample = []
    for leaf, dim in zip(leaves, dims):
        if dim is not None and leaf.is_tensor():
            leaf = leaf.call_method(tx, "select", [ConstantVariable.create(dim), ConstantVariable.create(0)], {})
        sample.append(leaf)
    return unpack_iterable(tx, _unflatten(tx, sample, spec_vt))


class _Entry:
    """One entry point: how its arguments split into the function, constant options, the
    call's own arguments and what the function itself receives."""

    def __init__(self, module, name, layout, option_names, per_sample=False):
        self.module, self.name = module, name
        self.entry = getattr(module, name)
        self.layout, self.option_names, self.per_sample = layout, option_names, per_sample
        self.signature = inspect.signature(self.entry)

    def split(self, tx, args, kwargs):
        """(func, options, call_args, function_args, function_kwargs) as VariableTrackers."""
        try:
            arguments = self.signature.bind(*args, **kwargs).arguments
        except TypeError as error:
            _unsupported(self.name, str(error))
        func = arguments["func"]
        options = {name: _constant(arguments[name], name) for name in self.option_names}
        if self.layout == "call":
            call_args = _items(arguments["args"], "args")
            kw = _keyword_items(arguments["kwargs"])
            func_args = _per_sample_args(tx, call_args, options["in_dims"]) if self.per_sample else call_args
            return func, tuple(options.values()), call_args, func_args, kw
        if self.layout == "jvp":
            primals = arguments["primals"]
            if not isinstance(primals, TupleVariable):
                _unsupported("jvp", "primals must be a tuple (eager jvp raises the error)")
            return func, options, [primals, arguments["tangents"]], list(primals.items), {}
        primals = _items(arguments["primals"], "primals")  # vjp, linearize
        return func, options, primals, primals, {}


# Every public transform reaches one of these module-level functions (looked up as module
# globals at each call, so `install` can swap in the versions dynamo must not step into).
_ENTRY_POINTS = (
    (vmap_api, "_vmap_call", "call", ("in_dims", "out_dims", "randomness", "chunk_size"), True),
    (reverse, "_grad_and_value_call", "call", ("argnums", "has_aux"), False),
    (reverse, "_jacrev_call", "call", ("argnums", "has_aux", "chunk_size"), False),
    (forward, "_jacfwd_call", "call", ("argnums", "has_aux", "randomness", "chunk_size"), False),
    (forward, "_jvp_call", "jvp", ("strict", "has_aux"), False),
    (reverse, "_vjp_call", "vjp", ("has_aux",), False),
    (forward, "_linearize_call", "linearize", (), False),
    (functionalize_api, "_functionalize_call", "call", ("reapply_views",), False),
)


class _Body:
    """The user's function traced into a subgraph, installed in the output graph."""

    def __init__(self, tx, func, func_args, func_kwargs, description):
        if func_kwargs:
            func = FunctoolsPartialVariable(func, [], func_kwargs)
        try:
            (output, output_spec), graph, lifted = speculate_subgraph(
                tx,
                func,
                list(func_args),
                {},
                description,
                set_subgraph_inputs="flatten_manual",
                should_flatten_outputs=True,
            )
        except _TRACE_ERRORS as error:
            _unsupported(description, f"tracing the function failed: {error}", error)
        self.n_func_leaves = len(
            [n for n in graph.nodes if n.op == "placeholder"]
        ) - len(lifted)
        self.captured = tuple(lifted)  # outer proxies, in the body's placeholder order
        module = torch.fx.GraphModule(tx.output.nn_modules, graph)
        self.name = tx.output.install_subgraph("functx_body", module)
        spec = output_spec.treespec
        if isinstance(spec, VariableTracker):
            spec = spec.as_python_constant()
        self.output = (spec, output_spec.masks_to_filter_const_values, output_spec.const_values)

    def stage(self, tx, layout, entry, options, call_args):
        """One graph node applying the transform to the body; returns the result's VT."""
        leaves, spec_vt = _flatten(tx, call_args)
        node_args = []
        for leaf in leaves:
            if leaf.is_python_constant():
                node_args.append(leaf.as_python_constant())
            elif leaf.is_tensor():
                node_args.append(leaf.as_proxy())
            else:
                _unsupported(entry.__name__, f"an argument of type {leaf.python_type().__name__} (tensors and constants only)")
        call = StagedCall.interned(layout, entry, options, spec_vt.as_python_constant(), self.n_func_leaves, self.output)
        proxy = tx.output.create_proxy(
            "call_function", call, (make_attr(tx, self.name), *node_args, *self.captured), {}
        )
        # AOTAutograd's cache takes a graph with a call it does not know when the node says
        # what it computes: the body is a submodule (in the key with its code), the call's
        # settings are hashed here. A warm process then skips re-tracing the transforms.
        proxy.node.meta["is_wrapped"] = True
        proxy.node.meta["user_cache_hash"] = call.cache_hash()
        try:
            flat_result = wrap_fx_proxy(tx, proxy)  # runs the call on fake tensors: records result_spec
        except _TRACE_ERRORS as error:
            _unsupported(call.__name__, f"the transform failed on the traced function: {error}", error)
        return SourcelessBuilder.create(tx, torch_pytree.tree_unflatten).call_function(
            tx, [flat_result, VariableTracker.build(tx, call.result_spec)], {}
        )


class _AppliedLater(VariableTracker):
    """vjp's `vjp_fn` / linearize's `jvp_fn`: calling it stages one more node on the same body."""

    def __init__(self, body, layout, entry, options, primals, **kwargs):
        super().__init__(**kwargs)
        self.body, self.layout, self.entry, self.options, self.primals = body, layout, entry, options, primals

    def python_type(self):
        return type(lambda: None)

    def call_function(self, tx, args, kwargs):
        if self.layout == "vjp_apply":
            if len(args) != 1:
                _unsupported("vjp_fn", "vjp_fn takes the cotangents as its one positional argument")
            for name in kwargs:  # retain_graph / create_graph change nothing in a staged call
                if name not in ("retain_graph", "create_graph"):
                    _unsupported("vjp_fn", f"unexpected keyword {name}")
            applied_to = args[0]
        else:
            if kwargs:
                _unsupported("jvp_fn", "jvp_fn takes tangents positionally")
            applied_to = TupleVariable(list(args))
        return self.body.stage(tx, self.layout, self.entry, self.options, [TupleVariable(list(self.primals)), applied_to])


class StagedTransformVariable(UserFunctionVariable):
    """Dynamo's view of a functx entry point: stage the call instead of inlining it."""

    def call_function(self, tx, args, kwargs):
        how = ENTRIES[self.fn]
        func, options, call_args, func_args, func_kwargs = how.split(tx, args, kwargs)
        body = _Body(tx, func, func_args, func_kwargs, f"functx.{how.name.strip('_')}")
        if how.layout in ("call", "jvp"):
            return body.stage(tx, how.layout, how.entry, options, call_args)
        output = body.stage(tx, "vjp_forward", reverse.vjp, options if how.layout == "vjp" else {}, call_args)
        if how.layout == "vjp":
            later = _AppliedLater(body, "vjp_apply", reverse.vjp, options, call_args)
            items = unpack_iterable(tx, output)  # (output,) or (output, aux)
            return TupleVariable([items[0], later, *items[1:]])
        later = _AppliedLater(body, "linearize_apply", forward.linearize, {}, call_args)
        return TupleVariable([unpack_iterable(tx, output)[0], later])


def _functional_call_as_torch(module, parameter_and_buffer_dicts, args=None, kwargs=None, *, tie_weights=True, strict=False):
    """What dynamo traces for `functx.functional_call`: torch's reparametrization, which
    dynamo knows (functx's own swaps module attributes, a side effect a staged body may not
    have). Same semantics as functx's (`return_state=True`: the function below)."""
    merged = _merge_dicts(parameter_and_buffer_dicts)  # functx's own checks and errors
    if args is None:
        args = ()
    elif not isinstance(args, tuple):
        args = (args,)
    return torch.nn.utils.stateless._functional_call(
        module, merged, args, kwargs or {}, tie_weights=tie_weights, strict=strict
    )


def _pure_functional_call_as_torch(module, parameter_and_buffer_dicts, args=None, kwargs=None, *, tie_weights=True, strict=False):
    """What dynamo traces for `functx.functional_call(..., return_state=True)`: the forward
    on clones of every buffer (the given ones, the module's own for names not given; one
    clone per tensor keeps tied buffers tied), then the buffers as they are after it."""
    values = dict(_merge_dicts(parameter_and_buffer_dicts))
    originals, clones = [], []
    for name, own in module.named_buffers(remove_duplicate=False):
        source = values[name] if name in values else own
        if source is None:
            continue
        for original, clone in zip(originals, clones):
            if original is source:
                values[name] = clone
                break
        else:
            originals.append(source)
            clones.append(source.clone())
            values[name] = clones[-1]
    if args is None:
        args = ()
    elif not isinstance(args, tuple):
        args = (args,)
    with torch.nn.utils.stateless._reparametrize_module(module, values, tie_weights=tie_weights, strict=strict):
        output = module(*args, **(kwargs or {}))
        new_buffers = {name: buffer for name, buffer in module.named_buffers()}
    return output, new_buffers


class FunctionalCallVariable(UserFunctionVariable):
    def call_function(self, tx, args, kwargs):
        return_state = kwargs.pop("return_state", None)
        if return_state is not None and _constant(return_state, "return_state"):
            return SourcelessBuilder.create(tx, _pure_functional_call_as_torch).call_function(tx, args, kwargs)
        return SourcelessBuilder.create(tx, _functional_call_as_torch).call_function(tx, args, kwargs)


ENTRIES = {}


_RULES = {}  # function -> the dynamo variable that traces it (functx's entries in dynamo's rule map)


def install():
    """Register functx with dynamo (idempotent): each entry point is staged when traced,
    and, where dynamo could not stage a call and runs it eagerly, runs with dynamo off
    (frames under a transform hold functx's level tensors: nothing dynamo should compile)."""
    if ENTRIES:
        return
    for module, name, layout, option_names, per_sample in _ENTRY_POINTS:
        how = _Entry(module, name, layout, option_names, per_sample)
        eager = torch._dynamo.disable(how.entry, reason="functx: a transform call dynamo could not stage")
        setattr(module, name, eager)
        for fn in (how.entry, eager):
            ENTRIES[fn] = how
            _RULES[fn] = StagedTransformVariable
    from ..nn.functional_call import functional_call

    _RULES[functional_call] = FunctionalCallVariable
    _keep_rules()


class _RuleMapWithFunctx:
    """dynamo's `trace_rules.get_torch_obj_rule_map` (a cached dict) with functx's entries
    added each time it is rebuilt. torch clears that cache at run time
    (`torch.distributed.init_process_group` does, via `trace_rules.clear_lru_cache`):
    entries written into the cached dict once were lost then, and every transform call
    under functx.jit / torch.compile became an eager graph break."""

    def __init__(self, original):
        self.original = original
        self.rules = None

    def __call__(self):
        if self.rules is None:
            self.rules = self.original()
            self.rules.update(_RULES)
        return self.rules

    def cache_clear(self):
        self.original.cache_clear()
        self.rules = None


def _keep_rules():
    current = trace_rules.get_torch_obj_rule_map
    if not isinstance(current, _RuleMapWithFunctx):
        current = _RuleMapWithFunctx(current)
        patch(
            trace_rules,
            "get_torch_obj_rule_map",
            current,
            "dynamo's rule map keeps functx's entries (transform calls staged whole) when torch rebuilds it",
        )
    current.cache_clear()
