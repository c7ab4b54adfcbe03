"""Containers registered with torch's pytree (`torch.utils._pytree`) or optree, through every
transform (issue 13): torch.func flattens with torch's pytree, so user classes, dataclasses
(`register_dataclass`) and libraries register there; functx sees those registrations too,
beside optree's. Values are checked against torch.func (the oracle for types torch's pytree
knows) and against per-sample loops / torch.autograd (for every kind)."""

from __future__ import annotations

import collections
import dataclasses

import optree
import pytest
import torch
import torch.func
import torch.utils._pytree as torch_pytree

import functx
from functx.core import pytree


class TorchPair:
    """Registered with torch.utils._pytree.register_pytree_node only."""

    def __init__(self, a, b):
        self.a, self.b = a, b


torch_pytree.register_pytree_node(TorchPair, lambda p: ([p.a, p.b], "pair"), lambda v, c: TorchPair(*v))


@dataclasses.dataclass
class TorchPoint:
    """A dataclass registered with torch.utils._pytree.register_dataclass."""

    x: torch.Tensor
    y: torch.Tensor


torch_pytree.register_dataclass(TorchPoint)

NT = collections.namedtuple("NT", "a b")  # known to both libraries


class OptreePair:
    """Registered with optree in functx's namespace only (torch.func cannot see it)."""

    def __init__(self, a, b):
        self.a, self.b = a, b


optree.register_pytree_node(OptreePair, lambda p: ((p.a, p.b), None), lambda m, c: OptreePair(*c), namespace="functx")


class OptreeGlobalPair:
    """Registered in optree's global namespace (what functx always saw)."""

    def __init__(self, a, b):
        self.a, self.b = a, b


optree.register_pytree_node(
    OptreeGlobalPair,
    lambda p: ((p.a, p.b), None),
    lambda m, c: OptreeGlobalPair(*c),
    namespace=getattr(optree.registry, "__GLOBAL_NAMESPACE"),
)


class BothPair:
    """Registered with both libraries: optree's registration (global) is used."""

    def __init__(self, a, b):
        self.a, self.b = a, b


torch_pytree.register_pytree_node(BothPair, lambda p: ([p.b, p.a], None), lambda v, c: BothPair(v[1], v[0]))
optree.register_pytree_node(
    BothPair,
    lambda p: ((p.a, p.b), None),
    lambda m, c: BothPair(*c),
    namespace=getattr(optree.registry, "__GLOBAL_NAMESPACE"),
)

# kind -> (make(a, b), parts(p) -> (a, b))
KINDS = {
    "torch_node": (TorchPair, lambda p: (p.a, p.b)),
    "torch_dataclass": (TorchPoint, lambda p: (p.x, p.y)),
    "namedtuple": (NT, tuple),
    "optree_namespace": (OptreePair, lambda p: (p.a, p.b)),
    "optree_global": (OptreeGlobalPair, lambda p: (p.a, p.b)),
    "both": (BothPair, lambda p: (p.a, p.b)),
}
TORCH_KINDS = ["torch_node", "torch_dataclass", "namedtuple", "both"]  # torch.func's oracle sees them
ALL_KINDS = list(KINDS)


def assert_tree_close(ours, expected, *, torch_structure=False):
    """Same structure (node types included) and close leaves."""
    ours_leaves, ours_spec = pytree.tree_flatten(ours, none_is_leaf=True)
    exp_leaves, exp_spec = pytree.tree_flatten(expected, none_is_leaf=True)
    assert ours_spec == exp_spec, f"{ours_spec} != {exp_spec}"
    if torch_structure:  # the structure as torch.func's own pytree sees it
        assert torch_pytree.tree_structure(ours) == torch_pytree.tree_structure(expected)
    assert len(ours_leaves) == len(exp_leaves)
    for o, e in zip(ours_leaves, exp_leaves):
        if isinstance(e, torch.Tensor):
            assert type(o) is torch.Tensor, type(o)  # no level's wrapper escapes
            assert o.requires_grad == e.requires_grad  # results leave their levels detached
            torch.testing.assert_close(o, e)
        else:
            assert o == e


