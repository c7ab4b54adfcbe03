"""functx.jit's rewrites of products with batch copies of a shared weight
(functx/staging/graph_passes.py).

The rewrites run on ATen graphs: here on the forward graphs functx.jit traces (captured
from AOTAutograd before any compiler: fast), which must (1) lose the per-element weight copies the rewrite targets and
(2) compute what the graph computed before and what a float64 per-sample
`torch.autograd.grad` loop computes; and once through `functx.jit(backend="inductor")`,
where a pass of the caller's runs after functx's and sees the rewritten graph.
"""

from __future__ import annotations

import contextlib
import operator

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.backends.common import aot_autograd

import functx
from functx.staging import graph_passes
from functx.staging.graph_passes import SharedWeights
from functx.vmap.batched_tensor import UNDER_DIRECT_GRAD

aten = torch.ops.aten
CONVS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _rewritten(f, *args):
    """(graph module before, graph module after the pass, the outputs of each) of the forward
    graph `functx.jit` traces for f(*args) (AOTAutograd's, before any compiler)."""
    graphs = {}

    def compiler(gm, example_inputs):
        copy = torch.fx.Graph()
        copy.output(copy.graph_copy(gm.graph, {}))
        graphs["before"] = torch.fx.GraphModule(gm, copy)
        SharedWeights()(gm.graph)
        gm.graph.lint()
        gm.recompile()
        graphs["after"] = gm

        def both(inputs):
            graphs["outputs"] = graphs["before"](*inputs), gm(*inputs)
            return graphs["outputs"][1]

        both._boxed_call = True
        return both

    functx.jit(f, backend=aot_autograd(fw_compiler=compiler))(*args)
    return graphs["before"], graphs["after"], *graphs["outputs"]


@contextlib.contextmanager
def _grouped_convolutions():
    """Eager vmap(grad) convolves against the shared weight itself (nn_conv.py's
    SharedWeightConvolution) except where the gradient is built with create_graph (MAML on a
    conv net, a gradient penalty), whose traces keep the grouped convolution against batch
    copies that the pass rewrites; switched off here to trace those graphs simply."""
    convolution = torch.ops.aten.convolution.default
    shared_weight = UNDER_DIRECT_GRAD.rules[convolution]
    UNDER_DIRECT_GRAD.set(convolution, lambda *args: NotImplemented)
    try:
        yield
    finally:
        UNDER_DIRECT_GRAD.set(convolution, shared_weight)


def _grouped_by_batch(gm, batch):
    """Convolutions (forward or backward) whose groups hold the batch."""
    convs = [n for n in gm.graph.nodes if n.target in (aten.convolution.default, aten.convolution_backward.default)]
    return [n for n in convs if n.args[-2 if n.target is aten.convolution_backward.default else -1] % batch == 0 and _weight_is_copied(n)]


def _weight_is_copied(node):
    """The convolution's weight argument is B copies of one weight (an expand, cloned or not)."""
    w = node.args[1 if node.target is aten.convolution.default else 2]
    while w.target in (aten._unsafe_view.default, aten.view.default, aten.reshape.default, aten.detach.default, aten.clone.default):
        w = w.args[0]
    return w.target is aten.expand.default and w.args[1][0] > 1 and w.args[0].meta["val"].dim() > 0  # not a dummy


def _batched_products_of_copies(gm):
    return [
        n for n in gm.graph.nodes
        if n.target in (aten.bmm.default, aten.baddbmm.default) and graph_passes._shared_matrix(n.args[-1]) is not None
    ]  # fmt: skip


def _per_sample_reference(loss, params, xs, argnums):
    """float64 per-sample gradients by torch.autograd.grad, one sample at a time."""
    grads = []
    for x in xs.double():
        leaves = [p.double().requires_grad_() for p in params] + [x.requires_grad_()]
        wanted = [leaves[i] for i in argnums]
        grads.append(torch.autograd.grad(loss(*leaves), wanted, allow_unused=True, materialize_grads=True))
    return [torch.stack(g) for g in zip(*grads)]


