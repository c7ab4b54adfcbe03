"""`functx.jit`: trace a transformed function once, replay it with no Python dispatch.

Eager functx pays Python for every op at every level. `jit` hands the function to
`torch.compile` (dynamo), which stages each functx transform whole (dynamo.py): on the
first call the function is traced on fake tensors, every transform dissolves into plain
ATen ops (AOTAutograd traces through the staged calls with make_fx), and the flat graph,
forward and backward, is what later calls run. `backend=None` replays that graph as it is;
`"inductor"` (or any torch.compile backend) compiles it first.

Semantics, as jax.jit's where they can be:

- **Caching.** A traced graph is reused while the call looks the same: the pytree structure
  of the arguments, their shapes (or, with `dynamic=True`, symbolic sizes), dtypes,
  devices, `requires_grad`, grad mode, and the values of the static arguments
  (`static_argnums`: hashable Python values, each distinct tuple its own trace). Anything
  else retraces; a warning says so after `RETRACE_WARNING_AFTER` traces of one function
  (shape churn: use `dynamic=True`, or pad). Across processes, torch's on-disk caches
  (AOTAutograd's, inductor's) keep the flat graph: a new process re-runs dynamo but not the
  transforms' trace (the staged calls key it by their settings and functx's source).
- **Python control flow** on Python values (shapes, static arguments, ints) is fixed at
  trace time and guarded: another value retraces. On tensor *values* (`if x.sum() > 0`)
  jax.jit refuses; here the graph is split there and the branch runs eagerly, so results
  stay right (slower). Python side effects are not frozen into the graph as jax.jit
  freezes them: a `print` splits the graph and runs on every call (the traced parts
  around it replayed); mutating Python state the function reads (appending to a captured
  list) changes what dynamo guards on, so every call traces again (the `RetraceWarning`
  says so): keep such state outside the jitted function.
- **Randomness.** Random ops draw fresh numbers on every call; `vmap`'s randomness modes
  hold inside (`"different"`: one draw per element).
- **In-place writes** to inputs (and to module buffers passed through `functional_call`,
  BatchNorm's running statistics) are reproduced on every call.
- **vmap's per-sample loop** (ops with no batching rule) is unrolled for the batch size it
  was traced with; the batch size is part of the cache key (with `dynamic=True` too: the
  trace specializes on it), so another batch size retraces instead of running a wrong loop.
- **Gradients through a jitted function** are those of the eager function: the backward is
  traced as a graph of its own (AOTAutograd's joint graph), never recorded from autograd's
  side effects during a trace, so `torch.autograd.grad` of a jitted function's output
  equals eager's. Once: a second backward through the jitted function's backward raises
  torch's "does not currently support double backward". Put the higher-order transform
  inside the jitted function instead (`jit(hessian(f))`, `jit(grad(grad(f)))`).
- **With inductor**, the wrapper that calls the kernels is C++ for a CPU graph of many small
  ops and inductor's Python one otherwise (`overhead_bound`; `options={"cpp_wrapper": ...}`
  decides instead), and functx's graph rewrites run first among inductor's post-grad passes
  (graph_passes.py: a product with per-element copies of one shared weight, which vmap's
  `grad` makes of an unbatched input, becomes a product with that weight); a
  `post_grad_custom_pre_pass` given in `options` runs after them.

- **Where torch.compile refuses** a program eager torch computes (`_COMPILE_REFUSALS`: a
  write through a view of an `as_strided` view, which torch's second-order SVD backward
  makes; a checkpoint's preserved RNG state in a traced backward; dynamo's empty subgraph
  after a split at a value-dependent branch) before any of the call ran (no input written), that signature runs eagerly from
  then on, with an `EagerFallbackWarning`: right values, untraced.

- **Under a user's `TorchDispatchMode`** (a FLOP counter, a logging mode) the function runs
  eagerly, untraced: the mode sees its plain-tensor ops (dynamo does not trace there, and a
  function it declined once it would never trace again). Calls outside the mode trace as usual.

Debugging: `FUNCTX_JIT_DEBUG=1` in the environment (or `functx.jit(..., debug=True)`)
prints each trace's cause, time and the backend's compile time.

    >>> import torch, functx
    >>> w = torch.randn(3)
    >>> f = functx.jit(functx.vmap(functx.grad(lambda w, x: (w * x).sin().sum()), in_dims=(None, 0)))
    >>> xs = torch.randn(4, 3)
    >>> torch.allclose(f(w, xs), torch.cos(w * xs) * xs)
    True
    >>> f.traces
    1
"""

from __future__ import annotations