def rand(*shape):
    return torch.randn(*shape, dtype=torch.float64)


def stack_trees(trees, dim=0):
    """A per-sample loop's results stacked leaf by leaf (the vmap reference)."""
    leaves, spec = pytree.tree_flatten(trees[0])
    columns = zip(*(pytree.tree_leaves(t) for t in trees))
    return pytree.tree_unflatten(spec, [torch.stack(c, dim) for c in columns])


# ---------------------------------------------------------------------------------- vmap


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_vmap_container_inputs_and_outputs(kind):
    make, parts = KINDS[kind]
    x, y = rand(4, 3), rand(4, 3)

    def f(p):
        a, b = parts(p)
        return make(a * b, a.sum())

    ours = functx.vmap(f)(make(x, y))
    assert type(ours) is make
    assert_tree_close(ours, stack_trees([f(make(x[i], y[i])) for i in range(4)]))
    if kind in TORCH_KINDS:
        assert_tree_close(ours, torch.func.vmap(f)(make(x, y)), torch_structure=True)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_vmap_in_dims_given_as_the_container(kind):
    make, parts = KINDS[kind]
    x, w = rand(3, 5), rand(3)  # x batched on dim 1, w shared

    def f(p):
        a, b = parts(p)
        return a * b

    if kind == "torch_dataclass":  # a None field is no child of a dataclass: map w on dim 1 too
        w = rand(3, 5)
        in_dims, expected = (make(1, 1),), torch.stack([x[:, i] * w[:, i] for i in range(5)])
    else:
        in_dims, expected = (make(1, None),), torch.stack([x[:, i] * w for i in range(5)])
    ours = functx.vmap(f, in_dims=in_dims)(make(x, w))
    torch.testing.assert_close(ours, expected)
    if kind in TORCH_KINDS:
        torch.testing.assert_close(ours, torch.func.vmap(f, in_dims=in_dims)(make(x, w)))


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_vmap_int_prefix_covers_the_container(kind):
    make, parts = KINDS[kind]
    s, x, y = rand(3), rand(2, 3), rand(2, 3)

    def f(scale, p):
        a, b = parts(p)
        return make(scale * a, b.exp())

    in_dims = (0, 1)  # 1 stands for both leaves of the container
    ours = functx.vmap(f, in_dims=in_dims, out_dims=make(1, 0))(s, make(x, y))
    expected_a = torch.stack([s[i] * x[:, i] for i in range(3)], 1)
    expected_b = torch.stack([y[:, i].exp() for i in range(3)], 0)
    assert_tree_close(ours, make(expected_a, expected_b))
    if kind in TORCH_KINDS:
        theirs = torch.func.vmap(f, in_dims=in_dims, out_dims=make(1, 0))(s, make(x, y))
        assert_tree_close(ours, theirs, torch_structure=True)


@pytest.mark.parametrize("kind", ["torch_node", "namedtuple", "optree_namespace", "optree_global"])
def test_vmap_none_inside_a_container_is_a_leaf(kind):
    # torch.func: a None output leaf needs out_dim None; functx's vmap treats None as a leaf too
    make, parts = KINDS[kind]
    x = rand(4, 2)
    with pytest.raises(ValueError, match="must only return Tensors, got type <class 'NoneType'>"):
        functx.vmap(lambda t: make(t * 2, None))(x)
    ours = functx.vmap(lambda t: make(t * 2, None), out_dims=make(0, None))(x)
    assert_tree_close(ours, make(x * 2, None))
    if kind in TORCH_KINDS:
        theirs = torch.func.vmap(lambda t: make(t * 2, None), out_dims=make(0, None))(x)
        assert_tree_close(ours, theirs, torch_structure=True)
    ours = functx.vmap(lambda p: parts(p)[0] + 1, in_dims=(make(0, None),))(make(x, None))
    torch.testing.assert_close(ours, x + 1)


def test_vmap_chunked_container_outputs():
    x = rand(7, 3)
    f = lambda t: TorchPair(t.sin(), TorchPoint(t.sum(), t * 2))
    ours = functx.vmap(f, chunk_size=3, out_dims=TorchPair(0, TorchPoint(0, 1)))(x)
    theirs = torch.func.vmap(f, chunk_size=3, out_dims=TorchPair(0, TorchPoint(0, 1)))(x)
    assert_tree_close(ours, theirs, torch_structure=True)


