"""The GRU's step (Cho et al. 2014), in PyTorch's gate layout (r, z, n): the spec rpt's gru cell and the exported
modeling_rpt.py both run. Plain torch only: `rpt export` copies this file."""

import torch
import torch.nn.functional as F
from torch import nn


def gru_step(x_t, state, w_ih, w_hh, b_ih, b_hh, linear=F.linear):
    """One step: x_t [B, D], state (h,) [B, H]; w_hh the dense recurrent matrix. Returns h_t and (h_t,)."""
    (h,) = state
    xr, xz, xn = linear(x_t, w_ih, b_ih).chunk(3, dim=-1)
    hr, hz, hn = linear(h, w_hh, b_hh).chunk(3, dim=-1)
    r = torch.sigmoid(xr + hr)
    z = torch.sigmoid(xz + hz)
    n = torch.tanh(xn + r * hn)
    h = (1 - z) * n + z * h
    return h, (h,)


class Layer(nn.Module):
    """The layer `rpt export` builds from this file (modeling_rpt.py imports it as spec_cell.Layer): its weights by
    the names rpt's cell gives them, so a checkpoint loads unchanged; a zero state (the reset's); one step."""

    n_gates, n_state = 3, 1

    def __init__(self, cfg):
        super().__init__()
        G, H, D, self.heads = self.n_gates, cfg.d_hidden, cfg.d_model, cfg.heads
        self.w_ih, self.w_hh = nn.Parameter(torch.empty(G * H, D)), nn.Parameter(torch.empty(G * H, H // cfg.heads))
        self.b_ih, self.b_hh = nn.Parameter(torch.zeros(G * H)), nn.Parameter(torch.zeros(G * H))
        self.proj = nn.Linear(H, D, bias=False) if H != D else None

    def init_state(self, batch: int, like: torch.Tensor) -> tuple:
        return tuple(like.new_zeros(batch, self.b_ih.shape[0] // self.n_gates) for _ in range(self.n_state))

    def step(self, x, state):
        # w_hh holds each head's [d, d] blocks (xLSTM's sLSTM heads); the step multiplies the dense matrix
        w_hh = torch.cat([torch.block_diag(*g.chunk(self.heads)) for g in self.w_hh.chunk(self.n_gates)])
        h, state = gru_step(x, state, self.w_ih, w_hh, self.b_ih, self.b_hh)
        return (self.proj(h) if self.proj is not None else h), state
