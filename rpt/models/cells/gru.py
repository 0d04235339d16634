"""Classic GRU (Cho et al. 2014), PyTorch's formulation and gate layout (r, z, n).

Fast paths: on GPU, torch's fused GRU (cuDNN; a head-wise GRU there runs its Triton loop, rpt/ops/gru/triton.py). On
CPU torch's GRU has no oneDNN kernel (only its LSTM has one) and runs a small-batch GEMM per step, about
0.2 of the matmul peak at B=2;
there `gru_sequence` runs instead: a fused sequence kernel with a hand-written backward, like
the modified LSTM's (input projections and weight gradients as single GEMMs, the per-step
product packed for oneDNN), whose two time loops run in C++ where rpt.kernels.cpu's loops could
be built (each step's elementwise work in one vector pass; the Python loops precompute what does
not depend on the recurrence for all steps at once instead).
"""

from typing import Optional

import torch
from torch import Tensor

from rpt import kernels
from rpt.kernels.cpu.products import PackedLinear, matmul
from rpt.kernels.triton import on_chip
from rpt.models.cells.base import GatedRNNCell, as_fp32, full_precision, over_segments
from rpt.models.registry import register_cell
from rpt.ops.gru.spec import gru_step


@register_cell("gru")
class GRU(GatedRNNCell):
    n_gates = 3
    options = ("heads",)

    def __init__(self, d_model: int, d_hidden: int = 0, heads: int = 1):
        super().__init__(d_model, d_hidden, heads=heads)

    def state_sizes(self):
        return [self.d_hidden]

    def step(self, x_t, state):
        h, state = gru_step(x_t, state, self.w_ih, self.step_weight(), self.b_ih, self.b_hh, self.linear)
        return self._out(h), state

    def forward(self, x, state=None, reset=None):
        state = state if state is not None else self.init_state(x.shape[0], x.device, x.dtype)
        if x.is_cuda and self.heads > 1 and on_chip(self.d_hidden, self.heads):  # a program per head, blocks on chip
            from rpt.ops.gru.triton import gru_sequence as loop

            keep = None if reset is None else (~reset).float().t().contiguous()
            y, new = loop(x, self.w_ih, self.w_hh, self.b_ih, self.b_hh, state[0], keep, self.heads)
            return self._out(y.to(x.dtype)), tuple(s.to(state[0].dtype) for s in new)
        if x.is_cuda:  # cuDNN runs the autocast dtype; the carried state keeps the caller's
            dtype = state[0].dtype
            y, state = self.library_path(x, state, reset)
            state = tuple(s.to(dtype) for s in state)
        else:
            with full_precision(x):
                x = as_fp32(x)
                keep = None if reset is None else (~reset).to(x.dtype).transpose(0, 1).contiguous()
                y, h, *_ = gru_sequence(x, self.w_ih, self.recurrent_weight(), self.b_ih, self.b_hh, state[0], keep)
            state = (h,)
        return self._out(y), state

    def library_path(self, x, state, reset):
        """torch's fused GRU (cuDNN on GPU), cut at reset columns."""
        weights = [self.w_ih, self.recurrent_weight(), self.b_ih, self.b_hh]

        def run(xs, st):
            y, h = torch.gru(xs, st[0][None], weights, True, 1, 0.0, self.training, False, True)
            return y, (h[0],)

        return over_segments(run, x, state, reset)