def test_vmap_mismatched_structures_raise_as_torch_func():
    x, w = rand(3, 2), rand(2)
    f = lambda p: p.a * p.b
    for args, in_dims in [((TorchPair(x, w),), ((0, None),)), (((x, w),), (TorchPair(0, None),))]:
        with pytest.raises(ValueError, match="in_dims is not compatible with the structure of `inputs`"):
            torch.func.vmap(f, in_dims=in_dims)(*args)
        with pytest.raises(ValueError, match="in_dims is not compatible with the structure of `inputs`"):
            functx.vmap(f, in_dims=in_dims)(*args)
    # a dataclass's None field is no child (register_dataclass): the structures differ
    with pytest.raises(ValueError, match="in_dims is not compatible"):
        functx.vmap(lambda p: p.x + p.y, in_dims=(TorchPoint(0, None),))(TorchPoint(x, w))
    with pytest.raises(ValueError, match="in_dims is not compatible"):
        torch.func.vmap(lambda p: p.x + p.y, in_dims=(TorchPoint(0, None),))(TorchPoint(x, w))
    # in_dims itself must be an int or a tuple (torch.func refuses a bare container too)
    for vmap in (functx.vmap, torch.func.vmap):
        with pytest.raises(ValueError, match="expected `in_dims` to be int or a"):
            vmap(f, in_dims=TorchPair(0, None))(TorchPair(x, w))
        with pytest.raises(ValueError, match="out_dims is not compatible with the structure of `outputs`"):
            vmap(lambda t: (t, t), out_dims=TorchPair(0, 0))(x)


def test_type_registered_after_first_use_is_seen():
    x = rand(3, 2)
    functx.vmap(torch.sin)(x)  # functx has flattened (and synced) before the registration

    class Late:
        def __init__(self, v):
            self.v = v

    with pytest.raises(ValueError, match="must only return Tensors"):
        functx.vmap(lambda t: Late(t))(x)
    torch_pytree.register_pytree_node(Late, lambda p: ([p.v], None), lambda v, c: Late(v[0]))
    out = functx.vmap(lambda t: Late(t.cos()))(x)
    assert type(out) is Late
    torch.testing.assert_close(out.v, x.cos())
    g = functx.grad(lambda p: p.v.sin().sum())(Late(x))
    assert type(g) is Late
    torch.testing.assert_close(g.v, x.cos())


def _box_type(name):
    return type(name, (), {"__init__": lambda self, v: setattr(self, "v", v)})


def _register_box(cls):
    torch_pytree.register_pytree_node(
        cls, lambda p: ([p.v], None), lambda v, c: cls(v[0]), serialized_type_name=f"tests.{cls.__name__}"
    )


@pytest.mark.parametrize("changes", ["swap the last", "swap one before the last", "swap two"])
def test_registry_changes_that_keep_its_size_are_seen(changes):
    """Issue 27: register A, use it, deregister A, register B: the registry's length is the
    same, and keying the sync on it made functx reject B ("must only return Tensors").
    Each variant keeps the length and must still be seen."""
    x = rand(3, 2)
    before = [_box_type(f"Before{i}") for i in range(2)]
    for cls in before:
        _register_box(cls)
    try:
        out = functx.vmap(lambda t: before[-1](t.cos()))(x)  # synced with `before` registered
        assert type(out) is before[-1]
        gone = {"swap the last": before[-1:], "swap one before the last": before[:1], "swap two": before}[changes]
        for cls in gone:
            torch_pytree._deregister_pytree_node(cls)
        new = [_box_type(f"New{i}") for i in range(len(gone))]
        for cls in new:
            _register_box(cls)
        for cls in new:
            out = functx.vmap(lambda t: cls(t.sin()))(x)
            assert type(out) is cls
            torch.testing.assert_close(out.v, x.sin())
        for cls in gone:  # deregistered: a plain object again, as torch.func sees it
            with pytest.raises(ValueError, match="must only return Tensors"):
                functx.vmap(lambda t: cls(t))(x)
    finally:
        for cls in [*before, *locals().get("new", [])]:
            if cls in torch_pytree.SUPPORTED_NODES:
                torch_pytree._deregister_pytree_node(cls)


