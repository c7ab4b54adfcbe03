"""Differential fuzzer: random small programs under random transform stacks, functx against
reference transforms written in plain torch float64.

A case is data (`Case(program, stack, seed, expand)`), so hypothesis shrinks it and prints it
as code that runs: paste a falsifying example into `check(...)` to get a regression test (the
ones at the bottom of this file came from this fuzzer).

- `Program`: a function of 1 or 2 float64 tensors made of 2-6 ops (pointwise, reductions,
  views and indexing, matmul / softmax / conv1d with closed-over constants, the Gram product
  `mm(m.mT, m)` of a value with itself, `torch.linalg`
  (inv, det, solve, cholesky, eigvalsh, eigh, slogdet, svdvals, matrix_exp, lu_solve,
  cholesky_solve, pinv, qr of `m^T m + diag(1, .., c)`), `torch.where`,
  in-place writes into clones and into fresh buffers, `detach`); each op's comment is the code
  it runs. Further families, each drawn by its own test:
  - `function`: a torch.autograd.Function applied to the current value and another value
    (itself, one that broadcasts, or a sum): `x * y + sin(x)` from one of the families of
    tests/ad/fuzz_functions.py (torch forward with setup_context/backward/jvp; NumPy forward
    with backward, jvp and a `vmap` staticmethod calling `apply` again;
    `generate_vmap_rule=True`; jvp only; backward only; old-style `forward(ctx, ...)`);
    functx and torch.func apply the Function, the reference runs the same math in torch;
  - `factory`: `torch.arange`, `torch.tensor(data)` (times a float32 0-dim tensor),
    `new_tensor`, `torch.as_tensor` of a NumPy array, inside the function;
  - `reduce_write`: `r = a.sum(dim)` / `mean`, then `r.mul_`, `r.sin_()` or `r.add_`;
  - `arg_write`: a first op writing into an argument of the program (`x1.mul_(C)` or
    `x1.add_(x0)`), differentiated, batched or not depending on the stack. The reference
    is the functional update (the rest of the program sees the new value): torch.func
    computes that or refuses (a differentiated or batched value into an argument that is
    not), and functx must match or raise where torch.func raises. No chunk_size in these
    stacks (a chunked vmap runs the function, and so the write, once per chunk);
  - `region`: `with torch.no_grad(): c = ...` / `with _set_fwd_grad_enabled(False): c = ...`,
    then `a * c`. Reference semantics (torch's documented ones, which torch.func follows):
    no_grad makes `c` constant for every reverse level (grad, vjp, jacrev) and does not apply
    to forward AD; `_set_fwd_grad_enabled(False)` makes it constant for every forward level
    (jvp, jacfwd) and does not apply to reverse mode. `Ref` computes forward levels by
    reverse autograd, so it can stop both kinds of level or neither: regions are drawn only
    under stacks whose AD levels are all reverse or all forward (no hessian), where the
    region is `.detach()` or nothing (`region_semantics`).
- `stack`: 1-3 transforms, outermost first, from {vmap, grad, vjp, jvp, linearize, jacrev,
  jacfwd, hessian, vjp_fn} (linearize: `linearize(f, *xs)[1](*tangents)`, which must be
  jvp's; torch.func and the reference compute it as jvp). Each maps a function of the program's tensors to a function of the same
  tensors returning one tensor, so stacks compose: vmap stacks fixed affine copies of its
  batched arguments (or, one time in five, an expand: every element the same, batch stride 0)
  along random in_dims and keeps the batch dim at out_dims (non-zero and negative too),
  batches of 1-3; grad and hessian differentiate a fixed random weighting of the output;
  vjp / jvp use fixed random cotangents / tangents (jvp returns `stack([primal, tangent])`);
  vjp_fn is `vjp(f, *xs)[1](ct)[argnum]` with the cotangent a fixed affine map of one of
  the transform's inputs (or a constant), the vjp taken either at each call or once outside
  every transform at fixed primals (then the outer transforms see it only through the
  cotangent); vmap, jacrev and jacfwd draw a chunk_size of 1 or 2 two times in three;
  Jacobians with several argnums are concatenated flat; outputs of more than 12 elements go
  through a fixed random projection to 6. `mix=True` makes the transformed function close
  over the transform's own inputs (`f(y * (1 + 0.5 sin(x)))` with `y` the transform's
  argument and `x` the outer value): the closures across levels where mixed partials live.
- `expand=True` (one case in six): the case's inputs are expanded tensors (stride 0 along
  their last dim).
- `Ref`: the reference transforms. vmap is a Python loop + `torch.stack`; grad / vjp /
  jacrev are `torch.autograd.grad(create_graph=True)` (Jacobian row by row); jvp / jacfwd use
  the double-vjp identity `J t = d/du <J^T u, t>` (never `torch.autograd.forward_ad`, which
  cannot nest); hessian is `jacfwd(jacrev)`; chunk_size changes nothing. Each level
  differentiates a fresh node of its inputs (`x.clone()`, still connected to the outer
  levels' graph), so nesting is plain autograd with create_graph. `detach()` stops every
  level, as in torch.func / JAX. `test_reference_matches_finite_differences` checks the
  reference itself against central differences at depth 1.

functx must match the reference (float64, rtol = atol = 1e-6) or raise one of the errors in
`ALLOWED_ERRORS` where torch.func fails too on the same case (raises, or is wrong), which is
checked. Open
functx bugs are named, each with an xfail(strict) regression test: errors in `KNOWN_GAPS`,
silent wrong values in `KNOWN_WRONG_VALUES`; a fuzz run records them as events.

`test_fuzz_two_threads`: two threads run two random cases at once, several times; each
outcome must equal the case's serial outcome (the same value or the same error).

Examples per fuzz test: FUNCTX_FUZZ_EXAMPLES (default 300, the thread test a third of it:
the whole file runs in under a minute on one core when the fuzz tests pass; a failing one
takes longer, shrinking). The long run (roughly 10 minutes once the fuzz tests pass; a
failing test stops generating early):

    FUNCTX_FUZZ_EXAMPLES=5000 .venv/bin/python -m pytest tests/ad/test_fuzz_transforms.py -q -p no:xdist

The examples are the same on every run (derandomized, so CI is reproducible). To explore
others, set FUNCTX_FUZZ_SEED: the run draws from that seed instead (a failure names the seed
to rerun it with):

    FUNCTX_FUZZ_SEED=7 FUNCTX_FUZZ_EXAMPLES=3000 .venv/bin/python -m pytest tests/ad/test_fuzz_transforms.py -q -n 2

A failing fuzz test prints its shrunk `Case(...)`; hypothesis reports each distinct error
(exception type and place) it found, so one run can list several.
"""

import math
import os
import re
import threading
import warnings

import pytest
import torch
import torch.func
import torch.nn.functional as F
from torch.autograd.forward_ad import _set_fwd_grad_enabled
from hypothesis import HealthCheck, assume, currently_in_test_context, event, given, seed, settings
from hypothesis import strategies as st
from torch._higher_order_ops import scan, while_loop
from torch.utils._pytree import tree_leaves

import functx
from functx.core import current_stack
from tests.ad.fuzz_functions import FUNCTIONS
from tests.ad.fuzz_functions import reference as function_reference

D = torch.float64
EXAMPLES = int(os.environ.get("FUNCTX_FUZZ_EXAMPLES", "300"))
INPUT_SHAPES = [(3,), (2, 3), (4,)]
MAX_NUMEL, MAX_NDIM = 16, 3  # bound on every intermediate value of a program
SQUASH_ABOVE, SQUASH_TO = 12, 6  # transform outputs larger than this are projected
RTOL = ATOL = 1e-6

SEED = os.environ.get("FUNCTX_FUZZ_SEED")

FUZZ = settings(
    derandomize=SEED is None,
    database=None,
    deadline=None,
    max_examples=EXAMPLES,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)

pytestmark = pytest.mark.filterwarnings("ignore::functx.PerformanceWarning")


def const(seed, shape):
    """A fixed random float64 tensor; always created outside every transform."""
    return torch.randn(tuple(shape), dtype=D, generator=torch.Generator().manual_seed(seed))


def numel(shape):
    return math.prod(shape)


def _kwargs_repr(params):
    return ", ".join(f"{k}={v!r}" for k, v in params.items())


# What the running Case is run by, on this thread (`Case.run` sets it): the ops that differ
# between the library under test and the reference read it.
_RUN = threading.local()


def _transform_library():
    """Whether functx or torch.func runs the case (not `Ref` or finite differences): then
    autograd.Function ops apply the Function, in-place writes into arguments write, and
    regions run under their context managers; the reference runs the same math in plain
    torch, functionally."""
    return getattr(_RUN, "lib", None) in (functx, torch.func)


REVERSE_KINDS, FORWARD_KINDS = {"grad", "vjp", "jacrev", "vjp_fn", "hessian"}, {"jvp", "linearize", "jacfwd", "hessian"}


def region_semantics(region, kinds):
    """What a `torch.no_grad()` (region "no_grad") or `_set_fwd_grad_enabled(False)` region
    ("no_fwd") means to the reference under a stack of `kinds`: "identity" or "detach".

    torch's documented semantics, which torch.func follows (checked: torch.func.grad(grad(f))
    is 0 through a no_grad region, jvp(jvp(f)) 0 through a no_fwd one, and each region is
    transparent to the other kind of level): no_grad makes a value constant for every
    reverse level (grad, vjp, jacrev, hessian's jacrev) and does not apply to forward AD;
    `_set_fwd_grad_enabled(False)` makes it constant for every forward level (jvp, jacfwd,
    hessian's jacfwd) and does not apply to reverse mode. `Ref` computes forward levels by
    reverse autograd (the double-vjp identity), so it can stop both kinds or neither, not one
    of them: a region is drawn only under stacks whose AD levels are all of one kind, where
    it is `.detach()` (the region's kind) or nothing (the other kind)."""
    stopped, other = (REVERSE_KINDS, FORWARD_KINDS) if region == "no_grad" else (FORWARD_KINDS, REVERSE_KINDS)
    if not set(kinds) & stopped:
        return "identity"
    if not set(kinds) & other:
        return "detach"
    raise ValueError(f"a {region} region under {sorted(kinds)} has no plain-autograd reference")


# ---------------------------------------------------------------------------------------------
# Programs
# ---------------------------------------------------------------------------------------------


def _broadcasts(small, big):
    try:
        return tuple(torch.broadcast_shapes(tuple(small), tuple(big))) == tuple(big)
    except RuntimeError:
        return False