import functools
import os
import time
import types

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from typing import Callable, Optional, Union, overload

from ..core import pytree
from ..core.type_aliases import Argnums, Function
from ..core.errors import warn

RETRACE_WARNING_AFTER = 4
_modes_on_stack = torch._C._len_torch_dispatch_stack


class RetraceWarning(UserWarning):
    """A jitted function was traced again and again (its calls keep changing shape)."""


class EagerFallbackWarning(UserWarning):
    """torch.compile refused to trace a jitted function: it runs eagerly (right, untraced)."""


# What torch.compile refuses though eager torch computes it: functionalization cannot
# express a write through a view of an `as_strided` view (torch's own backward of a write
# into a view, CopySlices, reads the slice back with as_strided: the caller's gradient
# through a jitted third derivative of an SVD meets it).
_COMPILE_REFUSALS = (
    "as_strided() is non-compositional",
    # torch's checkpoint traced whole with its backward (per-sample gradients of a checkpointed
    # model): AOTAutograd's rematerialization refuses the RNG state a checkpoint preserves
    "does not support RNG ops in recompute regions",
    # dynamo's own bug: a frame split at a value-dependent branch (the per-sample loop of
    # vmap's fallback) leaves a subgraph with no nodes, whose generated code does not compile
    "expected an indented block after function definition",
)
_REFUSED = object()  # a signature torch.compile refused: run eagerly


def _tensor_versions(args, kwargs) -> list:
    """The version counters of the tensors among the arguments (an in-place write bumps one)."""
    leaves = pytree.tree_leaves((args, kwargs))
    return [(leaf, leaf._version) for leaf in leaves if isinstance(leaf, torch.Tensor)]


@overload
def jit(
    fn: Function,
    *,
    static_argnums: Argnums = (),
    backend: Union[str, Callable, None] = None,
    dynamic: bool = False,
    debug: Optional[bool] = None,
    mode: Optional[str] = None,
    options: Optional[dict] = None,
) -> Jitted: ...


@overload
def jit(
    fn: None = None,
    *,
    static_argnums: Argnums = (),
    backend: Union[str, Callable, None] = None,
    dynamic: bool = False,
    debug: Optional[bool] = None,
    mode: Optional[str] = None,
    options: Optional[dict] = None,
) -> Callable[[Function], Jitted]: ...


def jit(fn=None, *, static_argnums=(), backend=None, dynamic=False, debug=None, mode=None, options=None):
    """`fn` traced on its first call (per argument signature) and replayed after: the
    transforms' Python dispatch runs once, later calls run the recorded ATen graph (compiled
    by `backend`, if given). Usable as a decorator, bare or with arguments.

    Args:
        fn (Callable | None, default None): the function (any composition of functx
            transforms, modules through `functional_call`, plain torch code). None:
            returns a decorator taking the function.
        static_argnums (int | tuple[int, ...], default ()): positions of arguments that
            are Python values fixed at trace time (hashable; each distinct value traces
            once).
        backend (str | Callable | None, default None): None to replay the traced graph as
            it is, or a torch.compile backend (`"inductor"`, a name from
            `torch._dynamo.list_backends()`, a callable).
        dynamic (bool, default False): trace with symbolic sizes (one trace for many
            shapes) instead of one per shape.
        debug (bool | None, default None): print each trace's cause and time (default: the
            `FUNCTX_JIT_DEBUG` environment variable).
        mode (str | None, default None): the compiler's mode, as torch.compile's
            (`backend="inductor"`: `"max-autotune-no-cudagraphs"`).
        options (dict | None, default None): the compiler's options, as torch.compile's
            (`{"cpp_wrapper": True}`). With inductor, functx chooses the wrapper per graph
            unless `cpp_wrapper` is given: C++ for CPU graphs of many small ops (a MAML
            step, a small Hessian: 0.78-0.88x the Python wrapper's time, for a longer first
            compile), inductor's Python wrapper otherwise. No settings with `backend=None`.

    Returns:
        Jitted: a callable like `fn` (its `traces` attribute counts the traces made), or,
        with `fn=None`, a decorator returning one.

    Raises:
        TypeError: `fn` is not callable.
        ValueError: `mode` or `options` with `backend=None`
            ([error catalogue: functx.jit](../errors.md#functxjit)).
        torch._dynamo.exc.InvalidBackend: an unknown backend name. A program
            torch.compile refuses runs eagerly with an `EagerFallbackWarning`; one that keeps
            retracing warns with a `RetraceWarning`.

    Examples:
        >>> import torch, functx
        >>> @functx.jit(static_argnums=1)
        ... def power_sum(x, n):
        ...     return (x ** n).sum()
        >>> power_sum(torch.tensor([1.0, 2.0]), 3)
        tensor(9.)
        >>> per_sample = functx.jit(functx.vmap(functx.grad(lambda w, x: (w @ x).tanh()), in_dims=(None, 0)))
        >>> per_sample(torch.ones(3), torch.randn(4, 3)).shape, per_sample.traces
        (torch.Size([4, 3]), 1)

    Differences from torch.func:
        torch.func has no `jit`; `torch.compile` of a torch.func program is the
        comparison (benchmarks/staging_jit.py). functx.jit traces the transforms once with
        dynamo, so a replay pays no Python dispatch per op.
    """
    if fn is None:
        return functools.partial(
            jit, static_argnums=static_argnums, backend=backend, dynamic=dynamic, debug=debug, mode=mode, options=options
        )
    if not callable(fn):
        raise TypeError(f"functx.jit: expected a function, got {type(fn).__name__}: {fn!r}")
    return Jitted(fn, static_argnums, backend, dynamic, debug, mode, options)


