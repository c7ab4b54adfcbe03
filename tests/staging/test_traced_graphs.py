"""What make_fx records of functx transforms: the program's ops, nothing of functx's own checks."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import functx


@pytest.mark.parametrize("mode", ["real", "fake", "symbolic"])
def test_per_sample_checks_leave_no_trace(mode):
    """vmap's per-sample shape check runs ops on meta tensors; outside the tracing modes."""
    f = lambda x, w: functx.vmap(lambda a: (a @ w).sum(0).softmax(0))(x)
    x, w = torch.randn(4, 3, 2), torch.randn(2, 5)
    graph = make_fx(f, tracing_mode=mode)(x, w)
    for node in graph.graph.nodes:
        value = node.meta.get("val")
        assert not (isinstance(value, torch.Tensor) and value.device.type == "meta"), node.format_node()
    torch.testing.assert_close(graph(x, w), f(x, w))
    ops = {n.target.overloadpacket.__name__ for n in graph.graph.nodes if n.op == "call_function" and hasattr(n.target, "overloadpacket")}
    assert ops <= {"view", "mm", "sum", "_softmax", "sym_size", "reshape", "unsqueeze", "expand", "bmm", "_unsafe_view"}, ops
