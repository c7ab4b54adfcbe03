"""What a torch.compile graph runs for one functx transform call.

Dynamo cannot trace functx itself (its values are Python tensor subclasses made per op),
but it can trace the user's function: `functx/staging/dynamo.py` traces the function the
transform was given into a subgraph (the *body*, on per-sample shapes for vmap) and puts one
node in the graph that calls a `StagedCall` with the body and the call's tensors. The node
runs the transform over the body. Under `aot_eager` / `inductor`, AOTAutograd traces through
that node with `make_fx`, so functx's levels dissolve into plain ATen ops: the backend sees
one flat graph, and autograd through the compiled function differentiates that graph.
"""

from __future__ import annotations

import functools
import hashlib
import pathlib
import sys

import torch.utils._pytree as torch_pytree
from torch import Tensor

from .. import ad
from ..core import config


@functools.cache
def _functx_source_hash() -> str:
    """A hash of every source file of the installed functx (read once per process)."""
    root = pathlib.Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


class StagedCall:
    """One staged transform call: `call(body, *flat)` where `flat` is the call's own
    argument leaves (`args_spec`) followed by the tensors the body closed over.

    `layout` says how the call's arguments are laid out and what the node returns:
    - "call": a transform applied to the function, called with args
      (`entry(func, *options, args, {})`: vmap, grad_and_value, jacrev, jacfwd);
    - "jvp": `jvp(func, primals, tangents, **options)`, the call's args are (primals, tangents);
    - "vjp_forward": `vjp(func, *primals, **options)` without its vjp_fn;
    - "vjp_apply": `vjp(func, *primals, **options)[1](cotangents)`, args (primals, cotangents);
    - "linearize_apply": the jvp_fn of `linearize(func, *primals)` applied to tangents.
    The result is returned flat (leaves of `result_spec`, recorded on the first, fake, run).
    """

    def __init__(self, layout, entry, options, args_spec, n_func_leaves, body_output):
        self.layout = layout
        self.entry = entry
        self.options = options  # positional for "call", keyword for the others
        self.args_spec = args_spec
        self.n_call_leaves = args_spec.num_leaves
        self.n_func_leaves = n_func_leaves  # leaves of what the function itself receives
        self.body_out_spec, self.body_out_masks, self.body_out_constants = body_output
        self.result_spec = None
        # Importable under a name that says what it computes: AOTAutograd's cache key names a
        # graph's globals by import path, so the module holds each distinct call (see
        # cache_hash; a later call with the same hash computes the same, and replaces it).
        name = f"functx_{getattr(entry, '__name__', 'transform').strip('_')}"
        self.__name__ = self.__qualname__ = f"{name}_{self.cache_hash()[:16]}"
        self.__module__ = __name__

    @classmethod
    def interned(cls, *settings) -> "StagedCall":
        """The call for these settings: one object per distinct call, held by this module
        under its name. AOTAutograd's cache key names a graph's globals by import path (and
        checks the import finds the same object), so a call must be importable under a name
        that says what it computes (see cache_hash). Calls with the same hash compute the
        same: the same result structure too (`result_spec`)."""
        call = cls(*settings)
        module = sys.modules[__name__]
        known = getattr(module, call.__name__, None)
        if isinstance(known, cls):
            return known
        setattr(module, call.__name__, call)
        return call

    def cache_hash(self) -> str:
        """What this call computes apart from its body (a submodule of the graph, in the
        key with its code), as a stable string for AOTAutograd's cache key: the settings
        and functx's own source, so that a changed functx never reuses an old trace.
        Settings whose repr is not stable (a function's) only make the key miss."""
        entry = f"{getattr(self.entry, '__module__', '')}.{getattr(self.entry, '__qualname__', self.entry)}"
        spec, masks, constants = self.body_out_spec, self.body_out_masks, self.body_out_constants
        settings = (self.layout, entry, self.options, self.args_spec, self.n_func_leaves, spec, masks, constants)
        described = repr((settings, config.fallback))  # vmap's fallback mode decides loop or error
        return hashlib.sha256((_functx_source_hash() + described).encode()).hexdigest()

    def __repr__(self):
        return f"StagedCall({self.layout}, {self.__name__}, options={self.options!r})"

    def function(self, body, captured):
        """The user's function, rebuilt from its traced body."""

        def func(*args):
            leaves = torch_pytree.tree_leaves(args)
            if len(leaves) != self.n_func_leaves:
                raise RuntimeError(
                    f"functx under torch.compile: the traced function expected {self.n_func_leaves} "
                    f"argument leaves, got {len(leaves)}"
                )
            return self._body_output(body(*leaves, *captured))

        return func

    def _body_output(self, outputs):
        if self.body_out_spec is None:
            return outputs
        outputs = iter(outputs if isinstance(outputs, (tuple, list)) else (outputs,))
        leaves = [  # a mask is True where the output was a constant, left out of the graph
            constant if is_constant else next(outputs)
            for is_constant, constant in zip(self.body_out_masks, self.body_out_constants)
        ]
        return torch_pytree.tree_unflatten(leaves, self.body_out_spec)

    def __call__(self, body, *flat):
        call_args = torch_pytree.tree_unflatten(list(flat[: self.n_call_leaves]), self.args_spec)
        func = self.function(body, flat[self.n_call_leaves :])
        result = self._apply(func, call_args)
        leaves, spec = torch_pytree.tree_flatten(result)
        if self.result_spec is None:
            for leaf in leaves:
                if not isinstance(leaf, Tensor):
                    raise TypeError(
                        f"functx under torch.compile: {self.__name__} returned a {type(leaf).__name__}; "
                        f"a staged transform call returns tensors only"
                    )
            self.result_spec = spec
        elif spec != self.result_spec:
            raise RuntimeError(
                f"functx under torch.compile: {self.__name__} returned {spec}, traced as {self.result_spec}"
            )
        return leaves

    def _apply(self, func, call_args):
        if self.layout == "call":
            return self.entry(func, *self.options, call_args, {})
        if self.layout == "jvp":
            primals, tangents = call_args
            return ad.jvp(func, primals, tangents, **self.options)
        if self.layout == "vjp_forward":
            output, _, *aux = ad.vjp(func, *call_args, **self.options)
            return (output, *aux)
        if self.layout == "vjp_apply":
            primals, cotangents = call_args
            return ad.vjp(func, *primals, **self.options)[1](cotangents)
        if self.layout == "linearize_apply":
            primals, tangents = call_args
            return ad.jvp(func, primals, tangents)[1]
        raise AssertionError(self.layout)