def _static_positions(static_argnums) -> tuple[int, ...]:
    if isinstance(static_argnums, int) and not isinstance(static_argnums, bool):
        static_argnums = (static_argnums,)
    if not isinstance(static_argnums, (tuple, list)) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in static_argnums
    ):
        raise TypeError(f"functx.jit: static_argnums must be an int or a tuple of ints, got {static_argnums!r}")
    return tuple(static_argnums)


def _resolve_backend(backend, mode, options, dynamic):
    """The compiler for `backend`, configured as torch.compile configures it (None:
    AOTAutograd, then the graph as it is)."""
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"functx.jit: options must be a dict of compiler settings, got {options!r}")
    if backend is None:
        if mode is not None or options:
            raise ValueError(
                "functx.jit: mode and options configure a compiler, but backend=None replays the "
                "traced graph as it is. Pass backend='inductor' (or another torch.compile backend) with them."
            )
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend("aot_eager")
    if backend == "inductor":
        chooses = options is None or "cpp_wrapper" not in options
        return _Inductor(mode, _with_graph_passes(options), dynamic, chooses)  # unknown options raise here
    if isinstance(backend, str) or callable(backend):
        return torch._TorchCompileWrapper(backend, mode, options, dynamic)
    raise TypeError(f"functx.jit: backend must be None, a backend name or a callable, got {backend!r}")


def _with_graph_passes(options):
    """Inductor's options with functx's rewrites of the traced graph first in its post-grad
    passes (graph_passes.py: products with batch copies of a shared weight made shared); a
    pass the caller set there runs after them."""
    from . import graph_passes

    if not graph_passes.ENABLED:
        return options
    options = dict(options or {})
    options["post_grad_custom_pre_pass"] = graph_passes.SharedWeights(then=options.get("post_grad_custom_pre_pass"))
    return options


class _Inductor(torch._TorchCompileInductorWrapper):
    """Inductor, choosing the wrapper (the code that calls the kernels) per traced graph,
    forward and backward each, unless `options` set `cpp_wrapper`: C++ for a CPU graph of
    many small ops (`overhead_bound`), Python otherwise (inductor's default).

    Inductor's default wrapper makes one Python call per kernel and per buffer, ~1-3 us
    each: on a MAML step (536 ops of ~1,400 elements each) that is most of the time, and the
    C++ wrapper runs it in 0.78x the time (jax.jit's territory); on graphs of large ops it
    changes nothing measurable and costs seconds of C++ compile on the first call."""

    def __init__(self, mode, options, dynamic, chooses: bool):
        super().__init__(mode, options, dynamic)
        self.chooses = chooses

    def __call__(self, model_, inputs_, *, config_patches=None):
        if not self.chooses:
            return super().__call__(model_, inputs_, config_patches=config_patches)
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(
            model_,
            inputs_,
            config_patches={**self.config, **(config_patches or {})},
            compile_region_name=self.name,
            inner_compile=_compile_choosing_wrapper,
        )


def _compile_choosing_wrapper(graph_module, example_inputs, **kwargs):
    """Inductor's compile of one flat graph (AOTAutograd's forward or backward), with the
    C++ wrapper where `overhead_bound` says it pays."""
    from torch._inductor.compile_fx import compile_fx_inner

    if not kwargs.get("cpp_wrapper") and not kwargs.get("fx_wrapper") and overhead_bound(graph_module, example_inputs):
        kwargs["cpp_wrapper"] = True
    return compile_fx_inner(graph_module, example_inputs, **kwargs)


