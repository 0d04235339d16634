"""The modified LSTM's time loop in two Triton kernels, a program per (head, 16 rows), as rpt/ops/lstm/triton.py
runs the lstm: the head's recurrent blocks and its rows' state on chip for the whole sequence.

The step is modlstm's spec (spec.py): pre-activations P = GX_t + h_{t-1} R^T (GX = x W_x^T + b for all
steps, one GEMM outside), the gate layer norm over each group (heads = 1 only: a head holds all H units), peepholes,
coupled gates, the sigmoid and hard-sigmoid gates, and the exponential gate with its stabiliser m (a constant to
differentiation, as in the spec). The forward keeps what the backward reads: gate values, the gate inputs,
c, n and m per step, and the layer norm's normalised input and 1/std. The backward walks back in time and writes
the raw pre-activations' gradient (turned into those of x, W_x, b and R by products outside: lstm.recurrent_grad),
and each program's share of the gradients of the peepholes and the layer norm's scale and shift, in float32,
summed after (no atomics).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from rpt.kernels.triton import GATE_FORMS
from rpt.kernels.triton.common import BLOCK_B, _block, _precision, _program, _tanh, padded, recurrent_grad, tuned

GATES = {"sigmoid": 0, "hard_sigmoid": 1, "exp": 2}  # any other: a registered gate's own Triton form (3)
REGISTERED = 3


@triton.jit
def _gate(x, GATE: tl.constexpr, FN: tl.constexpr):
    if GATE == 1:
        y = tl.minimum(tl.maximum(x / 6.0 + 0.5, 0.0), 1.0)
    elif GATE == 3:
        y = FN(x)
    else:
        y = tl.sigmoid(x)
    return y


@triton.jit
def _gate_grad(x, y, GATE: tl.constexpr, FN_GRAD: tl.constexpr):
    if GATE == 1:
        dy = tl.where((x > -3.0) & (x < 3.0), 1.0 / 6.0, 0.0)
    elif GATE == 3:
        dy = FN_GRAD(x, y)
    else:
        dy = y * (1.0 - y)
    return dy


@triton.jit
def _norm(p, w, b, D: tl.constexpr):
    """Layer norm of each row's D units (one gate group), then scale and shift: (y, normalised input, 1/std)."""
    mean = tl.sum(p, axis=1) / D
    centred = p - mean[:, None]
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) / D + 1e-5)
    xhat = centred * rstd[:, None]
    return xhat * w[None, :] + b[None, :], xhat, rstd


@triton.jit
def _norm_grad(dy, xhat, rstd, w, D: tl.constexpr):
    dx_hat = dy * w[None, :]
    mean_dx = tl.sum(dx_hat, axis=1)[:, None] / D
    mean_dx_xhat = tl.sum(dx_hat * xhat, axis=1)[:, None] / D
    return (dx_hat - mean_dx - xhat * mean_dx_xhat) * rstd[:, None]


@triton.jit
def _blocks(R, j, heads, rows, cols, D: tl.constexpr, GF: tl.constexpr, COUPLED: tl.constexpr):
    """Head j's blocks of the groups (i, f, z, o); i repeats f's with coupled gates (it has none)."""
    r_f = _block(R, GF, j, heads, rows, cols, D)
    r_i = r_f
    if not COUPLED:
        r_i = _block(R, 0, j, heads, rows, cols, D)
    return r_i, r_f, _block(R, GF + 1, j, heads, rows, cols, D), _block(R, GF + 2, j, heads, rows, cols, D)


@triton.jit
def _peepholes(PEEP, j, H, D: tl.constexpr, DP: tl.constexpr, G: tl.constexpr, COUPLED: tl.constexpr,
               PEEPHOLES: tl.constexpr):
    """Head j's peephole weights of i, f, o as [1, D] rows (zeros where the cell has none)."""
    p_i = tl.zeros((1, DP), dtype=tl.float32)
    p_f, p_o = p_i, p_i
    if PEEPHOLES:
        p_f, p_o = _vector(PEEP, G - 3, j, H, D, DP)[None, :], _vector(PEEP, G - 2, j, H, D, DP)[None, :]
        if not COUPLED:
            p_i = _vector(PEEP, 0, j, H, D, DP)[None, :]
    return p_i, p_f, p_o


