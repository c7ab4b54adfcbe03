"""Rewrites of a jitted graph for inductor: undo the batch copies of shared weights.

Under `vmap`, functx's `grad` gives an unbatched differentiated input the batch dim as an
`expand` (ad/direct_reverse.py) so that its gradient comes out per element. The traced
graph therefore multiplies by *per-element copies* of one weight: MAML's first inner
step and per-sample gradients run `baddbmm` against a batch-expanded matrix, convolutions
run grouped, the batch in the groups, against a weight cloned B times. Eager, that costs
little; compiled, it is what kept `functx.jit` behind `torch.compile` of the same
torch.func code (whose graph multiplies by the weight once). Once the graph is flat ATen
the gradient bookkeeping is done, so these products can be written back as shared ones:

- `bmm(A, expand(W))` -> `mm(A rows, W)` (and `baddbmm(C, A, expand(W))` -> `C + that`);
- `baddbmm(C, A, B)` -> `C + bmm(A, B)`, so that the add fuses into the kernels around it
  (inductor keeps `baddbmm` an extern call); with an inner dimension of 1 the product is a
  broadcast multiply, fused too;
- `convolution(x, clone(expand(W)), clone(expand(b)), groups=B*g)` -> a convolution of the
  B elements as a batch against W itself, groups g; its `convolution_backward` likewise
  for the input's gradient, while the weight's gradient (per element) stays grouped, its
  weight argument (read only for its shape) a stride-0 dummy instead of the B copies, and
  the bias's gradient a sum.

Measured (benchmarks/staging_jit.py, README "functx.jit, ninth session"): MAML step 1.05x ->
0.85x `torch.compile(torch.func)`, CNN per-sample gradients at parity. Installed by
`functx.jit(..., backend="inductor")` as inductor's `post_grad_custom_pre_pass`; each rule
leaves a node alone unless every size involved is a plain int (no symbolic shapes).
"""

from __future__ import annotations

import operator

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

ENABLED = True  # read when functx.jit is called; False compiles the graph as traced (A/B runs)

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_SAME_VALUES = (aten.detach.default, aten.alias.default)  # gone by inductor's passes, kept by make_fx


def _through_aliases(node):
    while _calls(node, *_SAME_VALUES):
        node = node.args[0]
    return node


def _val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _static(*shapes) -> bool:
    return all(type(d) is int for shape in shapes for d in shape)


def _calls(node, *targets) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


class _Builder:
    """Inserts ops before a node, each with its fake value (`meta["val"]`) as inductor needs."""

    def __init__(self, graph, anchor):
        from torch._guards import detect_fake_mode

        self.graph, self.anchor = graph, anchor
        self.fake_mode = detect_fake_mode([_val(anchor)])

    def __call__(self, target, *args, **kwargs):
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, args, kwargs)
        with self.fake_mode:
            node.meta["val"] = target(*(_val(a) if isinstance(a, torch.fx.Node) else a for a in args), **kwargs)
        return node

    def zeros_like_shape(self, like, shape):
        """A stride-0 tensor of `shape`: an argument the op reads only for its size."""
        zero = self(aten.full.default, [], 0.0, dtype=like.dtype, device=like.device)
        return self(aten.expand.default, zero, list(shape))


def _replace(graph, node, new):
    node.replace_all_uses_with(new)
    graph.erase_node(node)


# -- batched matrix products ----------------------------------------------------------------
def _shared_matrix(node):
    """If `node` ([B, r, c]) is one matrix repeated along the batch (an `expand`, through
    same-shape views and transposes of the last two dims): (that matrix's node, whether it
    is [1, r, c] rather than [r, c], whether to transpose it). Else None."""
    transposed = False
    while _calls(node := _through_aliases(node), *_VIEWS, aten.transpose.int, aten.permute.default, aten.expand.default):
        shape = tuple(_val(node).shape)
        if node.target in _VIEWS:
            if tuple(_val(node.args[0]).shape) != shape:
                return None
        elif node.target is aten.transpose.int:
            if sorted(d % 3 for d in node.args[1:3]) != [1, 2]:
                return None
            transposed = not transposed
        elif node.target is aten.permute.default:
            if [d % 3 for d in node.args[1]] != [0, 2, 1]:
                return None
            transposed = not transposed
        else:
            source_shape = tuple(_val(node.args[0]).shape)
            if source_shape == shape[1:]:
                return node.args[0], False, transposed
            if source_shape == (1, *shape[1:]):
                return node.args[0], True, transposed
            return None
        node = node.args[0]
    return None


def _rewrite_bmm(graph, node):
    if node.target is aten.baddbmm.default:
        if node.args[3:] or node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
            return
        bias, a, b = node.args
    else:
        bias, (a, b) = None, node.args
    (batch, rows, inner), cols = _val(a).shape, _val(b).shape[2]
    if not _static(_val(a).shape, _val(b).shape):
        return
    shared = _shared_matrix(b)
    if shared is None and bias is None:
        return  # a plain bmm: inductor's own rules handle it
    build = _Builder(graph, node)
    if shared is not None:
        matrix, leading_one, transposed = shared
        if leading_one:
            matrix = build(aten.select.int, matrix, 0, 0)
        if transposed:
            matrix = build(aten.permute.default, matrix, [1, 0])
        if inner == 1:  # an outer product: a broadcast multiply
            product = build(aten.mul.Tensor, a, matrix)
        else:
            flat = build(aten.mm.default, build(aten.reshape.default, a, [batch * rows, inner]), matrix)
            product = build(aten.reshape.default, flat, [batch, rows, cols])
    elif inner == 1:
        product = build(aten.mul.Tensor, a, b)
    else:
        product = build(aten.bmm.default, a, b)
    _replace(graph, node, build(aten.add.Tensor, bias, product) if bias is not None else product)


