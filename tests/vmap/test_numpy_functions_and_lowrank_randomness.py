"""Three values functx gave silently wrong (issue 26, items 1, 9, 10), each against an
independent reference: float64 per-sample loops of plain torch, torch.autograd on the plain
function, or the random draws torch makes for the whole batch at once with the same seed.

1. An autograd.Function whose forward leaves torch (NumPy, `torch.tensor(list)`) with a
   `vmap` staticmethod, under `vmap(grad(f), in_dims=(0, None))`: the direct grad level had
   batched the unbatched input, so the vmap level's mode lifted the tensor the forward made
   (`torch.as_tensor(ndarray)`) into a batched copy, and the forward handed a BatchedTensor
   to torch's autograd: per-sample gradients were zeros or garbage. The user's vmap
   staticmethod and everything it applies one level down now run with the modes of that
   vmap level and those above it lowered (vmap/randomness.py `lowered`), as torch.func's
   `interpreter.lower()`.
9. A `generate_vmap_rule` Function under nested vmaps with broadcasting inputs: each level's
   generated Function took its in_dims from one thread-local, which held the innermost
   application's when the outer forward ran, so the inner forward used the outer in_dims
   (`(2, 2, 2, 3, 4)` for `(2, 2, 3, 4)`); their states on the shared ctx overwrote each other
   too (saved-tensor dims, spec). The spec is now the generated Function's first argument and
   each level keeps its state on the ctx under its own key.
10. Random calls inside torch functions written in Python (`torch.svd_lowrank`,
   `torch.pca_lowrank`, `F.gumbel_softmax`, `torch.nn.init.*`, any library function with a
   `has_torch_function` guard) ran with vmap's mode off: "different" gave every element the
   same draw and "error" did not raise. The mode now runs such a function's body with itself
   on. `torch.binomial`, `torch._standard_gamma`, `torch._sample_dirichlet` (what
   torch.distributions samples with), `torch.native_dropout` and `torch.rrelu_` were not
   known as random at all.
"""

from __future__ import annotations

import itertools
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import functx
from functx.core import current_stack

D = torch.float64
RANDOM_ERROR = (
    "vmap: called random operation while in randomness error mode. Please either use the "
    "'same' or 'different' randomness flags on vmap or perform the randomness operation out of vmap"
)


def loop_vmap(f, in_dims, out_dims=0):
    """Plain-torch reference of `vmap(f, in_dims, out_dims)`: one call per element, stacked."""

    def looped(*args):
        n = next(a.shape[d] for a, d in zip(args, in_dims) if d is not None)
        outs = [f(*(a if d is None else a.select(d, i) for a, d in zip(args, in_dims))) for i in range(n)]
        return torch.stack(outs, out_dims)

    return looped


# -- item 1: Functions whose forward leaves torch, under vmap(grad) ----------------------------
def _vmap_rule(function):
    """The vmap staticmethod of PyTorch's "Extending torch.func" page: batch dims first,
    unbatched inputs given a size-1 batch, the Function applied again."""

    def vmap(info, in_dims, x, y):
        xd, yd = in_dims
        x = x.movedim(xd, 0) if xd is not None else x.unsqueeze(0)
        y = y.movedim(yd, 0) if yd is not None else y.unsqueeze(0)
        out = function.apply(*torch.broadcast_tensors(x, y))
        return out.expand(info.batch_size, *out.shape[1:]), 0

    return staticmethod(vmap)


class NumpyMulAdd(torch.autograd.Function):
    """x * y + 1 computed in NumPy."""

    @staticmethod
    def forward(x, y):
        return torch.as_tensor(x.detach().numpy() * y.detach().numpy() + 1.0)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        return g * y, g * x


NumpyMulAdd.vmap = _vmap_rule(NumpyMulAdd)