@triton.jit
def _vector(V, g, j, H, D: tl.constexpr, DP: tl.constexpr):
    """Row g of a [groups, H] parameter, head j's D units (zero past D)."""
    u = tl.arange(0, DP)
    return tl.load(V + g * H + j * D + u, mask=u < D, other=0.0).to(tl.float32)


@triton.jit
def _pre(GX, R_T, h, g, t, B, b, ok, j, u, H, G: tl.constexpr, D: tl.constexpr, PRECISION: tl.constexpr):
    """Group g's raw pre-activation at step t: GX_t + h R_g^T."""
    gx = tl.load(GX + t * B * G * H + b[:, None] * G * H + g * H + j * D + u[None, :], mask=ok, other=0.0)
    return gx.to(tl.float32) + tl.dot(h, R_T, input_precision=PRECISION)


@triton.jit
def _norm_forward(p, g, XHAT, RSTD, LNW, LNB, t, B, b, ok, u, H, G: tl.constexpr, D: tl.constexpr,
                  DP: tl.constexpr):
    """Group g's layer norm at step t (heads == 1), keeping the normalised input and 1/std for the backward."""
    y, xhat, rstd = _norm(p, _vector(LNW, g, 0, H, D, DP), _vector(LNB, g, 0, H, D, DP), D)
    tl.store(XHAT + t * B * G * H + b[:, None] * G * H + g * H + u[None, :], xhat, mask=ok)
    tl.store(RSTD + t * B * G + b * G + g, rstd, mask=b < B)
    return y


@triton.jit
def _norm_backward(dy, g, XHAT, RSTD, LNW, t, B, b, ok, u, H, G: tl.constexpr, D: tl.constexpr,
                   DP: tl.constexpr):
    """Back through group g's layer norm: (the raw pre-activation's gradient, the scale's and the shift's shares)."""
    xhat = tl.load(XHAT + t * B * G * H + b[:, None] * G * H + g * H + u[None, :], mask=ok, other=0.0)
    rstd = tl.load(RSTD + t * B * G + b * G + g, mask=b < B, other=0.0)
    return _norm_grad(dy, xhat, rstd, _vector(LNW, g, 0, H, D, DP), D), _row_sum(dy * xhat), _row_sum(dy)


@triton.jit
def _row_sum(x):
    return tl.sum(x, axis=0)


