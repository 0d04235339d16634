"""The LSTM's step (Hochreiter & Schmidhuber 1997, with forget gate), in PyTorch's gate layout (i, f, g, o): the
spec rpt's lstm cell and the exported modeling_rpt.py both run. Plain torch only: `rpt export` copies this file."""

import torch
import torch.nn.functional as F


def lstm_step(x_t, state, w_ih, w_hh, b_ih, b_hh, linear=F.linear):
    """One step: x_t [B, D], state (h, c) [B, H]; w_hh the dense recurrent matrix. Returns h_t and (h_t, c_t)."""
    h, c = state
    i, f, g, o = (linear(x_t, w_ih, b_ih) + linear(h, w_hh, b_hh)).chunk(4, dim=-1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    h = torch.sigmoid(o) * torch.tanh(c)
    return h, (h, c)
