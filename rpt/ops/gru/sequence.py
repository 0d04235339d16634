"""gru over a sequence: which form runs it (`forms`, asked of the backend once per call) and its CPU kernel.

On a GPU: torch's fused GRU (cuDNN; its heads as one block-diagonal matrix), or for heads of 16-64 units the
Triton loop (triton.py), a program per head. On the CPU torch's GRU has no oneDNN kernel (only its LSTM has
one) and runs a small-batch GEMM per step, about 0.2 of the matmul peak at B=2; there `gru_sequence` runs
instead: a fused sequence kernel with a hand-written backward, like modlstm's (input projections and weight
gradients as single GEMMs, the per-step product packed for oneDNN), whose two time loops run in C++ where
rpt.kernels.cpu's loops could be built (gru_cpu.cpp: each step's elementwise work in one vector pass), else in
Python (loops.py: what does not depend on the recurrence precomputed for all steps at once).
"""

from typing import Optional

import torch
from torch import Tensor

from rpt import kernels
from rpt.kernels.backend import Form
from rpt.kernels.cpu.products import PackedLinear, matmul
from rpt.kernels.triton import on_chip
from rpt.ops.gru.loops import backward_steps, forward_steps
from rpt.ops.precision import as_fp32, full_precision
from rpt.ops.segments import over_segments


def forms(d_hidden: int, heads: int, on_gpu: bool) -> set[Form]:
    """The forms that can run a gru: on a GPU cuDNN's, and the Triton loop for heads of 16-64 units; on the CPU
    rpt's kernel, its loops in C++ or Python (torch's own GRU is slower there)."""
    if on_gpu:
        return {Form.LIBRARY, Form.ATEN} | ({Form.TRITON_LOOP} if heads > 1 and on_chip(d_hidden, heads) else set())
    return {Form.NATIVE_ONE_PASS, Form.NATIVE, Form.ATEN}


def library(cell, x: Tensor, state: tuple, reset: Optional[Tensor]):
    """torch's fused GRU (cuDNN on a GPU), cut at reset columns."""
    weights = [cell.w_ih, cell.recurrent_weight(), cell.b_ih, cell.b_hh]

    def run(xs, st):
        y, h = torch.gru(xs, st[0][None], weights, True, 1, 0.0, cell.training, False, True)
        return y, (h[0],)

    return over_segments(run, x, state, reset)


def forward(cell, x: Tensor, state: tuple, reset: Optional[Tensor]):
    """The cell (rpt.models.cells.gru.GRU: its parameters) over x, from `state`: (y, state)."""
    form = kernels.current().form(x, forms(cell.d_hidden, cell.heads, x.is_cuda))
    if form is Form.TRITON_LOOP:  # a program per head, blocks on chip
        from rpt.ops.gru.triton import gru_triton_loop as loop

        keep = None if reset is None else (~reset).float().t().contiguous()
        y, new = loop(x, cell.w_ih, cell.w_hh, cell.b_ih, cell.b_hh, state[0], keep, cell.heads)
        return y.to(x.dtype), tuple(s.to(state[0].dtype) for s in new)
    if form is Form.LIBRARY:  # cuDNN runs the autocast dtype; the carried state keeps the caller's
        y, new = library(cell, x, state, reset)
        return y, tuple(s.to(state[0].dtype) for s in new)
    with full_precision(x):
        x = as_fp32(x)
        keep = None if reset is None else (~reset).to(x.dtype).transpose(0, 1).contiguous()
        y, h, *_ = gru_sequence(x, cell.w_ih, cell.recurrent_weight(), cell.b_ih, cell.b_hh, state[0], keep,
                                form.value)
    return y, (h,)


# The kernel as a pair of torch custom operators (forward; backward, registered as its gradient): opaque to
# torch.compile, which traces a model through them in one graph, where it could not trace the packed oneDNN
# weight and the native loops inside an autograd.Function. Buffers are time-major ([T, B, ...]) so that every
# step's slice is contiguous; the forward returns those its backward reads (HP, gates, hs) after y and h.
@torch.library.custom_op("rpt::gru_sequence", mutates_args=())
def gru_sequence(x: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor, b_hh: Tensor, h0: Tensor,
                 keep: Optional[Tensor], form: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> y, the last h, and the buffers the backward reads. `form`: the backend's choice (a Form's value); the
    backward runs the same one."""
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
    if form in (Form.NATIVE_ONE_PASS, Form.NATIVE):
        h = backend.loops().gru_forward(XP, *W.operand, bias, keep, h0, HP, gates, hs, form == Form.NATIVE_ONE_PASS)
    else:
        h = forward_steps(XP, W, bias, keep, h0, HP, gates, hs)
    return hs.transpose(0, 1).clone(memory_format=torch.contiguous_format), h.clone(), HP, gates, hs


@gru_sequence.register_fake
def _(x, w_ih, w_hh, b_ih, b_hh, h0, keep, form):
    B, T, _ = x.shape
    H = w_hh.shape[1]
    return x.new_empty(B, T, H), h0.new_empty(B, H), *(x.new_empty(T, B, 3, H) for _ in range(2)), x.new_empty(T, B, H)


@torch.library.custom_op("rpt::gru_sequence_backward", mutates_args=())
def gru_sequence_backward(grad_y: Tensor, grad_h: Tensor, x: Tensor, w_ih: Tensor, w_hh: Tensor, h0: Tensor,
                          keep: Optional[Tensor], HP: Tensor, gates: Tensor,
                          hs: Tensor, form: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
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
    if form in (Form.NATIVE_ONE_PASS, Form.NATIVE):  # derives each step's factors K (below) in its pass over the step
        dh = backend.loops_for_backward().gru_backward(grad_y, gates, HP, h_prev, dXP, dHP, keep3, *WT.operand, grad_h)
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
def _(grad_y, grad_h, x, w_ih, w_hh, h0, keep, HP, gates, hs, form):
    T, B, _, _ = gates.shape  # grad_x: a [B, T, D] view of a time-major tensor, as the kernel's
    return (x.new_empty(T, B, x.shape[2]).transpose(0, 1), torch.empty_like(w_ih), torch.empty_like(w_hh),
            w_ih.new_empty(w_ih.shape[0]), w_hh.new_empty(w_hh.shape[0]), torch.empty_like(h0))


def _save(ctx, inputs, output):
    x, w_ih, w_hh, _, _, h0, keep, form = inputs
    ctx.save_for_backward(x, w_ih, w_hh, h0, keep, *output[2:])
    ctx.form = form


def _gradients(ctx, grad_y, grad_h, *_):
    x, w_ih, w_hh, h0, keep, HP, gates, hs = ctx.saved_tensors
    grad_y = grad_y if grad_y is not None else x.new_zeros(*x.shape[:2], w_hh.shape[1])
    grad_h = grad_h if grad_h is not None else torch.zeros_like(h0)
    return *gru_sequence_backward(grad_y, grad_h, x, w_ih, w_hh, h0, keep, HP, gates, hs, ctx.form), None, None


gru_sequence.register_autograd(_gradients, setup_context=_save)
