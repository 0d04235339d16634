"""The head-wise LSTM time loop in two Triton kernels: the forward, and the reverse-time backward.

    P_t = GX_t + h_{t-1} R^T           GX = x W_ih^T + b_ih + b_hh for all steps: one GEMM, outside
    i, f, g, o = sigmoid, sigmoid, tanh, sigmoid of P_t's four gate groups
    c_t = f c_{t-1} + i g;  h_t = o tanh(c_t)

R is block-diagonal (rpt.ops.stack.spec.block_diagonal): program (j, b) keeps head j's four [d, d] blocks and
its rows' (h, c) on chip and walks the whole sequence, reading GX_t and writing h_t, c_t and the gate values the
backward reads. The backward walks back in time with the same blocks and writes the pre-activations' gradient; the
products outside turn it into the gradients of x, W_ih, the biases and R (one batched product over the heads,
`recurrent_grad`: no atomics, and no [d, d] accumulators in the loop's registers). A reset (keep_t = 0) zeroes a
row's carried state before step t, as the cells' `reset` does. Written here rather than taken from FlashRNN (CUDA
headers per gate) so that a gate is a Triton function and the same source runs on the CPU interpreter.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from rpt.kernels.triton.common import (BLOCK_B, _load_blocks, _precision, _program, _tanh, padded, recurrent_grad,
                                       tuned)


@tuned("T", "B", "heads", "D", "HAS_KEEP")
@triton.jit
def lstm_forward_kernel(GX, R, H0, C0, KEEP, HS, CS, ACT, T, B, heads,
                        D: tl.constexpr, DP: tl.constexpr, BB: tl.constexpr, HAS_KEEP: tl.constexpr,
                        PRECISION: tl.constexpr):
    j, _, b, u, H, ok = _program(B, heads, D, DP, BB)
    # R^T per gate, [in, out]: P_g = h @ R_g^T
    r_i, r_f, r_g, r_o = _load_blocks(R, j, heads, u[None, :], u[:, None], D)
    state = b[:, None] * H + j * D + u[None, :]
    h = tl.load(H0 + state, mask=ok, other=0.0).to(tl.float32)
    c = tl.load(C0 + state, mask=ok, other=0.0).to(tl.float32)
    for t in range(T):
        if HAS_KEEP:
            keep = tl.load(KEEP + t * B + b, mask=b < B, other=1.0).to(tl.float32)[:, None]
            h = h * keep
            c = c * keep
        gx = GX + t * B * 4 * H + b[:, None] * 4 * H + j * D + u[None, :]
        i = tl.sigmoid(tl.load(gx, mask=ok, other=0.0).to(tl.float32) + tl.dot(h, r_i, input_precision=PRECISION))
        f = tl.sigmoid(tl.load(gx + H, mask=ok, other=0.0).to(tl.float32) + tl.dot(h, r_f, input_precision=PRECISION))
        g = _tanh(tl.load(gx + 2 * H, mask=ok, other=0.0).to(tl.float32) + tl.dot(h, r_g, input_precision=PRECISION))
        p_o = tl.load(gx + 3 * H, mask=ok, other=0.0).to(tl.float32) + tl.dot(h, r_o, input_precision=PRECISION)
        o = tl.sigmoid(p_o)
        c = f * c + i * g
        h = o * _tanh(c)
        out = t * B * H + state
        tl.store(HS + out, h, mask=ok)
        tl.store(CS + out, c, mask=ok)
        act = ACT + t * B * 4 * H + b[:, None] * 4 * H + j * D + u[None, :]
        tl.store(act, i, mask=ok)
        tl.store(act + H, f, mask=ok)
        tl.store(act + 2 * H, g, mask=ok)
        tl.store(act + 3 * H, o, mask=ok)


@tuned("T", "B", "heads", "D", "HAS_KEEP")
@triton.jit
def lstm_backward_kernel(DHS, DCS, R, H0, C0, KEEP, HS, CS, ACT, DGX, DH0, DC0, T, B, heads,
                         D: tl.constexpr, DP: tl.constexpr, BB: tl.constexpr, HAS_KEEP: tl.constexpr,
                         PRECISION: tl.constexpr):
    j, _, b, u, H, ok = _program(B, heads, D, DP, BB)
    r_i, r_f, r_g, r_o = _load_blocks(R, j, heads, u[:, None], u[None, :], D)  # [out, in]: dh = dP_g @ R_g
    state = b[:, None] * H + j * D + u[None, :]
    dh = tl.zeros((BB, DP), dtype=tl.float32)
    dc = tl.zeros((BB, DP), dtype=tl.float32)
    for step in range(T):
        t = T - 1 - step
        dh += tl.load(DHS + t * B * H + state, mask=ok, other=0.0)  # from y_t (and h_T)
        dc += tl.load(DCS + t * B * H + state, mask=ok, other=0.0)  # from c_T
        keep = tl.full((BB, 1), 1.0, tl.float32)
        if HAS_KEEP:
            keep = tl.load(KEEP + t * B + b, mask=b < B, other=1.0).to(tl.float32)[:, None]
        earlier = (t - 1) * B * H + state  # c_{t-1}: the saved step before, or the initial state
        c_prev = tl.load(tl.where(t > 0, CS + earlier, C0 + state), mask=ok, other=0.0) * keep
        c = tl.load(CS + t * B * H + state, mask=ok, other=0.0)
        act = ACT + t * B * 4 * H + b[:, None] * 4 * H + j * D + u[None, :]
        i = tl.load(act, mask=ok, other=0.0)
        f = tl.load(act + H, mask=ok, other=0.0)
        g = tl.load(act + 2 * H, mask=ok, other=0.0)
        o = tl.load(act + 3 * H, mask=ok, other=0.0)
        tc = _tanh(c)
        dc = dc + dh * o * (1.0 - tc * tc)
        dp_i = dc * g * i * (1.0 - i)
        dp_f = dc * c_prev * f * (1.0 - f)
        dp_g = dc * i * (1.0 - g * g)
        dp_o = dh * tc * o * (1.0 - o)
        dgx = DGX + t * B * 4 * H + b[:, None] * 4 * H + j * D + u[None, :]
        tl.store(dgx, dp_i, mask=ok)
        tl.store(dgx + H, dp_f, mask=ok)
        tl.store(dgx + 2 * H, dp_g, mask=ok)
        tl.store(dgx + 3 * H, dp_o, mask=ok)
        dh = (tl.dot(dp_i, r_i, input_precision=PRECISION) + tl.dot(dp_f, r_f, input_precision=PRECISION)
              + tl.dot(dp_g, r_g, input_precision=PRECISION) + tl.dot(dp_o, r_o, input_precision=PRECISION)) * keep
        dc = dc * f * keep
    tl.store(DH0 + state, dh, mask=ok)
    tl.store(DC0 + state, dc, mask=ok)


# The loop as a pair of torch custom operators (forward; backward, registered as its gradient), as the CPU
# kernels are: torch.compile traces a model through them in one graph (their fake forms give the shapes).
@torch.library.custom_op("rpt::triton_lstm_loop", mutates_args=())
def lstm_loop(gx: Tensor, r: Tensor, h0: Tensor, c0: Tensor, keep: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """(GX [T, B, 4H], R [4, heads, d, d], h0, c0 [B, H], keep [T, B] or None) -> hs, cs [T, B, H] and the gate
    values the backward reads."""
    T, B, G = gx.shape
    heads, d = r.shape[1], r.shape[2]
    hs, cs, act = _lstm_buffers(gx, G // 4)
    lstm_forward_kernel[(heads, triton.cdiv(B, BLOCK_B))](
        gx.contiguous(), r.contiguous(), h0.float().contiguous(), c0.float().contiguous(),
        keep if keep is not None else hs, hs, cs, act, T, B, heads, D=d, DP=padded(d), BB=BLOCK_B,
        HAS_KEEP=keep is not None, PRECISION=_precision(gx))
    return hs, cs, act


def _lstm_buffers(gx: Tensor, H: int):
    T, B, _ = gx.shape
    new = lambda *shape: gx.new_empty(*shape, dtype=torch.float32)  # noqa: E731
    return new(T, B, H), new(T, B, H), new(T, B, 4 * H)


lstm_loop.register_fake(lambda gx, r, h0, c0, keep: _lstm_buffers(gx, gx.shape[2] // 4))


@torch.library.custom_op("rpt::triton_lstm_loop_backward", mutates_args=())
def lstm_loop_backward(d_hs: Tensor, d_cs: Tensor, r: Tensor, h0: Tensor, c0: Tensor, keep: Optional[Tensor],
                       hs: Tensor, cs: Tensor, act: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The gradients of GX, R, h0 and c0 (float32)."""
    T, B, H = hs.shape
    heads, d = r.shape[1], r.shape[2]
    dgx, dh0, dc0 = _lstm_grads(hs)
    lstm_backward_kernel[(heads, triton.cdiv(B, BLOCK_B))](
        d_hs.float().contiguous(), d_cs.float().contiguous(), r.contiguous(), h0.float().contiguous(),
        c0.float().contiguous(), keep if keep is not None else hs, hs, cs, act, dgx, dh0, dc0, T, B, heads,
        D=d, DP=padded(d), BB=BLOCK_B, HAS_KEEP=keep is not None, PRECISION=_precision(hs))
    return dgx, recurrent_grad(dgx, hs, h0, keep, heads), dh0, dc0


