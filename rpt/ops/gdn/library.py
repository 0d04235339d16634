"""flash-linear-attention's chunkwise kernel for the gated delta rule (`fla-core`, MIT: `chunk_gated_delta_rule`),
taking the arguments of chunkwise.py, on CUDA where it is installed (nothing on the CPU depends on it).

rpt resets the state inside a window (a document's start); the kernel resets it only between sequences. So each
row is cut at its resets into sequences of variable length (flash-attention's `cu_seqlens` over the rows laid
end to end): a row's first sequence starts from the row's entering state (unless the row resets at its first
token), every later one from zero, and the row's state after the window is its last sequence's. The queries
arrive normalised and scaled (scale 1), beta after its sigmoid, g as the log decay: what the kernel's defaults take.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor


def kernel() -> Callable | None:
    """The library's kernel, or None where fla-core is not installed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def sequences(reset: Optional[Tensor], B: int, T: int):
    """The rows cut at their resets: `cu_seqlens` [N + 1] over the B * T tokens laid end to end, each sequence's
    row [N], whether it starts from its row's entering state [N], and each row's last sequence [B]."""
    starts = torch.zeros(B, T, dtype=torch.bool, device=reset.device if reset is not None else "cpu")
    starts[:, 0] = True
    if reset is not None:
        starts |= reset
    at = starts.flatten().nonzero()[:, 0]
    cu = torch.cat([at, at.new_tensor([B * T])])
    row = at // T
    entered = at % T == 0
    if reset is not None:
        entered &= ~reset[row, 0]
    last = torch.bincount(row, minlength=B).cumsum(0) - 1
    return cu, row, entered, last


def by_sequences(run: Callable, q, k, v, g, beta, reset: Optional[Tensor], S: Tensor):
    """q, k [B, H, T, d_k], v [B, H, T, d_v], g, beta [B, H, T], reset [B, T] or None, S [B, H, d_k, d_v], through
    `run` (the kernel's signature) over the rows' sequences. Returns o [B, H, T, d_v] and the state after."""
    B, H, T, _ = q.shape
    cu, row, entered, last = sequences(reset, B, T)
    cu = cu.to(q.device)

    def laid(x):  # [B, H, T, ...] -> [1, B * T, H, ...]
        return x.transpose(1, 2).reshape(1, B * T, H, *x.shape[3:])
    start = S[row.to(S.device)] * entered.to(S.device, S.dtype)[:, None, None, None]
    o, final = run(laid(q), laid(k), laid(v), laid(g), laid(beta), scale=1.0, initial_state=start,
                   output_final_state=True, cu_seqlens=cu)
    return o.reshape(B, T, H, -1).transpose(1, 2), final[last.to(final.device)]
