"""The modified LSTM's time loops for cells too wide for one program's registers (one head of more than 64 units,
heads wider than 64, the gate norm with several heads): each step a cuBLAS product and one fused Triton kernel
for everything pointwise, and the whole loop replayed as one CUDA graph (rpt.kernels.triton.graphs).

They fill the same buffers as the Python loops in rpt/ops/modlstm/loops.py (`forward_steps`, `backward_steps`),
step for step, so the cell's operator and its backward are unchanged around them: the forward step kernel applies
the reset, the gate layer norm over each group's H units (so a program holds a row's whole group when the norm is
on), the peepholes and the gate functions (built-in, or a registered gate's Triton form), and writes the next
step's masked h for the next product; the backward step kernel runs backward_steps' per-step body over the
precomputed factors (backward_factors), the layer norm's backward included. Two launches a step, where the
Python loops issue about ten.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from rpt.kernels.triton import GATE_FORMS
from rpt.kernels.triton.graphs import replay
from rpt.kernels.triton.common import _tanh
from rpt.ops.modlstm.triton import GATES, REGISTERED, _exp_step, _sigmoid_step

MAX_BLOCK = 256  # units of a row one program takes when the gate norm does not need them all


@triton.jit
def _group(ptr, g, u, ok, H):
    """Group g's [1, BLOCK] slice of a row laid out [G, H] at ptr (in the buffers' dtype: float32 in training,
    float64 in the GPU run of the model tests)."""
    return tl.load(ptr + g * H + u, mask=ok, other=0.0)


@triton.jit
def _masked_norm(p, ok, w, b, H):
    """Layer norm of one row's group (its H units, the padding masked), then scale and shift: (y, mean, 1/std)."""
    mean = tl.sum(p, axis=1) / H
    centred = tl.where(ok, p - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) / H + 1e-5)
    return centred * rstd[:, None] * w + b, mean, rstd


@triton.jit
def _norm_step(p, g, ok, u, b, B, H, LNW, LNB, LN_IN, LN_STATS, G: tl.constexpr):
    """Group g's layer norm at this step, keeping its raw input and statistics ([2, B, G]) for the backward."""
    tl.store(LN_IN + g * H + u, p, mask=ok)
    y, mean, rstd = _masked_norm(p, ok, _group(LNW, g, u, ok, H), _group(LNB, g, u, ok, H), H)
    tl.store(LN_STATS + b * G + g + tl.zeros_like(mean).to(tl.int32), mean)
    tl.store(LN_STATS + B * G + b * G + g + tl.zeros_like(rstd).to(tl.int32), rstd)
    return y