CPP_WRAPPER_MIN_OPS = 32  # below, the wrapper's per-op cost is small next to dynamo's per call
CPP_WRAPPER_MAX_ELEMENTS_PER_OP = 8192  # above, the ops' own work hides the wrapper's


def overhead_bound(graph_module, example_inputs) -> bool:
    """Whether a flat CPU graph is many small ops: at least `CPP_WRAPPER_MIN_OPS` ops
    making tensors, of at most `CPP_WRAPPER_MAX_ELEMENTS_PER_OP` output elements on average.
    Measured on the benchmark suite's graphs (ops, elements per op): MAML (536, 1442) and a
    Hessian of an R^128 MLP (60, 3994) are chosen, and run in 0.78x and 0.88x the time with
    the C++ wrapper; a tiny vmap(grad) (18, 63), per-sample Jacobians (31, 12955) and the
    rest (>= 22k elements per op) are not, and ran within 0.94-1.02x either way."""
    if any(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in example_inputs):
        return False
    ops = elements = 0
    for node in graph_module.graph.nodes:
        if node.op != "call_function":
            continue
        value = node.meta.get("val")
        sizes = [t.numel() for t in (value if isinstance(value, (tuple, list)) else [value]) if isinstance(t, torch.Tensor)]
        if any(not isinstance(size, int) for size in sizes):
            return False  # symbolic sizes (dynamic=True): comparing them would guard on them; the default
        if sizes:
            ops += 1
            elements += sum(sizes)
    return ops >= CPP_WRAPPER_MIN_OPS and elements <= CPP_WRAPPER_MAX_ELEMENTS_PER_OP * ops


def _own_frame(target, name):
    """A function calling `target` with a code object of its own. Dynamo caches traces per
    code object: every `functx.vmap(f)` runs the same `vmapped` code, so jitting two of them
    would share one cache (and its recompile limit, after which dynamo runs the code eagerly)."""

    def call(*args, **kwargs):
        return target(*args, **kwargs)

    code = call.__code__.replace(co_name=f"jit_{name}"[:60] if name.isidentifier() else "jit_call")
    return types.FunctionType(code, call.__globals__, code.co_name, None, call.__closure__)


def _optimized(fn, backend, dynamic: bool):
    """`torch.compile(fn, backend=backend, dynamic=dynamic)`, with the dynamic-shapes setting
    applied only while dynamo traces. torch.compile enters and leaves that config patch on
    every call (5 of the 24 us a cache hit cost, measured); it matters only when dynamo
    converts a frame, which is when its callback runs (on a cache miss), so the patch moves
    into the callback. Where torch's context does not look as expected, plain torch.compile."""
    import torch._dynamo

    context = torch._dynamo.optimize(backend=backend, dynamic=dynamic)
    hooks = getattr(context, "enter_exit_hooks", None)
    callback = getattr(context, "callback", None)
    if not hooks or callback is None or "_make_closure_patcher" not in getattr(hooks[0], "__qualname__", ""):
        return torch.compile(fn, backend=backend, dynamic=dynamic)
    patch = hooks.pop(0)

    # Dynamo also brackets every call's pre-graph bytecode with two calls that only feed
    # the profiler's "Pregraph bytecode" ranges (2 of the 19 us a cache hit costs): not emitted.
    quiet = torch._dynamo.config._make_closure_patcher(record_runtime_overhead=False)

    def converting(*args, **kwargs):
        undo, undo_quiet = patch(), quiet()
        try:
            return callback(*args, **kwargs)
        finally:
            undo_quiet()
            undo()

    setattr(converting, "_torchdynamo_orig_backend", callback)  # how dynamo finds the backend behind a callback
    setattr(context, "callback", converting)
    return context(fn)