# ----------------------------------------------------------------------- reverse mode


def _loss(parts):
    def f(p):
        a, b = parts(p)
        return (a.sin() * b).sum()

    return f


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_grad_of_a_container(kind):
    make, parts = KINDS[kind]
    a, b = rand(3), rand(3)
    ours = functx.grad(_loss(parts))(make(a, b))
    ra, rb = a.clone().requires_grad_(), b.clone().requires_grad_()
    expected = make(*torch.autograd.grad(_loss(parts)(make(ra, rb)), (ra, rb)))
    assert_tree_close(ours, expected)
    if kind in TORCH_KINDS:
        assert_tree_close(ours, torch.func.grad(_loss(parts))(make(a, b)), torch_structure=True)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_grad_and_value_argnums_and_aux(kind):
    make, parts = KINDS[kind]
    s, a, b = rand(()), rand(3), rand(3)

    def f(scale, p, unused):
        u, v = parts(p)
        loss = scale * (u * v.exp()).sum()
        return loss, make(u * 2, TorchPoint(v, scale))  # aux: containers of either kind

    for transform in (functx.grad_and_value, torch.func.grad_and_value):
        if transform is torch.func.grad_and_value and kind not in TORCH_KINDS:
            continue
        (gs, gp), (value, aux) = transform(f, argnums=(0, 1), has_aux=True)(s, make(a, b), "not differentiated")
        rs, ra, rb = (t.clone().requires_grad_() for t in (s, a, b))
        expected = torch.autograd.grad(f(rs, make(ra, rb), None)[0], (rs, ra, rb))
        torch.testing.assert_close(gs, expected[0])
        assert_tree_close(gp, make(expected[1], expected[2]))
        torch.testing.assert_close(value, f(s, make(a, b), None)[0])
        assert_tree_close(aux, make(a * 2, TorchPoint(b, s)))
    g_int = functx.grad(lambda p: f(s, p, None), has_aux=True)(make(a, b))
    assert type(g_int[0]) is make and type(g_int[1]) is make


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_vjp_cotangents_shaped_like_the_outputs(kind):
    make, parts = KINDS[kind]
    a, b, u, w = rand(3), rand(3), rand(3), rand(())

    def f(p):
        x, y = parts(p)
        return make(x.sin() * y, (x * y).sum())

    out, vjp_fn = functx.vjp(f, make(a, b))
    assert_tree_close(out, f(make(a, b)))
    (ours,) = vjp_fn(make(u, w))
    ra, rb = a.clone().requires_grad_(), b.clone().requires_grad_()
    ro = f(make(ra, rb))
    assert_tree_close(ours, make(*torch.autograd.grad(list(parts(ro)), (ra, rb), (u, w))))
    if kind in TORCH_KINDS:
        _, their_fn = torch.func.vjp(f, make(a, b))
        assert_tree_close(ours, their_fn(make(u, w))[0], torch_structure=True)
    with pytest.raises(RuntimeError, match="Expected pytree structure of cotangents to be the same"):
        vjp_fn((u, w))  # a tuple is not the output's container


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_jacrev_jacfwd_nest_output_over_input(kind):
    make, parts = KINDS[kind]
    a, b = rand(3), rand(3)

    def f(p):
        x, y = parts(p)
        return make(x.sin() * y, (x * y).sum())

    flat_f = lambda x, y: parts(f(make(x, y)))
    J = torch.autograd.functional.jacobian(flat_f, (a, b))
    expected = make(make(*J[0]), make(*J[1]))  # output structure outside, input inside
    for jac in (functx.jacrev, functx.jacfwd):
        assert_tree_close(jac(f)(make(a, b)), expected)
    if kind in TORCH_KINDS:
        for ours, theirs in ((functx.jacrev, torch.func.jacrev), (functx.jacfwd, torch.func.jacfwd)):
            assert_tree_close(ours(f)(make(a, b)), theirs(f)(make(a, b)), torch_structure=True)


