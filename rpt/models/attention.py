"""Causal sliding-window attention as a recurrent sub-layer: its state is the last W keys and values.

Each position attends to itself and the W-1 positions before it, within its own document
(a reset starts a new one). The keys and values of the last W positions are the state carried
to the next chunk (truncated BPTT) or the next generated token, so memory per token stays
constant, as for the recurrent cells. Attention itself is torch's scaled_dot_product_attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn



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
        B, T, D = x.shape
        W, nh = self.window, self.n_heads
        k_cache, v_cache, valid = state
        q, k, v = self.qkv(x).split(D, dim=-1)
        keys, values = torch.cat([k_cache, k], 1), torch.cat([v_cache, v], 1)  # [B, W+T, D]
        # Document of every position: cached keys are document 0 while valid; each reset opens a new one.
        resets = reset.long() if reset is not None else torch.zeros(B, T, dtype=torch.long, device=x.device)
        doc_new = resets.cumsum(1)
        doc_cache = torch.where(valid > 0, 0, -1).to(doc_new.dtype)
        doc_all = torch.cat([doc_cache, doc_new], 1)  # [B, W+T]
        pos_q = torch.arange(T, device=x.device)[:, None] + W
        pos_k = torch.arange(W + T, device=x.device)[None, :]
        in_window = (pos_k <= pos_q) & (pos_k > pos_q - W)  # [T, W+T]
        mask = in_window[None] & (doc_all[:, None, :] == doc_new[:, :, None])  # [B, T, W+T]
        heads = lambda t: t.view(B, -1, nh, D // nh).transpose(1, 2)
        y = F.scaled_dot_product_attention(heads(q), heads(keys), heads(values), attn_mask=mask[:, None])
        y = self.out(y.transpose(1, 2).reshape(B, T, D))
        new_valid = (doc_all[:, -W:] == doc_new[:, -1:]).to(valid.dtype)
        return y, (keys[:, -W:], values[:, -W:], new_valid)

    def flops_per_token(self) -> int:
        D = self.d_model
        return 2 * 4 * D * D + 2 * 2 * self.window * D  # projections + scores and weighted sum over the window