class Jitted:
    """A function under `functx.jit`: call it as the function. `traces` counts the traces
    made so far (all static values together)."""

    def __init__(self, fn, static_argnums, backend, dynamic, debug, mode=None, options=None):
        self.fn = fn
        self.static_argnums = _static_positions(static_argnums)
        self.backend = backend
        self.dynamic = bool(dynamic)
        self.debug = bool(os.environ.get("FUNCTX_JIT_DEBUG")) if debug is None else bool(debug)
        self.traces = 0
        self._by_statics: dict = {}
        self._backend = _resolve_backend(backend, mode, options, self.dynamic)
        self._compile_seconds = 0.0
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        if _modes_on_stack() and is_in_torch_dispatch_mode(include_infra_modes=False):
            # dynamo does not trace under a user's TorchDispatchMode, and would then never trace
            # this function again: run it eagerly, which the mode sees as plain-tensor ops
            return self.fn(*args, **kwargs)
        if self.static_argnums:
            statics, dynamic_args = self._split(args)
        else:  # the hot path: a cache hit costs dynamo's guards and this call
            statics, dynamic_args = (), args
        compiled = self._by_statics.get(statics)
        if compiled is None:
            compiled = self._by_statics[statics] = self._compile_for(statics, len(args))
            return self._first_call(compiled, statics, args, dynamic_args, kwargs)
        if compiled is _REFUSED:
            return self.fn(*args, **kwargs)
        return self._call(compiled, args, dynamic_args, kwargs)

    def _call(self, compiled, args, dynamic_args, kwargs):
        if not self.debug:
            return compiled(*dynamic_args, **kwargs)
        traces, start = self.traces, time.perf_counter()
        out = compiled(*dynamic_args, **kwargs)
        if self.traces != traces:
            self._traced(args, time.perf_counter() - start)
        return out

    def _first_call(self, compiled, statics, args, dynamic_args, kwargs):
        """The call that traces a signature. Where torch.compile refuses the program
        (`_COMPILE_REFUSALS`) before anything of it ran (no input written), the signature runs
        eagerly from then on, with a warning; any other error is the function's own."""
        versions = _tensor_versions(args, kwargs)
        try:
            return self._call(compiled, args, dynamic_args, kwargs)
        except Exception as error:
            refused = next((r for r in _COMPILE_REFUSALS if r in str(error)), None)
            if refused is None or any(t._version != v for t, v in versions):
                raise
            self._by_statics[statics] = _REFUSED
            reason = next(line for line in str(error).splitlines() if refused in line).strip()
            warn(
                f"functx.jit({self._name}): torch.compile refuses to trace this call ({reason[:300]}); "
                f"it runs eagerly, untraced, for these arguments from now on.",
                EagerFallbackWarning,
            )
        return self.fn(*args, **kwargs)

    @property
    def _name(self) -> str:
        return getattr(self.fn, "__name__", type(self.fn).__name__)

    def __repr__(self):
        return f"functx.jit({self._name}, backend={self.backend!r}, traces={self.traces})"

    # -- one trace per signature ----------------------------------------------------------
    def _split(self, args):
        """(static values, the other arguments)."""
        if not self.static_argnums:
            return (), args
        n = len(args)
        positions = []
        for i in self.static_argnums:
            if not -n <= i < n:
                raise ValueError(
                    f"functx.jit({self._name}): static_argnums names argument {i}, but the call has "
                    f"{n} positional argument(s)."
                )
            positions.append(i % n)
        statics = tuple(args[i] for i in positions)
        try:
            hash(statics)
        except TypeError as error:
            raise TypeError(
                f"functx.jit({self._name}): static arguments must be hashable (they key the trace "
                f"cache), got {[type(a).__name__ for a in statics]}: {error}. Pass tensors as ordinary "
                f"arguments and containers as tuples."
            ) from None
        static_set = set(positions)
        return (tuple(positions), statics), tuple(a for i, a in enumerate(args) if i not in static_set)

    def _compile_for(self, statics, n_args):
        fn = self.fn
        if statics:
            positions, values = statics

            def with_statics(*dynamic_args, **kwargs):
                full, rest = [], iter(dynamic_args)
                fixed = dict(zip(positions, values))
                for i in range(n_args):
                    full.append(fixed[i] if i in fixed else next(rest))
                return fn(*full, **kwargs)

            target = with_statics
        else:
            target = fn
        return _optimized(_own_frame(target, self._name), self._counting_backend, self.dynamic)

    def _counting_backend(self, graph_module, example_inputs):
        """The backend, counting traces (dynamo calls it once per graph it traces)."""
        self.traces += 1
        start = time.perf_counter()
        compiled = self._backend(graph_module, example_inputs)
        self._compile_seconds = time.perf_counter() - start
        if self.traces == RETRACE_WARNING_AFTER:
            warn(
                f"functx.jit({self._name}) has traced {self.traces} graphs: its calls keep changing "
                f"(shapes, dtypes, static arguments or Python values it branches on). Each trace costs a "
                f"compile; pass dynamic=True for changing sizes, or pad the inputs to a few shapes.",
                RetraceWarning,
            )
        return compiled

    def _traced(self, args, seconds):
        shapes = [tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__ for a in args]
        print(
            f"functx.jit({self._name}): trace {self.traces} for arguments {shapes}: first call "
            f"{seconds:.3f} s, of which backend compile {self._compile_seconds:.3f} s "
            f"(backend {self.backend or 'None: the graph as traced'})"
        )