@tuned("T", "B", "heads", "D", "GATE", "COUPLED", "PEEPHOLES", "NORM", "HAS_KEEP")
@triton.jit
def modlstm_forward_kernel(GX, R, LNW, LNB, PEEP, H0, C0, N0, M0, KEEP, HS, CS, NS, MS, ACT, PRE, XHAT, RSTD,
                           T, B, heads, D: tl.constexpr, DP: tl.constexpr, BB: tl.constexpr, G: tl.constexpr,
                           GATE: tl.constexpr,
                           COUPLED: tl.constexpr, PEEPHOLES: tl.constexpr, NORM: tl.constexpr,
                           HAS_KEEP: tl.constexpr, PRECISION: tl.constexpr, FN: tl.constexpr, FN_GRAD: tl.constexpr):
    j, _, b, u, H, ok = _program(B, heads, D, DP, BB)
    GF: tl.constexpr = G - 3  # group order: (i, f, z, o), or (f, z, o) with coupled gates
    state = b[:, None] * H + j * D + u[None, :]
    h = tl.load(H0 + state, mask=ok, other=0.0).to(tl.float32)
    c = tl.load(C0 + state, mask=ok, other=0.0).to(tl.float32)
    n = tl.zeros((BB, DP), dtype=tl.float32)
    m = n
    if GATE == 2:
        n = tl.load(N0 + state, mask=ok, other=0.0).to(tl.float32)
        m = tl.load(M0 + state, mask=ok, other=0.0).to(tl.float32)
    r_i, r_f, r_z, r_o = _blocks(R, j, heads, u[None, :], u[:, None], D, GF, COUPLED)  # R_g^T, [in, out]
    peep_i, peep_f, peep_o = _peepholes(PEEP, j, H, D, DP, G, COUPLED, PEEPHOLES)
    for t in range(T):
        if HAS_KEEP:
            keep = tl.load(KEEP + t * B + b, mask=b < B, other=1.0).to(tl.float32)[:, None]
            h, c, n, m = h * keep, c * keep, n * keep, m * keep
        p_f = _pre(GX, r_f, h, GF, t, B, b, ok, j, u, H, G, D, PRECISION)
        p_z = _pre(GX, r_z, h, GF + 1, t, B, b, ok, j, u, H, G, D, PRECISION)
        p_o = _pre(GX, r_o, h, GF + 2, t, B, b, ok, j, u, H, G, D, PRECISION)
        p_i = p_f
        if not COUPLED:
            p_i = _pre(GX, r_i, h, 0, t, B, b, ok, j, u, H, G, D, PRECISION)
        if NORM:  # heads == 1: the program holds every unit of each group
            p_f = _norm_forward(p_f, GF, XHAT, RSTD, LNW, LNB, t, B, b, ok, u, H, G, D, DP)
            p_z = _norm_forward(p_z, GF + 1, XHAT, RSTD, LNW, LNB, t, B, b, ok, u, H, G, D, DP)
            p_o = _norm_forward(p_o, GF + 2, XHAT, RSTD, LNW, LNB, t, B, b, ok, u, H, G, D, DP)
            if not COUPLED:
                p_i = _norm_forward(p_i, 0, XHAT, RSTD, LNW, LNB, t, B, b, ok, u, H, G, D, DP)
        z = _tanh(p_z)
        if GATE == 2:
            i, f, o, c, n, m, h = _exp_step(p_i, p_f, z, p_o, c, n, m)
            tl.store(NS + t * B * H + state, n, mask=ok)
            tl.store(MS + t * B * H + state, m, mask=ok)
        else:
            i, f, o, c, h, p_i, p_f, p_o = _sigmoid_step(p_i, p_f, z, p_o, c, peep_i, peep_f, peep_o, GATE, FN,
                                                         COUPLED, PEEPHOLES)
            pre = PRE + t * B * 2 * H + b[:, None] * 2 * H + j * D + u[None, :]
            tl.store(pre, p_f, mask=ok)
            tl.store(pre + H, p_i, mask=ok)
        _store_groups(ACT + t * B * G * H + b[:, None] * G * H + j * D + u[None, :], ok, H, i, f, z, o, GF, COUPLED)
        tl.store(HS + t * B * H + state, h, mask=ok)
        tl.store(CS + t * B * H + state, c, mask=ok)


@triton.jit
def _exp_step(p_i, p_f, z, p_o, c, n, m):
    """The stabilised exponential gate's step, m_t = max(P_f + m_{t-1}, P_i) (-inf before a fresh start): the gate
    values i, f, o and the new c, n, m, h."""
    m_prev = tl.where(n > 0, m, float("-inf"))
    m = tl.maximum(p_f + m_prev, p_i)
    i = tl.exp(p_i - m)
    f = tl.exp(p_f + m_prev - m)
    c = f * c + i * z
    n = f * n + i
    o = tl.sigmoid(p_o)
    return i, f, o, c, n, m, o * c / n


