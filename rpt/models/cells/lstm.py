"""Classic LSTM (Hochreiter & Schmidhuber 1997, with forget gate), PyTorch's gate layout (i, f, g, o).

This module holds the parameters (in torch's layout); the step is the spec, rpt/ops/lstm/spec.py, and the
sequence runs in rpt/ops/lstm/sequence.py: torch's fused LSTM (cuDNN, oneDNN), or a head-wise cell's Triton loop
on a GPU.
"""

from __future__ import annotations

import torch

from rpt.models.cells.base import GatedRNNCell
from rpt.models.registry import register_cell
from rpt.ops.lstm import sequence
from rpt.ops.lstm.spec import lstm_step


@register_cell("lstm")
class LSTM(GatedRNNCell):
    n_gates = 4
    options = ("forget_bias", "weight_drop", "heads")
    export_spec = "rpt.ops.lstm.spec"

    def __init__(self, d_model: int, d_hidden: int = 0, forget_bias: float | None = None, weight_drop: float = 0.0,
                 heads: int = 1):
        forget_bias = 1.0 if forget_bias is None else forget_bias
        super().__init__(d_model, d_hidden, weight_drop, heads)
        H = self.d_hidden
        with torch.no_grad():
            self.b_ih[H:2 * H] = forget_bias

    def state_shapes(self):
        return [(self.d_hidden,), (self.d_hidden,)]

    def step(self, x_t, state):
        h, state = lstm_step(x_t, state, self.w_ih, self.step_weight(), self.b_ih, self.b_hh, self.linear)
        return self._out(h), state

    def forward(self, x, state=None, reset=None):
        state = state if state is not None else self.init_state(x.shape[0], x.device, x.dtype)
        y, state = sequence.forward(self, x, state, reset)
        return self._out(y), state