@triton.jit
def modlstm_step_kernel(P, C_PREV, N_PREV, M, KEEP, KEEP_NEXT, LNW, LNB, PEEP, ACT, PRE, CS, HS, NS, LN_IN,
                        LN_STATS, H_NEXT, B, H, BLOCK: tl.constexpr, G: tl.constexpr, GATE: tl.constexpr,
                        COUPLED: tl.constexpr, PEEPHOLES: tl.constexpr, NORM: tl.constexpr, HAS_PRE: tl.constexpr,
                        HAS_KEEP: tl.constexpr, HAS_KEEP_NEXT: tl.constexpr, FN: tl.constexpr):
    """One step for row b, units [cb * BLOCK, ...): P holds the raw pre-activations x W_x^T + b + h_{t-1} W_h^T."""
    b = tl.program_id(0)
    u = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)[None, :]
    ok = u < H
    GF: tl.constexpr = G - 3  # group order: (i, f, z, o), or (f, z, o) with coupled gates
    keep = 1.0
    if HAS_KEEP:
        keep = tl.load(KEEP + b)
    c = tl.load(C_PREV + b * H + u, mask=ok, other=0.0) * keep
    row = P + b * G * H
    p_f, p_z, p_o = _group(row, GF, u, ok, H), _group(row, GF + 1, u, ok, H), _group(row, GF + 2, u, ok, H)
    p_i = p_f
    if not COUPLED:
        p_i = _group(row, 0, u, ok, H)
    if NORM:  # the program holds the row's whole group (BLOCK >= H)
        ln_in, ln_stats = LN_IN + b * G * H, LN_STATS
        p_f = _norm_step(p_f, GF, ok, u, b, B, H, LNW, LNB, ln_in, ln_stats, G)
        p_z = _norm_step(p_z, GF + 1, ok, u, b, B, H, LNW, LNB, ln_in, ln_stats, G)
        p_o = _norm_step(p_o, GF + 2, ok, u, b, B, H, LNW, LNB, ln_in, ln_stats, G)
        if not COUPLED:
            p_i = _norm_step(p_i, 0, ok, u, b, B, H, LNW, LNB, ln_in, ln_stats, G)
    z = _tanh(p_z)
    state = b * H + u
    if GATE == 2:  # the stabilised exponential gate (m a constant to differentiation)
        n = tl.load(N_PREV + state, mask=ok, other=0.0) * keep
        i, f, o, c, n, m, h = _exp_step(p_i, p_f, z, p_o, c, n, tl.load(M + state, mask=ok, other=0.0) * keep)
        tl.store(M + state, m, mask=ok)
        tl.store(NS + state, n, mask=ok)
    else:
        peep_i, peep_f, peep_o = p_f * 0.0, p_f * 0.0, p_f * 0.0
        if PEEPHOLES:
            peep_f, peep_o = _group(PEEP, G - 3, u, ok, H), _group(PEEP, G - 2, u, ok, H)
            if not COUPLED:
                peep_i = _group(PEEP, 0, u, ok, H)
        i, f, o, c, h, p_i, p_f, p_o = _sigmoid_step(p_i, p_f, z, p_o, c, peep_i, peep_f, peep_o, GATE, FN, COUPLED,
                                                     PEEPHOLES)
    if HAS_PRE:  # the gate inputs, as the cell's own loop keeps them
        _store_rows(PRE + b * G * H, u, ok, H, p_i, p_f, p_z, p_o, GF, COUPLED)
    _store_rows(ACT + b * G * H, u, ok, H, i, f, z, o, GF, COUPLED)
    tl.store(CS + state, c, mask=ok)
    tl.store(HS + state, h, mask=ok)
    keep_next = 1.0
    if HAS_KEEP_NEXT:
        keep_next = tl.load(KEEP_NEXT + b)
    tl.store(H_NEXT + state, h * keep_next, mask=ok)  # what the next step's product reads


@triton.jit
def _store_rows(ptr, u, ok, H, i, f, z, o, GF: tl.constexpr, COUPLED: tl.constexpr):
    tl.store(ptr + GF * H + u, f, mask=ok)
    tl.store(ptr + (GF + 1) * H + u, z, mask=ok)
    tl.store(ptr + (GF + 2) * H + u, o, mask=ok)
    if not COUPLED:
        tl.store(ptr + u, i, mask=ok)


@triton.jit
def modlstm_step_backward_kernel(DH_IN, KEEP_NEXT, GY, DC, DN, K_C, K_O, K_DC, K_CC, K_N, K_DN, LNW, LN_IN,
                                 LN_STATS, DP, DP_RAW, B, H, BLOCK: tl.constexpr, G: tl.constexpr,
                                 EXP: tl.constexpr, NORM: tl.constexpr, HAS_KEEP_NEXT: tl.constexpr):
    """backward_steps' body at one step for row b: DH_IN is the later step's dP_raw W_h (or the final state's
    gradient), masked here by that step's reset; dc and dn are carried in place."""
    b = tl.program_id(0)
    u = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)[None, :]
    ok = u < H
    state = b * H + u
    keep_next = 1.0
    if HAS_KEEP_NEXT:
        keep_next = tl.load(KEEP_NEXT + b)
    dh = tl.load(DH_IN + state, mask=ok, other=0.0) * keep_next + tl.load(GY + state, mask=ok, other=0.0)
    dc = tl.load(DC + state, mask=ok, other=0.0) + dh * tl.load(K_C + state, mask=ok, other=0.0)
    k_cc = tl.load(K_CC + state, mask=ok, other=0.0)
    dp_last = dh * tl.load(K_O + state, mask=ok, other=0.0)
    k_dc = K_DC + b * (G - 1) * H
    dp_0 = dc * _group(k_dc, 0, u, ok, H)
    dp_1 = dc * _group(k_dc, 1, u, ok, H)
    dp_2 = dc * 0.0
    if G == 4:
        dp_2 = dc * _group(k_dc, 2, u, ok, H)
    if EXP:  # the normaliser's gradient reaches i and f
        dn = tl.load(DN + state, mask=ok, other=0.0) + dh * tl.load(K_N + state, mask=ok, other=0.0)
        k_dn = K_DN + b * 2 * H
        dp_0 += dn * _group(k_dn, 0, u, ok, H)
        dp_1 += dn * _group(k_dn, 1, u, ok, H)
        tl.store(DN + state, dn * k_cc, mask=ok)
    tl.store(DC + state, dc * k_cc, mask=ok)
    dp, dp_raw = DP + b * G * H, DP_RAW + b * G * H
    _store_grad(dp, dp_raw, 0, dp_0, u, ok, b, B, H, LNW, LN_IN, LN_STATS, G, NORM)
    _store_grad(dp, dp_raw, 1, dp_1, u, ok, b, B, H, LNW, LN_IN, LN_STATS, G, NORM)
    if G == 4:
        _store_grad(dp, dp_raw, 2, dp_2, u, ok, b, B, H, LNW, LN_IN, LN_STATS, G, NORM)
    _store_grad(dp, dp_raw, G - 1, dp_last, u, ok, b, B, H, LNW, LN_IN, LN_STATS, G, NORM)