@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_jacobians_with_argnums_aux_and_chunks_match_torch_func(kind):
    make, parts = KINDS[kind]
    s, a, b = rand(2), rand(3), rand(3)

    def f(scale, p):
        x, y = parts(p)
        out = make(scale.sum() * x, y * x.sum())
        return out, make(x.detach() * 0 + 1, y)

    for ours, theirs in ((functx.jacrev, torch.func.jacrev), (functx.jacfwd, torch.func.jacfwd)):
        got = ours(f, argnums=(0, 1), has_aux=True)(s, make(a, b))
        want = theirs(f, argnums=(0, 1), has_aux=True)(s, make(a, b))
        assert_tree_close(got, want, torch_structure=True)
    chunked = functx.jacrev(f, argnums=1, has_aux=True, chunk_size=2)(s, make(a, b))
    assert_tree_close(chunked, torch.func.jacrev(f, argnums=1, has_aux=True)(s, make(a, b)))
    chunked = functx.jacfwd(f, argnums=1, has_aux=True, chunk_size=2)(s, make(a, b))
    assert_tree_close(chunked, torch.func.jacfwd(f, argnums=1, has_aux=True)(s, make(a, b)))


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_hessian_of_a_container(kind):
    make, parts = KINDS[kind]
    a, b = rand(3), rand(2)

    def f(p):
        x, y = parts(p)
        return (x.sin() ** 2).sum() * y.exp().sum()

    H = torch.autograd.functional.hessian(lambda x, y: f(make(x, y)), (a, b))
    assert_tree_close(functx.hessian(f)(make(a, b)), make(make(*H[0]), make(*H[1])))
    if kind in TORCH_KINDS:
        assert_tree_close(functx.hessian(f)(make(a, b)), torch.func.hessian(f)(make(a, b)), torch_structure=True)


# ----------------------------------------------------------------------- forward mode


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_jvp_tangents_as_the_container(kind):
    make, parts = KINDS[kind]
    a, b, ta, tb = rand(3), rand(3), rand(3), rand(3)

    def f(p):
        x, y = parts(p)
        return make(x * y, x.exp().sum())

    out, tangent = functx.jvp(f, (make(a, b),), (make(ta, tb),))
    ref_out, ref_t = torch.autograd.functional.jvp(lambda x, y: tuple(parts(f(make(x, y)))), (a, b), (ta, tb))
    assert_tree_close(out, make(*ref_out))
    assert_tree_close(tangent, make(*ref_t))
    if kind in TORCH_KINDS:
        assert_tree_close((out, tangent), torch.func.jvp(f, (make(a, b),), (make(ta, tb),)), torch_structure=True)
    with pytest.raises(RuntimeError, match="Expected primals and tangents to have the same python structure"):
        functx.jvp(f, (make(a, b),), ((ta, tb),))
    out, jvp_fn = functx.linearize(f, make(a, b))
    assert_tree_close(jvp_fn(make(ta, tb)), make(*ref_t))


def test_jvp_has_aux_container():
    a, t = rand(3), rand(3)
    f = lambda x: (x.sin(), TorchPair(x * 2, TorchPoint(x, x.sum())))
    ours = functx.jvp(f, (a,), (t,), has_aux=True)
    theirs = torch.func.jvp(f, (a,), (t,), has_aux=True)
    assert_tree_close(ours, theirs, torch_structure=True)


# ----------------------------------------------------------------------- compositions


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_per_sample_grads_of_container_params(kind):
    make, parts = KINDS[kind]
    w, c = rand(3), rand(())
    xs, ys = rand(5, 3), rand(5)

    def loss(params, x, y):
        weight, bias = parts(params)
        return ((x @ weight + bias - y) ** 2)

    ours = functx.vmap(functx.grad(loss), in_dims=(None, 0, 0))(make(w, c), xs, ys)
    per_sample = [functx.grad(loss)(make(w, c), xs[i], ys[i]) for i in range(5)]
    assert_tree_close(ours, stack_trees(per_sample))
    if kind in TORCH_KINDS:
        theirs = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(make(w, c), xs, ys)
        assert_tree_close(ours, theirs, torch_structure=True)
    # batched containers of params (ensembling) through in_dims given as the container
    ws, cs = rand(4, 3), rand(4)
    ours = functx.vmap(functx.grad(loss), in_dims=(make(0, 0), None, None))(make(ws, cs), xs[0], ys[0])
    per_model = [functx.grad(loss)(make(ws[i], cs[i]), xs[0], ys[0]) for i in range(4)]
    assert_tree_close(ours, stack_trees(per_model))