@triton.jit
def _sigmoid_step(p_i, p_f, z, p_o, c, peep_i, peep_f, peep_o, GATE: tl.constexpr, FN: tl.constexpr,
                  COUPLED: tl.constexpr, PEEPHOLES: tl.constexpr):
    """The sigmoid family's step from c_{t-1}: the gate values i, f, o, the new c and h, and the gate inputs with
    their peepholes (i's is f's with coupled gates), as the backward reads them."""
    if PEEPHOLES:
        p_f = p_f + peep_f * c
        if not COUPLED:
            p_i = p_i + peep_i * c
    f = _gate(p_f, GATE, FN)
    i = 1.0 - f
    if not COUPLED:
        i = _gate(p_i, GATE, FN)
    c = f * c + i * z
    if PEEPHOLES:
        p_o = p_o + peep_o * c
    o = tl.sigmoid(p_o)
    return i, f, o, c, o * _tanh(c), p_i, p_f, p_o


@triton.jit
def _store_groups(ptr, mask, stride, i, f, z, o, GF: tl.constexpr, COUPLED: tl.constexpr):
    """Per-group values at ptr + group * stride, in the groups' memory order (no i with coupled gates)."""
    tl.store(ptr + GF * stride, f, mask=mask)
    tl.store(ptr + (GF + 1) * stride, z, mask=mask)
    tl.store(ptr + (GF + 2) * stride, o, mask=mask)
    if not COUPLED:
        tl.store(ptr, i, mask=mask)


@triton.jit
def _store_peepholes(ptr, mask, stride, i, f, o, COUPLED: tl.constexpr):
    """The peepholes' rows: (i, f, o), or (f, o) with coupled gates."""
    if COUPLED:
        tl.store(ptr, f, mask=mask)
        tl.store(ptr + stride, o, mask=mask)
    else:
        tl.store(ptr, i, mask=mask)
        tl.store(ptr + stride, f, mask=mask)
        tl.store(ptr + 2 * stride, o, mask=mask)


@triton.jit
def _exp_grads(dh, dc, dn, c, c_prev, n, n_prev, i, f, z, o):
    """The exponential gate's step backward (m a constant): the groups' gradients and those of c_{t-1}, n_{t-1}."""
    dp_o = dh * c / n * o * (1.0 - o)
    dc = dc + dh * o / n
    dn = dn - dh * o * c / (n * n)
    return (dc * z + dn) * i, (dc * c_prev + dn * n_prev) * f, dc * i * (1.0 - z * z), dp_o, dc * f, dn * f


@triton.jit
def _sigmoid_grads(dh, dc, c, c_prev, x_i, x_f, i, f, z, o, peep_i, peep_f, peep_o, GATE: tl.constexpr,
                   FN_GRAD: tl.constexpr, COUPLED: tl.constexpr, PEEPHOLES: tl.constexpr):
    """The sigmoid family's step backward: the groups' gradients, that of c_{t-1}, and the peepholes' shares."""
    tc = _tanh(c)
    dp_o = dh * tc * o * (1.0 - o)
    dc = dc + dh * o * (1.0 - tc * tc)
    if PEEPHOLES:
        dc += dp_o * peep_o
    dp_z = dc * i * (1.0 - z * z)
    d_f = dc * c_prev
    dp_i = dc * 0.0
    if COUPLED:
        d_f = d_f - dc * z
    else:
        dp_i = dc * z * _gate_grad(x_i, i, GATE, FN_GRAD)
    dp_f = d_f * _gate_grad(x_f, f, GATE, FN_GRAD)
    dc_prev = dc * f
    if PEEPHOLES:
        dc_prev += dp_f * peep_f + dp_i * peep_i
    return dp_i, dp_f, dp_z, dp_o, dc_prev, _row_sum(dp_i * c_prev), _row_sum(dp_f * c_prev), _row_sum(dp_o * c)


