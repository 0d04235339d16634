"""The mLSTM over a window in its parallel (quadratic) form: every output from every input at once, as attention
computes it, with the entering state added in and resets at document boundaries.

Unrolled, the spec's memory read at t is a sum over the inputs s <= t since the last reset, weighted by
exp(D_ts) with D_ts = b_t - b_s + i~_s (b the cumulative sum of log f), plus the entering state decayed by
exp(b_t); the stabiliser m_t is the largest of those exponents (exactly the spec's running maximum), so every
weight is at most 1. `window` is also the chunkwise form's inner step (chunkwise.py), over every chunk at once:
leading dimensions are free, the time axis is the last but one (the last for the gates).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from rpt.ops.mlstm.spec import EPS

State = tuple[Tensor, Tensor, Tensor]


class GateTerms(NamedTuple):
    """The log-gate sums of a window: b (cumulative log f, [..., T]), D ([..., T, T], -inf where s > t or a
    reset lies between), and with resets `clean` (no reset up to t) and `before` (b just before t's last reset)."""
    b: Tensor
    D: Tensor
    clean: Optional[Tensor]
    before: Optional[Tensor]


def gate_terms(i_pre: Tensor, log_f: Tensor, reset: Optional[Tensor]) -> GateTerms:
    """i_pre, log_f: [..., T]; reset: bool, broadcastable to them (a row's reset applies to all its heads)."""
    T = log_f.shape[-1]
    b = log_f.cumsum(-1)
    valid = torch.ones(T, T, dtype=torch.bool, device=b.device).tril()
    clean = before = None
    if reset is not None:
        segment = reset.cumsum(-1)
        valid = valid & (segment[..., :, None] == segment[..., None, :])
        clean = segment == 0
        t = torch.arange(T, device=b.device)
        last = torch.where(reset, t, -1).cummax(-1).values.expand_as(b)
        before = torch.where(last > 0, b.gather(-1, (last - 1).clamp(min=0)), torch.zeros_like(b))
    D = (b[..., :, None] - b[..., None, :] + i_pre[..., None, :]).masked_fill(~valid, float("-inf"))
    return GateTerms(b, D, clean, before)


def carried(b: Tensor, m0: Tensor, clean: Optional[Tensor], before: Optional[Tensor]) -> Tensor:
    """The largest exponent the state entering at b = 0 carries to each t: b + m0 (m0 broadcast to b), or after a
    reset the zero state's b - before."""
    return b + (m0 if clean is None else torch.where(clean, m0, -before))


def decayed(exponent: Tensor, clean: Optional[Tensor]) -> Tensor:
    """exp(exponent), and 0 where a reset has dropped the entering state (masked before exp: no inf, no nan)."""
    return torch.exp(exponent if clean is None else exponent.masked_fill(~clean, float("-inf")))


def window(q: Tensor, k: Tensor, v: Tensor, terms: GateTerms, state: State, final: bool = True):
    """h [..., T, d_v] from q, k [..., T, d_k], v [..., T, d_v] and the state entering the window; with `final`
    also the state after it."""
    C0, n0, m0 = state
    m = torch.maximum(carried(terms.b, m0[..., None], terms.clean, terms.before), terms.D.amax(-1))
    w = torch.exp(terms.D - m[..., None]) * (q @ k.transpose(-1, -2))
    old = decayed(terms.b + m0[..., None] - m, terms.clean)  # the entering state's weight at each t
    num = w @ v + old[..., None] * (q @ C0)
    den = w.sum(-1) + old * (q @ n0[..., None])[..., 0]
    h = num / (torch.maximum(den.abs(), torch.exp(-m)) + EPS)[..., None]
    if not final:
        return h, None
    m_end = m[..., -1]
    k_weighted = k * torch.exp(terms.D[..., -1, :] - m_end[..., None])[..., None]
    C = old[..., -1, None, None] * C0 + k_weighted.transpose(-1, -2) @ v
    n = old[..., -1, None] * n0 + k_weighted.sum(-2)
    return h, (C, n, m_end)


def at_least_fp32(form):
    """Run a form in float32 at least (float64 stays): the cumulative log gates of a long window lose their last
    steps in half precision. h comes back in q's dtype, the state in the precision it ran."""
    def run(q, k, v, i_pre, log_f, reset, state, *args, **kwargs):
        dtype = torch.promote_types(q.dtype, torch.float32)
        h, state = form(*(x.to(dtype) for x in (q, k, v, i_pre, log_f)), reset,
                        tuple(s.to(dtype) for s in state), *args, **kwargs)
        return h.to(q.dtype), state
    run.__doc__, run.__name__ = form.__doc__, form.__name__
    return run


@at_least_fp32
def parallel(q, k, v, i_pre, log_f, reset: Optional[Tensor], state: State):
    """The whole window at once: q, k [B, H, T, d_k], v [B, H, T, d_v], i_pre, log_f [B, H, T], reset [B, T] (or
    None), state (C [B, H, d_k, d_v], n [B, H, d_k], m [B, H]). Returns h [B, H, T, d_v] and the final state."""
    terms = gate_terms(i_pre, log_f, None if reset is None else reset[:, None])
    return window(q, k, v, terms, state)