@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_nested_transforms_of_containers_match_torch_func(kind):
    make, parts = KINDS[kind]
    a, b = rand(3), rand(3)
    xs = rand(4, 3)

    def f(p):
        x, y = parts(p)
        return (x.sin() * y.cos()).sum()

    def g(p, x):
        u, v = parts(p)
        return make(u * x, (v * x).sum())

    cases = [
        (lambda T: T.grad(lambda p: parts(T.grad(f)(p))[0].sum())),
        (lambda T: lambda p: T.vmap(T.jacrev(g), in_dims=(None, 0))(p, xs)),
        (lambda T: lambda p: T.vmap(T.jacfwd(g), in_dims=(None, 0))(p, xs)),
        (lambda T: lambda p: T.jvp(T.grad(f), (p,), (make(b, a),))),
        (lambda T: lambda p: T.jacrev(T.jacfwd(f))(p)),
    ]
    for case in cases:
        assert_tree_close(case(functx)(make(a, b)), case(torch.func)(make(a, b)), torch_structure=True)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_aux_containers_leave_nested_levels(kind):
    make, parts = KINDS[kind]
    a, b, xs = rand(3), rand(3), rand(4, 3)

    def f(p, x):
        u, v = parts(p)
        return (u * v * x).sum(), make(u * x, TorchPoint(v.sum(), x))

    ours = functx.vmap(functx.grad(f, has_aux=True), in_dims=(None, 0))(make(a, b), xs)
    per_sample = [functx.grad(f, has_aux=True)(make(a, b), xs[i]) for i in range(4)]
    assert_tree_close(ours, stack_trees(per_sample))
    assert_tree_close(per_sample[0][1], make(a * xs[0], TorchPoint(b.sum(), xs[0])))

    def outer(p):  # grad of grad: the inner aux is a wrapper of the outer level, unwrapped
        g, aux = functx.grad(f, has_aux=True)(p, xs[0])
        return parts(g)[0].sum() + parts(aux)[0].sum()

    ra, rb = a.clone().requires_grad_(), b.clone().requires_grad_()
    u, v = ra, rb
    inner = torch.autograd.grad((u * v * xs[0]).sum(), (u,), create_graph=True)[0]
    expected = torch.autograd.grad(inner.sum() + (u * xs[0]).sum(), (ra, rb))
    assert_tree_close(functx.grad(outer)(make(a, b)), make(*expected))
    for jac in (functx.jacrev, functx.jacfwd):
        J, aux = jac(lambda p: f(p, xs[0]), has_aux=True)(make(a, b))
        assert_tree_close(aux, make(a * xs[0], TorchPoint(b.sum(), xs[0])))


def test_structseq_and_builtin_containers_keep_optree_handling():
    x = rand(4, 5)
    ours = functx.vmap(lambda t: torch.max(t, 0))(x)
    theirs = torch.func.vmap(lambda t: torch.max(t, 0))(x)
    assert type(ours) is torch.return_types.max
    assert_tree_close(ours, theirs, torch_structure=True)
    tree = collections.OrderedDict(b=x, a=(x, [x]))
    ours = functx.vmap(lambda d: collections.OrderedDict((k, v) for k, v in reversed(list(d.items()))))(tree)
    assert list(ours) == ["a", "b"] and type(ours) is collections.OrderedDict
    assert type(pytree.tree_structure(BothPair(x, x))) is type(optree.tree_structure(BothPair(x, x)))
    assert pytree.tree_structure(BothPair(x, x)) == optree.tree_structure(BothPair(x, x))  # optree's wins
