"""The gated delta rule's training form: the window cut into chunks of L steps; within a chunk every output at
once by the UT transform (the WY representation), between chunks the state handed on as an affine map.

Within a chunk (cumulative log decay gamma_t, its decay Gamma_t = exp(gamma_t) of the state entering the chunk),
the values the step writes, u_t = beta_t (v_t - S'_t^T k_t), depend on the entering state S_0 only linearly:

    (I + N) U = beta V - (beta Gamma K) S_0,   N_ts = beta_t exp(gamma_t - gamma_s) k_t . k_s   (s < t)

so one triangular solve per chunk gives U = W_v - W_k S_0 with W_v, W_k free of S_0: (1) for every chunk at
once. (2) Chunk by chunk, from the state entering it: the values it writes U = W_v - W_k S_0, its outputs o_t =
Gamma_t q_t S_0 + sum_{s <= t} exp(gamma_t - gamma_s) (q_t . k_s) u_s, and the state it hands on, Gamma_L S_0 +
K_d^T U (K_d the keys decayed to the chunk's end): three [L, d] x [d, d]-sized products a chunk, 6 d^2 a token a
head. The chunk's effect as an affine map S_0 -> A S_0 + B (A = Gamma_L I - K_d^T W_k [d_k, d_k], B = K_d^T W_v),
which context parallelism folds, costs a [d, d] x [d, d] product more a chunk (2 d^3 / L a token), so the
training form does not build it. A reset (a document's start) cuts every decay across it, the entering state's
included. A window that L does not divide is padded with steps that change nothing (beta = 0, g = 0, zero
inputs). `parallel`, the whole window as one chunk, is the quadratic form. Written in torch: its products and
the triangular solve run on oneDNN / LAPACK on the CPU, and autograd gives the backward.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor


class Terms(NamedTuple):
    """A chunk's S_0-free parts: the pairwise decays D [..., L, L] (s <= t, 0 across a reset), the entering
    state's decay G [..., L] (0 after a reset), and the triangular solve's W_v [..., L, d_v], W_k [..., L, d_k]."""
    D: Tensor
    G: Tensor
    Wv: Tensor
    Wk: Tensor


def terms(k, v, g, beta, reset: Optional[Tensor]) -> Terms:
    """k [..., L, d_k], v [..., L, d_v], g, beta [..., L], reset [..., L] bool (broadcast over heads) or None."""
    L = g.shape[-1]
    gamma = g.cumsum(-1)
    valid = torch.ones(L, L, dtype=torch.bool, device=g.device).tril()
    G = gamma
    if reset is not None:
        segment = reset.cumsum(-1)
        valid = valid & (segment[..., :, None] == segment[..., None, :])
        G = gamma.masked_fill(segment != 0, float("-inf"))
    D = torch.exp((gamma[..., :, None] - gamma[..., None, :]).masked_fill(~valid, float("-inf")))
    G = torch.exp(G)
    N = beta[..., :, None] * D.tril(-1) * (k @ k.transpose(-1, -2))
    rhs = torch.cat([beta[..., None] * v, (beta * G)[..., None] * k], dim=-1)
    W = torch.linalg.solve_triangular(N, rhs, upper=False, unitriangular=True)  # N's diagonal read as ones
    Wv, Wk = W.split([v.shape[-1], k.shape[-1]], dim=-1)
    return Terms(D, G, Wv, Wk)


def decayed_keys(k, t: Terms) -> Tensor:
    """The keys decayed to the chunk's end (0 before a reset inside it), [..., d_k, L]."""
    return (t.D[..., -1, :, None] * k).transpose(-1, -2)


def summary(k, t: Terms) -> tuple[Tensor, Tensor]:
    """The chunk's effect on the state entering it, S -> A S + B: A [..., d_k, d_k], B [..., d_k, d_v]."""
    Kd = decayed_keys(k, t)
    A = t.G[..., -1, None, None] * torch.eye(k.shape[-1], dtype=k.dtype, device=k.device) - Kd @ t.Wk
    return A, Kd @ t.Wv