class Op:
    """One op of a program, applied to the current value `a` (the previous op's result, or
    `x0` first). `j` names another value (an input or an earlier result) for binary ops; it is
    used elementwise when it broadcasts to `a`, else through `.sum()`."""

    def __init__(self, name, **params):
        self.name, self.params = name, params

    def __repr__(self):
        rest = _kwargs_repr(self.params)
        return f"Op({self.name!r}{', ' if rest else ''}{rest})"

    def build(self, shapes, cur, names):
        """-> (fn(values) -> tensor, output shape, source). Constants are made here."""
        p, s, a = self.params, tuple(shapes[cur]), names[cur]
        n, nd = numel(s), len(s)
        name = self.name

        def operand(j):
            if _broadcasts(shapes[j], s):
                return (lambda vals: vals[j]), names[j]
            return (lambda vals: vals[j].sum()), f"{names[j]}.sum()"

        if name in ("sin", "tanh", "sigmoid"):
            return (lambda vals: getattr(torch, name)(vals[cur])), s, f"torch.{name}({a})"
        if name == "exp":
            return (lambda vals: torch.exp(0.5 * vals[cur])), s, f"torch.exp(0.5 * {a})"
        if name == "unary":  # the jvp level's own elementwise rules (ad/jvp_rules.py); positive where needed
            fn = p["fn"]
            if fn in ("relu", "cos", "neg"):
                return (lambda vals: getattr(torch, fn)(vals[cur])), s, f"torch.{fn}({a})"
            return (lambda vals: getattr(torch, fn)(vals[cur] * vals[cur] + 1)), s, f"torch.{fn}({a} * {a} + 1)"
        if name == "pow":
            return (lambda vals: vals[cur].pow(p["p"])), s, f"{a}.pow({p['p']})"
        if name == "where":
            return (lambda vals: torch.where(vals[cur] > 0, vals[cur], vals[cur] * vals[cur])), s, f"torch.where({a} > 0, {a}, {a} * {a})"
        if name == "branch":  # Python control flow on a value: under vmap, the per-sample fallback
            return (
                lambda vals: torch.sin(vals[cur]) if vals[cur].sum() > 0 else vals[cur] * vals[cur]
            ), s, f"torch.sin({a}) if {a}.sum() > 0 else {a} * {a}"
        if name in ("cond_op", "while_op", "scan_op"):  # torch's control-flow operators
            return _control_flow_op(name, cur, s, a)
        if name == "const":
            c = const(p["seed"], s)
            sym = {"mul": "*", "add": "+"}[p["kind"]]
            fn = (lambda vals: vals[cur] * c) if p["kind"] == "mul" else (lambda vals: vals[cur] + c)
            return fn, s, f"{a} {sym} C{list(s)}"
        if name == "binary":
            u, un = operand(p["j"])
            if p["kind"] == "div":  # by a positive denominator
                return (lambda vals: vals[cur] / (u(vals) * u(vals) + 1)), s, f"{a} / ({un} * {un} + 1)"
            sym = {"mul": "*", "add": "+", "sub": "-"}[p["kind"]]
            ops = {"mul": torch.mul, "add": torch.add, "sub": torch.sub}
            return (lambda vals: ops[p["kind"]](vals[cur], u(vals))), s, f"{a} {sym} {un}"
        if name in ("sum", "mean"):
            dim = p["dim"]
            if dim is None:
                return (lambda vals: getattr(vals[cur], name)()), (), f"{a}.{name}()"
            out = s[: dim % nd] + s[dim % nd + 1 :]
            return (lambda vals: getattr(vals[cur], name)(dim)), out, f"{a}.{name}({dim})"
        if name in ("logsumexp", "amax"):
            dim = p["dim"]
            out = s[: dim % nd] + s[dim % nd + 1 :]
            return (lambda vals: getattr(torch, name)(vals[cur], dim)), out, f"torch.{name}({a}, {dim})"
        if name == "reshape":
            shape = tuple(p["shape"])
            return (lambda vals: vals[cur].reshape(shape)), shape, f"{a}.reshape({shape})"
        if name == "transpose":
            d0, d1 = p["dims"]
            out = list(s)
            out[d0], out[d1] = out[d1], out[d0]
            return (lambda vals: vals[cur].transpose(d0, d1)), tuple(out), f"{a}.transpose({d0}, {d1})"
        if name == "slice":
            return (lambda vals: vals[cur][1:]), (s[0] - 1,) + s[1:], f"{a}[1:]"
        if name == "select":
            i = p["i"]
            return (lambda vals: vals[cur][i]), s[1:], f"{a}[{i}]"
        if name in ("index_select", "gather"):
            dim, k = p["dim"], p["k"]
            shape = (k,) if name == "index_select" else s[: dim % nd] + (k,) + s[dim % nd + 1 :]
            g = torch.Generator().manual_seed(p["seed"])
            idx = torch.randint(0, s[dim], shape, generator=g)
            out = s[: dim % nd] + (k,) + s[dim % nd + 1 :]
            fn = getattr(torch, name)
            return (lambda vals: fn(vals[cur], dim, idx)), out, f"torch.{name}({a}, {dim}, {idx.tolist()})"
        if name == "expand":
            return (lambda vals: vals[cur].unsqueeze(0).expand(2, *s)), (2,) + s, f"{a}.unsqueeze(0).expand(2, *{a}.shape)"
        if name == "matmul":
            m = const(p["seed"], (s[-1], p["k"]))
            return (lambda vals: vals[cur] @ m), s[:-1] + (p["k"],), f"{a} @ M{[s[-1], p['k']]}"
        if name == "gram":  # a product of two differentiated operands (an outer product for one row)
            c = s[-1]
            return (lambda vals: torch.mm(vals[cur].reshape(-1, c).mT, vals[cur].reshape(-1, c))), (c, c), f"torch.mm({a}.reshape(-1, {c}).mT, {a}.reshape(-1, {c}))"
        if name == "softmax":
            return (lambda vals: vals[cur].softmax(-1)), s, f"{a}.softmax(-1)"
        if name == "batch_norm":  # training mode, no running statistics: dim 0 the batch, dim 1 the channels
            shape3 = (s[0], s[1], -1)

            def fn(vals):
                v = vals[cur].reshape(shape3)
                if _transform_library():
                    return F.batch_norm(v, None, None, training=True).reshape(s)
                # the reference: the formula in ops (torch's own third derivative of batch norm
                # is wrong: -1.86 where central differences of its second give 1e-13)
                mean = v.mean((0, 2), keepdim=True)
                return ((v - mean) / torch.sqrt((v - mean).pow(2).mean((0, 2), keepdim=True) + 1e-5)).reshape(s)

            return fn, s, f"F.batch_norm({a}.reshape{shape3}, training=True)"
        if name in ("layer_norm", "instance_norm"):  # over the last dim; over dims 2.. of (s0, s1, -1)
            layer = name == "layer_norm"
            shape = (-1, s[-1]) if layer else (s[0], s[1], -1)

            def fn(vals):
                v = vals[cur].reshape(shape)
                if _transform_library():
                    return (F.layer_norm(v, (s[-1],)) if layer else F.instance_norm(v)).reshape(s)
                # the reference: the formula in ops (torch's own third derivatives of both are wrong)
                dim = -1 if layer else 2
                mean = v.mean(dim, keepdim=True)
                return ((v - mean) / torch.sqrt((v - mean).pow(2).mean(dim, keepdim=True) + 1e-5)).reshape(s)

            call = f"F.layer_norm({a}, ({s[-1]},))" if layer else f"F.instance_norm({a}.reshape{shape})"
            return fn, s, call
        if name == "attention":  # self-attention over the last two dims (rows attend to rows)
            causal = p["causal"]
            heads = (1, -1, s[-2], s[-1])

            def fn(vals):
                v = vals[cur].reshape(heads)
                if _transform_library():  # the fused CPU kernel (its backward has no derivative)
                    return F.scaled_dot_product_attention(v, v, v, is_causal=causal).reshape(s)
                scores = v @ v.mT * s[-1] ** -0.5
                if causal:
                    scores = scores.masked_fill(torch.ones(s[-2], s[-2], dtype=torch.bool).triu(1), float("-inf"))
                return (scores.softmax(-1) @ v).reshape(s)

            return fn, s, f"F.scaled_dot_product_attention({a}, {a}, {a}, is_causal={causal}) over its last 2 dims"
        if name == "loss":  # a loss against a constant target (torch's fused loss kernels and
            # their double backward: mse_loss's forward-over-reverse formula once raised)
            kind, red = p["kind"], p["red"]
            target = const(p["seed"], s)
            if kind in ("binary_cross_entropy_with_logits", "soft_margin_loss"):
                target = torch.sigmoid(target) if kind != "soft_margin_loss" else torch.sign(target) + (target == 0)
            loss = getattr(F, kind)
            return (
                lambda vals: loss(vals[cur], target.to(vals[cur].dtype), reduction=red),
                s if red == "none" else (),
                f"F.{kind}({a}, T{list(s)}, reduction={red!r})",
            )
        if name == "spectral":  # complex intermediates of a real program: conjugate and
            # negative views (forward mode under vmap once refused them, and jacfwd took
            # `X.conj().real` for resolved)
            kind, k = p["kind"], s[-1]
            fns = {
                "power": (lambda v: (torch.fft.fft(v) * torch.fft.fft(v).conj()).real, "(fft({a}) * fft({a}).conj()).real"),
                "conj_real": (lambda v: torch.fft.fft(v).conj().real, "fft({a}).conj().real"),
                "conj_imag": (lambda v: torch.fft.fft(v).conj().imag, "fft({a}).conj().imag"),
                "irfft_conj": (lambda v: torch.fft.irfft(torch.fft.rfft(v).conj(), n=k), "irfft(rfft({a}).conj(), n={k})"),
                "neg_view": (lambda v: (torch.fft.fft(v).conj() * 1j).real, "(fft({a}).conj() * 1j).real"),
            }
            fn, text = fns[kind]
            return (lambda vals: fn(vals[cur])), s, text.format(a=a, k=k)
        if name == "conv1d":
            c, ks, pad = p["c"], p["ks"], p["pad"]
            kernel = const(p["seed"], (c, 1, ks))
            length = n + 2 * pad - ks + 1
            out = (length,) if c == 1 else (c, length)
            return (
                lambda vals: F.conv1d(vals[cur].reshape(1, 1, n), kernel, padding=pad).reshape(out),
                out,
                f"F.conv1d({a}.reshape(1, 1, {n}), K{[c, 1, ks]}, padding={pad}).reshape({out})",
            )
        if name == "linalg":  # on a well-conditioned Gram matrix G = M^T M + diag(1..c) of a's rows
            c, kind = s[-1], p["kind"]
            ops = {
                "inv": (torch.linalg.inv, (c, c)),
                "det": (torch.linalg.det, ()),
                "solve": (lambda g: torch.linalg.solve(g, torch.ones(c, dtype=D)), (c,)),
                "cholesky": (torch.linalg.cholesky, (c, c)),
                "eigvalsh": (torch.linalg.eigvalsh, (c,)),
                # eigenvectors squared: the sign each column is returned with drops out
                "eigh": (lambda g: torch.linalg.eigh(g)[1].square(), (c, c)),
                "slogdet": (lambda g: torch.linalg.slogdet(g)[1], ()),
                "svdvals": (torch.linalg.svdvals, (c,)),
                "matrix_exp": (lambda g: torch.linalg.matrix_exp(g / (2 * c)), (c, c)),
                "lu_solve": (lambda g: torch.linalg.lu_solve(*torch.linalg.lu_factor(g), torch.ones(c, 1, dtype=D)), (c, 1)),
                "cholesky_solve": (lambda g: torch.cholesky_solve(torch.ones(c, 1, dtype=D), torch.linalg.cholesky(g)), (c, 1)),
                "pinv": (torch.linalg.pinv, (c, c)),
                "qr": (lambda g: torch.linalg.qr(g)[1], (c, c)),
            }
            op, out = ops[kind]

            def fn(vals):
                m = vals[cur].reshape(-1, c)
                # distinct diagonal: a rank-1 M^T M + I would have a repeated eigenvalue, where
                # eigvalsh's higher derivatives do not exist
                return op(m.mT @ m + torch.diag(torch.arange(1, c + 1, dtype=D)))

            call = {
                "solve": "torch.linalg.solve(G, torch.ones(c))",
                "eigh": "torch.linalg.eigh(G)[1].square()",
                "slogdet": "torch.linalg.slogdet(G)[1]",
                "matrix_exp": f"torch.linalg.matrix_exp(G / {2 * c})",
                "lu_solve": "torch.linalg.lu_solve(*torch.linalg.lu_factor(G), torch.ones(c, 1))",
                "cholesky_solve": "torch.cholesky_solve(torch.ones(c, 1), torch.linalg.cholesky(G))",
                "qr": "torch.linalg.qr(G)[1]",
            }.get(kind, f"torch.linalg.{kind}(G)")
            return fn, out, f"m = {a}.reshape(-1, {c}); G = m.mT @ m + diag(1..{c}); {{out}} = {call}"
        # in-place writes into an intermediate (a clone)
        if name == "clone_mul_":
            c = const(p["seed"], s)

            def fn(vals):
                w = vals[cur].clone()
                w.mul_(c)
                return w

            return fn, s, f"w = {a}.clone(); w.mul_(C{list(s)}); {{out}} = w"
        if name == "clone_setitem":

            def fn(vals):
                w = vals[cur].clone()
                w[0] = w[0] * 2
                return w

            return fn, s, f"w = {a}.clone(); w[0] = w[0] * 2; {{out}} = w"
        if name == "clone_add_":
            u, un = operand(p["j"])

            def fn(vals):
                w = vals[cur].clone()
                w.add_(u(vals))
                return w

            return fn, s, f"w = {a}.clone(); w.add_({un}); {{out}} = w"
        if name == "clone_self_":  # an in-place op reading its own target (`w.mul_(w)`)
            kind = p["kind"]
            in_place = {
                "mul_": lambda w: w.mul_(w),
                "imul": lambda w: w.__imul__(w),
                "addcmul_": lambda w: w.addcmul_(w, w),
                "hypot_": lambda w: w.hypot_(w),
                "mul_view": lambda w: w.mul_(w.view_as(w)),
            }[kind]
            # plain torch's forward AD of these reads the operand after the write (a wrong
            # tangent) and its autograd refuses them: the reference runs them out of place
            out_of_place = {
                "mul_": lambda w: w * w,
                "imul": lambda w: w * w,
                "addcmul_": lambda w: w + w * w,
                "hypot_": lambda w: torch.hypot(w, w),
                "mul_view": lambda w: w * w,
            }[kind]

            def fn(vals):
                w = vals[cur].clone()
                if _transform_library():
                    in_place(w)
                    return w
                return out_of_place(w)

            call = {"imul": "w *= w", "mul_view": "w.mul_(w.view_as(w))", "addcmul_": "w.addcmul_(w, w)"}.get(kind, f"w.{kind}(w)")
            return fn, s, f"w = {a}.clone(); {call}; {{out}} = w"
        if name == "clone_sin_":

            def fn(vals):
                w = vals[cur].clone()
                w.sin_()
                return w

            return fn, s, f"w = {a}.clone(); w.sin_(); {{out}} = w"
        # in-place writes into a fresh buffer made inside the function
        if name in ("buf_copy", "buf_add", "buf_mul"):
            like = p["like"]
            fill = 0.0 if name == "buf_copy" else 1.0
            method = name[4:] + "_"

            def fn(vals):
                v = vals[cur]
                buf = torch.full_like(v, fill) if like else torch.full(s, fill, dtype=D)
                getattr(buf, method)(v)
                return buf

            made = f"torch.full_like({a}, {fill})" if like else f"torch.full({s}, {fill}, dtype=D)"
            return fn, s, f"buf = {made}; buf.{method}({a}); {{out}} = buf"
        if name == "buf_setitem":

            def fn(vals):
                v = vals[cur]
                buf = torch.zeros(3, dtype=D)
                buf[0] = v.sum()
                buf[2] = v.reshape(-1)[0]
                return buf

            return fn, (3,), f"buf = torch.zeros(3, dtype=D); buf[0] = {a}.sum(); buf[2] = {a}.reshape(-1)[0]; {{out}} = buf"
        if name == "buf_slice":

            def fn(vals):
                v = vals[cur]
                buf = torch.zeros(n + 1, dtype=D)
                buf[1:] = v.reshape(-1)
                return buf

            return fn, (n + 1,), f"buf = torch.zeros({n + 1}, dtype=D); buf[1:] = {a}.reshape(-1); {{out}} = buf"
        # autograd.Function families (tests/ad/fuzz_functions.py): F.apply(a, operand)
        if name == "function":
            u, un = operand(p["j"])
            cls = FUNCTIONS[p["cls"]]

            def fn(vals):
                y = u(vals)
                return cls.apply(vals[cur], y) if _transform_library() else function_reference(vals[cur], y)

            return fn, s, f"{cls.__name__}.apply({a}, {un})  (= {a} * {un} + sin({a}))"
        # factories and tensors from data inside the function
        if name == "arange":
            return (
                lambda vals: vals[cur] * torch.arange(1, n + 1, dtype=D).reshape(s) / n,
                s,
                f"{a} * torch.arange(1, {n + 1}, dtype=D).reshape({s}) / {n}",
            )
        if name in ("tensor_lit", "new_tensor"):
            lit = const(p["seed"], s).tolist()
            if name == "tensor_lit":  # a float32 0-dim tensor promotes to float64
                return (lambda vals: vals[cur] + torch.tensor(lit, dtype=D) * torch.tensor(1.5)), s, f"{a} + torch.tensor({lit}, dtype=D) * torch.tensor(1.5)"
            return (lambda vals: vals[cur] * vals[cur].new_tensor(lit)), s, f"{a} * {a}.new_tensor({lit})"
        if name == "as_tensor":
            arr = const(p["seed"], s).numpy()
            return (lambda vals: vals[cur] * torch.as_tensor(arr)), s, f"{a} * torch.as_tensor(np.array({arr.tolist()}))"
        # an in-place write into the result of a reduction
        if name == "reduce_write":
            dim, red, kind = p["dim"], p["red"], p["kind"]
            out = () if dim is None else s[: dim % nd] + s[dim % nd + 1 :]
            c = const(p.get("seed", 0), out)
            j = p.get("j", cur)
            un = names[j] if _broadcasts(shapes[j], out) else f"{names[j]}.sum()"

            def fn(vals):
                r = getattr(vals[cur], red)() if dim is None else getattr(vals[cur], red)(dim)
                if kind == "mul_":
                    r.mul_(c)
                elif kind == "sin_":
                    r.sin_()
                else:
                    r.add_(vals[j] if _broadcasts(shapes[j], out) else vals[j].sum())
                return r

            call = {"mul_": f"mul_(C{list(out)})", "sin_": "sin_()", "add_": f"add_({un})"}[kind]
            red_src = f"{a}.{red}()" if dim is None else f"{a}.{red}({dim})"
            return fn, out, f"r = {red_src}; r.{call}; {{out}} = r"
        # an in-place write into an argument of the program (drawn as the first op only, so no
        # view of the argument exists yet). Transforms may or may not differentiate or batch
        # the argument; the reference's semantics is the functional update (the rest of the
        # program sees the new value). torch.func refuses some (a differentiated or batched
        # value written into an argument that is not), and so must functx then.
        if name == "arg_write":
            i = p["i"]
            target = tuple(shapes[i])
            if p["kind"] == "self":
                c = const(p["seed"], target)

                def fn(vals):
                    if _transform_library():
                        vals[i].mul_(c)
                    else:
                        vals[i] = vals[i] * c
                    return vals[i]

                return fn, target, f"{names[i]}.mul_(C{list(target)}); {{out}} = {names[i]}"
            o = 1 - i
            whole = _broadcasts(shapes[o], target)

            def fn(vals):
                value = vals[o] if whole else vals[o].sum()
                if _transform_library():
                    vals[i].add_(value)
                else:
                    vals[i] = vals[i] + value
                return vals[i]

            return fn, target, f"{names[i]}.add_({names[o] if whole else names[o] + '.sum()'}); {{out}} = {names[i]}"
        # a region under saved-tensor hooks whose pack makes a new tensor (a clone, a detached
        # copy, an offload to CPU memory): the math is the region's, whatever the hooks
        if name == "hooked":
            pack = {
                "clone": lambda t: t.clone(),
                "detach": lambda t: t.detach(),
                "save_on_cpu": None,
            }[p["pack"]]

            def fn(vals):
                v = vals[cur]
                if not _transform_library():
                    return torch.sin(v) * v.exp()
                hooks = (
                    torch.autograd.graph.save_on_cpu()
                    if pack is None
                    else torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
                )
                with hooks:
                    return torch.sin(v) * v.exp()

            return fn, s, f"with saved_tensors_hooks({p['pack']}): {{out}} = torch.sin({a}) * {a}.exp()"
        # a checkpointed module called through functx.functional_call with the current value
        # as its weight: the recomputation in the backward (after functional_call returned)
        # must see the given weight, not the module's own (it once did not: wrong gradients)
        if name == "checkpointed_call":
            reentrant, body = p["reentrant"], p["body"]

            def fn(vals):
                v = vals[cur]
                if not _uses_operators():  # torch.func refuses checkpoint under its transforms
                    return _CHECKPOINT_BODIES[body][1](v * v) * v
                return functx.functional_call(_CheckpointedScale(s, reentrant, body), {"w": v}, (v,))

            return fn, s, f"functional_call(checkpointed {body}({a} * w) * w, w={a}, reentrant={reentrant})"
        # regions under torch.no_grad() / _set_fwd_grad_enabled(False) (see `region_semantics`)
        if name in ("no_grad", "no_fwd"):
            body = {"pow": lambda v: v.pow(2), "sin": lambda v: torch.sin(v) * v}[p["body"]]

            def fn(vals):
                v = vals[cur]
                if _transform_library():
                    with torch.no_grad() if name == "no_grad" else _set_fwd_grad_enabled(False):
                        c = body(v)
                elif _RUN.regions[name] == "detach":
                    c = body(v).detach()
                else:
                    c = body(v)
                return v * c

            manager = "torch.no_grad()" if name == "no_grad" else "_set_fwd_grad_enabled(False)"
            body_src = {"pow": f"{a}.pow(2)", "sin": f"torch.sin({a}) * {a}"}[p["body"]]
            return fn, s, f"with {manager}: c = {body_src}; {{out}} = {a} * c"
        if name == "detach_mul":
            return (lambda vals: vals[cur] * vals[cur].detach()), s, f"{a} * {a}.detach()"
        if name == "detach_add":
            return (lambda vals: vals[cur] + vals[cur].detach().pow(2)), s, f"{a} + {a}.detach().pow(2)"
        raise ValueError(f"unknown op {name!r}")


def _layer_norm_in_ops(v):
    mean = v.mean(-1, keepdim=True)
    return (v - mean) / torch.sqrt((v - mean).pow(2).mean(-1, keepdim=True) + 1e-5)


_CHECKPOINT_BODIES = {  # what a checkpoint recomputes: (under functx, the reference's)
    "sin": (torch.sin, torch.sin),
    # a function whose ops functx picks by the levels around it (ad/norms_in_ops.py): the
    # recomputation must pick as the first run did
    "layer_norm": (lambda v: F.layer_norm(v, v.shape[-1:]), _layer_norm_in_ops),
}


class _CheckpointedScale(torch.nn.Module):
    """`body(x * w) * w` under torch's checkpoint; its own `w` (ones) is never the one used."""

    def __init__(self, shape, reentrant, body):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(shape, dtype=torch.float64))
        self.reentrant = reentrant
        self.body = _CHECKPOINT_BODIES[body][0]

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(lambda x: self.body(x * self.w) * self.w, x, use_reentrant=self.reentrant)


def _uses_operators():
    """Whether the control-flow ops run as torch's operators (under functx; torch.func refuses
    them) or as the Python they mean (the reference, torch.func)."""
    return getattr(_RUN, "lib", None) is functx


def _control_flow_op(name, cur, s, a):
    """torch.cond / while_loop / scan on the current value, or the same Python."""
    if name == "cond_op":

        def fn(vals):
            v = vals[cur]
            if _uses_operators():
                return torch.cond(v.sum() > 0, torch.sin, lambda u: u * u, (v,))
            return torch.sin(v) if v.sum() > 0 else v * v

        return fn, s, f"torch.cond({a}.sum() > 0, torch.sin, lambda u: u * u, ({a},))"
    if name == "while_op":  # at most 3 iterations, fewer where the value grows past 2

        def fn(vals):
            v = vals[cur]
            if _uses_operators():
                go = lambda i, u: (i < 3) & (u.abs().sum() < 2)  # noqa: E731
                return while_loop(go, lambda i, u: (i + 1, u * 1.5 + 0.1 * torch.sin(u)), (torch.tensor(0), v))[1]
            i = 0
            while i < 3 and v.abs().sum() < 2:
                i, v = i + 1, v * 1.5 + 0.1 * torch.sin(v)
            return v

        return fn, s, f"while_loop(i < 3 and |{a}|_1 < 2: {a} = 1.5 {a} + 0.1 sin({a}))"

    def fn(vals):  # scan over dim 0: carry c = tanh(c + row), output c * row
        v = vals[cur]
        if _uses_operators():
            return scan(lambda c, row: (torch.tanh(c + row), torch.tanh(c + row) * row), v[0] * 0, v)[1]
        c, out = v[0] * 0, []
        for row in v:
            c = torch.tanh(c + row)
            out.append(c * row)
        return torch.stack(out)

    return fn, s, f"scan(c = tanh(c + row), c * row over {a})"


