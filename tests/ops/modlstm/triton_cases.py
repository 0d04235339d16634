"""What the modlstm's Triton tests share: a user's gate with its Triton form (softsign squashed into [0, 1]),
registered once (its torch form runs in the reference, its Triton form in the loops), and the float64 case they
hold the loops to. (tests/conftest.py sets TRITON_INTERPRET before triton is imported.)"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rpt.config import ModelConfig
from rpt.models import register_gate
from rpt.models.lm import build_cell

SOFTSIGN = "softsign-triton-test"


@triton.jit
def softsign_gate(x):
    return 0.5 + 0.5 * x / (1.0 + tl.abs(x))


@triton.jit
def softsign_gate_grad(x, y):
    d = 1.0 + tl.abs(x)
    return 0.5 / (d * d)


register_gate(SOFTSIGN, lambda x: 0.5 + 0.5 * x / (1 + x.abs()), lambda x, y: 0.5 / (1 + x.abs()) ** 2,
              triton=(softsign_gate, softsign_gate_grad))


def float64_case(B: int, T: int, **model):
    """A float64 modlstm with every parameter moved off its init, an input x [B, T, d_model] and a random initial
    state (for the exponential gate a normaliser > 0 and a stabiliser)."""
    cell = build_cell(ModelConfig(cell="modlstm", **model)).double()
    with torch.no_grad():
        for p in cell.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x = torch.randn(B, T, cell.d_model, dtype=torch.float64)
    H = cell.d_hidden
    state = [torch.randn(B, *shape, dtype=torch.float64) * 0.5 for shape in cell.state_shapes()]
    if cell.exp:
        state[2] = torch.rand(B, H, dtype=torch.float64) + 0.5
        state[3] = torch.randn(B, H, dtype=torch.float64) * 0.1
    return cell, x, state
