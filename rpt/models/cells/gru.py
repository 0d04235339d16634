"""Classic GRU (Cho et al. 2014), PyTorch's formulation and gate layout (r, z, n).

The fast path is torch's fused GRU kernel (cuDNN on GPU, oneDNN on CPU) with this cell's parameters.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from rpt.models.cells.base import Cell, over_segments
from rpt.models.registry import register_cell


@register_cell("gru")
class GRU(Cell):
    def __init__(self, d_model: int, d_hidden: int = 0, **_):
        super().__init__(d_model, d_hidden or d_model)
        H, D = self.d_hidden, d_model
        self.w_ih = nn.Parameter(torch.empty(3 * H, D))
        self.w_hh = nn.Parameter(torch.empty(3 * H, H))
        self.b_ih = nn.Parameter(torch.zeros(3 * H))
        self.b_hh = nn.Parameter(torch.zeros(3 * H))
        bound = 1 / math.sqrt(H)
        for w in (self.w_ih, self.w_hh):
            nn.init.uniform_(w, -bound, bound)
        self.proj = nn.Linear(H, D, bias=False) if H != D else None

    def state_sizes(self):
        return [self.d_hidden]

    def step(self, x_t, state):
        (h,) = state
        xr, xz, xn = (x_t @ self.w_ih.T + self.b_ih).chunk(3, dim=-1)
        hr, hz, hn = (h @ self.w_hh.T + self.b_hh).chunk(3, dim=-1)
        r = torch.sigmoid(xr + hr)
        z = torch.sigmoid(xz + hz)
        n = torch.tanh(xn + r * hn)
        h = (1 - z) * n + z * h
        return self._out(h), (h,)

    def forward(self, x, state=None, reset=None):
        state = state if state is not None else self.init_state(x.shape[0], x.device, x.dtype)
        weights = [self.w_ih, self.w_hh, self.b_ih, self.b_hh]

        def run(xs, st):
            y, h = torch.gru(xs, st[0][None], weights, True, 1, 0.0, self.training, False, True)
            return y, (h[0],)

        y, state = over_segments(run, x, state, reset)
        return self._out(y), state

    def _out(self, h):
        return self.proj(h) if self.proj is not None else h

    def flops_per_token(self):
        H, D = self.d_hidden, self.d_model
        return 2 * 3 * H * (D + H) + (2 * H * D if self.proj is not None else 0)