class ListMulAdd(torch.autograd.Function):
    """x * y + 1 computed on Python floats, the result made by `torch.tensor(list)`."""

    @staticmethod
    def forward(x, y):
        flat = [a * b + 1.0 for a, b in zip(x.reshape(-1).tolist(), y.reshape(-1).tolist())]
        return torch.tensor(flat, dtype=x.dtype).reshape(x.shape)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        return g * y, g * x


ListMulAdd.vmap = _vmap_rule(ListMulAdd)


class NumpyBothWays(NumpyMulAdd):
    """NumpyMulAdd with a NumPy backward too (fine under vmap(grad), where the backward runs
    on the physical tensors; not under jacrev, whose backward is batched, nor in torch.func)."""

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        return torch.as_tensor(g.numpy() * y.detach().numpy()), torch.as_tensor(g.numpy() * x.detach().numpy())


NumpyBothWays.vmap = _vmap_rule(NumpyBothWays)


class GeneratedMulAdd(torch.autograd.Function):
    """x * y * 2 + 1 with its constants made by factories in forward, batched by
    generate_vmap_rule."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, y):
        return x * y * torch.tensor(2.0, dtype=x.dtype) + torch.ones(x.shape, dtype=x.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        return 2 * g * y, 2 * g * x


PLAIN = {
    NumpyMulAdd: lambda x, y: x * y + 1,
    ListMulAdd: lambda x, y: x * y + 1,
    NumpyBothWays: lambda x, y: x * y + 1,
    GeneratedMulAdd: lambda x, y: 2 * x * y + 1,
}
IN_DIMS = [(0, None), (None, 0), (0, 0)]


def _inputs(in_dims):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(*((5, 3) if d is not None else (3,)), dtype=D, generator=g) for d in in_dims]


def _per_sample_grads(plain, args, in_dims, argnums):
    """torch.autograd.grad of the plain function, one element at a time."""

    def one(*sample):
        sample = [s.detach().requires_grad_() for s in sample]
        grads = torch.autograd.grad(plain(*sample).sum(), [sample[i] for i in argnums])
        return torch.stack(grads)

    return loop_vmap(one, in_dims)(*args)


@pytest.mark.parametrize("function", [NumpyMulAdd, ListMulAdd, NumpyBothWays, GeneratedMulAdd], ids=lambda f: f.__name__)
@pytest.mark.parametrize("in_dims", IN_DIMS, ids=str)
@pytest.mark.parametrize("argnums", [(0, 1), 0, 1], ids=str)
def test_vmap_of_grad_through_function_leaving_torch(function, in_dims, argnums):
    """Was: zeros / garbage per-sample gradients whenever an input was unbatched (the direct
    grad level batched it and the forward's own tensor came back lifted, batched)."""
    args = _inputs(in_dims)
    got = functx.vmap(functx.grad(lambda a, b: function.apply(a, b).sum(), argnums=argnums), in_dims=in_dims)(*args)
    expected = _per_sample_grads(PLAIN[function], args, in_dims, argnums if isinstance(argnums, tuple) else (argnums,))
    got = torch.stack(got, 1) if isinstance(argnums, tuple) else got.unsqueeze(1)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("function", [NumpyMulAdd, ListMulAdd, GeneratedMulAdd], ids=lambda f: f.__name__)
@pytest.mark.parametrize("in_dims", IN_DIMS, ids=str)
def test_vmap_of_jacrev_through_function_leaving_torch(function, in_dims):
    """Per-sample Jacobians, against torch.autograd.functional.jacobian of the plain function."""
    args = _inputs(in_dims)
    got = functx.vmap(functx.jacrev(function.apply, argnums=(0, 1)), in_dims=in_dims)(*args)
    plain = PLAIN[function]
    expected = loop_vmap(lambda a, b: torch.stack(torch.autograd.functional.jacobian(plain, (a, b))), in_dims)(*args)
    torch.testing.assert_close(torch.stack(got, 1), expected, rtol=0, atol=1e-12)


def test_repro_issue_26_item_1():
    """The issue's program: gx must equal y per row, gy must equal xs."""
    xs, y = torch.randn(5, 3, dtype=D), torch.randn(3, dtype=D)
    f = lambda a, b: NumpyMulAdd.apply(a, b).sum()
    gx, gy = functx.vmap(functx.grad(f, argnums=(0, 1)), in_dims=(0, None))(xs, y)
    torch.testing.assert_close(gx, y.expand(5, 3), rtol=0, atol=0)
    torch.testing.assert_close(gy, xs, rtol=0, atol=0)


class NoisyForward(torch.autograd.Function):
    """Adds noise in its forward, which torch runs on the physical tensor."""

    @staticmethod
    def forward(x):
        return x + torch.randn(x.shape, dtype=x.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g

    @staticmethod
    def vmap(info, in_dims, x):
        return NoisyForward.apply(x), in_dims[0]


@pytest.mark.parametrize("randomness", ["error", "same", "different"])
def test_vmap_staticmethod_runs_below_the_vmap_level(randomness):
    """The vmap staticmethod (and the Function it applies) runs on the physical values, below
    the vmap level, whose randomness policy is not its business (it reads info.randomness):
    the draw is one plain draw of the physical shape, as torch.func gives. Was: 'error'
    raised, 'different' handed a BatchedTensor to torch's apply."""
    x = torch.zeros(4, 3, dtype=D)
    torch.manual_seed(5)
    got = functx.vmap(NoisyForward.apply, randomness=randomness)(x)
    torch.manual_seed(5)
    torch.testing.assert_close(got, torch.randn(4, 3, dtype=D), rtol=0, atol=0)


def test_lowering_is_undone_after_an_error():
    """A vmap staticmethod that raises leaves no level lowered and an empty stack."""
    from functx.vmap import randomness

    class Raises(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g):
            return g

        @staticmethod
        def vmap(info, in_dims, x):
            raise ValueError("from the vmap rule")

    with pytest.raises(ValueError, match="from the vmap rule"):
        functx.vmap(Raises.apply)(torch.zeros(2, 3))
    assert randomness._lowered.interps == {}
    assert current_stack() == ()
    with pytest.raises(RuntimeError, match="randomness error mode"):  # the next vmap's mode is on
        functx.vmap(lambda a: a + torch.randn(3))(torch.zeros(2, 3))


class OldStyleNoise(torch.autograd.Function):
    """Old style (forward(ctx, ...)): vmap runs it once per element, one level down."""

    @staticmethod
    def forward(ctx, x):
        return x + torch.randn(x.shape, dtype=x.dtype)

    @staticmethod
    def backward(ctx, g):
        return g


@pytest.mark.filterwarnings("ignore::functx.PerformanceWarning")
def test_old_style_function_run_per_sample_keeps_the_policy():
    """An old-style Function's forward is the vmapped function's code for one element, run
    below the level (so its own tensors are plain, as for the new style): its draws are
    per element ('different': the consecutive draws of a loop), 'error' raises, and 'same',
    which per-element calls cannot give, is refused naming the Function."""
    x = torch.zeros(4, 3, dtype=D)
    torch.manual_seed(6)
    got = functx.vmap(OldStyleNoise.apply, randomness="different")(x)
    torch.manual_seed(6)
    torch.testing.assert_close(got, torch.stack([torch.randn(3, dtype=D) for _ in range(4)]), rtol=0, atol=0)
    with pytest.raises(RuntimeError) as info:
        functx.vmap(OldStyleNoise.apply, randomness="error")(x)
    assert str(info.value) == RANDOM_ERROR
    with pytest.raises(RuntimeError, match="randomness='same' cannot hold inside the old-style autograd.Function OldStyleNoise"):
        functx.vmap(OldStyleNoise.apply, randomness="same")(x)
    # torch.distributions.Dirichlet samples through such a Function
    with pytest.raises(RuntimeError) as info:
        functx.vmap(lambda a: torch.distributions.Dirichlet(a + 1, validate_args=False).sample(), randomness="error")(x)
    assert str(info.value) == RANDOM_ERROR
    assert current_stack() == ()


# -- item 9: generate_vmap_rule under nested vmaps -------------------------------------------
class GeneratedMul(torch.autograd.Function):
    """x * y (broadcasting) with a backward that sums to each input's shape and reads
    needs_input_grad, and a jvp; batched by generate_vmap_rule."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, y):
        return x * y

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)
        ctx.save_for_forward(*inputs)

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        assert len(ctx.needs_input_grad) == 2, ctx.needs_input_grad
        dx = (g * y).sum_to_size(x.shape) if ctx.needs_input_grad[0] else None
        dy = (g * x).sum_to_size(y.shape) if ctx.needs_input_grad[1] else None
        return dx, dy

    @staticmethod
    def jvp(ctx, tx, ty):
        x, y = ctx.saved_tensors
        return tx * y + x * ty


def _mul(a, b):
    return a * b


def test_repro_issue_26_item_9():
    """Was (2, 2, 2, 3, 4): the inner forward ran with the outer in_dims (0, None)."""
    x, y = torch.randn(2, 2, 4, dtype=D), torch.randn(2, 3, 4, dtype=D)
    got = functx.vmap(functx.vmap(GeneratedMul.apply, in_dims=(0, 0)), in_dims=(0, None))(x, y)
    expected = torch.stack([torch.stack([x[i][j] * y[j] for j in range(2)]) for i in range(2)])
    assert got.shape == (2, 2, 3, 4)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def _insert(shape, dim, size):
    shape = list(shape)
    if dim is not None:
        shape.insert(dim, size)
    return shape


def _fits(outer, inner):
    """Whether every in_dim is a dim of the tensor it applies to (per-sample x (4,), y (5, 4))."""
    return all(
        o is None or o <= len(_insert(shape, i, 3))
        for o, i, shape in zip(outer, inner, ([4], [5, 4]))
    )


NESTED = [
    (outer, inner, out_outer, out_inner)
    for outer, inner, out_outer, out_inner in itertools.product(
        [(0, 0), (0, None), (None, 0), (1, None), (None, 2), (2, 1)],
        [(0, 0), (0, None), (None, 0), (1, 0), (None, 1)],
        [0, 1],
        [0, 1],
    )
    if _fits(outer, inner) and (out_outer, out_inner) != (1, 1)
]


@pytest.mark.parametrize("outer,inner,out_outer,out_inner", NESTED, ids=str)
def test_nested_vmap_of_generated_rule(outer, inner, out_outer, out_inner):
    """Values, gradients (torch.autograd through the vmaps, and functx.grad) and jvp of
    vmap(vmap(F.apply)) with broadcasting per-sample shapes x (4,), y (5, 4), against the
    loop of plain `x * y` (its autograd, and the product rule for the tangent)."""
    g = torch.Generator().manual_seed(2)
    xshape = _insert(_insert([4], inner[0], 3), outer[0], 2)
    yshape = _insert(_insert([5, 4], inner[1], 3), outer[1], 2)
    x = torch.randn(*xshape, dtype=D, generator=g, requires_grad=True)
    y = torch.randn(*yshape, dtype=D, generator=g, requires_grad=True)

    def batched(a, b):
        return functx.vmap(functx.vmap(GeneratedMul.apply, in_dims=inner, out_dims=out_inner), in_dims=outer, out_dims=out_outer)(a, b)

    reference = loop_vmap(loop_vmap(_mul, inner, out_inner), outer, out_outer)
    got, expected = batched(x, y), reference(x, y)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=0)

    w = torch.randn(expected.shape, dtype=D, generator=g)
    expected_grads = torch.autograd.grad((expected * w).sum(), (x, y))
    torch.testing.assert_close(torch.autograd.grad((got * w).sum(), (x, y)), expected_grads, rtol=0, atol=1e-12)
    x0, y0 = x.detach(), y.detach()
    fx_grads = functx.grad(lambda a, b: (batched(a, b) * w).sum(), argnums=(0, 1))(x0, y0)
    torch.testing.assert_close(fx_grads, expected_grads, rtol=0, atol=1e-12)

    tx, ty = torch.randn(x.shape, dtype=D, generator=g), torch.randn(y.shape, dtype=D, generator=g)
    _, tangent = functx.jvp(batched, (x0, y0), (tx, ty))
    torch.testing.assert_close(tangent, reference(tx, y0) + reference(x0, ty), rtol=0, atol=1e-12)


def test_triple_nested_generated_rule_with_one_input_differentiated():
    """Three levels, y unbatched at two of them and not differentiated (needs_input_grad
    per input at every level)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 4, 5, dtype=D, generator=g, requires_grad=True)
    y = torch.randn(5, 6, 4, dtype=D, generator=g)
    dims = [(0, None), (0, None), (1, 0)]  # per sample: x (4,), y (6, 4)
    f = GeneratedMul.apply
    ref = _mul
    for d in reversed(dims):
        f, ref = functx.vmap(f, in_dims=d), loop_vmap(ref, d)
    got, expected = f(x, y), ref(x, y)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    w = torch.randn(expected.shape, dtype=D, generator=g)
    torch.testing.assert_close(
        torch.autograd.grad((got * w).sum(), x), torch.autograd.grad((expected * w).sum(), x), rtol=0, atol=1e-12
    )


# -- item 10: random calls inside torch functions written in Python ---------------------------
def _per_sample_lowrank(fn, x, draws):
    """`fn` of each element, its `torch.randn` answered with draws[b] (the plain reference)."""
    outs = []
    for b in range(x.shape[0]):
        with mock.patch.object(torch, "randn", lambda *a, **k: draws[b]):
            outs.append(fn(x[b]))
    return torch.stack(outs)


LOWRANK = {
    "svd_lowrank": lambda a: torch.svd_lowrank(a, q=2, niter=1)[0],
    "pca_lowrank": lambda a: torch.pca_lowrank(a, q=2, center=True, niter=1)[0],
}


@pytest.mark.parametrize("name", list(LOWRANK))
def test_lowrank_error_mode_raises(name):
    """Was: no error."""
    with pytest.raises(RuntimeError) as info:
        functx.vmap(LOWRANK[name], randomness="error")(torch.randn(4, 6, 5, dtype=D))
    assert str(info.value) == RANDOM_ERROR
    assert current_stack() == ()


@pytest.mark.parametrize("name", list(LOWRANK))
def test_lowrank_different_draws_per_element(name):
    """Was: one draw shared by every element. Element b uses the b-th slice of one draw of
    (batch, n, q) (torch.func's layout), checked against the per-element computation given
    that slice."""
    x = torch.randn(4, 6, 5, dtype=D)
    torch.manual_seed(11)
    got = functx.vmap(LOWRANK[name], randomness="different")(x)
    torch.manual_seed(11)
    draws = torch.randn(4, 5, 2, dtype=D)
    assert not any(torch.equal(draws[0], draws[b]) for b in range(1, 4))
    torch.testing.assert_close(got, _per_sample_lowrank(LOWRANK[name], x, draws), rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", list(LOWRANK))
def test_lowrank_same_equals_per_sample_with_the_same_draw(name):
    """'same': every element's result is the per-sample computation from the same seed."""
    x = torch.randn(4, 6, 5, dtype=D)
    torch.manual_seed(12)
    got = functx.vmap(LOWRANK[name], randomness="same")(x)
    expected = []
    for b in range(4):
        torch.manual_seed(12)
        expected.append(LOWRANK[name](x[b]))
    torch.testing.assert_close(got, torch.stack(expected), rtol=0, atol=1e-10)


B = 4
_P = torch.full((3,), 0.3, dtype=D)
_W = torch.randn(3, dtype=D, generator=torch.Generator().manual_seed(4))
# (one element's draw, the whole batch's draw as torch.func makes it), given a generator or None
DRAWS = {
    "randn": (lambda g: torch.randn(3, 2, generator=g, dtype=D), lambda g: torch.randn(B, 3, 2, generator=g, dtype=D)),
    "randn(size=)": (lambda g: torch.randn(size=(3,), generator=g), lambda g: torch.randn(size=(B, 3), generator=g)),
    "rand": (lambda g: torch.rand(3, generator=g), lambda g: torch.rand(B, 3, generator=g)),
    "randint": (lambda g: torch.randint(0, 10, (3,), generator=g), lambda g: torch.randint(0, 10, (B, 3), generator=g)),
    "normal": (lambda g: torch.normal(0.0, 2.0, (3,), generator=g), lambda g: torch.normal(0.0, 2.0, (B, 3), generator=g)),
    "randn_like": (lambda g: torch.randn_like(_W), lambda g: torch.randn_like(_W.expand(B, 3))),
    "rand_like": (lambda g: torch.rand_like(_W), lambda g: torch.rand_like(_W.expand(B, 3))),
    "bernoulli": (lambda g: torch.bernoulli(_P, generator=g), lambda g: torch.bernoulli(_P.expand(B, 3), generator=g)),
    "normal(tensor)": (lambda g: torch.normal(_W, 1.0, generator=g), lambda g: torch.normal(_W.expand(B, 3), 1.0, generator=g)),
    "multinomial": (
        lambda g: torch.multinomial(_P, 2, generator=g),
        lambda g: torch.multinomial(_P.expand(B, 3), 2, generator=g),
    ),
    "randperm": (lambda g: torch.randperm(5, generator=g), lambda g: torch.stack([torch.randperm(5, generator=g) for _ in range(B)])),
}


def library_function(x, draw, generator):
    """A torch function written in Python, as library code writes them (svd_lowrank,
    F.gumbel_softmax): a BatchedTensor argument brings the call to vmap's mode as one call."""
    if torch.overrides.has_torch_function_unary(x):
        return torch.overrides.handle_torch_function(library_function, (x,), x, draw, generator)
    return draw(generator), x * 2


@pytest.mark.parametrize("use_generator", [False, True], ids=["global", "generator"])
@pytest.mark.parametrize("draw", list(DRAWS))
@pytest.mark.parametrize("randomness", ["error", "same", "different"])
def test_random_call_inside_python_library_function(draw, use_generator, randomness):
    """Every random call made by library code under vmap follows the policy: 'error' raises
    torch.func's error, 'same' is one draw for all, 'different' is the draw of the whole
    batch at once (the reference, same seed or generator state). Was: one plain draw in
    every mode."""
    one, whole = DRAWS[draw]
    generator = torch.Generator().manual_seed(7) if use_generator else None
    x = torch.zeros(B, 3, dtype=D)
    torch.manual_seed(3)
    call = functx.vmap(lambda a: library_function(a, one, generator), randomness=randomness)
    if randomness == "error":
        with pytest.raises(RuntimeError) as info:
            call(x)
        assert str(info.value) == RANDOM_ERROR
        return
    got, doubled = call(x)
    torch.testing.assert_close(doubled, x * 2)
    reference_generator = torch.Generator().manual_seed(7) if use_generator else None
    torch.manual_seed(3)
    if randomness == "same":
        expected = one(reference_generator).expand(B, *got.shape[1:])
    else:
        expected = whole(reference_generator)
        assert not all(torch.equal(got[0], got[b]) for b in range(1, B))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_different_draws_inside_library_code_are_independent_samples():
    """Distribution sanity of 'different' through a Python library function: the draws of
    2000 elements have mean 0 and variance 1, and two coordinates are uncorrelated across
    elements."""
    x = torch.zeros(2000, 3, dtype=D)
    got, _ = functx.vmap(lambda a: library_function(a, DRAWS["randn"][0], None), randomness="different")(x)
    flat = got.reshape(-1)
    assert abs(flat.mean().item()) < 0.03 and abs(flat.var().item() - 1) < 0.05
    # element-to-element correlation ~ 0 (no shared draw)
    corr = torch.corrcoef(got.reshape(2000, -1)[:, :2].T)[0, 1]
    assert abs(corr.item()) < 0.1


# torch.binomial of an unbatched count and batched probabilities: the batching rule hands
# torch shapes (3,) and (4, 3), and torch resizes its output (values right, a deprecation
# warning; rules/random.py)
@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")
def test_torch_library_functions_follow_the_policy():
    """F.gumbel_softmax, torch.nn.init and torch.distributions inside vmap, as torch.func:
    'error' raises, 'different' draws per element (in place into a fresh unbatched tensor
    it refuses, naming why), 'same' is one draw. Was: no error and one shared draw
    (Python library bodies; torch.binomial / _standard_gamma / _sample_dirichlet of
    unbatched parameters not known as random)."""
    w = torch.zeros(3, dtype=D)
    x = torch.zeros(B, 3, dtype=D)
    cases = {
        "gumbel_softmax": lambda a: F.gumbel_softmax(a, tau=1.0),
        "init.normal_": lambda a: torch.nn.init.normal_(a.clone()),
        # (validate_args=False: checking the parameters calls bool() on them)
        "Gamma": lambda a: torch.distributions.Gamma(a + 1, a + 1, validate_args=False).sample(),
        "Binomial": lambda a: torch.distributions.Binomial(10, probs=a + 0.5, validate_args=False).sample(),
        "Dirichlet": lambda a: torch.distributions.Dirichlet(a + 1, validate_args=False).sample(),
        "Gamma of unbatched": lambda a: torch.distributions.Gamma(w + 1, w + 1, validate_args=False).sample() + a,
    }
    for name, f in cases.items():
        with pytest.raises(RuntimeError) as info:
            functx.vmap(f, randomness="error")(x)
        assert str(info.value) == RANDOM_ERROR, name
        got = functx.vmap(f, randomness="different")(x)
        assert not all(torch.equal(got[0], got[b]) for b in range(1, B)), name
        if name in ("Gamma", "Binomial", "Dirichlet"):
            continue  # ('same' with per-element parameters is refused by the batching rules)
        got = functx.vmap(f, randomness="same")(x)
        assert all(torch.equal(got[0], got[b]) for b in range(1, B)), name
    with pytest.raises(RuntimeError, match="Cannot ask for different inplace randomness on an unbatched tensor"):
        functx.vmap(lambda a: torch.nn.init.uniform_(torch.empty(3, dtype=D)) + a, randomness="different")(x)
    assert current_stack() == ()


@pytest.mark.parametrize("train", [False, True])
def test_native_dropout_is_random_only_in_training(train):
    """torch.native_dropout of an unbatched tensor: random (the policy applies) only with
    train=True, as torch.func."""
    w = torch.randn(50, dtype=D)
    f = lambda a: torch.native_dropout(w, 0.5, train)[0] + a
    x = torch.zeros(B, 50, dtype=D)
    if not train:
        torch.testing.assert_close(functx.vmap(f, randomness="error")(x), w.expand(B, 50))
        return
    with pytest.raises(RuntimeError, match="randomness error mode"):
        functx.vmap(f, randomness="error")(x)
    got = functx.vmap(f, randomness="different")(x)
    assert not all(torch.equal(got[0], got[b]) for b in range(1, B))