@triton.jit
def _store_grad(DP, DP_RAW, g, dp, u, ok, b, B, H, LNW, LN_IN, LN_STATS, G: tl.constexpr, NORM: tl.constexpr):
    """Group g's gradient at the gate inputs, and (gate norm) back through the norm to the raw pre-activation."""
    tl.store(DP + g * H + u, dp, mask=ok)
    if NORM:
        zero = tl.zeros((1,), dtype=tl.int32)
        mean = tl.load(LN_STATS + b * G + g + zero)
        rstd = tl.load(LN_STATS + B * G + b * G + g + zero)
        xhat = tl.where(ok, (_group(LN_IN + b * G * H, g, u, ok, H) - mean[:, None]) * rstd[:, None], 0.0)
        dx_hat = dp * _group(LNW, g, u, ok, H)
        mean_dx = tl.sum(dx_hat, axis=1)[:, None] / H
        mean_dx_xhat = tl.sum(dx_hat * xhat, axis=1)[:, None] / H
        dp = (dx_hat - mean_dx - xhat * mean_dx_xhat) * rstd[:, None]
        tl.store(DP_RAW + g * H + u, dp, mask=ok)


def _grid(B: int, H: int, norm: bool) -> tuple[tuple[int, int], int]:
    block = triton.next_power_of_2(H) if norm else min(triton.next_power_of_2(H), MAX_BLOCK)
    return (B, triton.cdiv(H, block)), block


def triton_forward_steps(gate: str, coupled: bool, XP: Tensor, w_h: Tensor, keep: Optional[Tensor], state: tuple,
                  acts: Tensor, pre: Optional[Tensor], cs: Tensor, hs: Tensor, ns: Optional[Tensor],
                  ln_in: Optional[Tensor], ln_stats: Optional[Tensor], ln_w: Optional[Tensor], ln_b: Optional[Tensor],
                  peep: Optional[Tensor]) -> tuple:
    """loops.forward_steps on a GPU: fills the same buffers, returns the final state; w_h is the
    dense recurrent matrix [G*H, H]. On a GPU the loop is one CUDA graph's replay."""
    exp = gate == "exp"
    n0, m0 = (state[2], state[3]) if exp else (None, None)
    final = replay(_forward_loop, (gate, coupled), [XP, w_h, keep, state[0], state[1], n0, m0, ln_w, ln_b, peep],
                   [acts, pre, cs, hs, ns, ln_in, ln_stats])
    return tuple(final) if exp else tuple(final[:2])