@tuned("T", "B", "heads", "D", "GATE", "COUPLED", "PEEPHOLES", "NORM", "HAS_KEEP")
@triton.jit
def modlstm_backward_kernel(DHS, DCS, DNS, R, LNW, PEEP, C0, N0, KEEP, CS, NS, ACT, PRE, XHAT, RSTD, DGX, DPEEP,
                            DLNW, DLNB, DH0, DC0, DN0, T, B, heads, D: tl.constexpr, DP: tl.constexpr,
                            BB: tl.constexpr, G: tl.constexpr, GATE: tl.constexpr, COUPLED: tl.constexpr,
                            PEEPHOLES: tl.constexpr, NORM: tl.constexpr, HAS_KEEP: tl.constexpr,
                            PRECISION: tl.constexpr, FN: tl.constexpr, FN_GRAD: tl.constexpr):
    j, pb, b, u, H, ok = _program(B, heads, D, DP, BB)
    GF: tl.constexpr = G - 3
    state = b[:, None] * H + j * D + u[None, :]
    r_i, r_f, r_z, r_o = _blocks(R, j, heads, u[:, None], u[None, :], D, GF, COUPLED)  # R_g: dh = dP_g @ R_g
    zero_d = tl.zeros((DP,), dtype=tl.float32)
    peep_i, peep_f, peep_o = _peepholes(PEEP, j, H, D, DP, G, COUPLED, PEEPHOLES)
    dh = tl.zeros((BB, DP), dtype=tl.float32)
    dc, dn = dh, dh
    dpeep_i, dpeep_f, dpeep_o = zero_d, zero_d, zero_d
    dlnw_i, dlnw_f, dlnw_z, dlnw_o = zero_d, zero_d, zero_d, zero_d
    dlnb_i, dlnb_f, dlnb_z, dlnb_o = zero_d, zero_d, zero_d, zero_d
    for step in range(T):
        t = T - 1 - step
        here, earlier = t * B * H + state, (t - 1) * B * H + state  # earlier: the step before, or the start
        dh += tl.load(DHS + here, mask=ok, other=0.0)
        dc += tl.load(DCS + here, mask=ok, other=0.0)
        keep = tl.full((BB, 1), 1.0, tl.float32)
        if HAS_KEEP:
            keep = tl.load(KEEP + t * B + b, mask=b < B, other=1.0).to(tl.float32)[:, None]
        c_prev = tl.load(tl.where(t > 0, CS + earlier, C0 + state), mask=ok, other=0.0) * keep
        c = tl.load(CS + here, mask=ok, other=0.0)
        acts = ACT + t * B * G * H + b[:, None] * G * H + j * D + u[None, :]
        f = tl.load(acts + GF * H, mask=ok, other=0.0)
        z = tl.load(acts + (GF + 1) * H, mask=ok, other=0.0)
        o = tl.load(acts + (GF + 2) * H, mask=ok, other=0.0)
        i = 1.0 - f
        if not COUPLED:
            i = tl.load(acts, mask=ok, other=0.0)
        if GATE == 2:
            dn += tl.load(DNS + here, mask=ok, other=0.0)
            n = tl.load(NS + here, mask=ok, other=1.0)
            n_prev = tl.load(tl.where(t > 0, NS + earlier, N0 + state), mask=ok, other=0.0) * keep
            dp_i, dp_f, dp_z, dp_o, dc_prev, dn = _exp_grads(dh, dc, dn, c, c_prev, n, n_prev, i, f, z, o)
            dn = dn * keep
        else:
            pre = PRE + t * B * 2 * H + b[:, None] * 2 * H + j * D + u[None, :]
            dp_i, dp_f, dp_z, dp_o, dc_prev, s_i, s_f, s_o = _sigmoid_grads(
                dh, dc, c, c_prev, tl.load(pre + H, mask=ok, other=0.0), tl.load(pre, mask=ok, other=0.0), i, f, z,
                o, peep_i, peep_f, peep_o, GATE, FN_GRAD, COUPLED, PEEPHOLES)
            dpeep_i, dpeep_f, dpeep_o = dpeep_i + s_i, dpeep_f + s_f, dpeep_o + s_o
        if NORM:  # back through each group's layer norm (heads == 1)
            dp_f, w_f, b_f = _norm_backward(dp_f, GF, XHAT, RSTD, LNW, t, B, b, ok, u, H, G, D, DP)
            dp_z, w_z, b_z = _norm_backward(dp_z, GF + 1, XHAT, RSTD, LNW, t, B, b, ok, u, H, G, D, DP)
            dp_o, w_o, b_o = _norm_backward(dp_o, GF + 2, XHAT, RSTD, LNW, t, B, b, ok, u, H, G, D, DP)
            dp_i, w_i, b_i = _norm_backward(dp_i, 0, XHAT, RSTD, LNW, t, B, b, ok, u, H, G, D, DP)  # (coupled: unused)
            dlnw_i, dlnw_f, dlnw_z, dlnw_o = dlnw_i + w_i, dlnw_f + w_f, dlnw_z + w_z, dlnw_o + w_o
            dlnb_i, dlnb_f, dlnb_z, dlnb_o = dlnb_i + b_i, dlnb_f + b_f, dlnb_z + b_z, dlnb_o + b_o
        _store_groups(DGX + t * B * G * H + b[:, None] * G * H + j * D + u[None, :], ok, H, dp_i, dp_f, dp_z, dp_o,
                      GF, COUPLED)
        dh = (tl.dot(dp_f, r_f, input_precision=PRECISION) + tl.dot(dp_z, r_z, input_precision=PRECISION)
              + tl.dot(dp_o, r_o, input_precision=PRECISION))
        if not COUPLED:
            dh += tl.dot(dp_i, r_i, input_precision=PRECISION)
        dh = dh * keep
        dc = dc_prev * keep
    tl.store(DH0 + state, dh, mask=ok)
    tl.store(DC0 + state, dc, mask=ok)
    if GATE == 2:
        tl.store(DN0 + state, dn, mask=ok)
    # this program's shares, summed over batch blocks after: DPEEP[pb, g, j*D:], DLN*[pb, g, :]
    if PEEPHOLES:
        _store_peepholes(DPEEP + pb * (G - 1) * H + j * D + u, u < D, H, dpeep_i, dpeep_f, dpeep_o, COUPLED)
    if NORM:
        _store_groups(DLNW + pb * G * H + u, u < D, H, dlnw_i, dlnw_f, dlnw_z, dlnw_o, GF, COUPLED)
        _store_groups(DLNB + pb * G * H + u, u < D, H, dlnb_i, dlnb_f, dlnb_z, dlnb_o, GF, COUPLED)


