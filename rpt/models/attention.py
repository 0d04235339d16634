"""Causal sliding-window attention as a recurrent sub-layer: its state is the last W keys and values.

Each position attends to itself and the W-1 positions before it, within its own document
(a reset starts a new one). The keys and values of the last W positions are the state carried
to the next chunk (truncated BPTT) or the next generated token, so memory per token stays
constant, as for the recurrent cells. The maths is rpt/ops/stack/spec.py's (which the export ships); attention
itself is torch's scaled_dot_product_attention.
"""

from __future__ import annotations

import torch
from torch import nn

from rpt.ops.stack.spec import sliding_window_attention

class SlidingWindowAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, window: int):
        super().__init__()
        self.d_model, self.n_heads, self.window = d_model, n_heads, window
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)

    def init_state(self, batch: int, device=None, dtype=None):
        """(keys [B, W, D], values [B, W, D], valid [B, W]): nothing valid yet."""
        p = self.qkv.weight
        device, dtype = device or p.device, dtype or p.dtype
        zeros = torch.zeros(batch, self.window, self.d_model, device=device, dtype=dtype)
        return zeros, zeros.clone(), torch.zeros(batch, self.window, device=device, dtype=dtype)

    def forward(self, x, state, reset=None):
        return sliding_window_attention(x, state, reset, self.qkv, self.out, self.n_heads, self.window)

    def flops_per_token(self) -> int:
        D = self.d_model
        return 2 * 4 * D * D + 2 * 2 * self.window * D  # projections + scores and weighted sum over the window
