"""Recurrent layers: `aten::mkldnn_rnn_layer` and its backward (one LSTM layer on CPU with
oneDNN, the default path of `nn.LSTM` there), and the whole layers (`torch._VF.lstm`, `gru`,
`rnn_tanh`, `rnn_relu`) under vmap.

The whole layers are CompositeImplicitAutograd kernels in C++ that write in place into their
temporaries: an LSTM step is `linear(h, w_hh).add_(linear(x, w_ih))`. Under `grad(vmap(f))`
the weights and the first state are not batched at the vmap level while the input is, and the
write of a batched value into an unbatched tensor is refused (it would need one tensor per
sample). While a vmap level is live, the layers run as torch._decomp's Python for them
(`RUN_AS_PYTHON`), out of place, every op through the levels: torch._decomp's layer
functions in torch ops (checked against a per-sample loop in tests/nn and tests/zoo).

Both rules run one LSTM layer written in torch ops on this level's tensors, which
re-dispatch through the batching rules: the batched input, states and (when an ensemble
or a grad level right inside vmap makes them so) weights are handled by the rules of
`linear`, the pointwise gates and `stack`. oneDNN's `workspace` output is only ever fed
back to the backward op, so the forward returns an empty one and the backward
recomputes the layer with autograd instead of reading it.
"""

import torch
import torch._decomp.decompositions as _decompositions
import torch.nn.functional as F

from ...core.interpreter import current_stack
from ...core.torch_function import RUN_AS_PYTHON
from ..batched_tensor import RULES_USING_AUTOGRAD, VMAP_RULES, BatchedTensor
from ..interpreter import VmapInterpreter

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


def _lstm(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    """torch._decomp's `lstm_impl` with its layer written in torch ops always: on float32 CPU
    tensors it picks a oneDNN form (`mkldnn_one_layer_lstm`) that gave wrong values under
    vmap (measured: off by 0.1 in per-sample gradients, wrong shapes in an ensemble)."""
    params = _decompositions.gather_params(params, has_biases, hx[0].size(2) != hx[1].size(2))
    hidden = list(zip(hx[0], hx[1]))
    out, final = _decompositions._rnn_helper(
        input, hidden, params, has_biases, num_layers, dropout, train, bidirectional, batch_first, _decompositions.one_layer_lstm
    )
    h, c = zip(*final)
    return out, torch.stack(h, 0), torch.stack(c, 0)


def _layers_out_of_place(decomposition, is_input_form):
    """`torch._VF.<layer>` as the Python `decomposition` while a vmap level is live (the
    module docstring), for its form on a padded input; otherwise torch's own (declines)."""

    def run(*args, **kwargs):
        if kwargs or not is_input_form(args) or not any(type(level) is VmapInterpreter for level in current_stack()):
            return NotImplemented
        return decomposition(*args)

    return run


def _is_lstm_input_form(args):  # lstm(input, (h, c), params, ...), not (data, batch_sizes, ...)
    return len(args) == 9 and isinstance(args[1], (tuple, list))


def _is_rnn_input_form(args):  # gru(input, h, params, has_biases, ...), not (data, batch_sizes, h, ...)
    return len(args) == 9 and isinstance(args[2], (tuple, list)) and isinstance(args[3], bool)


RUN_AS_PYTHON.update(
    {
        torch._VF.lstm: _layers_out_of_place(_lstm, _is_lstm_input_form),
        torch._VF.gru: _layers_out_of_place(_decompositions.gru_impl, _is_rnn_input_form),
        torch._VF.rnn_tanh: _layers_out_of_place(_decompositions.rnn_tanh_input, _is_rnn_input_form),
        torch._VF.rnn_relu: _layers_out_of_place(_decompositions.rnn_relu_input, _is_rnn_input_form),
    }
)
