"""minGRU and minLSTM (Feng et al. 2024, "Were RNNs All We Needed?").

Their gates read the input only, so the recurrence is linear in h,
    h_t = a_t * h_{t-1} + b_t (the spec: rpt/ops/minrnn/spec.py),
and the whole sequence runs as one parallel scan (rpt/ops/minrnn/scan.py) after one input projection:
    minGRU:  z = sigmoid(W_z x),  h~ = W_h x,                 a = 1 - z,         b = z * h~
    minLSTM: f = sigmoid(W_f x),  i = sigmoid(W_i x), h~ = W_h x,  a = f / (f + i),  b = i / (f + i) * h~
The hidden state is wider than the model (d_hidden, default 2 * d_model) and projected back
down, as in the paper's expansion. A reset sets a_t = 0: the carry is dropped at that step.

The recurrence runs in rpt/ops/minrnn/sequence.py in the form the backend picks: for these two cells one C++ pass
each way on the CPU, one Triton kernel each way on a GPU (the coefficients folded into the scan); for a subclass
with coefficients of its own, the coefficients and the chunked scan as ATen ops.
"""

from __future__ import annotations

import torch
from torch import nn

from rpt.kernels.cpu.products import linear
from rpt.models.cells.base import Cell
from rpt.models.registry import register_cell
from rpt.ops.precision import as_fp32
from rpt.ops.minrnn import sequence
from rpt.ops.minrnn.scan import linear_scan
from rpt.ops.minrnn.sequence import MinScan
from rpt.ops.minrnn.spec import min_step, minlstm_coefficients, mingru_coefficients


class _MinRNN(Cell):
    n_proj = 2
    export_spec = "rpt.ops.minrnn.spec"
    native_loops = True

    def __init__(self, d_model: int, d_hidden: int = 0):
        super().__init__(d_model, d_hidden or 2 * d_model)
        self.in_proj = nn.Linear(d_model, self.n_proj * self.d_hidden)
        self.out_proj = nn.Linear(self.d_hidden, d_model, bias=False)

    def state_shapes(self):
        return [(self.d_hidden,)]

    def coefficients(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(a, b) of the linear recurrence from the projected input u."""
        raise NotImplementedError

    def step(self, x_t, state):
        h, state = min_step(self.in_proj(x_t), state, self.coefficients)
        return self.out_proj(h), state

    def forward(self, x, state=None, reset=None):
        (h0,) = state if state is not None else self.init_state(x.shape[0], x.device, x.dtype)
        u = linear(x, self.in_proj.weight, self.in_proj.bias)
        h, final = sequence.forward(u, h0, reset, _BUILT_IN.get(type(self).coefficients), self.coefficients)
        return linear(h, self.out_proj.weight), (final,)

    def flops_per_token(self):
        return 2 * self.d_model * self.d_hidden * (self.n_proj + 1)

    def piece_forward(self, x, state, reset, entering):
        """Context parallelism: the piece's scan from zero, its summary (the product of a over it, its last state)
        folded into the entering state, and h_t += (product of a up to t) * that state."""
        (h0,) = state
        u = linear(x, self.in_proj.weight, self.in_proj.bias)
        h, _ = sequence.forward(u, torch.zeros_like(h0), reset, _BUILT_IN.get(type(self).coefficients),
                                self.coefficients)
        with torch.autocast(u.device.type, enabled=False):
            a, _ = self.coefficients(as_fp32(u))
            if reset is not None:
                a = a * (~reset).to(a.dtype)[..., None]
            decay = linear_scan(a, torch.zeros_like(a), torch.ones_like(a[:, 0]))  # product of a up to each step
            h = as_fp32(h)
            (carry,) = entering((decay[:, -1], h[:, -1]), (as_fp32(h0),), _scan_fold)
            h = torch.addcmul(h, decay, carry[:, None])
        return linear(h, self.out_proj.weight), (h[:, -1].to(h0.dtype),)

    def summary_numbers(self):
        return 2 * self.d_hidden


def _scan_fold(own, state):
    """The state after a piece of product `own[0]` and last state from zero `own[1]`."""
    return (own[0] * state[0] + own[1],)


@register_cell("mingru")
class MinGRU(_MinRNN):
    n_proj = 2

    def coefficients(self, u):
        return mingru_coefficients(u)


@register_cell("minlstm")
class MinLSTM(_MinRNN):
    n_proj = 3

    def coefficients(self, u):
        return minlstm_coefficients(u)


_BUILT_IN = {MinGRU.coefficients: MinScan.MINGRU, MinLSTM.coefficients: MinScan.MINLSTM}  # their forms know them