def _flags(r: Tensor, gate: str, coupled: bool, peep, norm: bool, keep, on: Tensor) -> dict:
    d = r.shape[2]
    fn, fn_grad = GATE_FORMS.get(gate, (_tanh, _tanh))  # a registered gate's Triton form (built-ins call neither)
    return dict(D=d, DP=padded(d), BB=BLOCK_B, G=r.shape[0], GATE=GATES.get(gate, REGISTERED), COUPLED=coupled,
                PEEPHOLES=peep is not None, NORM=norm, HAS_KEEP=keep is not None, PRECISION=_precision(on), FN=fn,
                FN_GRAD=fn_grad)


# The loop as a pair of torch custom operators (see lstm.py): torch.compile traces through them in one graph. An
# operator returns a fixed number of tensors: one this variant has not is empty.
@torch.library.custom_op("rpt::triton_modlstm_loop", mutates_args=())
def modlstm_loop(gx: Tensor, r: Tensor, ln_w: Optional[Tensor], ln_b: Optional[Tensor], peep: Optional[Tensor],
                 h0: Tensor, c0: Tensor, n0: Optional[Tensor], m0: Optional[Tensor], keep: Optional[Tensor], gate: str,
                 coupled: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(GX [T, B, G*H], R [G, heads, d, d], ln_w, ln_b [G, H], peep [G-1, H], h0, c0, n0, m0 [B, H] (n0, m0: the
    exponential gate's), keep [T, B]) -> hs, cs, ns, ms [T, B, H] and the buffers the backward reads (gate
    values, gate inputs, the layer norm's normalised input and 1/std)."""
    T, B, _ = gx.shape
    exp = gate == "exp"
    hs, cs, ns, ms, act, pre, xhat, rstd = out = _modlstm_buffers(gx, r, exp, ln_w is not None)
    some = lambda t: t if t is not None and t.numel() else hs  # noqa: E731  (a pointer the kernel does not read)
    f32 = lambda t: t.float().contiguous() if t is not None else hs  # noqa: E731
    modlstm_forward_kernel[(r.shape[1], triton.cdiv(B, BLOCK_B))](
        gx.contiguous(), r.contiguous(), some(ln_w), some(ln_b), some(peep), f32(h0), f32(c0), f32(n0), f32(m0),
        some(keep), hs, cs, some(ns), some(ms), act, some(pre), some(xhat), some(rstd), T, B, r.shape[1],
        **_flags(r, gate, coupled, peep, ln_w is not None, keep, gx))
    return out


def _modlstm_buffers(gx: Tensor, r: Tensor, exp: bool, norm: bool):
    T, B, _ = gx.shape
    G, H = r.shape[0], r.shape[1] * r.shape[2]
    new = lambda keep_it, *shape: gx.new_empty(*shape if keep_it else (0,), dtype=torch.float32)  # noqa: E731
    return (new(True, T, B, H), new(True, T, B, H), new(exp, T, B, H), new(exp, T, B, H), new(True, T, B, G * H),
            new(not exp, T, B, 2 * H), new(norm, T, B, G * H), new(norm, T, B, G))


@modlstm_loop.register_fake
def _(gx, r, ln_w, ln_b, peep, h0, c0, n0, m0, keep, gate, coupled):
    return _modlstm_buffers(gx, r, gate == "exp", ln_w is not None)


@torch.library.custom_op("rpt::triton_modlstm_loop_backward", mutates_args=())
def modlstm_loop_backward(d_hs: Tensor, d_cs: Tensor, d_ns: Tensor, r: Tensor, ln_w: Optional[Tensor],
                          peep: Optional[Tensor], h0: Tensor, c0: Tensor, n0: Optional[Tensor], keep: Optional[Tensor],
                          hs: Tensor, cs: Tensor, ns: Tensor, act: Tensor, pre: Tensor, xhat: Tensor, rstd: Tensor,
                          gate: str, coupled: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                                             Tensor]:
    """The gradients of GX, R, ln_w, ln_b, peep, h0, c0 and n0 (float32; empty for those the cell has not)."""
    T, B, H = hs.shape
    nb = triton.cdiv(B, BLOCK_B)
    dgx, dlnw, dlnb, dpeep, dh0, dc0, dn0 = _modlstm_grads(hs, r, peep, ln_w, gate == "exp", nb)
    some = lambda t: t if t is not None and t.numel() else hs  # noqa: E731
    f32 = lambda t: t.float().contiguous() if t is not None and t.numel() else hs  # noqa: E731
    modlstm_backward_kernel[(r.shape[1], nb)](
        f32(d_hs), f32(d_cs), f32(d_ns), r.contiguous(), some(ln_w), some(peep), f32(c0), f32(n0), some(keep), cs,
        some(ns), act, some(pre), some(xhat), some(rstd), dgx, some(dpeep), some(dlnw), some(dlnb), dh0, dc0,
        some(dn0), T, B, r.shape[1], **_flags(r, gate, coupled, peep, ln_w is not None, keep, hs))
    summed = lambda g: g.sum(0) if g.numel() else g  # noqa: E731  (the programs' shares)
    return (dgx, recurrent_grad(dgx, hs, h0, keep, r.shape[1]), summed(dlnw), summed(dlnb), summed(dpeep), dh0, dc0,
            dn0)


def _modlstm_grads(hs: Tensor, r: Tensor, peep, ln_w, exp: bool, blocks: int):
    T, B, H = hs.shape
    G = r.shape[0]
    new = lambda keep_it, *shape: hs.new_empty(*shape if keep_it else (0,), dtype=torch.float32)  # noqa: E731
    norm = ln_w is not None
    return (new(True, T, B, G * H), new(norm, blocks, G, H), new(norm, blocks, G, H),
            new(peep is not None, blocks, G - 1, H), new(True, B, H), new(True, B, H), new(exp, B, H))


@modlstm_loop_backward.register_fake
def _(d_hs, d_cs, d_ns, r, ln_w, peep, h0, c0, n0, keep, hs, cs, ns, act, pre, xhat, rstd, gate, coupled):
    dgx, *rest = _modlstm_grads(hs, r, peep, ln_w, gate == "exp", 1)
    return dgx, hs.new_empty(r.shape, dtype=torch.float32), *(g[0] if k < 3 and g.numel() else g
                                                             for k, g in enumerate(rest))


def _modlstm_setup(ctx, inputs, output):
    gx, r, ln_w, ln_b, peep, h0, c0, n0, m0, keep, gate, coupled = inputs
    ctx.save_for_backward(r, ln_w, peep, h0, c0, n0, keep, *output[:3], *output[4:])
    ctx.gate, ctx.coupled = gate, coupled
    ctx.dtypes = [gx.dtype, r.dtype, *(t.dtype if t is not None else None for t in (ln_w, ln_b, peep, h0, c0, n0))]


def _modlstm_backward(ctx, d_hs, d_cs, d_ns, *_):
    r, ln_w, peep, h0, c0, n0, keep, hs, cs, ns, act, pre, xhat, rstd = ctx.saved_tensors
    zero = lambda g, like: torch.zeros_like(like) if g is None else g  # noqa: E731
    grads = modlstm_loop_backward(zero(d_hs, hs), zero(d_cs, cs), zero(d_ns, ns), r, ln_w, peep, h0, c0, n0, keep,
                                  hs, cs, ns, act, pre, xhat, rstd, ctx.gate, ctx.coupled)
    grads = [g.to(dtype) if dtype is not None and g.numel() else None for g, dtype in zip(grads, ctx.dtypes)]
    return (*grads, None, None, None, None)  # m0 (a constant to differentiation), keep, gate, coupled


modlstm_loop.register_autograd(_modlstm_backward, setup_context=_modlstm_setup)


def modlstm_triton_loop(x, w_x, w_h, bias, ln_w, ln_b, peep, state: tuple, keep, gate: str, coupled: bool, heads: int):
    """The head-wise modified LSTM over x [B, T, D] from `state` ((h, c), or (h, c, n, m) for the exponential
    gate): (y [B, T, H], the final state). w_h holds the recurrent blocks ([G*H, H / heads]); keep [T, B] float
    (0 where a row's state resets before that step) or None; a registered gate needs its Triton form
    (rpt.kernels.triton.GATE_FORMS, filled by register_gate)."""
    B, T, _ = x.shape
    G = 3 if coupled else 4
    H = w_x.shape[0] // G
    d = H // heads
    xt = x.transpose(0, 1).reshape(T * B, -1)
    gx = (torch.addmm(bias, xt, w_x.t()) if bias is not None else xt @ w_x.t()).view(T, B, G * H)
    exp = gate == "exp"
    n0, m0 = (state[2], state[3]) if exp else (None, None)
    hs, cs, ns, ms, *_ = modlstm_loop(gx, w_h.view(G, heads, d, d), ln_w, ln_b, peep, state[0], state[1], n0, m0,
                                      keep, gate, coupled)
    final = (hs[-1], cs[-1], ns[-1], ms[-1]) if exp else (hs[-1], cs[-1])
    return hs.transpose(0, 1), final