LINALG_KINDS = ["inv", "det", "solve", "cholesky", "eigvalsh", "eigh", "slogdet", "svdvals", "matrix_exp",
                "lu_solve", "cholesky_solve", "pinv", "qr"]  # fmt: skip

FAMILIES = {
    "pointwise": ["sin", "exp", "tanh", "sigmoid", "pow", "const", "binary", "where", "unary"],
    # not in PURE_FAMILIES: the staging fuzzers cannot trace a Python if
    "control_flow": ["branch", "cond_op", "while_op", "scan_op"],
    "reduction": ["sum", "mean", "logsumexp", "amax"],
    "view": ["reshape", "transpose", "slice", "select", "index_select", "gather", "expand"],
    "nn": ["matmul", "gram", "softmax", "attention", "conv1d", "linalg", "loss", "spectral"],
    # not in PURE_FAMILIES: drawn by test_fuzz_norms (torch's own third derivatives of these
    # are wrong; functx runs them as their formula in ops where they may be: ad/norms_in_ops.py)
    "norm": ["batch_norm", "layer_norm", "instance_norm"],
    "inplace": ["clone_mul_", "clone_self_", "clone_setitem", "clone_add_", "clone_sin_", "buf_copy", "buf_add", "buf_mul", "buf_setitem", "buf_slice"],
    "detach": ["detach_mul", "detach_add"],
    "function": ["function"],
    "factory": ["arange", "tensor_lit", "new_tensor", "as_tensor"],
    "reduce_write": ["reduce_write"],
    "arg_write": ["arg_write"],  # first op only (see `programs`)
    "region": ["no_grad", "no_fwd"],  # only under stacks of one kind of AD level
    "hooks": ["hooked", "checkpointed_call"],  # saved-tensor hooks around an op; checkpointing
}
EFFECTFUL = FAMILIES["inplace"] + FAMILIES["detach"]
FUNCTION_KINDS = list(FUNCTIONS)
SPECTRAL_KINDS = ["power", "conj_real", "conj_imag", "irfft_conj", "neg_view"]
LOSS_KINDS = ["mse_loss", "smooth_l1_loss", "huber_loss", "l1_loss", "binary_cross_entropy_with_logits", "soft_margin_loss"]


def _applicable(name, s):
    nd, n = len(s), numel(s)
    if name == "arg_write":
        return False  # drawn by `programs` at position 0 only
    if name in ("sum", "mean", "logsumexp", "amax", "select", "index_select", "gather", "softmax", "matmul", "clone_setitem", "linalg", "spectral", "scan_op"):
        return nd >= 1
    if name == "gram":
        return nd >= 1 and s[-1] ** 2 <= MAX_NUMEL
    if name in ("transpose", "attention"):
        return nd >= 2
    if name == "batch_norm":  # at least two values per channel
        return nd >= 2 and n // s[1] >= 2
    if name == "layer_norm":
        return nd >= 1 and s[-1] >= 2
    if name == "instance_norm":  # at least two values per instance
        return nd >= 2 and n // (s[0] * s[1]) >= 2
    if name == "slice":
        return nd >= 1 and s[0] >= 2
    if name == "expand":
        return nd <= 2 and 2 * n <= MAX_NUMEL
    if name == "buf_slice":
        return n + 1 <= MAX_NUMEL
    if name == "reshape":
        return bool(_reshape_targets(s))
    return True