def _forward_loop(flags, inputs, outputs) -> list[Tensor]:
    gate, coupled = flags
    XP, w_h, keep, h0, c0, n0, m0, ln_w, ln_b, peep = inputs
    acts, pre, cs, hs, ns, ln_in, ln_stats = outputs
    T, B, G, H = acts.shape
    exp = gate == "exp"
    grid, block = _grid(B, H, ln_w is not None)
    some = lambda t: t if t is not None else hs  # noqa: E731  (a pointer the kernel does not read)
    fn = GATE_FORMS.get(gate, (_tanh, _tanh))[0]  # a registered gate's Triton form (built-ins call none)
    consts = dict(BLOCK=block, G=G, GATE=GATES.get(gate, REGISTERED), COUPLED=coupled, PEEPHOLES=peep is not None,
                  NORM=ln_w is not None, HAS_PRE=pre is not None, HAS_KEEP=keep is not None, FN=fn)
    w_t = w_h.t()
    P = XP.new_empty(B, G * H)
    h_next = torch.empty_like(h0)
    h_in = h0 * keep[0][:, None] if keep is not None else h0
    m = m0.clone() if exp else None
    for t in range(T):
        torch.addmm(XP[t], h_in, w_t, out=P)
        c_prev, n_prev = (cs[t - 1], ns[t - 1] if exp else None) if t else (c0, n0)
        later = keep is not None and t + 1 < T
        modlstm_step_kernel[grid](
            P, c_prev, some(n_prev), some(m), some(keep[t] if keep is not None else None),
            some(keep[t + 1] if later else None), some(ln_w), some(ln_b), some(peep), acts[t],
            some(pre[t] if pre is not None else None), cs[t], hs[t], some(ns[t] if exp else None),
            some(ln_in[t] if ln_in is not None else None), some(ln_stats[t] if ln_stats is not None else None),
            h_next, B, H, HAS_KEEP_NEXT=later, **consts)
        h_in = h_next
    return [hs[-1], cs[-1], ns[-1], m] if exp else [hs[-1], cs[-1]]


def triton_backward_steps(grad_y: Tensor, K_c: Tensor, K_o: Tensor, K_dc: Tensor, K_cc: Tensor, K_n: Optional[Tensor],
                   K_dn: Optional[Tensor], dP: Tensor, dP_raw: Tensor, keep: Optional[Tensor], w_h: Tensor,
                   dh: Tensor, dc: Tensor, dn: Optional[Tensor], ln_w: Optional[Tensor], ln_in: Optional[Tensor],
                   ln_stats: Optional[Tensor]) -> tuple:
    """loops.backward_steps on a GPU (keep [T, B] here): fills dP and dP_raw, returns the initial
    state's gradient. w_h is the dense recurrent matrix [G*H, H]."""
    inputs = [grad_y.contiguous(), K_c, K_o, K_dc, K_cc, K_n, K_dn, keep, w_h, dh, dc, dn, ln_w, ln_in, ln_stats]
    outputs = [dP, dP_raw if ln_w is not None else None]
    grads = replay(_backward_loop, (K_n is not None,), inputs, outputs)
    return tuple(grads) if K_n is not None else tuple(grads[:2])


def _backward_loop(flags, inputs, outputs) -> list[Tensor]:
    grad_y, K_c, K_o, K_dc, K_cc, K_n, K_dn, keep, w_h, dh, dc, dn, ln_w, ln_in, ln_stats = inputs
    dP, dP_raw = outputs
    dP_raw = dP_raw if dP_raw is not None else dP
    T, B, G, H = dP.shape
    exp = K_n is not None
    grid, block = _grid(B, H, ln_w is not None)
    some = lambda t: t if t is not None else dh  # noqa: E731
    dh_in, dc, dn = dh.clone(), dc.clone(), dn.clone() if exp else None
    for t in reversed(range(T)):
        later = keep is not None and t + 1 < T
        modlstm_step_backward_kernel[grid](
            dh_in, some(keep[t + 1] if later else None), grad_y[t], dc, some(dn), K_c[t], K_o[t], K_dc[t], K_cc[t],
            some(K_n[t] if exp else None), some(K_dn[t] if exp else None), some(ln_w),
            some(ln_in[t] if ln_in is not None else None), some(ln_stats[t] if ln_stats is not None else None),
            dP[t], dP_raw[t], B, H, BLOCK=block, G=G, EXP=exp, NORM=ln_w is not None, HAS_KEEP_NEXT=later)
        torch.mm(dP_raw[t].view(B, G * H), w_h, out=dh_in)
    dh0 = dh_in * keep[0][:, None] if keep is not None else dh_in
    return [dh0, dc, dn] if exp else [dh0, dc]