@st.composite
def conv_cases(draw):
    dim = draw(st.sampled_from([1, 2, 3]))
    groups = draw(st.integers(1, 2))
    c_in, c_out = groups * draw(st.integers(1, 2)), groups * draw(st.integers(1, 3))
    kernel = draw(st.integers(1, 3))
    size = draw(st.integers(kernel + 1, kernel + 3)) if dim < 3 else kernel + 1
    return {
        "dim": dim, "groups": groups, "batch": draw(st.integers(2, 3)), "n": draw(st.integers(1, 2)),
        "c_in": c_in, "c_out": c_out, "kernel": kernel, "size": size,
        "stride": draw(st.integers(1, 2)), "padding": draw(st.integers(0, 1)), "dilation": draw(st.integers(1, 2)),
        "bias": draw(st.booleans()), "input_grad": draw(st.booleans()),
    }  # fmt: skip


def _conv_problem(case):
    torch.manual_seed(0)
    dim, k = case["dim"], case["kernel"]
    w = torch.randn(case["c_out"], case["c_in"] // case["groups"], *[k] * dim)
    b = torch.randn(case["c_out"]) if case["bias"] else None
    span = case["dilation"] * (k - 1) + 1
    size = max(case["size"], span - 2 * case["padding"])
    xs = torch.randn(case["batch"], case["n"], case["c_in"], *[size] * dim)
    conv = CONVS[dim]

    def loss(w, b, x):
        y = conv(x, w, b, stride=case["stride"], padding=case["padding"], dilation=case["dilation"], groups=case["groups"])
        return (y.tanh() * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view(y.shape)).sum()

    return loss, w, b, xs


@settings(max_examples=40, deadline=None)
@given(conv_cases())
def test_per_sample_convolutions_lose_their_weight_copies_and_keep_their_values(case):
    loss, w, b, xs = _conv_problem(case)
    params = (w,) if b is None else (w, b)
    argnums = (0, *(1,) * (b is not None), *(len(params),) * case["input_grad"])

    def one(*args):
        return loss(args[0], args[1] if b is not None else None, args[-1])

    f = functx.vmap(functx.grad(one, argnums=argnums), in_dims=(*(None,) * len(params), 0))
    with _grouped_convolutions():
        before, after, old, got = _rewritten(f, *params, xs)
    assert _grouped_by_batch(before, case["batch"]), "the trace no longer copies the weight: update the pass"
    assert not _grouped_by_batch(after, case["batch"])
    torch.testing.assert_close(got, old)
    expected = _per_sample_reference(one, params, xs, argnums)
    torch.testing.assert_close([g.double() for g in got], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("in_features", [1, 3])
@pytest.mark.parametrize("bias", [True, False])
def test_inner_steps_under_vmap_multiply_by_the_shared_weight(in_features, bias):
    """MAML: the outer grad of a vmap of inner grad steps on a linear model, the parameters
    shared by the tasks at the first step (the batch-expanded matrix the rewrite removes), per
    task after."""
    torch.manual_seed(0)
    w, b = torch.randn(4, in_features), torch.randn(4)
    xs = torch.randn(3, 5, in_features)

    def mse(w, b, x):
        return F.linear(torch.tanh(F.linear(x, w, b if bias else None)), torch.ones(1, 4, dtype=x.dtype) / 4).square().mean()

    def adapted_loss(w, b, x):
        for _ in range(2):
            gw, gb = functx.grad(mse, argnums=(0, 1))(w, b, x)
            w, b = w - 0.1 * gw, b - 0.1 * gb
        return mse(w, b, x)

    def meta_loss(w, b, xs):
        return functx.vmap(adapted_loss, in_dims=(None, None, 0))(w, b, xs).sum()

    f = functx.grad(meta_loss, argnums=(0, 1))
    before, after, old, got = _rewritten(f, w, b, xs)
    assert _batched_products_of_copies(before)
    assert not _batched_products_of_copies(after)
    assert not [n for n in after.graph.nodes if n.target is aten.baddbmm.default]
    torch.testing.assert_close(got, old)
    expected = [g.sum(0) for g in _per_sample_reference(adapted_loss, (w, b), xs, (0, 1))]
    torch.testing.assert_close([g.double() for g in got], expected, rtol=1e-5, atol=1e-5)


def test_graphs_without_copies_are_left_alone():
    def f(a, b, c):
        return torch.baddbmm(c, a, b, beta=0.5), torch.bmm(a, b), F.conv2d(a.unsqueeze(0), b.unsqueeze(0), groups=1)

    a, b, c = torch.randn(2, 3, 3), torch.randn(2, 3, 3), torch.randn(2, 3, 3)
    before, after, _, _ = _rewritten(f, a, b, c)
    assert [n.target for n in before.graph.nodes] == [n.target for n in after.graph.nodes]


def test_jit_runs_the_pass_before_the_callers(monkeypatch):
    """functx.jit(backend="inductor") rewrites the post-grad graph; a pass given in options
    runs after it (it sees the rewritten graph); with graph_passes.ENABLED off it sees the copies."""
    seen = []

    class Recorder(torch._inductor.custom_graph_pass.CustomGraphPass):
        def __call__(self, graph):
            seen.append([(n.target, n.args) for n in graph.nodes if n.op == "call_function"])

        def uuid(self):
            return None  # no FX-graph cache: every compile runs the passes

    torch.manual_seed(0)
    w, b, xs = torch.randn(3, 2, 3, 3), torch.randn(3), torch.randn(4, 2, 6, 6)

    def loss(w, b, x):
        return F.conv2d(x.unsqueeze(0), w, b, padding=1).relu().square().sum()

    f = functx.vmap(functx.grad(loss, argnums=(0, 1, 2)), in_dims=(None, None, 0))
    expected = _per_sample_reference(loss, (w, b), xs, (0, 1, 2))
    grouped = []
    with _grouped_convolutions():
        for enabled in (True, False):
            monkeypatch.setattr(graph_passes, "ENABLED", enabled)
            seen.clear()
            got = functx.jit(f, backend="inductor", options={"post_grad_custom_pre_pass": Recorder()})(w, b, xs)
            torch.testing.assert_close([g.double() for g in got], expected, rtol=1e-4, atol=1e-4)
            (nodes,) = seen
            grouped.append([args for target, args in nodes if target is aten.convolution.default and args[-1] == 4])
    assert grouped[0] == [] and len(grouped[1]) == 1


def test_the_cache_key_follows_the_callers_pass():
    class Keyed(torch._inductor.custom_graph_pass.CustomGraphPass):
        def __init__(self, key):
            self.key = key

        def __call__(self, graph):
            pass

        def uuid(self):
            return self.key

    assert SharedWeights().uuid() == SharedWeights().uuid() is not None
    assert SharedWeights(then=Keyed("a")).uuid() not in (SharedWeights(then=Keyed("b")).uuid(), SharedWeights().uuid())
    assert SharedWeights(then=Keyed(None)).uuid() is None  # not cacheable, as the caller's pass
    assert SharedWeights(then=lambda graph: None).uuid() is None


def test_getitem_of_unused_gradients_is_dropped():
    """No getitem is left pointing at an output a rewritten backward does not compute."""
    torch.manual_seed(0)
    w, xs = torch.randn(2, 1, 3), torch.randn(3, 1, 7)
    f = functx.vmap(functx.grad(lambda w, x: F.conv1d(x.unsqueeze(0), w).sin().sum()), in_dims=(None, 0))
    _, after, _, _ = _rewritten(f, w, xs)
    assert all(u.target is operator.getitem and u.users for n in after.graph.nodes
               if n.target is aten.convolution_backward.default for u in n.users)  # fmt: skip