# -- convolutions with the batch in the groups ----------------------------------------------
def _batch_copies(node, batch):
    """If `node` is [batch * R, ...]: `batch` copies of one [R, ...] tensor (a reshape of a
    batch-expand, cloned or not), that tensor's node; else None."""
    if not _calls(node, *_VIEWS):
        return None
    inner = _through_aliases(node.args[0])
    if _calls(inner, aten.clone.default):
        inner = _through_aliases(inner.args[0])
    if not _calls(inner, aten.expand.default):
        return None
    source = inner.args[0]
    shape = tuple(_val(source).shape)
    if tuple(inner.args[1]) != (batch, *shape) or tuple(_val(node).shape) != (batch * shape[0], *shape[1:]):
        return None
    return source


def _shared_weight_batch(weight, groups):
    """(the shared weight's node, the batch size) when a grouped convolution's weight is
    batch copies of one weight; else None."""
    for batch in range(2, groups + 1):
        if groups % batch == 0 and (source := _batch_copies(weight, batch)) is not None:
            return source, batch
    return None


def _ungroup(build, t, batch, channels):
    """[N, batch * channels, *S] -> [batch * N, channels, *S]: the batch out of the channels."""
    n, spatial = _val(t).shape[0], list(_val(t).shape[2:])
    t = build(aten.reshape.default, t, [n, batch, channels, *spatial])
    t = build(aten.permute.default, t, [1, 0, *range(2, 3 + len(spatial))])
    return build(aten.reshape.default, t, [batch * n, channels, *spatial])


def _regroup(build, t, batch, channels):
    """The inverse of `_ungroup`."""
    n, spatial = _val(t).shape[0] // batch, list(_val(t).shape[2:])
    t = build(aten.reshape.default, t, [batch, n, channels, *spatial])
    t = build(aten.permute.default, t, [1, 0, *range(2, 3 + len(spatial))])
    return build(aten.reshape.default, t, [n, batch * channels, *spatial])


def _rewrite_convolution(graph, node):
    x, weight, bias, stride, padding, dilation, transposed, output_padding, groups = node.args
    if transposed or not _static(_val(x).shape, _val(weight).shape):
        return
    found = _shared_weight_batch(weight, groups)
    if found is None:
        return
    shared, batch = found
    shared_bias = None
    if bias is not None and (shared_bias := _batch_copies(bias, batch)) is None:
        return
    build = _Builder(graph, node)
    y = build(
        aten.convolution.default, _ungroup(build, x, batch, _val(x).shape[1] // batch), shared, shared_bias,
        stride, padding, dilation, False, output_padding, groups // batch,
    )  # fmt: skip
    _replace(graph, node, _regroup(build, y, batch, _val(shared).shape[0]))


def _rewrite_convolution_backward(graph, node):
    grad_y, x, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, mask = node.args
    if transposed or not _static(_val(x).shape, _val(weight).shape, _val(grad_y).shape):
        return
    found = _shared_weight_batch(weight, groups)
    if found is None:
        return
    shared, batch = found
    x_shape, channels = _val(x).shape, _val(x).shape[1] // batch
    build = _Builder(graph, node)
    results = {}
    if mask[0]:  # the input's gradient against the shared weight (the input read for its size only)
        per_element_x = build.zeros_like_shape(_val(x), [batch * x_shape[0], channels, *x_shape[2:]])
        grads = build(
            aten.convolution_backward.default, _ungroup(build, grad_y, batch, _val(shared).shape[0]), per_element_x,
            shared, None, stride, padding, dilation, False, output_padding, groups // batch, [True, False, False],
        )  # fmt: skip
        results[0] = _regroup(build, build(operator.getitem, grads, 0), batch, channels)
    if mask[1]:  # per element: stays grouped, against a weight read for its size only
        weight_grads = build(
            aten.convolution_backward.default, grad_y, x, build.zeros_like_shape(_val(weight), _val(weight).shape),
            None, stride, padding, dilation, False, output_padding, groups, [False, True, False],
        )  # fmt: skip
        results[1] = build(operator.getitem, weight_grads, 1)
    if mask[2]:
        results[2] = build(aten.sum.dim_IntList, grad_y, [0, *range(2, len(x_shape))])
    for user in list(node.users):
        if user.args[1] in results:
            _replace(graph, user, results[user.args[1]])
        else:  # an unused output (mask False, getitem kept by make_fx)
            graph.erase_node(user)
    graph.erase_node(node)


_REWRITES = {
    aten.bmm.default: _rewrite_bmm,
    aten.baddbmm.default: _rewrite_bmm,
    aten.convolution.default: _rewrite_convolution,
    aten.convolution_backward.default: _rewrite_convolution_backward,
}


class SharedWeights(CustomGraphPass):
    """Inductor's `post_grad_custom_pre_pass` for functx.jit (the module docstring says what
    it rewrites). `uuid` keys inductor's FX-graph cache on this file's source."""

    def __init__(self, then=None):
        self.then = then  # a pass the user configured: runs after this one

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target in _REWRITES and all(
                _val(a) is not None for a in node.all_input_nodes
            ):
                _REWRITES[node.target](graph, node)
        graph.eliminate_dead_code()
        if self.then is not None:
            self.then(graph)

    def uuid(self):
        """This file's hash, with the caller's pass's uuid; None (not cacheable: inductor
        then compiles afresh) when the caller's pass has none."""
        then = None
        if self.then is not None:
            then = self.then.uuid() if hasattr(self.then, "uuid") else None
            if then is None:
                return None
        return get_hash_for_files((__file__,), repr(then))
