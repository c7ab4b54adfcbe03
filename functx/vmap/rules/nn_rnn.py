"""Recurrent layers: `aten::mkldnn_rnn_layer` and its backward (one LSTM layer on CPU with
oneDNN, the default path of `nn.LSTM` there).

Both rules run one LSTM layer written in torch ops on this level's tensors, which
re-dispatch through the batching rules: the batched input, states and (when an ensemble
or a grad level right inside vmap makes them so) weights are handled by the rules of
`linear`, the pointwise gates and `stack`. oneDNN's `workspace` output is only ever fed
back to the backward op, so the forward returns an empty one and the backward
recomputes the layer with autograd instead of reading it.
"""

import torch
import torch.nn.functional as F

from ..batched_tensor import RULES_USING_AUTOGRAD, VMAP_RULES, BatchedTensor

aten = torch.ops.aten

_LSTM = 2  # oneDNN's rnn kind for LSTM (the only one torch sends to this op)


def _lstm_layer(x, h, c, w_ih, w_hh, b_ih, b_hh, reverse):
    """One LSTM layer over x (seq, batch, features) from states h, c (batch, hidden)."""
    gates_from_input = F.linear(x, w_ih, b_ih)  # every step's input projection at once
    steps = range(x.shape[0] - 1, -1, -1) if reverse else range(x.shape[0])
    outputs = []
    for t in steps:
        in_gate, forget_gate, cell_gate, out_gate = (gates_from_input[t] + F.linear(h, w_hh, b_hh)).chunk(4, -1)
        c = forget_gate.sigmoid() * c + in_gate.sigmoid() * cell_gate.tanh()
        h = out_gate.sigmoid() * c.tanh()
        outputs.append(h)
    if reverse:
        outputs.reverse()
    return torch.stack(outputs), h, c


def _check_lstm(mode):
    if mode != _LSTM:
        raise NotImplementedError(f"functx.vmap: aten::mkldnn_rnn_layer with rnn mode {mode} (only LSTM, mode 2)")


@VMAP_RULES.register(aten.mkldnn_rnn_layer.default)
def _mkldnn_rnn_layer(interp, x, w_ih, w_hh, b_ih, b_hh, hx, cx, reverse, batch_sizes, mode, *flags):
    _check_lstm(mode)
    y, hy, cy = _lstm_layer(x, hx, cx, w_ih, w_hh, b_ih, b_hh, reverse)
    return y, hy, cy, x.new_empty(0)


@VMAP_RULES.register(aten.mkldnn_rnn_layer_backward.default)
def _mkldnn_rnn_layer_backward(
    interp, x, w_ih, w_hh, b_ih, b_hh, hx, cx, output, hy, cy, grad_output, grad_hy, grad_cy, reverse, mode, *rest
):
    _check_lstm(mode)

    def fresh_leaf(t):  # a new autograd leaf for the same values (this level's wrapper)
        if type(t) is BatchedTensor and t._interp is interp:
            return BatchedTensor(t._value.detach(), interp).requires_grad_()
        return t.detach().requires_grad_()

    with torch.enable_grad():
        leaves = [fresh_leaf(t) for t in (x, w_ih, w_hh, b_ih, b_hh, hx, cx)]  # the op's input order
        x_, w_ih_, w_hh_, b_ih_, b_hh_, hx_, cx_ = leaves
        recomputed = _lstm_layer(x_, hx_, cx_, w_ih_, w_hh_, b_ih_, b_hh_, reverse)
        pairs = [(out, g) for out, g in zip(recomputed, (grad_output, grad_hy, grad_cy)) if g is not None]
        grads = torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True)
    return tuple(torch.zeros_like(leaf) if g is None else g for g, leaf in zip(grads, leaves))


RULES_USING_AUTOGRAD.add(aten.mkldnn_rnn_layer_backward.default)
