"""Classic LSTM (Hochreiter & Schmidhuber 1997, with forget gate), PyTorch's gate layout (i, f, g, o).

The fast path is torch's fused LSTM kernel (cuDNN on GPU, oneDNN on CPU), called with this
cell's own parameters so that regularisers such as weight normalisation work on them. A head-wise cell
(`heads`) on a GPU runs its Triton loop instead (rpt/ops/lstm/triton.py), a program per head with its blocks on chip.
"""

from __future__ import annotations

import torch

from rpt.kernels.triton import on_chip
from rpt.models.cells.base import GatedRNNCell, as_fp32, full_precision, over_segments
from rpt.models.registry import register_cell
from rpt.ops.lstm.spec import lstm_step


@register_cell("lstm")
class LSTM(GatedRNNCell):
    n_gates = 4
    options = ("forget_bias", "weight_drop", "heads")

    def __init__(self, d_model: int, d_hidden: int = 0, forget_bias: float | None = None, weight_drop: float = 0.0,
                 heads: int = 1):
        forget_bias = 1.0 if forget_bias is None else forget_bias
        super().__init__(d_model, d_hidden, weight_drop, heads)
        H = self.d_hidden
        with torch.no_grad():
            self.b_ih[H:2 * H] = forget_bias

    def state_sizes(self):
        return [self.d_hidden, self.d_hidden]

    def step(self, x_t, state):
        h, state = lstm_step(x_t, state, self.w_ih, self.step_weight(), self.b_ih, self.b_hh, self.linear)
        return self._out(h), state

    def forward(self, x, state=None, reset=None):
        state = state if state is not None else self.init_state(x.shape[0], x.device, x.dtype)
        weights = [self.w_ih, self.recurrent_weight(), self.b_ih, self.b_hh]

        def run(xs, st):
            y, h, c = torch.lstm(xs, (st[0][None], st[1][None]), weights, True, 1, 0.0, self.training, False, True)
            return y, (h[0], c[0])

        if x.is_cuda and self.heads > 1 and on_chip(self.d_hidden, self.heads):  # a program per head, blocks on chip
            from rpt.ops.lstm.triton import lstm_sequence

            keep = None if reset is None else (~reset).float().t().contiguous()
            y, new = lstm_sequence(x, self.w_ih, self.recurrent_blocks(), self.b_ih, self.b_hh, state[0], state[1], keep,
                                   self.heads)
            return self._out(y.to(x.dtype)), tuple(s.to(state[0].dtype) for s in new)
        if x.is_cuda:  # cuDNN runs the autocast dtype; the carried state keeps the caller's
            dtype = state[0].dtype
            y, state = over_segments(run, x, state, reset)
            state = tuple(s.to(dtype) for s in state)
        else:
            with full_precision(x):
                y, state = over_segments(run, as_fp32(x), state, reset)
        return self._out(y), state