def at_least_fp32(form):
    """Run a form in float32 at least (float64 stays): the cumulative decays and the triangular solve lose too
    much in half precision. The outputs come back in q's dtype, the state in the precision it ran."""
    def run(q, k, v, g, beta, reset, S, *args, **kwargs):
        dtype = torch.promote_types(q.dtype, torch.float32)
        o, S = form(*(x.to(dtype) for x in (q, k, v, g, beta)), reset, S.to(dtype), *args, **kwargs)
        return o.to(q.dtype), S
    run.__doc__, run.__name__ = form.__doc__, form.__name__
    return run


class Chunked(NamedTuple):
    """A window cut into K chunks of L steps ([B, H, K, L, ...]) and their S_0-free terms: what `run` and
    `composed` read. T: the window's own length (the rest is padding)."""
    q: Tensor
    k: Tensor
    terms: Terms
    T: int


def chunked(q, k, v, g, beta, reset: Optional[Tensor], chunk: int) -> Chunked:
    """(1) for every chunk at once: q, k [B, H, T, d_k], v [B, H, T, d_v], g (log decay, <= 0) and beta [B, H, T],
    reset [B, T] bool or None."""
    B, H, T, _ = q.shape
    L = min(chunk, T)
    K = math.ceil(T / L)
    pad = K * L - T
    if pad:  # steps that change nothing: no decay, no write, no read
        q, k, v, g, beta = (F.pad(x, (0, 0, 0, pad)) if x.dim() == 4 else F.pad(x, (0, pad)) for x in (q, k, v, g, beta))
        reset = None if reset is None else F.pad(reset, (0, pad))

    def cut(x):
        return x.reshape(x.shape[0], x.shape[1], K, L, *x.shape[3:])
    qc, kc, vc, gc, bc = (cut(x) for x in (q, k, v, g, beta))
    return Chunked(qc, kc, terms(kc, vc, gc, bc, None if reset is None else reset.reshape(B, 1, K, L)), T)


def run(c: Chunked, S: Tensor):
    """(2) chunk by chunk from S [B, H, d_k, d_v]. Returns o [B, H, T, d_v] and the state after the window."""
    B, H, K, L, _ = c.q.shape
    t = c.terms
    # what the loop reads, for every chunk at once; unbound once (one backward for all K, not K selects)
    reads = torch.cat([t.Wk, t.G[..., None] * c.q], dim=-2).unbind(2)  # both multiply the entering state
    within = (t.D * (c.q @ c.k.transpose(-1, -2))).unbind(2)
    Kd, Gl, Wv = decayed_keys(c.k, t).unbind(2), t.G[..., -1, None, None].unbind(2), t.Wv.unbind(2)
    outputs = []
    for j in range(K):
        WkS, qS = (reads[j] @ S).split(L, dim=-2)
        U = Wv[j] - WkS
        outputs.append(qS + within[j] @ U)
        S = Gl[j] * S + Kd[j] @ U
    return torch.stack(outputs, dim=2).reshape(B, H, K * L, -1)[:, :, :c.T], S


def composed(c: Chunked) -> tuple[Tensor, Tensor]:
    """The whole window's effect on the state entering it, S -> A S + B: its chunks' maps composed in order."""
    A, B = summary(c.k, c.terms)
    Aw, Bw = A[:, :, 0], B[:, :, 0]
    for j in range(1, A.shape[2]):
        Aw, Bw = A[:, :, j] @ Aw, A[:, :, j] @ Bw + B[:, :, j]
    return Aw, Bw


@at_least_fp32
def chunkwise(q, k, v, g, beta, reset: Optional[Tensor], S: Tensor, chunk: int):
    """q, k [B, H, T, d_k], v [B, H, T, d_v], g (log decay, <= 0) and beta [B, H, T], reset [B, T] bool or None,
    S [B, H, d_k, d_v], in chunks of `chunk` steps. Returns o [B, H, T, d_v] and the state after the window."""
    return run(chunked(q, k, v, g, beta, reset, chunk), S)


def parallel(q, k, v, g, beta, reset: Optional[Tensor], S: Tensor):
    """The whole window as one chunk: the quadratic form (T x T products), the others' reference."""
    return chunkwise(q, k, v, g, beta, reset, S, chunk=q.shape[2])
