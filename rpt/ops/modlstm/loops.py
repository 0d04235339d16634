"""modlstm's time loops as ATen ops driven from Python: the readable form of its C++ loops (modlstm_cpu.cpp
beside this file), which are the same loops step for step on the same buffers, and of its Triton step kernels
(triton_steps.py), which fill the same buffers too.
"""

import math

import torch

from rpt.kernels.cpu.products import PackedLinear
from rpt.ops.modlstm.spec import LN_EPS



def forward_steps(cell, XP, W: PackedLinear, keep, state, acts, pre, cs, hs, ns, ln_in, ln_stats,
                  ln_w, ln_b, peep):
    """Run the recurrence over XP (the input projections, [T, B, G*H]), filling the buffers step by step;
    returns the state after the last step."""
    T, B, G, H = acts.shape
    h, c = state[0], state[1]
    n, m = (state[2], state[3]) if cell.exp else (None, None)
    gi = {g: k for k, g in enumerate(cell.groups)}
    n_dc = G - 1  # gates driven by dc: (i, f, z) or (f, z); the output gate is last
    use_sigmoid = cell.gate_fn is not None and cell.gate_fn.fn is torch.sigmoid
    keeps = keep[:, :, None].unbind(0) if keep is not None else [None] * T
    ns_t = ns.unbind(0) if cell.exp else [None] * T
    for t, (xp, a, c_out, h_out, n_out, kt) in enumerate(
            zip(XP.unbind(0), acts.unbind(0), cs.unbind(0), hs.unbind(0), ns_t, keeps)):
        if kt is not None:
            h, c = h * kt, c * kt
            if cell.exp:
                n, m = n * kt, m * kt
        P = W(h, xp).view(B, G, H)
        if cell.gate_norm:
            ln_in[t] = P
            P, mean, rstd = torch.native_layer_norm(P, (H,), None, None, LN_EPS)
            ln_stats[t, 0], ln_stats[t, 1] = mean, rstd
            P = torch.addcmul(ln_b, P, ln_w)
        if cell.exp:
            P_i, P_f, P_z, P_o = P.unbind(1)
            a_i, a_f, a_z, a_o = a.unbind(1)
            m_prev = torch.where(n > 0, m, torch.full_like(m, -math.inf))
            m = torch.maximum(P_f + m_prev, P_i)
            torch.exp(P_i - m, out=a_i)
            torch.exp(P_f + m_prev - m, out=a_f)
            torch.tanh(P_z, out=a_z)
            torch.sigmoid(P_o, out=a_o)
            c = torch.addcmul(a_f * c, a_i, a_z, out=c_out)
            n = torch.addcmul(a_i, a_f, n, out=n_out)
            h = torch.mul(a_o, c / n, out=h_out)
            continue
        if cell.peepholes:
            P[:, :n_dc - 1] += peep[:-1] * c[:, None]  # i (and f) read c_{t-1}
        gate_in = P[:, :n_dc - 1]  # (i, f) or (f)
        if use_sigmoid:
            torch.sigmoid(gate_in, out=a[:, :n_dc - 1])
        else:
            a[:, :n_dc - 1] = cell.gate_fn.fn(gate_in)
        torch.tanh(P[:, n_dc - 1], out=a[:, n_dc - 1])
        a_f, a_z = a[:, gi["f"]], a[:, n_dc - 1]
        a_i = 1 - a_f if cell.coupled else a[:, 0]
        c = torch.addcmul(a_f * c, a_i, a_z, out=c_out)
        if cell.peepholes:
            P[:, G - 1] += peep[-1] * c  # o reads c_t
        torch.sigmoid(P[:, G - 1], out=a[:, G - 1])
        h = torch.mul(a[:, G - 1], torch.tanh(c), out=h_out)
        if pre is not None:
            pre[t] = P
    return (h, c, n, m) if cell.exp else (h, c)  # (views of the buffers: the operator copies them)


def previous(xs, x0, keep3):
    """The state each step read ([T, B, H]): x0, then xs shifted by one step, after each step's reset."""
    prev = torch.cat([x0[None], xs[:-1]])
    return prev * keep3 if keep3 is not None else prev