# The kernel as a pair of torch custom operators (forward; backward, registered as its gradient): opaque to
# torch.compile, which traces a model through them in one graph, where it could not trace the packed oneDNN
# weight and the native loops inside an autograd.Function. Buffers are time-major ([T, B, ...]) so that every
# step's slice is contiguous; the forward returns those its backward reads (HP, gates, hs) after y and h.
@torch.library.custom_op("rpt::gru_sequence", mutates_args=())
def gru_sequence(x: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor, b_hh: Tensor, h0: Tensor,
                 keep: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    B, T, D = x.shape
    H = w_hh.shape[1]
    xt = x.transpose(0, 1).reshape(T * B, D)
    XP = matmul(xt, w_ih, b_ih).view(T, B, 3, H)
    backend = kernels.current()
    W = PackedLinear(w_hh, B, backend)
    bias = b_hh.expand(B, 3 * H).contiguous()
    HP = x.new_empty(T, B, 3, H)  # h_{t-1} W_hh^T + b_hh, whose n part the backward needs
    gates = x.new_empty(T, B, 3, H)  # r, z, n
    hs = x.new_empty(T, B, H)
    native = backend.loops()
    if native is not None:
        h = native.gru_forward(XP, *W.operand, bias, keep, h0, HP, gates, hs, backend.fused_steps)
    else:
        h = forward_steps(XP, W, bias, keep, h0, HP, gates, hs)
    return hs.transpose(0, 1).clone(memory_format=torch.contiguous_format), h.clone(), HP, gates, hs


@gru_sequence.register_fake
def _(x, w_ih, w_hh, b_ih, b_hh, h0, keep):
    B, T, _ = x.shape
    H = w_hh.shape[1]
    return x.new_empty(B, T, H), h0.new_empty(B, H), *(x.new_empty(T, B, 3, H) for _ in range(2)), x.new_empty(T, B, H)


@torch.library.custom_op("rpt::gru_sequence_backward", mutates_args=())
def gru_sequence_backward(grad_y: Tensor, grad_h: Tensor, x: Tensor, w_ih: Tensor, w_hh: Tensor, h0: Tensor,
                          keep: Optional[Tensor], HP: Tensor, gates: Tensor,
                          hs: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients of x, w_ih, w_hh, b_ih, b_hh and h0."""
    T, B, _, H = gates.shape
    D = x.shape[2]
    h_prev = torch.cat([h0[None], hs[:-1]])
    if keep is not None:
        h_prev = h_prev * keep[:, :, None]
    dXP, dHP = torch.empty_like(gates), torch.empty_like(gates)
    backend = kernels.current()
    WT = PackedLinear(w_hh.T.contiguous(), B, backend)
    grad_y = grad_y.transpose(0, 1)
    keep3 = keep[:, :, None] if keep is not None else None
    native = backend.loops() if gates.is_cpu else None
    if native is not None:  # derives each step's factors K (below) in its pass over the step
        dh = native.gru_backward(grad_y, gates, HP, h_prev, dXP, dHP, keep3, *WT.operand, grad_h)
    else:
        r, z, n = gates.unbind(2)
        # dpre = dh * K for every gate, precomputed for all steps: nothing here depends on the recurrence.
        K_n = (1 - z) * (1 - n * n)
        K_z = (h_prev - n) * z * (1 - z)
        K_r = K_n * HP[:, :, 2] * r * (1 - r)
        KX = torch.stack([K_r, K_z, K_n], dim=2)  # d/d(x-projection)
        KH = torch.stack([K_r, K_z, K_n * r], dim=2)  # d/d(h-projection)
        dh = backward_steps(grad_y, KX, KH, z, dXP, dHP, keep3, WT, grad_h)
    dXPf, dHPf = dXP.view(T * B, 3 * H), dHP.view(T * B, 3 * H)
    grad_x = matmul(dXPf, w_ih.t()).view(T, B, D).transpose(0, 1)
    grad_w_ih = dXPf.T @ x.transpose(0, 1).reshape(T * B, D)
    grad_w_hh = dHPf.T @ h_prev.reshape(T * B, H)
    return grad_x, grad_w_ih, grad_w_hh, dXPf.sum(0), dHPf.sum(0), dh.clone()


@gru_sequence_backward.register_fake
def _(grad_y, grad_h, x, w_ih, w_hh, h0, keep, HP, gates, hs):
    T, B, _, _ = gates.shape  # grad_x: a [B, T, D] view of a time-major tensor, as the kernel's
    return (x.new_empty(T, B, x.shape[2]).transpose(0, 1), torch.empty_like(w_ih), torch.empty_like(w_hh),
            w_ih.new_empty(w_ih.shape[0]), w_hh.new_empty(w_hh.shape[0]), torch.empty_like(h0))


def _save(ctx, inputs, output):
    x, w_ih, w_hh, _, _, h0, keep = inputs
    ctx.save_for_backward(x, w_ih, w_hh, h0, keep, *output[2:])


def _gradients(ctx, grad_y, grad_h, *_):
    x, w_ih, w_hh, h0, keep, HP, gates, hs = ctx.saved_tensors
    grad_y = grad_y if grad_y is not None else x.new_zeros(*x.shape[:2], w_hh.shape[1])
    grad_h = grad_h if grad_h is not None else torch.zeros_like(h0)
    return *gru_sequence_backward(grad_y, grad_h, x, w_ih, w_hh, h0, keep, HP, gates, hs), None


gru_sequence.register_autograd(_gradients, setup_context=_save)


# ---------------------------------------------------------------------- the time loops
# The Python form of the kernel's two loops; rpt/kernels/cpu/recurrent_loops.cpp is the same loops in
# C++ (used when it is built), step for step (its backward derives the factors K inside each step).

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
