"""minGRU and minLSTM (Feng et al. 2024): gates from the input only, so the recurrence is linear in h,
h_t = a_t * h_{t-1} + b_t. The coefficients from the projected input u, and the step: the spec rpt's cells and the
exported modeling_rpt.py both run. Plain torch only: `rpt export` copies this file."""

import torch
from torch import nn


def mingru_coefficients(u):
    """u = [z_pre, h~] (the input projection): a = 1 - z, b = z * h~ with z = sigmoid(z_pre)."""
    z_pre, h_tilde = u.chunk(2, dim=-1)
    z = torch.sigmoid(z_pre)
    return 1 - z, z * h_tilde


def minlstm_coefficients(u):
    """u = [f_pre, i_pre, h~]: a = f / (f + i), b = i / (f + i) * h~ with f, i the sigmoids."""
    f_pre, i_pre, h_tilde = u.chunk(3, dim=-1)
    f, i = torch.sigmoid(f_pre), torch.sigmoid(i_pre)
    total = f + i
    return f / total, i / total * h_tilde


COEFFICIENTS = {"mingru": mingru_coefficients, "minlstm": minlstm_coefficients}


def min_step(u_t, state, coefficients):
    """One step from the projected input u_t [B, n H]: returns h_t and (h_t,)."""
    (h,) = state
    a, b = coefficients(u_t)
    h = a * h + b
    return h, (h,)


class Layer(nn.Module):
    """The layer `rpt export` builds from this file (modeling_rpt.py imports it as spec_cell.Layer): its weights by
    the names rpt's cell gives them, so a checkpoint loads unchanged; a zero state (the reset's); one step."""

    def __init__(self, cfg):
        super().__init__()
        self.coefficients = COEFFICIENTS[cfg.cell]
        self.in_proj = nn.Linear(cfg.d_model, (2 if cfg.cell == "mingru" else 3) * cfg.d_hidden)
        self.out_proj = nn.Linear(cfg.d_hidden, cfg.d_model, bias=False)

    def init_state(self, batch: int, like: torch.Tensor) -> tuple:
        return (like.new_zeros(batch, self.out_proj.in_features),)

    def step(self, x, state):
        h, state = min_step(self.in_proj(x), state, self.coefficients)
        return self.out_proj(h), state