def backward_factors(cell, acts, pre, cs, ns, keep3, state, peep):
    """Everything of the backward that does not depend on its recurrence, for all steps at once:
        dP_o = dh * K_o;  dc += dh * K_c;  dP[dc-driven gates] = dc * K_dc (+ dn * K_dn);  dc_prev = dc * K_cc
    Returns (K_c, K_o, K_dc, K_cc, K_n, K_dn), the last two None but for the exponential gate. (The native loops'
    CPU form derives these inside each step's pass instead: modlstm_backward_cpu in modlstm_cpu.cpp.)"""
    gi = {g: k for k, g in enumerate(cell.groups)}
    o, z, f = acts[:, :, gi["o"]], acts[:, :, gi["z"]], acts[:, :, gi["f"]]
    c_prev = previous(cs, state[1], keep3)
    K_n = K_dn = None
    if cell.exp:
        n = ns
        n_prev = previous(ns, state[2], keep3)
        i = acts[:, :, gi["i"]]
        hhat = cs / n
        K_o = hhat * o * (1 - o)
        K_c = o / n
        K_n = -o * hhat / n
        K_dc = torch.stack([z * i, c_prev * f, i * (1 - z * z)], dim=2)  # (i, f, z)
        K_dn = torch.stack([i, n_prev * f], dim=2)  # (i, f)
        K_cc = f
    else:
        tc = torch.tanh(cs)
        K_o = tc * o * (1 - o)
        K_c = o * (1 - tc * tc)
        if cell.peepholes:
            K_c = K_c + K_o * peep[-1]
        gate_input = (lambda g: pre[:, :, gi[g]]) if pre is not None else (lambda g: None)
        gf = cell.gate_fn.grad(gate_input("f"), f)
        if cell.coupled:
            i = 1 - f
            K_f = (c_prev - z) * gf
            K_dc = torch.stack([K_f, i * (1 - z * z)], dim=2)  # (f, z)
            K_cc = f + K_f * peep[0] if cell.peepholes else f
        else:
            i = acts[:, :, gi["i"]]
            K_i = z * cell.gate_fn.grad(gate_input("i"), i)
            K_f = c_prev * gf
            K_dc = torch.stack([K_i, K_f, i * (1 - z * z)], dim=2)  # (i, f, z)
            K_cc = f + K_i * peep[0] + K_f * peep[1] if cell.peepholes else f
    if keep3 is not None:
        K_cc = K_cc * keep3
    return K_c, K_o, K_dc, K_cc, K_n, K_dn


def backward_steps(grad_y, K_c, K_o, K_dc, K_cc, K_n, K_dn, dP, dP_raw, keep3, WT: PackedLinear, dh, dc, dn,
                   ln_w, ln_in, ln_stats):
    """Run the gradient back through time over the precomputed factors, filling dP (and dP_raw, the gradient
    before the gate layer norm); returns the gradient of the initial state: (dh, dc), or (dh, dc, dn)."""
    T, B, G, H = dP.shape
    keeps = keep3.unbind(0) if keep3 is not None else [None] * T
    per_step = zip(range(T), grad_y.unbind(0), K_c.unbind(0), K_o.unbind(0), K_dc.unbind(0), K_cc.unbind(0),
                   dP.unbind(0), dP_raw.unbind(0), keeps)
    for t, gy, k_c, k_o, k_dc, k_cc, dp, dp_raw, kt in reversed(list(per_step)):
        dh = dh + gy
        dc = torch.addcmul(dc, dh, k_c)
        torch.mul(dh, k_o, out=dp[:, G - 1])
        torch.mul(dc[:, None], k_dc, out=dp[:, :G - 1])
        if K_n is not None:  # the exponential gate's normaliser
            dn = torch.addcmul(dn, dh, K_n[t])
            dp[:, :2].addcmul_(dn[:, None], K_dn[t])
            dn = dn * k_cc  # K_cc is f (with the reset folded in)
        if ln_w is not None:
            dp_raw.copy_(torch.ops.aten.native_layer_norm_backward(
                dp * ln_w, ln_in[t], (H,), ln_stats[t, 0], ln_stats[t, 1], None, None, (True, False, False))[0])
        dc = dc * k_cc
        dh = WT(dp_raw.view(B, G * H))
        if kt is not None:
            dh = dh * kt
    return (dh, dc, dn) if K_n is not None else (dh, dc)
