"""The GRU's step (Cho et al. 2014), in PyTorch's gate layout (r, z, n): the spec rpt's gru cell and the exported
modeling_rpt.py both run. Plain torch only: `rpt export` copies this file."""

import torch
import torch.nn.functional as F


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