def _lstm_grads(hs: Tensor):
    T, B, H = hs.shape
    new = lambda *shape: hs.new_empty(*shape, dtype=torch.float32)  # noqa: E731
    return new(T, B, 4 * H), new(B, H), new(B, H)


@lstm_loop_backward.register_fake
def _(d_hs, d_cs, r, h0, c0, keep, hs, cs, act):
    dgx, dh0, dc0 = _lstm_grads(hs)
    return dgx, hs.new_empty(r.shape, dtype=torch.float32), dh0, dc0


def _lstm_setup(ctx, inputs, output):
    gx, r, h0, c0, keep = inputs
    ctx.save_for_backward(r, h0, c0, keep, *output)
    ctx.dtypes = gx.dtype, r.dtype, h0.dtype, c0.dtype


def _lstm_backward(ctx, d_hs, d_cs, _):
    r, h0, c0, keep, hs, cs, act = ctx.saved_tensors
    d_hs = torch.zeros_like(hs) if d_hs is None else d_hs
    d_cs = torch.zeros_like(cs) if d_cs is None else d_cs
    grads = lstm_loop_backward(d_hs, d_cs, r, h0, c0, keep, hs, cs, act)
    return *(g.to(dtype) for g, dtype in zip(grads, ctx.dtypes)), None


lstm_loop.register_autograd(_lstm_backward, setup_context=_lstm_setup)


def lstm_triton_loop(x, w_ih, w_hh, b_ih, b_hh, h0, c0, keep, heads: int):
    """The head-wise LSTM over x [B, T, D] from (h0, c0): (y [B, T, H], (h_T, c_T)). w_hh holds the recurrent
    blocks ([4H, H / heads]); keep [T, B] float (0 where a row's state resets before that step) or None."""
    B, T, _ = x.shape
    H = w_hh.shape[0] // 4
    d = H // heads
    gx = torch.addmm(b_ih + b_hh, x.transpose(0, 1).reshape(T * B, -1), w_ih.t()).view(T, B, 4 * H)
    hs, cs, _ = lstm_loop(gx, w_hh.view(4, heads, d, d), h0, c0, keep)
    return hs.transpose(0, 1), (hs[-1], cs[-1])