def _reshape_targets(s):
    n, out = numel(s), []
    if len(s) != 1:
        out.append((n,))
    if len(s) == 1 and n >= 4 and n % 2 == 0:
        out.append((2, n // 2))
    if len(s) == 2 and s[0] != s[1]:
        out.append((s[1], s[0]))
    return out


@st.composite
def draw_op(draw, names, shapes, cur):
    s = tuple(shapes[cur])
    name = draw(st.sampled_from(names))  # names: the applicable ones
    nd = len(s)
    dims = list(range(-nd, nd))
    p = {}
    if name == "pow":
        p["p"] = draw(st.sampled_from([2, 3]))
    elif name == "hooked":
        p["pack"] = draw(st.sampled_from(["clone", "detach", "save_on_cpu"]))
    elif name == "checkpointed_call":
        p["reentrant"] = draw(st.booleans())
        p["body"] = draw(st.sampled_from(["sin", "layer_norm"] if s and s[-1] >= 2 else ["sin"]))
    elif name == "attention":
        p["causal"] = draw(st.booleans())
    elif name == "unary":
        p["fn"] = draw(st.sampled_from(["relu", "cos", "neg", "log", "sqrt", "rsqrt", "reciprocal"]))
    elif name in ("const", "clone_mul_"):
        if name == "const":
            p["kind"] = draw(st.sampled_from(["mul", "add"]))
        p["seed"] = draw(st.integers(0, 9))
    elif name == "clone_self_":
        p["kind"] = draw(st.sampled_from(["mul_", "imul", "addcmul_", "hypot_", "mul_view"]))
    elif name in ("binary", "clone_add_"):
        if name == "binary":
            p["kind"] = draw(st.sampled_from(["mul", "add", "sub", "div"]))
        p["j"] = draw(st.integers(0, len(shapes) - 1))
    elif name in ("sum", "mean"):
        p["dim"] = draw(st.sampled_from([None] + dims))
    elif name in ("logsumexp", "amax"):
        p["dim"] = draw(st.sampled_from(dims))
    elif name == "reshape":
        p["shape"] = draw(st.sampled_from(_reshape_targets(s)))
    elif name == "transpose":
        p["dims"] = draw(st.sampled_from([(0, 1), (-1, -2), (0, -1)]))
    elif name == "select":
        p["i"] = draw(st.sampled_from([0, -1]))
    elif name in ("index_select", "gather"):
        p["dim"] = draw(st.sampled_from(dims))
        p["k"] = draw(st.integers(1, 3))
        p["seed"] = draw(st.integers(0, 9))
    elif name == "matmul":
        p["k"] = draw(st.sampled_from([2, 3]))
        p["seed"] = draw(st.integers(0, 9))
    elif name == "conv1d":
        p["c"] = draw(st.sampled_from([1, 2]))
        p["pad"] = draw(st.sampled_from([0, 1]))
        p["ks"] = draw(st.integers(1, min(3, numel(s) + 2 * p["pad"])))
        p["seed"] = draw(st.integers(0, 9))
    elif name in ("buf_copy", "buf_add", "buf_mul"):
        p["like"] = draw(st.booleans())
    elif name == "linalg":
        p["kind"] = draw(st.sampled_from(LINALG_KINDS))
    elif name == "spectral":
        p["kind"] = draw(st.sampled_from(SPECTRAL_KINDS))
    elif name == "loss":
        p["kind"] = draw(st.sampled_from(LOSS_KINDS))
        p["red"] = draw(st.sampled_from(["mean", "sum", "none"]))
        p["seed"] = draw(st.integers(0, 9))
    elif name == "function":
        p["cls"] = draw(st.sampled_from(FUNCTION_KINDS))
        p["j"] = draw(st.integers(0, len(shapes) - 1))
    elif name in ("tensor_lit", "new_tensor", "as_tensor"):
        p["seed"] = draw(st.integers(0, 9))
    elif name == "reduce_write":
        p["red"] = draw(st.sampled_from(["sum", "mean"]))
        p["dim"] = draw(st.sampled_from([None] + dims))
        p["kind"] = draw(st.sampled_from(["mul_", "sin_", "add_"]))
        if p["kind"] == "mul_":
            p["seed"] = draw(st.integers(0, 9))
        elif p["kind"] == "add_":
            p["j"] = draw(st.integers(0, len(shapes) - 1))
    elif name == "arg_write":
        p["i"] = draw(st.integers(0, len(shapes) - 1))
        p["kind"] = draw(st.sampled_from(["self", "cross"] if len(shapes) == 2 else ["self"]))
        if p["kind"] == "self":
            p["seed"] = draw(st.integers(0, 9))
    elif name in ("no_grad", "no_fwd"):
        p["body"] = draw(st.sampled_from(["pow", "sin"]))
    return Op(name, **p)


class Program:
    """`ops` applied in order; the function returns the last value. Values are named x0, x1
    (inputs) and v1, v2, ... (results); each op reads the previous result (x0 first)."""

    def __init__(self, inputs, ops):
        self.inputs = [tuple(s) for s in inputs]
        self.ops = list(ops)
        n_in = len(self.inputs)
        self.names = [f"x{i}" for i in range(n_in)]
        self.shapes = list(self.inputs)
        self.fns, self.sources = [], []
        cur = 0
        for k, op in enumerate(self.ops):
            fn, shape, src = op.build(self.shapes, cur, self.names)
            name = f"v{k + 1}"
            self.names.append(name)
            self.shapes.append(tuple(shape))
            self.fns.append(fn)
            self.sources.append(src.replace("{out}", name) if "{out}" in src else f"{name} = {src}")
            cur = len(self.shapes) - 1
        self.out_shape = self.shapes[-1]

    def __call__(self, *xs):
        vals = list(xs)
        for fn in self.fns:
            vals.append(fn(vals))
        return vals[-1]

    def __repr__(self):
        lines = [f"Program({self.inputs!r}, ["]
        for op, src in zip(self.ops, self.sources):
            lines.append(f"    {op!r},  # {src}")
        lines.append("])")
        return "\n".join(lines)


@st.composite
def programs(draw, families, must=None):
    """`must`: op names of which at least one op is drawn (at a random position; an
    `arg_write` is always the first op)."""
    n_in = draw(st.integers(1, 2))
    inputs = [draw(st.sampled_from(INPUT_SHAPES)) for _ in range(n_in)]
    n_ops = draw(st.integers(2, 6))
    names = [n for f in families for n in FAMILIES[f]]
    ops, shapes, cur = [], list(inputs), 0
    if "arg_write" in names and (must == ["arg_write"] or draw(st.integers(0, 2)) == 2):
        op = draw(draw_op(["arg_write"], shapes, cur))
        _, shape, _ = op.build(shapes, cur, [f"n{i}" for i in range(len(shapes))])
        ops.append(op)
        shapes.append(tuple(shape))
        cur = len(shapes) - 1
        if must == ["arg_write"]:
            must = None
    forced = draw(st.integers(len(ops), n_ops - 1)) if must else -1
    for k in range(len(ops), n_ops):
        candidates = [n for n in (must if k == forced else names) if _applicable(n, shapes[cur])] or ["sin"]
        for _ in range(10):  # keep every value small
            op = draw(draw_op(candidates, shapes, cur))
            _, shape, _ = op.build(shapes, cur, [f"n{i}" for i in range(len(shapes))])
            if numel(shape) <= MAX_NUMEL and len(shape) <= MAX_NDIM:
                break
        else:
            op, shape = Op("sin"), shapes[cur]
        ops.append(op)
        shapes.append(tuple(shape))
        cur = len(shapes) - 1
    uses_x1 = any(o.params.get("j") == 1 or (o.name == "arg_write" and n_in == 2) for o in ops)
    if n_in == 2 and not uses_x1:  # a second input the program ignores is not worth drawing
        ops.append(Op("binary", kind="add", j=1))
    return Program(inputs, ops)


# ---------------------------------------------------------------------------------------------
# Transforms
# ---------------------------------------------------------------------------------------------

BATCH_SCALE, BATCH_SHIFT = (1.0, 0.5, -1.3), (0.0, 0.25, 0.1)  # vmap's k-th copy: a x + b


def _combine(result):
    """A tuple of tensors (several argnums) -> one flat tensor; a tensor stays as it is."""
    if isinstance(result, torch.Tensor):
        return result
    return torch.cat([t.reshape(-1) for t in tree_leaves(result)])


def _mixed(ys, xs, mix):
    """`mix`: the transformed function closes over the transform's own inputs `xs`."""
    if not mix:
        return ys
    return [y * (1 + 0.5 * torch.sin(x)) for y, x in zip(ys, xs)]


def _argnum_list(argnums, n):
    return [a % n for a in ((argnums,) if isinstance(argnums, int) else argnums)]


class T:
    """One transform of a stack (stacks are lists, outermost first)."""

    def __init__(self, kind, **params):
        self.kind, self.params = kind, params

    def __repr__(self):
        rest = _kwargs_repr(self.params)
        return f"T({self.kind!r}{', ' if rest else ''}{rest})"

    def out_shape(self, in_shapes, out):
        """Shape of the transformed function's output (before the squash)."""
        k, p = self.kind, self.params
        if k == "vmap":
            o = p["out_dims"] % (len(out) + 1)
            return out[:o] + (p["size"],) + out[o:]
        if k in ("jvp", "linearize"):
            return (2,) + out
        if k == "vjp":
            return in_shapes[0] if len(in_shapes) == 1 else (sum(numel(s) for s in in_shapes),)
        if k == "vjp_fn":
            return in_shapes[p["argnum"] % len(in_shapes)]
        argnums = p["argnums"]
        sel = _argnum_list(argnums, len(in_shapes))
        if k == "grad":
            return in_shapes[sel[0]] if isinstance(argnums, int) else (sum(numel(in_shapes[a]) for a in sel),)
        if k in ("jacrev", "jacfwd"):
            if isinstance(argnums, int):
                return out + in_shapes[sel[0]]
            return (sum(numel(out) * numel(in_shapes[a]) for a in sel),)
        if k == "hessian":
            if isinstance(argnums, int):
                return in_shapes[sel[0]] * 2
            return (sum(numel(in_shapes[a]) * numel(in_shapes[b]) for a in sel for b in sel),)
        raise ValueError(k)

    def build(self, f, lib, in_shapes, out):
        """f: function of len(in_shapes) tensors -> tensor of shape `out`. -> (g, g's out shape)."""
        k, p = self.kind, self.params
        mix, seed = p.get("mix", False), p.get("seed", 0)
        shape = self.out_shape(in_shapes, out)
        # torch.func.jacfwd has no chunk_size (it is only the oracle for allowed errors)
        chunks = {"chunk_size": p["chunk_size"]} if p.get("chunk_size") and (lib, k) != (torch.func, "jacfwd") else {}
        if k == "vmap":
            in_dims, out_dims, size = p["in_dims"], p["out_dims"], p["size"]

            def batch(x, d):
                if p.get("expand"):  # every element the same, the batch dim of stride 0
                    return x.unsqueeze(d).expand(torch.Size(x.shape[: d % (x.dim() + 1)]) + (size,) + x.shape[d % (x.dim() + 1) :])
                return torch.stack([x * BATCH_SCALE[i] + BATCH_SHIFT[i] for i in range(size)], dim=d)

            def g(*xs):
                args = [x if d is None else batch(x, d) for x, d in zip(xs, in_dims)]
                return lib.vmap(lambda *ys: f(*_mixed(ys, xs, mix)), in_dims=in_dims, out_dims=out_dims, **chunks)(*args)

        elif k in ("grad", "hessian"):
            weight = const(seed, out)
            transform = getattr(lib, k)

            def g(*xs):
                scalar = lambda *ys: (f(*_mixed(ys, xs, mix)) * weight).sum()
                return _combine(transform(scalar, argnums=p["argnums"])(*xs))

        elif k in ("jacrev", "jacfwd"):
            transform = getattr(lib, k)

            def g(*xs):
                return _combine(transform(lambda *ys: f(*_mixed(ys, xs, mix)), argnums=p["argnums"], **chunks)(*xs))

        elif k == "vjp":
            cotangent = const(seed, out)

            def g(*xs):
                _, vjp_fn = lib.vjp(lambda *ys: f(*_mixed(ys, xs, mix)), *xs)
                grads = vjp_fn(cotangent)
                return grads[0] if len(xs) == 1 else _combine(grads)

        elif k == "vjp_fn":
            argnum, source = p["argnum"], p.get("ct")
            shift = const(seed, out)
            if source is None:
                cotangent = lambda xs: shift
            else:  # the cotangent is a fixed affine map of the transform's input `source`
                m = const(seed + 1, (numel(in_shapes[source]), numel(out))) / math.sqrt(numel(in_shapes[source]))
                cotangent = lambda xs: (xs[source].reshape(-1) @ m).reshape(out) + shift
            if p.get("outside"):
                # vjp of fixed primals, taken now (outside every transform); its vjp_fn is
                # called under the outer transforms, which see it only through the cotangent
                primals = [const(seed + 20 + i, s) for i, s in enumerate(in_shapes)]
                _, outside_fn = lib.vjp(f, *primals)

                def g(*xs):
                    return outside_fn(cotangent(xs))[argnum]

            else:

                def g(*xs):
                    _, vjp_fn = lib.vjp(lambda *ys: f(*_mixed(ys, xs, mix)), *xs)
                    return vjp_fn(cotangent(xs))[argnum]

        elif k in ("jvp", "linearize"):
            tangents = tuple(const(seed + i, s) for i, s in enumerate(in_shapes))

            def g(*xs):
                if k == "linearize" and lib is functx:  # the references compute it as jvp
                    primal, jvp_fn = functx.linearize(lambda *ys: f(*_mixed(ys, xs, mix)), *xs)
                    return torch.stack([primal, jvp_fn(*tangents)])
                primal, tangent = lib.jvp(lambda *ys: f(*_mixed(ys, xs, mix)), tuple(xs), tangents)
                return torch.stack([primal, tangent])

        else:
            raise ValueError(k)
        if numel(shape) <= SQUASH_ABOVE:
            return g, shape
        projection = const(10_000 + numel(shape), (numel(shape), SQUASH_TO)) / math.sqrt(numel(shape))
        return (lambda *xs: g(*xs).reshape(-1) @ projection), (SQUASH_TO,)


ARGNUMS_1 = [0, (0,)]
ARGNUMS_2 = [0, 1, -1, (0, 1), (1, 0), (1,)]


@st.composite
def draw_transform(draw, kind, in_shapes, out, chunks=True):
    p = {}
    if kind == "vmap":
        dims = []
        for s in in_shapes:
            d = draw(st.one_of(st.none(), st.integers(-(len(s) + 1), len(s))))
            dims.append(d)
        if all(d is None for d in dims):
            k = draw(st.integers(0, len(dims) - 1))
            dims[k] = 0
        p["in_dims"] = tuple(dims)
        p["out_dims"] = draw(st.integers(-(len(out) + 1), len(out)))
        p["size"] = draw(st.integers(1, 3))
        if draw(st.integers(0, 4)) == 4:
            p["expand"] = True
    elif kind in ("grad", "jacrev", "jacfwd", "hessian"):
        p["argnums"] = draw(st.sampled_from(ARGNUMS_1 if len(in_shapes) == 1 else ARGNUMS_2))
    elif kind == "vjp_fn":
        p["argnum"] = draw(st.sampled_from([0] if len(in_shapes) == 1 else [0, 1, -1]))
        p["outside"] = draw(st.booleans())
        ct = draw(st.sampled_from([None] + list(range(len(in_shapes)))))
        if p["outside"] and ct is None:
            ct = 0  # else the function would be constant
        if ct is not None:
            p["ct"] = ct
    if kind in ("vmap", "jacrev", "jacfwd") and chunks:
        chunk_size = draw(st.sampled_from([None, 1, 2]))
        if chunk_size:
            p["chunk_size"] = chunk_size
    if kind in ("grad", "hessian", "vjp", "jvp", "linearize", "vjp_fn"):
        p["seed"] = draw(st.integers(0, 9))
    if not p.get("outside") and draw(st.integers(0, 3)) == 3:  # shrinks towards no closure
        p["mix"] = True
    return T(kind, **p)


@st.composite
def stacks(draw, program, kinds, must=None, depth=(1, 3)):
    """Drawn innermost first (each transform needs the shape of what it transforms)."""
    n = draw(st.integers(*depth))
    forced = draw(st.integers(0, n - 1)) if must else -1
    out, stack = program.out_shape, []
    for k in range(n):
        kind = draw(st.sampled_from(must if k == forced else kinds))
        # a chunked vmap (jacfwd's too) runs the function once per chunk, so a write into an
        # unbatched argument would happen once per chunk: the reference's functional update
        # describes one run
        t = draw(draw_transform(kind, program.inputs, out, chunks=not any(o.name == "arg_write" for o in program.ops)))
        shape = t.out_shape(program.inputs, out)
        out = shape if numel(shape) <= SQUASH_ABOVE else (SQUASH_TO,)
        stack.insert(0, t)
    return stack


class Case:
    """`expand`: the program's inputs are expanded (stride 0 along their last dim, every
    element of a row equal) instead of contiguous. `caller`: the inputs are leaves that
    require grad, and the value compared is the stack's output followed by the gradient of
    a fixed weighting of it w.r.t. those leaves by plain `torch.autograd.grad` (the caller's
    autograd through the whole stack: a result must stay connected to the caller's graph)."""

    def __init__(self, program, stack, seed=0, expand=False, caller=False):
        self.program, self.stack, self.seed, self.expand = program, list(stack), seed, expand
        self.caller = caller

    def __repr__(self):
        program = repr(self.program).replace("\n", "\n    ")
        stack = ",\n".join(f"        {t!r}" for t in self.stack)
        expand = "    expand=True,\n" if self.expand else ""
        caller = "    caller=True,\n" if self.caller else ""
        return f"Case(\n    {program},\n    [  # outermost first\n{stack},\n    ],\n    seed={self.seed},\n{expand}{caller})"

    def inputs(self):
        g = torch.Generator().manual_seed(self.seed)
        moved = 1.0 + getattr(_RUN, "perturbation", 0.0)  # _rounding_noise moves the inputs
        if self.expand:
            return [(torch.randn(s[:-1] + (1,), dtype=D, generator=g) * moved).expand(s) for s in self.program.inputs]
        return [torch.randn(s, dtype=D, generator=g) * moved for s in self.program.inputs]

    def build(self, lib):
        f, out = self.program, self.program.out_shape
        for t in reversed(self.stack):
            f, out = t.build(f, lib, self.program.inputs, out)
        return f

    def run(self, lib):
        saved = getattr(_RUN, "lib", None), getattr(_RUN, "regions", None)
        _RUN.lib = lib
        kinds = [t.kind for t in self.stack]
        regions = {r: region_semantics(r, kinds) for r in ("no_grad", "no_fwd") if any(o.name == r for o in self.program.ops)}
        _RUN.regions = regions
        try:
            if not self.caller:
                return self.build(lib)(*self.inputs())
            return self._run_under_the_callers_autograd(lib)
        finally:
            _RUN.lib, _RUN.regions = saved

    def _run_under_the_callers_autograd(self, lib):
        g = torch.Generator().manual_seed(self.seed + 1)
        moved = 1.0 + getattr(_RUN, "perturbation", 0.0)
        leaves = [(torch.randn(s[:-1] + (1,) if self.expand else s, dtype=D, generator=g) * moved).requires_grad_() for s in self.program.inputs]
        inputs = [x.expand(s) if self.expand else x for x, s in zip(leaves, self.program.inputs)]
        out = self.build(lib)(*inputs)
        weights = torch.randn(out.shape, dtype=D, generator=g)
        if out.requires_grad:
            grads = torch.autograd.grad((out * weights).sum(), leaves, allow_unused=True, materialize_grads=True)
        else:  # independent of the inputs (a constant Hessian): zero gradients
            grads = [torch.zeros_like(x) for x in leaves]
        return torch.cat([out.detach().flatten(), *(gr.detach().flatten() for gr in grads)])

    def batch_size_at_least(self, size):
        """The same case with every vmap of at least `size` elements. torch.func lets some
        in-place writes of a batched value into an unbatched tensor through when the batch has
        one element (the shapes broadcast); functx raises whatever the size."""
        stack = [T(t.kind, **{**t.params, "size": max(size, t.params["size"])}) if t.kind == "vmap" else t for t in self.stack]
        return Case(self.program, stack, self.seed, self.expand, self.caller)


@st.composite
def cases(draw, families, kinds, must_op=None, must_transform=None, depth=(1, 3)):
    program = draw(programs(families, must_op))
    if any(o.name in ("no_grad", "no_fwd") for o in program.ops):  # stacks of one kind of AD level
        kinds = draw(st.sampled_from([[k for k in kinds if k not in FORWARD_KINDS], [k for k in kinds if k not in REVERSE_KINDS]]))
    stack = draw(stacks(program, kinds, must_transform, depth))
    seed = draw(st.integers(0, 2**16))
    expand = draw(st.integers(0, 5)) == 5
    return Case(program, stack, seed, expand)


# ---------------------------------------------------------------------------------------------
# Reference transforms: plain torch autograd, float64
# ---------------------------------------------------------------------------------------------


def _fresh(x):
    """A node of its own for this level to differentiate: connected to the outer levels'
    graph when x depends on their inputs, a new leaf otherwise. d/d(fresh) counts only the
    paths through this level's use of x, not the outer levels' other uses of x."""
    return x.clone() if x.requires_grad else x.detach().requires_grad_()


def _grads(out, wrt, cotangent=None):
    """vjp of `out` (tensor or tuple) w.r.t. `wrt` with create_graph; zeros where unused."""
    outs = [out] if isinstance(out, torch.Tensor) else list(out)
    cots = None if cotangent is None else ([cotangent] if isinstance(cotangent, torch.Tensor) else list(cotangent))
    if cots is None:
        cots = [torch.ones_like(o) for o in outs]
    pairs = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]
    if not pairs:
        return tuple(torch.zeros_like(w) for w in wrt)
    got = torch.autograd.grad(
        [o for o, _ in pairs], list(wrt), [c for _, c in pairs], retain_graph=True, create_graph=True, allow_unused=True
    )
    return tuple(torch.zeros_like(w) if gw is None else gw for w, gw in zip(wrt, got))


def _prepare(args, argnums):
    sel = _argnum_list(argnums, len(args))
    args = list(args)
    for a in sel:
        args[a] = _fresh(args[a])
    return args, sel


def _shape_like(per_output, out_is_tensor, argnums):
    """per_output[o][a]: Jacobian of output o w.r.t. argnum a -> torch.func's structure."""
    per_output = [ja[0] if isinstance(argnums, int) else tuple(ja) for ja in per_output]
    return per_output[0] if out_is_tensor else tuple(per_output)


class Ref:
    @staticmethod
    def vmap(f, in_dims, out_dims, chunk_size=None):
        def run(*args):
            size = next(a.size(d) for a, d in zip(args, in_dims) if d is not None)
            outs = [f(*(a if d is None else a.select(d, i) for a, d in zip(args, in_dims))) for i in range(size)]
            return torch.stack(outs, dim=out_dims)

        return run

    @staticmethod
    def grad(f, argnums=0):
        def run(*xs):
            args, sel = _prepare(xs, argnums)
            gs = _grads(f(*args), [args[a] for a in sel])
            return gs[0] if isinstance(argnums, int) else gs

        return run

    @staticmethod
    def vjp(f, *primals):
        args = [_fresh(x) for x in primals]
        out = f(*args)
        return out, lambda cotangent: _grads(out, args, cotangent)

    @staticmethod
    def jvp(f, primals, tangents):
        args = [_fresh(x) for x in primals]
        out = f(*args)
        u = torch.zeros_like(out, requires_grad=True)
        transposed = _grads(out, args, u)  # J^T u, linear in u
        inner = sum((g * t).sum() for g, t in zip(transposed, tangents))
        return out, _grads(inner, [u])[0]  # d/du <J^T u, t> = J t

    @staticmethod
    def jacrev(f, argnums=0, chunk_size=None):
        def run(*xs):
            args, sel = _prepare(xs, argnums)
            out = f(*args)
            outs = [out] if isinstance(out, torch.Tensor) else list(out)
            per_output = []
            for o in outs:
                flat = o.reshape(-1)
                rows = [_grads(flat[i], [args[a] for a in sel]) for i in range(flat.numel())]
                per_output.append(
                    [torch.stack([r[k] for r in rows]).reshape(o.shape + args[a].shape) for k, a in enumerate(sel)]
                )
            return _shape_like(per_output, isinstance(out, torch.Tensor), argnums)

        return run

    @staticmethod
    def jacfwd(f, argnums=0, chunk_size=None):
        def run(*xs):
            args, sel = _prepare(xs, argnums)
            out = f(*args)
            outs = [out] if isinstance(out, torch.Tensor) else list(out)
            us = [torch.zeros_like(o, requires_grad=True) for o in outs]
            transposed = _grads(outs, [args[a] for a in sel], us)  # sum_o J_o^T u_o
            per_output = [[None] * len(sel) for _ in outs]
            for k, a in enumerate(sel):
                flat = transposed[k].reshape(-1)
                columns = [_grads(flat[j], us) for j in range(flat.numel())]  # J_o e_j, per o
                for o, out_o in enumerate(outs):
                    per_output[o][k] = torch.stack([c[o] for c in columns], dim=-1).reshape(out_o.shape + args[a].shape)
            return _shape_like(per_output, isinstance(out, torch.Tensor), argnums)

        return run

    @staticmethod
    def hessian(f, argnums=0):
        return Ref.jacfwd(Ref.jacrev(f, argnums), argnums)


class FiniteDifferences:
    """Central differences, for depth-1 checks of `Ref` (hessian: differences of Ref.jacrev)."""

    eps = 1e-6

    @staticmethod
    def _jac(f, argnums, chunk_size=None):
        def run(*xs):
            xs = [x.detach() for x in xs]
            out = f(*xs)
            per_output = [[] for _ in tree_leaves(out)]
            for a in _argnum_list(argnums, len(xs)):
                columns = []
                for j in range(xs[a].numel()):
                    e = torch.zeros(xs[a].numel(), dtype=D)
                    e[j] = FiniteDifferences.eps
                    plus, minus = list(xs), list(xs)
                    plus[a], minus[a] = xs[a] + e.reshape(xs[a].shape), xs[a] - e.reshape(xs[a].shape)
                    diff = [(p - m) / (2 * FiniteDifferences.eps) for p, m in zip(tree_leaves(f(*plus)), tree_leaves(f(*minus)))]
                    columns.append(diff)
                for o, leaf in enumerate(tree_leaves(out)):
                    per_output[o].append(torch.stack([c[o] for c in columns], dim=-1).reshape(leaf.shape + xs[a].shape))
            return _shape_like(per_output, isinstance(out, torch.Tensor), argnums)

        return run

    jacrev = jacfwd = grad = _jac

    @staticmethod
    def vjp(f, *primals):
        out = f(*primals)
        jac = FiniteDifferences._jac(f, tuple(range(len(primals))))(*primals)
        return out, lambda c: tuple(torch.tensordot(c, j, dims=c.dim()) for j in jac)

    @staticmethod
    def jvp(f, primals, tangents):
        eps = FiniteDifferences.eps
        plus = f(*(p + eps * t for p, t in zip(primals, tangents)))
        minus = f(*(p - eps * t for p, t in zip(primals, tangents)))
        return f(*primals), (plus - minus) / (2 * eps)

    @staticmethod
    def hessian(f, argnums=0):
        return FiniteDifferences._jac(Ref.jacrev(f, argnums), argnums)


# ---------------------------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------------------------

ALLOWED_ERRORS = [
    # vmap cannot write a batched value in place into a tensor that is not batched (a fresh
    # `torch.zeros(n)` buffer, or a clone of a value from an unbatched argument): each batch
    # element would need its own copy. torch.func raises too ("vmap: inplace arithmetic(self,
    # *extra_args) is not possible ...", or a broadcast-shape error), checked with batches of
    # at least 2 elements (see `Case.batch_size_at_least`).
    re.compile(r"vmap: \S+ writes in place into a tensor that is not batched"),
    # autograd.Function families (tests/ad/fuzz_functions.py) where a transform needs what
    # the Function lacks: a vmap rule (`plain`), a backward (`fwdonly`), a jvp (`nojvp`,
    # `oldstyle`); torch.func raises the same (and refuses `oldstyle` everywhere).
    re.compile(r"does not have vmap support"),
    re.compile(r"must implement either the backward or vjp method"),
    _NO_JVP := re.compile(r"has no jvp staticmethod|must implement the jvp function"),
    # in-place writes into the program's arguments (`arg_write`): a differentiated value
    # written into an argument the level does not differentiate (torch.func: "would mutate a
    # captured Tensor"), into a differentiated leaf, or into an expanded input.
    re.compile(r"\(a captured tensor\)"),
    re.compile(r"a leaf Variable that requires grad is being used in an in-place operation"),
    re.compile(r"more than one element of the written-to tensor refers to a single memory location"),
    # a Python `if` on a sample's value (`branch`) after a write into an argument: vmap's
    # per-sample fallback would run the write twice, so it refuses (torch.func refuses the
    # `if` itself); found by this fuzzer as a wrong value before the refusal existed
    re.compile(r"had already written in place into one of its inputs"),
    # torch's own higher-order formulas of the fused losses under the caller's autograd
    # (mse_loss then l1_loss differentiated three times: plain torch raises the same)
    re.compile(r"ZeroTensors are immutable"),
    re.compile(r"which is output 0 of torch::autograd::CopySlices, is at version"),
]


def _has_op(case, *names, **params):
    return any(o.name in names and all(o.params.get(k) == v for k, v in params.items()) for o in case.program.ops)


def _has_function(case, *families):
    return any(o.name == "function" and (not families or o.params["cls"] in families) for o in case.program.ops)


def _kinds(case):
    return [t.kind for t in case.stack]


# Known functx bugs the fuzzer finds (functx raises, torch.func computes): a fuzz run that
# meets one records it as an event instead of failing, so CI stays a check of everything
# else; each has a regression case below marked xfail(strict), which starts failing (XPASS)
# once the bug is fixed, and is named in the issue notes. Each entry: a regex of the error,
# or (regex, predicate on the Case) where the message alone would also match other errors.
KNOWN_GAPS = [
    # (Fixed: jvp over hessian(mix=True) of a clone with an indexed write raised torch's
    # forward-AD layout assert; test_regression_jvp_of_mixed_hessian_through_an_indexed_write.)
    # (Fixed, issue 26: third-order jvp, jacfwd over a reverse transform and jacfwd over
    # jacfwd of a Function raised, and vjp_fn over jvp over jacrev of one: the tensors its
    # forward or jvp made one level down were lifted into the level applying it;
    # test_regression_jvp_of_jvp_of_jvp_of_function, test_regression_jacfwd_of_grad_of_function,
    # test_regression_jacfwd_of_jacfwd_of_function, test_regression_vjp_fn_of_jvp_of_jacrev_of_function.)
    # (Fixed, issue 27: chunked jacfwd over another transform raised torch's view-layout
    # assert, test_regression_chunked_jacfwd_of_*; a write into a non-differentiated argument
    # or into a reduction's result under a wrapped level was refused as a captured tensor,
    # test_regression_jacfwd_of_grad_write_into_reduction_result.)
    # (Fixed, issue 26: jvp(jvp) through an op without a forward formula in a function with
    # no_grad regions was refused (and before that wrong); it computes at a wrapped level:
    # test_regression_jvp_of_jvp_of_a_huber_loss_of_a_no_grad_region.)
    # (Fixed, issue 26: vmap over grad over a mixed hessian of a reduction raised "an input
    # is not batched": a wrapped reverse level's backward took an output of the levels below;
    # test_regression_vmap_of_grad_of_mixed_hessian_of_a_reduction.)
    # (Fixed, issue 26: grad over jacfwd of a Function of an expanded value raised "more than
    # one element of the written-to tensor refers to a single memory location";
    # test_regression_grad_of_jacfwd_of_a_numpy_function_of_an_expand.)
    # (Fixed, issue 27: the caller's grad through hessian(hessian) of an FFT's slicing raised
    # "slice_scatter does not support automatic differentiation for outputs with complex
    # dtype": vmap's slice_backward/select_backward rules scattered into zeros;
    # test_regression_callers_grad_of_hessian_of_hessian_of_a_complex_intermediate.)
    # (Fixed, issue 27: the caller's backward through jacrev(jvp(jacrev)) met a dead row of
    # jacrev's vmap: torch's ZeroTensor kernels answered a plain tensor beside it, now
    # core/lazy_bits.py's; test_regression_callers_grad_of_jacrev_of_jvp_of_jacrev.)
]


def _known_gap(case, error):
    for gap in KNOWN_GAPS:
        pattern, matches = gap if isinstance(gap, tuple) else (gap, lambda c: True)
        if pattern.search(str(error)) and matches(case):
            return True
    return False


# Known silent wrong values (functx computes, differs from the reference): the same as
# KNOWN_GAPS, but matched by what the case contains (a predicate on the Case, as narrow as
# the class is known) since a wrong value has no message. Each names its xfail(strict)
# regression test; a fuzz run that meets one records an event instead of failing.
KNOWN_WRONG_VALUES = {
    # (Fixed, issue 26: forward mode over a Jacobian through a conjugate view, jvp(jacfwd)
    # and jvp(hessian) of `X * X.conj()`; test_regression_jvp_of_jacfwd_of_a_power_spectrum.)
    # (Fixed, issue 26: a NumPy-forward Function under two AD levels, an old-style Function
    # under forward over reverse; test_regression_hessian_of_numpy_function,
    # test_regression_grad_of_jacrev_of_numpy_function, test_regression_jvp_of_jacrev_of_old_style_function.)
    # (Fixed, issue 26: torch.linalg.det differentiated three times, NaN as in torch.func:
    # ad/aten_reverse_rules.py; test_regression_vjp_of_vmap_of_hessian_of_det,
    # test_regression_callers_grad_of_jacrev_of_jacrev_of_det.)
    # (Fixed, issue 26: torch.linalg solve, det and eigvalsh under reverse over forward;
    # test_regression_vjp_of_jvp_of_solve, test_regression_vjp_of_jvp_of_det,
    # test_regression_vjp_of_jvp_of_grad_of_eigvalsh.)
    # (Fixed, issue 26: a write into a differentiated argument under a closure over the
    # outer level; test_regression_vjp_of_mixed_vjp_write_into_differentiated_argument.)
}


def _torch_func_fails(case):
    """torch.func raises on `case` (its vmaps of at least 2 elements), or computes a value
    the reference disagrees with: then it does not support the case either (torch.func.jacfwd
    through a Function without a jvp, differentiating an argument passed straight into the
    Function, gives a silently wrong tangent where functx raises the missing-jvp error)."""
    case = case.batch_size_at_least(2)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = case.run(torch.func).detach()
    except Exception:
        return True
    return not torch.allclose(got, case.run(Ref).detach(), rtol=RTOL, atol=ATOL)


def check(case, lib=functx, rtol=RTOL, atol=ATOL):
    """functx (`lib`) on `case` against `Ref`: equal, or an allowed error torch.func raises too."""
    fuzzing = currently_in_test_context()
    try:
        expected = case.run(Ref).detach()
    except Exception:  # plain torch cannot run the program (a singular matrix, a neg-bit tensor's new_tensor)
        if fuzzing:
            event("the reference raises: not a valid program")
            assume(False)
        raise
    tame = bool(torch.isfinite(expected).all() and expected.abs().max() < 1e4)  # exp/pow chains can blow up
    if fuzzing:
        assume(tame)
    else:
        assert tame, "a regression case must have a tame reference"
    try:
        actual = case.run(lib)
    except Exception as error:
        assert current_stack() == (), f"functx left its interpreter stack dirty after raising {error!r}"
        if _NO_JVP.search(str(error)) and _has_function(case, "nojvp", "oldstyle"):
            # refused by design under forward mode; torch.func's tangent there is silently
            # wrong in general, and right only by chance (`F.apply(x) - F.apply(x)`)
            if fuzzing:
                event("allowed functx error")
            return
        if any(p.search(str(error)) for p in ALLOWED_ERRORS) and _torch_func_fails(case):
            if fuzzing:
                event("allowed functx error")
            return
        if fuzzing and _known_gap(case, error):
            event("known functx gap")
            return
        raise AssertionError(f"functx raised where the reference runs: {type(error).__name__}: {error}") from error
    assert current_stack() == (), "functx left its interpreter stack dirty"
    try:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    except AssertionError as mismatch:
        known = [name for name, matches in KNOWN_WRONG_VALUES.items() if matches(case)]
        if fuzzing and known:
            event(f"known functx wrong value: {known[0]}")
            return
        noise = _rounding_noise(case, expected)
        if torch.isfinite(actual).all() and (actual - expected).abs().max() <= 3 * noise:
            if fuzzing:
                event("within the reference's own rounding noise (an ill-conditioned program)")
            return
        raise AssertionError(f"{mismatch}\nfunctx:    {actual}\nreference: {expected}\n(the reference's rounding noise: {noise:.2e})") from None


def _rounding_noise(case, expected) -> float:
    """How far the float64 reference itself moves when its inputs move by 1e-12 relative:
    in a well-conditioned program ~1e-12 times a derivative, in an ill-conditioned one (the
    inverse of a Gram matrix of x**12, an exp of a power spectrum) the rounding errors of
    its own operations, which reached 6e-5 on values of 1: there functx and the reference
    (and torch.func) may differ by that much and neither is wrong. A wrong value, off by
    O(1) in a well-conditioned program, stays far outside it."""
    spread = 0.0
    for k in (1, -1, 2, -2):
        _RUN.perturbation = k * 1e-12
        try:
            moved = case.run(Ref).detach()
        finally:
            _RUN.perturbation = 0.0
        spread = max(spread, float((moved - expected).abs().max()))
    return spread


# ---------------------------------------------------------------------------------------------
# The fuzz tests
# ---------------------------------------------------------------------------------------------

REVERSE = ["vmap", "grad", "vjp", "jacrev"]
ALL = REVERSE + ["jvp", "linearize", "jacfwd", "hessian"]
PURE_FAMILIES = ["pointwise", "reduction", "view", "nn"]


@FUZZ
@given(cases(PURE_FAMILIES + ["control_flow"], REVERSE))
def test_fuzz_vmap_and_reverse(case):
    """Stacks of vmap, grad, vjp, jacrev over programs without in-place ops or detach."""
    check(case)


@FUZZ
@given(cases(PURE_FAMILIES + ["control_flow"], ALL, must_op=["cond_op", "while_op", "scan_op"]))
def test_fuzz_control_flow_operators(case):
    """Programs with torch.cond, while_loop or scan (core/control_flow.py) under every
    transform, against the same program with Python control flow in plain autograd."""
    check(case)


@FUZZ
@given(cases(PURE_FAMILIES + ["hooks"], ALL, must_op=["hooked", "checkpointed_call"]))
def test_fuzz_saved_tensor_hooks(case):
    """Programs with a region under saved-tensor hooks whose pack makes a new tensor, or a
    checkpointed module called through functional_call, under every transform stack: the
    values of the program without hooks (a pack hook's clone under vmap(hessian) once gave a
    second derivative off by 2; the recomputation once saw the module's own weight)."""
    check(case)


@FUZZ
@given(cases(PURE_FAMILIES, ALL, must_transform=["jvp", "jacfwd", "hessian"]))
def test_fuzz_with_forward_transforms(case):
    """Stacks with at least one of jvp, jacfwd, hessian; programs without in-place or detach."""
    check(case)


@FUZZ
@given(cases(PURE_FAMILIES + ["inplace", "detach"], ALL, must_op=EFFECTFUL))
def test_fuzz_inplace_and_detach(case):
    """Programs with at least one in-place write (into a clone or a fresh buffer) or detach."""
    check(case)


@FUZZ
@given(cases(PURE_FAMILIES + ["function"], ALL + ["vjp_fn"], must_op=FAMILIES["function"]))
def test_fuzz_autograd_functions(case):
    """Programs with at least one torch.autograd.Function (tests/ad/fuzz_functions.py: plain,
    NumPy forward with a vmap staticmethod calling apply, generate_vmap_rule, jvp only, no
    jvp, old-style), applied to the current value and another value of the program (the
    same one, one that broadcasts, or a sum), under any stack."""
    check(case)


@FUZZ
@given(cases(PURE_FAMILIES + ["function"], ALL + ["vjp_fn"], must_transform=["vjp_fn"]))
def test_fuzz_vjp_fn_in_the_stack(case):
    """Stacks with a vjp_fn: `vjp(f, *xs)[1](ct)[argnum]`, the cotangent a fixed affine map of
    one of the transform's inputs (or a constant), taken either inside (at each call) or
    outside every transform (fixed primals; the outer transforms act on the cotangent)."""
    check(case)


@FUZZ
@given(cases(PURE_FAMILIES + ["norm"], ALL + ["vjp_fn"], must_op=FAMILIES["norm"]))
def test_fuzz_norms(case):
    """Programs through batch norm in training mode, layer norm and instance norm under stacks
    of up to three transforms: second derivatives under vmap once lost the statistics'
    dependence on the input (vmap(hessian): off by ~3), and third derivatives were torch's
    (grad(grad(grad)): off by 1.5 for batch norm, 25 for layer and instance norm)."""
    check(case)


@FUZZ
@given(cases(PURE_FAMILIES, ALL + ["vjp_fn"], must_op=["attention"]))
def test_fuzz_fused_attention(case):
    """Programs through F.scaled_dot_product_attention (torch's fused CPU kernel, whose
    backward has no derivative: second order once raised under functx, still does under
    torch.func) under every transform, against its math form in plain autograd."""
    check(case)


@FUZZ
@given(cases(PURE_FAMILIES, ALL + ["vjp_fn"], must_op=["linalg"]))
def test_fuzz_linear_algebra(case):
    """Every program has a torch.linalg op: their forward formulas (several reuse outputs
    with no derivative: det's and solve's LU) under reverse and nested levels."""
    check(case)


@FUZZ
@given(cases(PURE_FAMILIES, ALL + ["vjp_fn"], must_op=["spectral"]))
def test_fuzz_complex_intermediates(case):
    """Every program has an FFT with conjugate (and negative) views on the way back to real
    values: torch's forward AD checks those views' tangents, which vmap's wrappers once
    failed (tests/ad/test_forward_view_layout.py)."""
    check(case)


@FUZZ
@given(cases(PURE_FAMILIES, ALL + ["vjp_fn"], must_op=["attention"]))
def test_fuzz_attention_under_the_callers_autograd(case):
    """Every program has fused attention, and the caller's autograd tracks the inputs: a
    transform then records the fused kernel through `_FusedAttention` (one AD level) or its
    math form in blocks (two), and a jvp level over tracked values met the Function without
    a jvp ("You must implement the jvp function"), which the general caller fuzzer, drawing
    attention in about one program in ten, never combined with a lone jvp."""
    check(Case(case.program, case.stack, case.seed, case.expand, caller=True))


@FUZZ
@given(cases(PURE_FAMILIES + ["function"], ALL + ["vjp_fn"]))
def test_fuzz_under_the_callers_autograd(case):
    """The inputs require grad and plain torch.autograd differentiates the stack's output
    (`Case.caller`): a result must stay connected to the caller's graph (a gradient
    penalty, a meta-gradient through per-sample Hessians). vmap(jacrev) of `mm(col, row)`
    lost it, silently (the caller's gradient missed the term), until this test found it."""
    check(Case(case.program, case.stack, case.seed, case.expand, caller=True))


@FUZZ
@given(cases(PURE_FAMILIES + ["factory", "reduce_write", "arg_write"], ALL, must_op=FAMILIES["factory"] + ["reduce_write"]))
def test_fuzz_factories_and_writes(case):
    """Programs with factories and tensors from data (`torch.arange`, `torch.tensor`,
    `new_tensor`, `torch.as_tensor` of a NumPy array), in-place writes into the results of
    reductions, and (a third of them) a first op writing into an argument."""
    check(case)


@FUZZ
@given(cases(PURE_FAMILIES + ["region", "inplace"], ALL + ["vjp_fn"], must_op=FAMILIES["region"]))
def test_fuzz_no_grad_and_no_forward_grad_regions(case):
    """Regions under `torch.no_grad()` and `_set_fwd_grad_enabled(False)`, under stacks whose
    AD levels are all reverse or all forward (see `region_semantics`)."""
    check(case)


ALL_FAMILIES = PURE_FAMILIES + ["inplace", "detach", "function", "factory", "reduce_write", "arg_write"]


def _outcome(case):
    """functx's result on `case`, or the type and message of its error."""
    try:
        return case.run(functx).detach()
    except Exception as error:
        return (type(error), str(error))


@settings(FUZZ, max_examples=max(EXAMPLES // 3, 10))
@given(cases(ALL_FAMILIES + ["control_flow"], ALL + ["vjp_fn"]), cases(ALL_FAMILIES, ALL + ["vjp_fn"]))
def test_fuzz_two_threads(first, second):
    """Two threads run random cases at once (each several times, started together): every
    run's outcome equals the case's serial outcome (the same value, or the same error), and
    each thread's interpreter stack is empty afterwards. Both threads draw forward-mode
    transforms too (torch's one forward-AD level is held by one thread at a time:
    tests/ad/test_forward_threads.py; shared, 53 of 100 runs of a hessian(jvp(vjp)) beside
    a jacfwd(grad) raised "a forward AD level with an invalid index")."""
    serial = [_outcome(first), _outcome(second)]
    rounds, got, barrier = 3, [[], []], threading.Barrier(2)

    def work(k, case):
        barrier.wait()
        for _ in range(rounds):
            got[k].append(_outcome(case))
        got[k].append(current_stack())

    threads = [threading.Thread(target=work, args=(k, c)) for k, c in enumerate((first, second))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in range(2):
        assert got[k][-1] == (), "a thread left its interpreter stack dirty"
        for outcome in got[k][:-1]:
            if isinstance(serial[k], torch.Tensor):
                assert isinstance(outcome, torch.Tensor), f"case {k}: serial run gave a value, threaded run raised {outcome}"
                # (equal_nan: a case whose serial value holds a NaN must hold it threaded too)
                torch.testing.assert_close(outcome, serial[k], rtol=1e-12, atol=1e-12, equal_nan=True)
            else:
                assert outcome == serial[k], f"case {k}: serial outcome {serial[k]}, threaded {outcome}"


@FUZZ
@given(cases(PURE_FAMILIES + ["inplace"], ["grad", "vjp", "jvp", "jacrev", "jacfwd", "hessian"], depth=(1, 1)))
def test_reference_matches_finite_differences(case):
    """The reference itself, at depth 1, against central differences (float64, eps 1e-6).
    Tolerance: atol 1e-5, rtol 1e-4: the differences' truncation and rounding errors
    (~1e-10 |f| with |f| the function's own size, which a derivative of a few hundred can
    reach 1e5 through exp(det): 1.4e-5 relative at 3,000 examples); a wrong reference is
    off by O(1).
    No detach here: differences see through it. An amax of expanded inputs is taken at a
    tie (equal elements), where it has no derivative for differences to find; the FFT of
    equal elements is exactly zero off its first bin, where a `where` switches."""
    # (and the FFT of equal elements has exact zeros, where `where(v > 0, ...)` has a kink)
    assume(not (case.expand and any(op.name in ("amax", "spectral") for op in case.program.ops)))
    # the function's own size bounds the differences' rounding error (~1e-10 |f| / step):
    # tame values only (exp of a Gram product reached 1e-3 relative error)
    value = Case(case.program, [], case.seed, case.expand).run(Ref).detach()
    assume(torch.isfinite(value).all() and value.abs().max() < 1e3)
    expected = case.run(FiniteDifferences).detach()
    assume(torch.isfinite(expected).all() and expected.abs().max() < 1e3)
    reference = case.run(Ref).detach()
    assume(torch.isfinite(reference).all())  # 0 * inf of an overflowed chain (tanh(exp(exp(det))))
    torch.testing.assert_close(reference, expected, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Regression tests: shrunk counterexamples found by the fuzzer
# ---------------------------------------------------------------------------------------------
# Each was the fuzzer's shrunk output (inputs: `Case.inputs()`, seed 0); the docstring says
# what functx did at 247249c (before the AD-level rewrite) and, where it differs, at f683bff.


def test_regression_jvp_of_mixed_hessian_through_an_indexed_write():
    """jvp over hessian(mix=True) of `w = x.clone(); w[0] = w[0] * 2; sin(w)`: torch's forward
    AD asserted ("Expected the output of forward differentiable view operations to have the
    tangent have the same layout as primal", autograd_meta.cpp) in the outer jacrev's backward
    (at 8faa1f8). vmap's layout check read the storage of a grad level's wrapper, a placeholder
    sized by the wrapper's own layout (a column of a 3x3: 7 elements, not 9), so a column's
    tangent was judged laid out unlike the column."""
    check(Case(Program([(3,)], [Op("clone_setitem"), Op("sin")]), [T("jvp", seed=0), T("hessian", argnums=0, seed=0, mix=True)], seed=0))


def test_regression_jvp_of_jvp_with_closure():
    """Nested forward mode drops the mixed partial: the inner jvp's function closes over the
    outer jvp's input. The second-order tangent differs (e.g. -4.7104 vs -4.6396)."""
    program = Program([(3,)], [Op("sin"), Op("sin")])
    check(Case(program, [T("jvp", seed=0), T("jvp", seed=0, mix=True)]))


def test_regression_jvp_of_jacfwd():
    """jvp(jacfwd(f, argnums=1)) of f(x0, x1) = sin(sin(x0)) + x1: the Jacobian w.r.t. x1 is
    the identity, its tangent 0; functx's values differ in every element."""
    program = Program([(3,), (3,)], [Op("sin"), Op("sin"), Op("binary", kind="add", j=1)])
    check(Case(program, [T("jvp", seed=0), T("jacfwd", argnums=1)]))


def test_regression_jvp_of_jacfwd_has_same_storage_numel():
    """Forward over forward raised NotImplementedError: the per-sample fallback for
    aten::_has_same_storage_numel got a bool result."""
    program = Program([(3,)], [Op("sin"), Op("sin")])
    check(Case(program, [T("jvp", seed=0), T("jacfwd", argnums=0)]))


def test_regression_jvp_of_jacrev_with_closure():
    """Forward over reverse with a closure raised NotImplementedError: "You must implement
    the jvp function for custom autograd.Function" (a functx-internal Function; the same
    error came out of the TorchScript decomposition of softmax's backward in jvp(hessian))."""
    program = Program([(3,)], [Op("sin"), Op("sin")])
    check(Case(program, [T("jvp", seed=0), T("jacrev", argnums=0, mix=True)]))


def test_regression_grad_of_vmap_of_jvp_softmax():
    """grad(vmap(jvp(f))) with a softmax raised "one of the variables needed for gradient
    computation has been modified by an inplace operation" (output 0 of Exp)."""
    program = Program([(2, 3), (3,)], [Op("sin"), Op("softmax"), Op("binary", kind="add", j=1)])
    stack = [T("grad", argnums=0, seed=0), T("vmap", in_dims=(0, None), out_dims=0, size=1), T("jvp", seed=0)]
    check(Case(program, stack))


def test_regression_vjp_of_jvp_softmax():
    """The same error without vmap, vjp(jvp(f)) of softmax(sin(x)), at f683bff (right at
    247249c)."""
    program = Program([(3,)], [Op("sin"), Op("softmax")])
    check(Case(program, [T("vjp", seed=0), T("jvp", seed=0)]))


def test_regression_vmap_of_jvp_of_jvp_expand():
    """vmap(in_dims=(1, None)) over jvp(jvp(f)) of a pure f with an expand raised
    "!this_view_meta->has_fw_view() INTERNAL ASSERT FAILED"."""
    program = Program([(2, 3), (3,)], [Op("sin"), Op("expand"), Op("binary", kind="add", j=1)])
    check(Case(program, [T("vmap", in_dims=(1, None), out_dims=0, size=2), T("jvp", seed=0), T("jvp", seed=0)]))


def test_regression_grad_of_grad_of_jvp_sin_on_clone():
    """`w = x.clone(); w.sin_()` under grad(grad(jvp)): wrong values at 247249c; at f683bff
    "functx.grad: aten::copy_ writes in place into a tensor that was not made inside the
    transformed function (a captured tensor)"."""
    program = Program([(3,)], [Op("clone_sin_"), Op("sin")])
    check(Case(program, [T("grad", argnums=0, seed=0), T("grad", argnums=0, seed=0), T("jvp", seed=0)]))


def test_regression_jacfwd_of_vmap_in_dims_1():
    """jacfwd over vmap(in_dims=(1, None)) of a pure function raised "vmap: aten::copy_ writes
    in place into a tensor that is not batched at this vmap level (shape (3, 3))": an in-place
    write of functx's own (the program has none); torch.func runs it."""
    program = Program([(3,), (3,)], [Op("sin"), Op("sin"), Op("binary", kind="add", j=1)])
    check(Case(program, [T("vmap", in_dims=(1, None), out_dims=0, size=2), T("jacfwd", argnums=0)]))


def test_regression_jacrev_of_vmap_setitem_on_clone():
    """An in-place write into a clone, under jacrev(vmap(in_dims=1)): wrong values in every
    element (vmap alone and jacrev alone are right)."""
    program = Program([(3,), (3,)], [Op("clone_setitem"), Op("sin"), Op("binary", kind="add", j=1)])
    check(Case(program, [T("jacrev", argnums=0), T("vmap", in_dims=(1, None), out_dims=0, size=2)]))


def test_regression_jvp_setitem_into_fresh_buffer():
    """`buf = torch.zeros(3); buf[0] = x.sum()` under a single jvp raised "!this_view_meta->
    has_fw_view() INTERNAL ASSERT FAILED"."""
    program = Program([(3,)], [Op("buf_setitem"), Op("sin")])
    check(Case(program, [T("jvp", seed=0)]))


def test_regression_vjp_of_jvp_setitem_into_fresh_buffer():
    """The same write under vjp(jvp): the INTERNAL ASSERT at 247249c; wrong values at f683bff
    (where a single jvp of it is right)."""
    program = Program([(3,)], [Op("sin"), Op("buf_setitem")])
    check(Case(program, [T("vjp", seed=0), T("jvp", seed=0)]))


def test_regression_hessian_setitem_into_fresh_buffer():
    """`buf = torch.zeros(3); buf[0] = x.sum()` under hessian (reverse over reverse) raised
    "fn_edge.is_valid() == this_edge.is_valid() INTERNAL ASSERT FAILED"; vjp(vjp) too."""
    program = Program([(3,)], [Op("buf_setitem"), Op("sin")])
    check(Case(program, [T("hessian", argnums=0, seed=0)]))


def test_regression_jvp_of_jvp_slice_write_into_fresh_buffer():
    """`buf[1:] = v.reshape(-1)` into a fresh buffer under jvp(jvp) raised "Setting a forward
    grad that itself has a forward gradient at the same level0 is not supported"; wrong
    values at f683bff."""
    program = Program([(2, 3)], [Op("clone_setitem"), Op("sin"), Op("buf_slice")])
    check(Case(program, [T("jvp", seed=0), T("jvp", seed=0)]))


def test_regression_hessian_through_copy_into_fresh_buffer():
    """Second derivatives through `torch.zeros(3).copy_(x)` were 0 (reference: diag(-sin x))."""
    program = Program([(3,)], [Op("buf_copy", like=False), Op("sin")])
    check(Case(program, [T("hessian", argnums=0, seed=0)]))


def test_regression_hessian_through_add_into_clone_of_other_input():
    """`w = x0.clone(); w.add_(x1)`, hessian w.r.t. x1: w does not depend on x1 before the
    write (as a fresh buffer); the second derivatives were 0 (reference: diag(-sin(x0 + x1)))."""
    program = Program([(3,), (3,)], [Op("clone_add_", j=1), Op("sin")])
    check(Case(program, [T("hessian", argnums=1, seed=0)]))


def test_regression_jvp_of_jvp_through_copy_into_fresh_buffer():
    """The forward flavour of the previous one: the second-order tangent was 0."""
    program = Program([(3,)], [Op("buf_copy", like=False), Op("sin")])
    check(Case(program, [T("jvp", seed=0), T("jvp", seed=0)]))


def test_regression_vjp_of_jvp_of_jvp_through_copy_into_fresh_buffer():
    """Third order through `torch.zeros(3).copy_(sin(x))`: "Setting a forward grad that
    itself has a forward gradient" at 247249c, wrong values at f683bff."""
    program = Program([(3,)], [Op("sin"), Op("buf_copy", like=False)])
    check(Case(program, [T("vjp", seed=0), T("jvp", seed=0), T("jvp", seed=0)]))


def test_regression_vmap_of_grad_unbatched_argnum_copied_into_fresh_buffer():
    """vmap(grad(f, argnums=0), in_dims=(None, 0)) with `torch.zeros(3).copy_(x0)`: x0 is not
    batched, so torch.func runs it; functx raised "vmap: aten::copy_ writes in place into a
    tensor that is not batched" (the direct level batches the differentiated x0 for its
    per-element gradients; the function's own buffers are now batched too)."""
    program = Program([(3,), (3,)], [Op("buf_copy", like=False), Op("sin"), Op("binary", kind="add", j=1)])
    check(Case(program, [T("vmap", in_dims=(None, 0), out_dims=0, size=1), T("grad", argnums=0, seed=0)]))


def test_regression_detach_under_grad_of_vjp():
    """`x * x.detach()` stops the derivative at every level (torch.func, JAX); functx's
    second derivative went through the detach at the outer level."""
    program = Program([(3,)], [Op("detach_mul"), Op("sin")])
    check(Case(program, [T("grad", argnums=0, seed=0), T("vjp", seed=0)]))


def test_regression_detach_under_jvp_of_jvp():
    """The forward flavour of the previous one."""
    program = Program([(3,)], [Op("detach_mul"), Op("sin")])
    check(Case(program, [T("jvp", seed=0), T("jvp", seed=0)]))


# Found by the 2000-example run (FUNCTX_FUZZ_EXAMPLES=2000): an in-place formula (`sin_`'s
# tangent is `t.mul_(cos x)`) writing values of more levels than the tangent was made at.
def test_regression_vmap_of_jacfwd_inplace_on_clones():
    """`vmap(jacfwd)`: the tangent of a clone was batched at jacfwd's vmap only, the primal at
    the outer vmap too: "vmap: aten::copy_ writes in place into a tensor that is not batched"."""
    program = Program([(2, 3)], [Op("clone_sin_"), Op("clone_mul_", seed=0)])
    check(Case(program, [T("vmap", in_dims=(0,), out_dims=0, size=1), T("jacfwd", argnums=0)]))


def test_regression_jvp_of_jacfwd_inplace_on_clones():
    """The same under jvp(jacfwd): the outer jvp's refusal of a write into "a captured tensor"."""
    program = Program([(2, 3)], [Op("clone_sin_"), Op("clone_mul_", seed=0)])
    check(Case(program, [T("jvp", seed=0), T("jacfwd", argnums=0)]))


def test_regression_hessian_of_jvp_inplace_on_clones():
    """hessian(jvp): "fn_edge.is_valid() == this_edge.is_valid() INTERNAL ASSERT FAILED"."""
    program = Program([(3,)], [Op("clone_sin_"), Op("clone_setitem")])
    check(Case(program, [T("hessian", argnums=0, seed=0), T("jvp", seed=0)]))


# Found by the 3000-example run.
def test_regression_vjp_of_grad_of_vjp_write_into_clone_of_undifferentiated_input():
    """`w = x0.clone()` made inside an inner vjp, where the grad around it does not
    differentiate x0: the clone was plain at the grad level, and writing `x1.sum()` into it
    raised the grad level's "captured tensor" error (torch.func runs it)."""
    program = Program([(4,), (3,)], [Op("clone_mul_", seed=0), Op("clone_add_", j=1)])
    check(Case(program, [T("vjp", seed=0), T("grad", argnums=1, seed=0), T("vjp", seed=0)]))


def test_regression_vjp_of_jvp_logsumexp():
    """vjp(jvp(logsumexp(sin x))): torch's logsumexp_jvp multiplies `exp` in place on plain
    tensors, overwriting what the reverse level below saved ("modified by an inplace
    operation"); a nested jvp level therefore runs torch's formulas on its carriers."""
    program = Program([(3,)], [Op("sin"), Op("logsumexp", dim=-1)])
    check(Case(program, [T("vjp", seed=0), T("jvp", seed=0)]))


# Found by the 5000-example run.
def test_regression_jacfwd_of_grad_write_into_clone_of_value_jvp_does_not_differentiate():
    """jacfwd(argnums=1) over grad(argnums=0): `w = sin(x0).clone()` is the grad level's, plain
    at the jvp level (x0 has no tangent there); `w.add_(x1.sum())` raised the jvp level's
    "captured tensor" error: the lift into the wrapped levels below stopped at jacfwd's vmap."""
    program = Program([(4,), (3,)], [Op("sin"), Op("clone_add_", j=1), Op("clone_mul_", seed=0)])
    check(Case(program, [T("jacfwd", argnums=1), T("grad", argnums=0, seed=0)]))


def test_regression_vjp_of_jacrev_of_vmap_write_into_clone_of_batched_input():
    """vjp(jacrev(argnums=1)(vmap(in_dims=(0, None)))): `w = x0.clone()` is batched at the
    vmap level but plain at jacrev's level (x0 is not differentiated there); vmap's rule for
    `w.add_(x1)` wrote jacrev's x1 into it and jacrev refused a write into "a captured
    tensor": vmap now lifts the value under its target into the wrapped levels below too."""
    program = Program([(3,), (3,)], [Op("clone_add_", j=1), Op("sin")])
    check(Case(program, [T("vjp", seed=0), T("jacrev", argnums=1), T("vmap", in_dims=(0, None), out_dims=0, size=1)]))


def test_regression_vjp_of_vmap_of_hessian_gradient_independent_of_batched_leaf():
    """vjp(vmap(in_dims=(0, None))(hessian(argnums=1, mix=True))): the outer jacrev of the
    hessian is direct on vmap's physical tensors, and the inner gradient,
    `(1 + 0.5 sin(x1)) * weight`, does not depend on its leaf but requires grad for the
    outermost (direct) vjp level, which tracks x1; it is not batched at the vmap level. The
    direct level took `requires_grad` for "depends on my leaves" and built a per-element
    cotangent for a physical tensor without the batch dim (an `expand` error): an output
    not batched at every vmap level under a direct level cannot depend on its leaves."""
    program = Program([(3,), (3,)], [Op("clone_mul_", seed=0), Op("sin"), Op("binary", kind="add", j=1)])
    check(
        Case(
            program,
            [T("vjp", seed=0), T("vmap", in_dims=(0, None), out_dims=0, size=1), T("hessian", argnums=1, seed=0, mix=True)],
            seed=0,
        )
    )


def test_regression_jacfwd_of_jvp_of_jvp_write_into_clone_whose_tangent_is_unbatched():
    """jacfwd over jvp over jvp: `w = (x0**2).sum()`, `w.sin_()`, `w2 = w.clone()`,
    `w2.mul_(C)`. The innermost jvp's formula for `sin_` writes its new tangent into w's
    tangent in place; one level down that tangent's own tangent at jacfwd's jvp level was
    plain (unbatched at jacfwd's vmap) while the tangent written into it was batched, and
    both primals were plain, so `_tangent_for_write`, which looked only at the target's
    primal levels, kept the plain tangent and vmap refused the batched `copy_` into it. The
    target's tangent must also live at every level of the tangents written into it."""
    program = Program([(3,)], [Op("pow", p=2), Op("sum", dim=None), Op("clone_sin_"), Op("clone_mul_", seed=0)])
    check(Case(program, [T("jacfwd", argnums=0), T("jvp", seed=0), T("jvp", seed=0)], seed=0))


def test_regression_jvp_on_values_with_inner_jvp_under_vmap():
    """An outermost jvp running torch's forward AD on plain values, with another jvp inside
    (under vmap, closing over the outer's tensors), re-set forward grads: torch asserted
    (vmap's `stack` rule computes by ops on its own wrappers; core/dual_values.py)."""
    check(
        Case(
            Program([(3,)], [Op("sin"), Op("sin")]),
            [T("jvp", seed=0), T("vmap", in_dims=(0,), out_dims=0, size=1, mix=True), T("jvp", seed=0)],
            seed=0,
        )
    )


def test_regression_jvp_on_values_over_jacrev_of_jvp():
    """The same strategy under jacrev with an inner jvp: every value silently wrong. The
    jacrev's wrappers picked up the outer tangent from a closed-over plain value, and the
    inner jvp took it for its own (core/dual_values.py)."""
    check(
        Case(
            Program([(3,)], [Op("clone_mul_", seed=0), Op("sin")]),
            [T("jvp", seed=0), T("jacrev", argnums=0, mix=True), T("jvp", seed=0, mix=True)],
            seed=0,
        )
    )


def test_regression_jvp_on_values_over_jacfwd_of_jvp():
    """jvp on values over jacfwd of a jvp: torch asserted (a forward grad re-set on a
    wrapper of jacfwd's vmap level)."""
    check(
        Case(
            Program([(3,)], [Op("sin"), Op("sin")]),
            [T("jvp", seed=0), T("jacfwd", argnums=0), T("jvp", seed=0)],
            seed=0,
        )
    )


def test_regression_jvp_on_values_over_jacfwd_of_a_write():
    """jvp on values over jacfwd of an in-place `sin_`: its tangent formula at the wrapper
    level wrote a batched tangent into the outer (unbatched) tangent: vmap refused."""
    check(
        Case(
            Program([(2, 3)], [Op("conv1d", c=2, pad=0, ks=1, seed=0), Op("amax", dim=-2), Op("clone_sin_")]),
            [T("jvp", seed=0), T("jacfwd", argnums=0)],
            seed=0,
        )
    )


def test_regression_jacfwd_write_into_clone_of_expand():
    """A view's fast path gave an `expand`ed tangent that the clone written into shared:
    torch refused the in-place tangent write (internal overlap)."""
    check(
        Case(
            Program([(3,), (3,)], [Op("expand"), Op("clone_mul_", seed=0), Op("sin"), Op("binary", kind="add", j=1)]),
            [T("jacfwd", argnums=(0, 1))],
            seed=0,
        )
    )


# Found by the widened fuzzer (autograd.Function families, writes into arguments; issue 26).
# Still open when written: each is xfail(strict) and named in KNOWN_GAPS (errors) or
# KNOWN_WRONG_VALUES (wrong values); a fix makes it XPASS: then remove the mark and the entry.
# (The Function cases are fixed; tests/ad/test_custom_function.py pins their causes.)
# The reference of each was checked against central differences of its outermost level
# (inner levels by `Ref`); torch.func's outcome is in the docstring.
FUNCTION_SIN = lambda cls: Program([(3,)], [Op("function", cls=cls, j=0), Op("sin")])
def test_regression_jvp_of_jvp_of_jvp_of_function():
    """Third-order jvp of `sin(F.apply(x, x))` (F with setup_context/backward/jvp, plain or
    generate_vmap_rule): functx raised torch's "is_inplace_op INTERNAL ASSERT FAILED ... Only
    inplace operations can re-set the forward grad of a Tensor that already has one"
    (second order is right). torch.func computes a wrong value (off by up to 195).
    Fixed (issue 26): what the Function's forward or jvp made one level down (factories:
    `zeros_like` in its jvp) is no longer lifted into the level applying it."""
    check(Case(FUNCTION_SIN("generated"), [T("jvp", seed=0), T("jvp", seed=0), T("jvp", seed=0)]))


def test_regression_jacfwd_of_grad_of_function():
    """jacfwd(grad(sin(F.apply(x, x)))), any new-style F (also jacfwd over vjp, jacrev,
    hessian, a vjp_fn): functx raised "vmap: a tensor of shape (3, 3) created inside a
    functx.vmap was used after that vmap returned"; torch.func matches the reference.
    Fixed (issue 26) with the same cause as the test above."""
    check(Case(FUNCTION_SIN("generated"), [T("jacfwd", argnums=0), T("grad", argnums=0, seed=0)]))


def test_regression_jacfwd_of_jacfwd_of_function():
    """jacfwd(jacfwd(sin(F.apply(x, x)))) (also jacfwd(jvp) and vmap(jacfwd) for the NumPy
    Function): functx raised "Attempted to make a tensor into a differentiable view, but the
    tensor already had autograd metadata associated with it". torch.func computes a wrong
    value here (off by 1.28); the reference agrees with central differences.
    Fixed (issue 26) with the same cause as the tests above."""
    check(Case(FUNCTION_SIN("generated"), [T("jacfwd", argnums=0), T("jacfwd", argnums=0)]))


def test_regression_hessian_of_numpy_function():
    """hessian of `sin(F.apply(x, x))`, F with a NumPy forward, torch backward/jvp and a vmap
    staticmethod calling apply: functx's Hessian differs (e.g. diagonal 4.35 vs -33.05);
    the same F with a torch forward (generate_vmap_rule) is right, as is torch.func. Every
    second-order stack (grad(jacrev), jvp(jacrev), vjp(jvp), hessian(vmap), ...) is wrong.
    Fixed (issue 26): the tensor the forward made (`torch.as_tensor`) was lifted into the
    wrapped level applying the Function one level down, as that level's constant, so the
    outer level's graph (or tangent) of the result was dropped."""
    check(Case(FUNCTION_SIN("numpy"), [T("hessian", argnums=0, seed=0)]))


def test_regression_grad_of_jacrev_of_numpy_function():
    """The reverse-over-reverse flavour, two inputs: grad(jacrev(sin(F.apply(sin(x0), x1))))."""
    program = Program([(3,), (3,)], [Op("sin"), Op("function", cls="numpy", j=1), Op("sin")])
    check(Case(program, [T("grad", argnums=0, seed=0), T("jacrev", argnums=0)]))


def test_regression_jvp_of_jacrev_of_old_style_function():
    """An old-style Function (`forward(ctx, ...)`, backward only) under jvp(jacrev) (also
    jvp(hessian)): functx returns a wrong tangent (max difference 15.7) where jvp(grad) and
    a single jvp raise its "has no jvp staticmethod" error. torch.func refuses old-style
    Functions everywhere; functx must raise or be right. Fixed (issue 26): the forward
    level below (a jvp on values) was not counted as seeing the Function, so torch's apply at
    the grad level ran its forward with forward AD off and the result's tangent was lost;
    it now raises the missing-jvp error (and uses the jvp staticmethod where there is one)."""
    check(Case(FUNCTION_SIN("oldstyle"), [T("jvp", seed=0), T("jacrev", argnums=0)]))


def test_regression_grad_write_into_undifferentiated_argument():
    """grad(argnums=0) of `x1.add_(x0); x1 * arange`: x1 is an argument of the function that
    grad does not differentiate; functx raised its "writes in place into a tensor that was
    not made inside the transformed function (a captured tensor)" error, torch.func computes
    the reference's gradient (the write as a functional update). Fixed: the function's
    arguments are its own (lifting.arguments_are_the_functions_own)."""
    program = Program([(3,), (3,)], [Op("arg_write", i=1, kind="cross"), Op("arange")])
    check(Case(program, [T("grad", argnums=0, seed=0)]))


def test_regression_chunked_jacfwd_of_chunked_vmap():
    """jacfwd(argnums=1, chunk_size=1) over vmap(in_dims=(None, 0), chunk_size=1) of
    `sin(x0) + x1` (two chunks of one element): functx raised torch's "!this_view_meta->
    has_fw_view() INTERNAL ASSERT FAILED ... Expected the output of forward differentiable
    view operations to have the tangent have the same layout as primal"; without either
    chunk_size it is right, and torch.func (no chunk_size for jacfwd) matches the reference.
    Fixed with test_regression_chunked_jacfwd_of_inverse_of_inverse (a chunk of one column:
    vmap's _has_same_storage_numel misjudged a batch of size 1)."""
    program = Program([(3,), (2, 3)], [Op("sin"), Op("binary", kind="add", j=1)])
    check(Case(program, [T("jacfwd", argnums=1, chunk_size=1), T("vmap", in_dims=(None, 0), out_dims=0, size=2, chunk_size=1)]))


def test_regression_chunked_jacfwd_of_jacfwd():
    """jacfwd(argnums=0, chunk_size=1) over jacfwd(argnums=(0, 1)) of `sin(x0) + x1`: the
    same "has_fw_view() INTERNAL ASSERT FAILED" (argnums=0 inside is right). Fixed with
    test_regression_chunked_jacfwd_of_inverse_of_inverse."""
    program = Program([(3,), (3,)], [Op("sin"), Op("binary", kind="add", j=1)])
    check(Case(program, [T("jacfwd", argnums=0, chunk_size=1), T("jacfwd", argnums=(0, 1))]))


def test_regression_vjp_fn_of_jvp_of_jacrev_of_function():
    """vjp_fn (or vjp) over jvp over jacrev (or hessian) of `sin(F.apply(x, x))` (plain or
    generate_vmap_rule F): functx raised "vjp(f, *primals): vjp_fn got a cotangent of shape
    (6,) for an output of shape (1, 6)" (with a 2-d input: "Function StackBackward0 returned
    an invalid gradient at index 1 - got [6] but expected shape compatible with [1, 6]");
    the same stack without the Function is right; torch.func matches the reference.
    Fixed (issue 26) with the cause of test_regression_jvp_of_jvp_of_jvp_of_function."""
    check(Case(FUNCTION_SIN("generated"), [T("vjp_fn", argnum=0, outside=False, seed=0), T("jvp", seed=0), T("jacrev", argnums=0)]))


def test_regression_vjp_of_jvp_of_det():
    """vjp(jvp(det(x^T x + diag(1, 2, 3)))) for x of shape (3,): functx and torch.func agreed
    with each other, not with the reference, which central differences of central
    differences (eps 1e-4) confirm. Both ran torch's forward formula for det, which solves
    with the LU the op returns (no derivative), so its reverse derivative was wrong. Fixed
    (issue 26): a wrapped jvp level factorizes A itself (jvp_rules._det_jvp)."""
    check(Case(Program([(3,)], [Op("linalg", kind="det")]), [T("vjp", seed=0), T("jvp", seed=0)]))


def test_regression_chunked_jacfwd_of_grad_of_expand():
    """jacfwd(chunk_size=1) over grad of `x.unsqueeze(0).expand(2, 2, 3) @ M`: the same
    "has_fw_view() INTERNAL ASSERT FAILED"; chunk_size 2 or none, or jacfwd alone, is right.
    Fixed with test_regression_chunked_jacfwd_of_inverse_of_inverse."""
    program = Program([(2, 3)], [Op("expand"), Op("matmul", k=2, seed=0)])
    check(Case(program, [T("jacfwd", argnums=0, chunk_size=1), T("grad", argnums=0, seed=0)]))


def test_regression_vjp_of_jvp_of_solve():
    """vjp(jvp(solve(x^T x + diag(1, 2, 3), 1))) for x of shape (3,): functx and torch.func
    agree with each other and differ from the reference (confirmed by central differences of
    central differences); hessian is right. The same class as det (torch's forward formulas,
    differentiated in reverse). Fixed (issue 26): a wrapped jvp level computes solve's
    tangent by linalg.solve itself (jvp_rules._solve_jvp), not from the returned LU."""
    check(Case(Program([(3,)], [Op("linalg", kind="solve")]), [T("vjp", seed=0), T("jvp", seed=0)]))


def test_regression_vjp_of_mixed_vjp_write_into_differentiated_argument():
    """vjp(mix=True) over vjp of `x0.mul_(C); sin(x0 * arange)`: the inner vjp's argument is
    written in place. torch.func refuses ("a leaf Variable that requires grad is being used
    in an in-place operation"), as functx does without the closure; with it functx accepts
    the write and returns a wrong vjp (e.g. 2.049 vs -4.464; the reference, the write as a
    functional update, agrees with central differences of its outer level). Same with
    grad(mix=True) over grad. Fixed (issue 26): the inner level's leaf for an input the
    outer level tracks is a view (to stay connected), which torch lets be written; the
    captured-write check refuses writes into a direct level's own leaves, as torch does."""
    program = Program([(3,)], [Op("arg_write", i=0, kind="self", seed=0), Op("arange"), Op("sin")])
    check(Case(program, [T("vjp", seed=0, mix=True), T("vjp", seed=0)]))


def test_regression_jacfwd_of_grad_write_into_reduction_result():
    """jacfwd(argnums=0) over grad(argnums=1) of `r = x0.sum(); r.add_(x1.sum())`: r is made
    inside the function, yet functx raised "functx.grad: aten::add_.Tensor writes in place
    into a tensor that was not made inside the transformed function (a captured tensor)";
    grad alone, jvp(grad) and the same write into `x0.sum().clone()` were right; torch.func
    matches the reference. Fixed when the non-differentiated x0 became the wrapped grad
    level's own constant (ADLevel.own), so r is the level's too."""
    program = Program([(4,), (3,)], [Op("reduce_write", red="sum", dim=None, kind="add_", j=1), Op("arange")])
    check(Case(program, [T("jacfwd", argnums=0), T("grad", argnums=1, seed=0)]))


def test_regression_hessian_of_grad_of_det():
    """hessian(grad(sin(det(x^T x + diag(1, 2, 3))))): NaN in functx and torch.func; the
    reference (reverse mode three times) is finite, as plain torch's forward AD over two
    create_graph backwards is. torch's det backward under create_graph uses its SVD formula
    for every matrix when the tensors are subclasses (functx's and torch.func's wrappers;
    plain tensors' second-derivative graph holds no SVD): differentiated again, it takes the
    SVD of det's orthogonal factor U, whose repeated singular values make svd_backward
    divide by zero gaps: NaN. Fixed for this stack (issue 26): hessian's inner
    jacrev, right inside the outermost grad level, records on the values (choose.py,
    `_jacrev_on_values`); test_regression_vjp_of_vmap_of_hessian_of_det still is NaN."""
    program = Program([(3,)], [Op("linalg", kind="det"), Op("sin")])
    check(Case(program, [T("hessian", argnums=0, seed=0), T("grad", argnums=0, seed=0)]))


def test_regression_vjp_of_vmap_of_hessian_of_det():
    """vjp over vmap over hessian of `sin(det(G)) + x1.sum()`: NaN (the cause of
    test_regression_hessian_of_grad_of_det, through wrapped levels). Fixed: inside
    transforms det's derivatives go through slogdet (ad/aten_reverse_rules.py)."""
    program = Program([(3,), (3,)], [Op("linalg", kind="det"), Op("sin"), Op("binary", kind="add", j=1)])
    check(Case(program, [T("vjp", seed=0), T("vmap", in_dims=(0, None), out_dims=0, size=1), T("hessian", argnums=0, seed=0)]))


def test_regression_callers_grad_of_jacrev_of_jacrev_of_det():
    """The caller's gradient through jacrev(jacrev(det(G))): the third order through the
    caller's autograd, NaN as in test_regression_vjp_of_vmap_of_hessian_of_det (found by the
    10,000-example run): det on plain values, its backward run by jacrev's rows on batched
    cotangents, where torch's formula takes its subclass (SVD) path. Fixed with it."""
    program = Program([(3,)], [Op("gram"), Op("linalg", kind="det"), Op("expand")])
    check(Case(program, [T("jacrev", argnums=0), T("jacrev", argnums=0)], caller=True))


def test_regression_vjp_of_jvp_of_grad_of_eigvalsh():
    """vjp(jvp(grad(eigvalsh(x^T x + diag(1, 2, 3))))) (distinct eigenvalues): functx and
    torch.func gave NaN; the reference is finite and agrees with central differences of its
    outer level. torch's eigh tangent divides by the eigenvalue gaps with the diagonal's
    zeros in them and masks the result: 0 / 0 in reverse. Fixed (issue 26): a wrapped jvp
    level's eigh tangent replaces the diagonal before dividing (jvp_rules._eigh_jvp)."""
    program = Program([(3,)], [Op("linalg", kind="eigvalsh")])
    check(Case(program, [T("vjp", seed=0), T("jvp", seed=0), T("grad", argnums=0, seed=0)]))


# Found by a 3,000-example run (FUNCTX_FUZZ_EXAMPLES=3000) after the loss ops were added:
# errors on valid programs that the default 300 examples do not reach. Known gaps.
def test_regression_vmap_of_grad_of_mixed_hessian_of_a_reduction():
    """vmap(size 1) over grad over hessian(mix=True) of `x0.sum().reshape(1)`: functx raised
    "torch.autograd.grad inside functx.vmap: an input is not batched at every vmap level its
    outputs are batched at". The inner gradient of a function linear in the differentiated
    input does not involve it: an output of the levels below (tracked by the direct grad
    level on vmap's physical values), which the wrapped level's backward now leaves out."""
    program = Program([(3,)], [Op("sum", dim=None), Op("reshape", shape=(1,))])
    check(Case(program, [T("vmap", in_dims=(0,), out_dims=0, size=1), T("grad", argnums=0, seed=0), T("hessian", argnums=0, seed=0, mix=True)]))


def test_regression_grad_of_jacfwd_of_a_numpy_function_of_an_expand():
    """grad over jacfwd(argnums=(0, 1)) of `NumpyFn.apply(x0.unsqueeze(0).expand(2, 3), x0) + x1`
    raised "more than one element of the written-to tensor refers to a single memory location":
    torch's make_dual copied the batched tangent into the expanded primal's layout. The
    Function's inputs are now made dual as the level's own inputs are (the expanded one copied,
    the tangent laid out like it through its vmap levels)."""
    program = Program([(3,), (3,)], [Op("expand"), Op("function", cls="numpy", j=0), Op("binary", kind="add", j=1)])
    check(Case(program, [T("grad", argnums=0, seed=0), T("jacfwd", argnums=(0, 1))]))


@pytest.mark.parametrize("cls", ["plain", "generated", "numpy"])
@pytest.mark.parametrize("stack", [["jacfwd"], ["jvp"], ["grad", "jacfwd"], ["jacfwd", "jacrev"]])
def test_regression_forward_transforms_of_a_function_of_an_expand(cls, stack):
    """A Function applied to an expanded value under forward mode: copying only the expanded
    input (without laying the tangent out through its levels, outside the level's lifting)
    gave jacfwd all zeros silently."""
    program = Program([(3,), (3,)], [Op("expand"), Op("function", cls=cls, j=0), Op("binary", kind="add", j=1)])
    check(Case(program, [T(kind, argnums=(0, 1), seed=k) if kind != "jvp" else T(kind, seed=k) for k, kind in enumerate(stack)]))


def test_regression_callers_grad_of_jacrev_of_jvp_of_jacrev():
    """The caller's torch.autograd.grad through jacrev(jvp(jacrev(tanh(sin x)))) with x
    requiring grad (found by test_fuzz_under_the_callers_autograd): DeadLevelError, a
    tensor of jacrev's vmap over rows saved in the graph the outer jacrev built with
    create_graph; torch.func computes it, and jacrev(jvp(grad)), jacrev(jacrev) and
    vmap(jvp(jacrev)) are right in functx. Traced: the jvp's forward formulas leave
    ZeroTensor tangents (requiring grad: the caller tracks them) in the graph; in the outer
    jacrev's backward a formula multiplies a row (a BatchedTensor of the rows vmap) by one,
    and torch's ZeroTensor fallback answers below vmap's dispatch (it asks only for the
    result's shape, `to("meta")`) with a *plain* zero tensor, so autograd records that mul
    at the wrapper level, saving the row; the plain zero reaches the physical graph, and the
    caller's backward unpacks the dead row. Fixed: core/lazy_bits.py's kernels at the
    ZeroTensor key answer through the level beside a level tensor."""
    program = Program([(3,)], [Op("sin"), Op("tanh")])
    check(Case(program, [T("jacrev", argnums=0), T("jvp", seed=0), T("jacrev", argnums=0)], caller=True))


def test_regression_callers_grad_of_vmap_of_jacrev_of_an_outer_product():
    """The caller's gradient through vmap(jacrev(mm(m.mT, m))) (x requiring grad): the
    result did not require grad, so a loss adding it to anything else silently lost its
    term (gradient [1, 1, 1] for torch.func's [12.4, 34.5, -12.3] in vmap(hessian) of a Gram
    product). jacrev's backward rows applied vmap's BatchedProduct Function to the batched
    cotangent, which recorded on vmap's wrappers: the graph did not leave the level. Found
    by test_fuzz_under_the_callers_autograd with the Gram op."""
    program = Program([(3,)], [Op("gram"), Op("sin")])
    check(Case(program, [T("vmap", in_dims=(0,), out_dims=0, size=2), T("jacrev", argnums=0)], caller=True))
    check(Case(program, [T("vmap", in_dims=(0,), out_dims=0, size=1), T("hessian", argnums=0, seed=0)], caller=True))


def test_regression_callers_grad_of_vmap_of_jvp_of_softmax():
    """vmap(jvp(softmax(sin x))) with x requiring grad: "modified by an inplace operation"
    in the caller's backward (torch's softmax tangent writes into the exp it saved; plain
    torch fails the same way, torch.func computes). A jvp under vmap over primals the
    caller's autograd tracks now takes the wrapped level, whose softmax tangent is out of
    place; jvp(logsumexp) the same (a wrapped level's explicit logsumexp tangent)."""
    check(Case(Program([(3,)], [Op("sin"), Op("softmax")]), [T("vmap", in_dims=(0,), out_dims=0, size=1), T("jvp", seed=0)], caller=True))
    check(Case(Program([(3,)], [Op("sin"), Op("logsumexp", dim=-1)]), [T("jvp", seed=0)], caller=True))


def test_regression_grad_of_jvp_of_an_expanded_loss():
    """grad over jvp of `sin(F.mse_loss(eigvalsh(G), T).unsqueeze(0).expand(2))` (a
    3,000-example run): "more than one element of the written-to tensor refers to a single
    memory location" (torch.func computes). The wrapped jvp level made a dual of the
    expanded 0-dim loss whose tangent torch judged laid out otherwise (another storage
    size), and torch copies such a tangent into the primal's overlapping layout. An
    expanded primal is copied before it becomes a dual (as `dual` does for inputs)."""
    program = Program([(3,)], [Op("linalg", kind="eigvalsh"), Op("loss", kind="mse_loss", red="mean", seed=0), Op("expand"), Op("sin")])
    check(Case(program, [T("grad", argnums=0, seed=0), T("jvp", seed=0)]))


def test_regression_jvp_of_grad_writing_the_differentiated_input_into_another_argument():
    """jvp over grad(argnums=1) of `x0.add_(x1); x0 * arange / 3` (a 3,000-example run):
    refused as a write into a captured tensor (torch.func computes; grad alone was right).
    Under a jvp on values every input is a dual, a view of its primal, and the check looks
    at a view's base: the grad level marked the argument as its own, not its base. Both are
    marked now (ADLevel.own)."""
    program = Program([(3,), (3,)], [Op("arg_write", i=0, kind="cross"), Op("arange")])
    check(Case(program, [T("jvp", seed=0), T("grad", argnums=1, seed=0)]))


def test_regression_chunked_jacfwd_of_inverse_of_inverse():
    """jacfwd(chunk_size=1) of inv(G(inv(G(x)))) (G = m^T m + diag): the view of linalg.inv's
    column-major result asserted in torch's forward AD ("the tangent have the same layout as
    primal"); chunk_size=None or 3 worked. A chunk of one column is a batch of size 1, whose
    batch stride `view` sets freely (3, not 9): vmap's _has_same_storage_numel judged the
    element storage from it and answered no. One element's storage is all of it now."""
    check(Case(Program([(3,)], [Op("linalg", kind="inv"), Op("linalg", kind="inv")]), [T("jacfwd", argnums=0, chunk_size=1)]))


def test_regression_jvp_of_jvp_of_a_huber_loss_of_a_no_grad_region():
    """jvp(jvp) of `F.huber_loss(x0 * no_grad(x0 ** 2), T)` (found by a 10,000-example run):
    huber_loss_backward has no forward formula, so functx computed the jvp by the double-VJP
    identity for the whole function, where torch.no_grad() stops what it does not stop in
    forward mode: a wrong value (4.67 for 14.0), then a clear refusal. Where the function
    crosses such a region, the jvp now runs at a wrapped level, which applies the identity to
    the op without a formula alone."""
    program = Program([(3,)], [Op("no_grad", body="pow"), Op("loss", kind="huber_loss", red="mean", seed=0)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for stack in ([T("jvp", seed=0), T("jvp", seed=0)], [T("jacfwd", argnums=0), T("jvp", seed=1)]):
            check(Case(program, stack))


def test_regression_linearize_through_a_no_grad_region():
    """linearize of `sin(x0 * no_grad(x0 ** 2))` (found by the fuzzer once linearize joined
    its stacks): linearize records the function in reverse mode, where torch.no_grad() stops
    the tangent that forward mode (jvp, torch.func.linearize) carries: `jvp_fn` gave the
    derivative of `x * c` with `c` constant. Where the function crosses such a region (or a
    forward-AD-off one), jvp_fn now runs the function under forward mode."""
    program = Program([(3,)], [Op("no_grad", body="pow"), Op("sin")])
    for stack in ([T("linearize", seed=0)], [T("vmap", in_dims=(0,), out_dims=0, size=2), T("linearize", seed=1)],
                  [T("linearize", seed=0), T("jvp", seed=1)]):
        check(Case(program, stack))
    x, v = torch.tensor([1.0, 2.0], dtype=torch.float64), torch.ones(2, dtype=torch.float64)

    def f(x):
        with torch.no_grad():
            c = x ** 2
        return x - c

    # the derivative of x - x**2 (forward mode does not follow grad mode), by differences
    differences = (f(x + 1e-6 * v) - f(x - 1e-6 * v)) / 2e-6
    torch.testing.assert_close(functx.linearize(f, x)[1](v), differences)
    torch.testing.assert_close(functx.linearize(f, x)[1](v), functx.jvp(f, (x,), (v,))[1])


def test_jvp_through_an_op_without_a_forward_formula_in_a_no_grad_region_matches_finite_differences():
    """The same fallback against central differences, with the no_grad region on the value
    the op without a formula reads (`F.huber_loss` differentiated twice in forward mode:
    huber_loss_backward has none): torch.no_grad() stops nothing in forward mode."""

    def f(x):
        with torch.no_grad():
            scale = x**2  # a value computed without grad: forward mode still differentiates it
        return F.huber_loss(x * scale, torch.zeros_like(x), delta=0.5)

    x, t = torch.tensor([0.3, -0.8, 1.1], dtype=D), torch.tensor([0.5, 1.0, -0.7], dtype=D)
    first = lambda y: functx.jvp(f, (y,), (t,))[1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        second = functx.jvp(first, (x,), (t,))[1]
    # plain torch differentiates x * x**2 = x**3 (no_grad does not exist for the differences)
    plain = lambda y: F.huber_loss(y**3, torch.zeros_like(y), delta=0.5)
    eps = 1e-4
    d1 = lambda y: (plain(y + eps * t) - plain(y - eps * t)) / (2 * eps)
    expected = (d1(x + eps * t) - d1(x - eps * t)) / (2 * eps)
    torch.testing.assert_close(second, expected, rtol=1e-5, atol=1e-6)


# Found by the second 10,000-example run (after the fixes of the first):
def test_regression_jvp_of_chunked_vmap_of_jvp_of_a_write_into_a_buffer():
    """jvp over vmap(in_dims=-1, chunk_size=1) over jvp of `buf = zeros(7); buf[1:] =
    x0.reshape(-1)`: torch's forward-AD view-layout assert. The chunk of a batch along the
    last dim is not dense, and vmap's zeros for its tangent (`_new_zeros_with_same_feature_meta`,
    zeros_like) came out contiguous; they take the physical layout now."""
    program = Program([(2, 3)], [Op("buf_slice"), Op("no_grad", body="pow")])
    check(Case(program, [T("jvp", seed=0), T("vmap", in_dims=(-1,), out_dims=0, size=2, chunk_size=1), T("jvp", seed=0)]))


def test_regression_jvp_of_vjp_of_a_function_and_a_huber_loss():
    """jvp over vjp of `huber_loss(PlainFn.apply(x0, x0), T)`: the double-VJP fallback's watch
    for no_grad regions counted the grad mode torch turns off inside the Function's forward
    and refused a valid program; calls inside a Function are not counted now."""
    program = Program([(2, 3)], [Op("function", cls="plain", j=0), Op("loss", kind="huber_loss", red="mean", seed=0)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check(Case(program, [T("jvp", seed=0), T("vjp", seed=0)]))


def test_regression_grad_of_jvp_of_jvp_of_solve():
    """grad over jvp over jvp of solve(G(sin(x)), 1): wrong (torch's formula differentiated in
    reverse, and an explicit tangent for A alone left the outer level's tangent of B to it).
    The wrapped jvp level's solve tangent takes both A's and B's tangents."""
    program = Program([(2, 3)], [Op("sin"), Op("linalg", kind="solve")])
    check(Case(program, [T("grad", argnums=0, seed=0), T("jvp", seed=0), T("jvp", seed=0)]))


def test_regression_vjp_fn_of_vmap_of_expanded_inputs_of_jvp():
    """vjp_fn over vmap (expanded inputs) over jvp of sin(sin(x)): "more than one element of
    the written-to tensor refers to a single memory location" when vmap's zeros for a tangent
    took an expanded value's layout; an expanded value gets zeros of its own."""
    check(Case(Program([(3,)], [Op("sin"), Op("sin")]), [T("vjp_fn", argnum=0, outside=False, seed=0), T("vmap", in_dims=(0,), out_dims=0, size=2, expand=True), T("jvp", seed=0)]))


# Found when the fuzzer's programs got complex intermediates (the "spectral" ops): a silent
# wrong value, torch.func right. A backward formula such as mul's `grad * self.conj()` makes
# a lazy conjugate view of a plain tensor that requires grad; beside a level tensor (here
# the BatchedTensor rows of jacrev, recorded with create_graph on vmap's physical values)
# torch's Conjugate fallback materialized it below autograd, without a graph, before vmap's
# rule saw it: that path of the second derivative was lost (half the Hessian of |z|^2).
# functx/core/lazy_bits.py resolves such views with their graph.
def test_regression_jacrev_of_jacrev_through_a_conjugate_view():
    """jacrev(jacrev) of `(fft(x) * fft(x).conj()).real`: against plain torch's Hessian."""
    check(Case(Program([(3,)], [Op("spectral", kind="power")]), [T("jacrev", argnums=0), T("jacrev", argnums=0)]))


def test_regression_callers_grad_of_jacrev_through_a_conjugate_view():
    """The caller's torch.autograd.grad through jacrev of the same power spectrum."""
    check(Case(Program([(3,)], [Op("spectral", kind="power")]), [T("jacrev", argnums=0)], caller=True))


@pytest.mark.parametrize("inner", ["jacfwd", "hessian"])
@pytest.mark.parametrize("kind", ["power", "conj_real"])
def test_regression_jvp_of_jacfwd_of_a_power_spectrum(inner, kind):
    """jvp(jacfwd) and jvp(hessian) of `(fft(x) * fft(x).conj()).real` (and of
    `fft(x).conj().real`) were wrong (half a term; right with `conj_physical()`; torch.func
    right): core/lazy_bits.py resolved the conj view at the wrappers, where forward AD is
    off, and the outer jvp on values lost its tangent. It now lets the view through to the
    level's rule, which meets it on the values with their forward AD on."""
    check(Case(Program([(3,)], [Op("sin"), Op("spectral", kind=kind)]), [T("jvp", seed=0), T(inner, argnums=0)]))


def test_regression_callers_grad_of_hessian_of_hessian_of_a_complex_intermediate():
    """The caller's grad through hessian(hessian) of a program with an FFT: "slice_scatter
    does not support automatic differentiation for outputs with complex dtype" (the class
    torch's OpInfo tests found, issue 27; plain torch computes the four derivatives). vmap's
    rules for slice_backward/select_backward scattered into zeros with slice_scatter /
    select_scatter, whose derivatives refuse complex values; they now call the backward ops."""
    program = Program([(3,)], [Op("sin"), Op("spectral", kind="irfft_conj"), Op("sin")])
    check(Case(program, [T("hessian", argnums=0), T("hessian", argnums=0)], caller=True))


# Found by the 3,000-example run of the complex-intermediate family: three derivatives of
# `x.conj().real` (vjp/grad over hessian) raised "view_as_real doesn't work on unresolved
# conjugated tensors": a dead grad level's wrapper of a lazily conjugated value, used by the
# outer backward, went to view_as_real unresolved (core/level_tensor._dispatch_with_dead_levels).
@pytest.mark.parametrize(
    "stack",
    [
        [T("grad", argnums=0, seed=0), T("hessian", argnums=0, seed=0), T("grad", argnums=0, seed=0)],
        [T("vjp", seed=0), T("hessian", argnums=0, seed=0), T("grad", argnums=0, seed=0)],
    ],
)
def test_regression_third_derivative_through_conj_real(stack):
    check(Case(Program([(3,)], [Op("sin"), Op("spectral", kind="conj_real"), Op("sin")]), stack))


@pytest.mark.parametrize("kind", ["conj_real", "conj_imag"])
def test_regression_jvp_of_hessian_through_conj_real(kind):
    """jvp(hessian) of `sin(fft(sin x).conj().real)` (found by the exhaustive depth-2 stacks
    over the spectral ops): the grad level's `view_as_real` of a conj value resolved it
    outside the forward-AD state of the values, and the outer jvp lost that tangent; it is
    now resolved with the op, in that state (ad/wrapped_reverse.py, core/level_tensor.py)."""
    check(Case(Program([(3,)], [Op("sin"), Op("spectral", kind=kind), Op("sin")]), [T("jvp", seed=0), T("hessian", argnums=0)]))


# Found by the 10,000-example run of this session's fuzzer (issue 26).
def test_regression_jvp_of_jvp_of_jacfwd_of_a_huber_loss_with_a_no_grad_region():
    """jvp(jvp(jacfwd)) of a Huber loss of `x0 * no_grad(x0 ** 2)`: "Trying to use forward
    AD with huber_loss_backward" raised by the middle jvp, whose fallbacks (double VJP,
    then a wrapped level) met the outermost jvp's op: the outer jvp on values runs torch's
    forward AD over the inner levels' formulas. Under another forward transform the error
    now goes on to that level's fallback; the outermost refuses, if it must."""
    program = Program([(4,), (3,)], [Op("no_grad", body="pow"), Op("loss", kind="huber_loss", red="mean", seed=0), Op("binary", kind="add", j=1)])
    check(Case(program, [T("jvp", seed=0), T("jvp", seed=0), T("jacfwd", argnums=1)]))
    check(Case(program, [T("jvp", seed=0), T("jvp", seed=0), T("jacfwd", argnums=0)]))


@pytest.mark.parametrize("stack", [[T("vjp", seed=0)], [T("vjp_fn", argnum=0, outside=False, seed=0)], [T("jvp", seed=0)], [T("vmap", in_dims=(0,), out_dims=0, size=2)]])
def test_regression_numpy_function_of_a_lazily_negated_value(stack):
    """A NumPy-forward Function given `fft(x).conj().imag`, a lazy negative view: its
    `.numpy()` refuses the view unless resolved (in plain torch as under any transform;
    the fuzzer's NumpyFn resolves it, as NumPy code must): then right at every level."""
    shape = [(2, 3)] if stack[0].kind == "vmap" else [(3,)]
    program = Program(shape, [Op("spectral", kind="conj_imag"), Op("function", cls="numpy", j=0)])
    check(Case(program, stack))


def test_ill_conditioned_programs_are_judged_within_the_references_rounding_noise():
    """The harness's tolerance for ill-conditioned programs (found by the 10,000-example
    run: hessian of inv of a Gram matrix of x**12, where functx, the reference and
    torch.func differ by 4e-5 on values of 1, and central differences by 1e-4): the
    reference's own movement under a 1e-12 relative move of its inputs, ~6e-5 there. A
    well-conditioned program's stays ~1e-12, so a wrong value cannot hide in it."""
    ill = Case(Program([(3,)], [Op("pow", p=2), Op("pow", p=2), Op("pow", p=3), Op("linalg", kind="inv")]), [T("hessian", argnums=0, seed=0)])
    well = Case(Program([(3,)], [Op("sin"), Op("linalg", kind="inv")]), [T("hessian", argnums=0, seed=0)])
    assert _rounding_noise(ill, ill.run(Ref).detach()) > 1e-5
    assert _rounding_noise(well, well.run(Ref).detach()) < 1e-10
    check(ill)
    check(well)



if SEED is not None:  # FUNCTX_FUZZ_SEED: the fuzz tests draw from that seed (module docstring)
    for _name, _test in list(globals().items()):
        if _name.startswith("test_fuzz"):
            globals()[_name] = seed(int(SEED))(_test)


@pytest.mark.parametrize("stack", [["jvp", "jvp"], ["jacfwd", "jacfwd"], ["grad", "jvp", "jvp"]])
def test_regression_forward_over_forward_of_a_function_applying_a_function(stack):
    """jvp(jvp(F)) where F's jvp applies another Function (`nested`: found by the op-database
    sweep of functx.jet, on torch's SelectAutogradFunction): the second derivative was zero
    (off by 0.99 here), also under jacfwd(jacfwd) and grad(jvp(jvp)). The inner Function,
    applied inside F's jvp where torch has forward AD off, had its outputs taken apart with
    forward AD still off, and `_unpack_dual` gave no tangent. The fuzzer had no Function whose
    derivatives apply a Function (now the `nested` family)."""
    transforms = [T(name, argnums=0, seed=i) if name != "jvp" else T(name, seed=i) for i, name in enumerate(stack)]
    check(Case(FUNCTION_SIN("nested"), transforms))


@pytest.mark.parametrize("stack", [["jvp", "jacrev"], ["jvp", "jvp", "jacrev"]])
def test_regression_forward_over_reverse_of_a_function_whose_derivatives_apply_a_function(stack):
    """jvp(jacrev(F)) of a `nested` Function (its jvp and backward apply _Product, a Function
    with a generated vmap rule; found by test_fuzz_autograd_functions): RecursionError. The
    jvp level on values applied _Product's generated vmap rule with torch's own apply, whose
    jvp (forward AD off for that level) applied _Product at a fresh vmap level; that level's
    `applying_function` counted, and so did the state an `at_wrappers` of a wrapped jvp
    around kept (jvp(jvp(jacrev))), so the jvp level on values switched forward AD on again
    and called the same jvp for the same level, without end (core/forward_ad_state.py)."""
    transforms = [T("jvp", seed=i) if name == "jvp" else T(name, argnums=0) for i, name in enumerate(stack)]
    check(Case(FUNCTION_SIN("nested"), transforms, seed=0))
