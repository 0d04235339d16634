"""gru's time loops as ATen ops driven from Python: the readable form of its C++ loops (gru_cpu.cpp beside this
file), the same loops step for step on the same buffers (the C++ backward derives the factors K inside each
step, where these precompute them for all steps).
"""

import torch

from rpt.kernels.cpu.products import PackedLinear



def forward_steps(XP, W: PackedLinear, bias, keep, h, HP, gates, hs):
    """Run the recurrence over XP (the input projections, [T, B, 3, H]), filling HP, gates and hs; returns the
    last h."""
    B, H = h.shape
    keeps = keep[:, :, None].unbind(0) if keep is not None else [None] * len(XP)
    for xp, hp, g, out, kt in zip(XP.unbind(0), HP.unbind(0), gates.unbind(0), hs.unbind(0), keeps):
        if kt is not None:
            h = h * kt
        hp.copy_(W(h, bias).view(B, 3, H))
        r, z, n = g.unbind(1)
        torch.sigmoid(xp[:, :2] + hp[:, :2], out=g[:, :2])
        torch.tanh(torch.addcmul(xp[:, 2], r, hp[:, 2]), out=n)
        h = torch.addcmul(n, z, h - n, out=out)
    return h


def backward_steps(grad_y, KX, KH, z, dXP, dHP, keep3, WT: PackedLinear, dh):
    """Run the gradient back through time, filling dXP and dHP; returns the gradient of the initial h."""
    B, H = dh.shape
    keeps = keep3.unbind(0) if keep3 is not None else [None] * len(dXP)
    steps = zip(grad_y.unbind(0), KX.unbind(0), KH.unbind(0), dXP.unbind(0), dHP.unbind(0), z.unbind(0), keeps)
    for gy, kx, kh, dxp, dhp, zt, kt in reversed(list(steps)):
        dh = dh + gy
        torch.mul(dh[:, None], kx, out=dxp)
        torch.mul(dh[:, None], kh, out=dhp)
        dh = WT(dhp.view(B, 3 * H), dh * zt)
        if kt is not None:
            dh = dh * kt
    return dh
