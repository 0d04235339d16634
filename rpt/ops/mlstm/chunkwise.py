"""The mLSTM's training form: the window cut into chunks of L steps, the state handed from chunk to chunk by the
recurrence, every chunk's outputs at once by the parallel form (parallel.py) from the state entering it.

Three phases, as the chunkwise forms of linear attention run them: (1) each chunk's own contribution to the state
at its end, from a zero start (`summary`: one batched product over all chunks); (2) the states entering each
chunk, one small step per chunk (`advance`: K = T / L steps of [d_k, d_v] matrices); (3) every output, all chunks
at once (products of L x L). Work per token is O(L (d_k + d_v) + d_k d_v) per head instead of the parallel form's
O(T (d_k + d_v)). A window that L does not divide ends with one shorter chunk, run by the parallel form from the
state so far. `summary` and `advance` are also what context parallelism exchanges and folds: a rank's piece of a
window is one more chunk (rpt/parallel/context.py). Written in torch: on the CPU its products run on oneDNN, and
autograd gives the backward.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from rpt.ops.mlstm.parallel import State, at_least_fp32, carried, decayed, gate_terms, parallel, window


class Summary(NamedTuple):
    """What a stretch of steps does to the state that enters it: its own memory and normaliser at its end (C, n),
    stabilised by their largest exponent `a`; the sum of its log forget gates `b`; and with resets, whether none
    lies in it (`clean`) and the log-gate sum before the last one (`before`)."""
    C: Tensor
    n: Tensor
    a: Tensor
    b: Tensor
    clean: Optional[Tensor]
    before: Optional[Tensor]


def summary(k, v, i_pre, log_f, reset: Optional[Tensor]) -> Summary:
    """Over the time axis (the last but one of k, v; the last of the gates and of `reset`, which broadcasts over
    heads), in O(T) memory: only the last step's row of the parallel form's weights."""
    b = log_f.cumsum(-1)
    b_end = b[..., -1]
    last = b_end[..., None] - b + i_pre  # the exponent of each step's share at the end
    clean = before = None
    if reset is not None:
        segment = reset.cumsum(-1)
        last = last.masked_fill(segment != segment[..., -1:], float("-inf"))  # dropped by a later reset
        t = torch.arange(reset.shape[-1], device=reset.device)
        final = torch.where(reset, t, -1).amax(-1, keepdim=True).expand_as(b_end[..., None])
        clean = final[..., 0] < 0
        before = torch.where(final > 0, b.gather(-1, (final - 1).clamp(min=0)), torch.zeros_like(b_end[..., None]))[..., 0]
    a = last.amax(-1)
    k_weighted = k * torch.exp(last - a[..., None])[..., None]
    return Summary(k_weighted.transpose(-1, -2) @ v, k_weighted.sum(-2), a, b_end, clean, before)


def advance(state: State, own: Summary) -> State:
    """The state after a stretch, from the state entering it and the stretch's summary: the spec's stabiliser
    exactly (the largest exponent of what it holds), so every form hands on the same state."""
    C, n, m = state
    m_new = torch.maximum(carried(own.b, m, own.clean, own.before), own.a)
    old, new = decayed(own.b + m - m_new, own.clean), torch.exp(own.a - m_new)
    return (old[..., None, None] * C + new[..., None, None] * own.C, old[..., None] * n + new[..., None] * own.n,
            m_new)


@at_least_fp32
def chunkwise(q, k, v, i_pre, log_f, reset: Optional[Tensor], state: State, chunk: int):
    """As `parallel` (same arguments and results), in chunks of `chunk` steps."""
    B, H, T, _ = q.shape
    L = min(chunk, T)
    K, full = T // L, T // L * L
    if K <= 1:
        return parallel(q, k, v, i_pre, log_f, reset, state)

    def cut(x, heads=H):
        return x[:, :, :full].reshape(B, heads, K, L, *x.shape[3:])
    qc, kc, vc, ic, fc = cut(q), cut(k), cut(v), cut(i_pre), cut(log_f)
    rc = None if reset is None else cut(reset[:, None], 1)
    own = summary(kc, vc, ic, fc, rc)  # (1)
    by_chunk = [[None] * K if t is None else t.unbind(2) for t in own]  # one backward for all K (not K selects)
    entering = []
    for j in range(K):  # (2)
        entering.append(state)
        state = advance(state, Summary(*(t[j] for t in by_chunk)))
    state_in = tuple(torch.stack(s, dim=2) for s in zip(*entering))
    h, _ = window(qc, kc, vc, gate_terms(ic, fc, rc), state_in, final=False)  # (3)
    h = h.reshape(B, H, full, -1)
    if full == T:
        return h, state
    rest = slice(full, T)
    h_rest, state = parallel(q[:, :, rest], k[:, :, rest], v[:, :, rest], i_pre[..., rest], log_f[..., rest],
                             None if reset is None else reset[:, rest], state)
    return torch.cat([h, h_rest], dim=2), state
