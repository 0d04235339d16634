"""The head-wise GRU's time loop in two Triton kernels, a program per (head, 16 rows), as rpt/ops/lstm/triton.py
runs the lstm (its blocks and its rows' state on chip for the whole sequence). PyTorch's formulation:

    r = sigmoid(GX_r + h R_r^T),  z = sigmoid(GX_z + h R_z^T)      GX = x W_ih^T + b_ih (+ b_hh's r, z parts)
    n = tanh(GX_n + r * (h R_n^T + b_hn)),  h' = (1 - z) n + z h

b_hn (b_hh's n part) sits inside the reset gate's product, so the kernel reads it. The backward writes the
pre-activations' gradient; R's and b_hn's are products and sums over it outside (lstm.recurrent_grad), n's
through the reset gate.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from rpt.kernels.triton.common import BLOCK_B, _block, _precision, _program, _tanh, padded, recurrent_grad, tuned


@triton.jit
def _blocks3(R, j, heads, rows, cols, D: tl.constexpr):
    return (_block(R, 0, j, heads, rows, cols, D), _block(R, 1, j, heads, rows, cols, D),
            _block(R, 2, j, heads, rows, cols, D))


@tuned("T", "B", "heads", "D", "HAS_KEEP")
@triton.jit
def gru_forward_kernel(GX, R, BHN, H0, KEEP, HS, ACT, T, B, heads, D: tl.constexpr, DP: tl.constexpr,
                       BB: tl.constexpr, HAS_KEEP: tl.constexpr, PRECISION: tl.constexpr):
    j, _, b, u, H, ok = _program(B, heads, D, DP, BB)
    r_r, r_z, r_n = _blocks3(R, j, heads, u[None, :], u[:, None], D)  # R_g^T, [in, out]
    b_hn = tl.load(BHN + j * D + u, mask=u < D, other=0.0).to(tl.float32)[None, :]
    state = b[:, None] * H + j * D + u[None, :]
    h = tl.load(H0 + state, mask=ok, other=0.0).to(tl.float32)
    for t in range(T):
        if HAS_KEEP:
            h = h * tl.load(KEEP + t * B + b, mask=b < B, other=1.0).to(tl.float32)[:, None]
        gx = GX + t * B * 3 * H + b[:, None] * 3 * H + j * D + u[None, :]
        r = tl.sigmoid(tl.load(gx, mask=ok, other=0.0).to(tl.float32) + tl.dot(h, r_r, input_precision=PRECISION))
        z = tl.sigmoid(tl.load(gx + H, mask=ok, other=0.0).to(tl.float32) + tl.dot(h, r_z, input_precision=PRECISION))
        hn = tl.dot(h, r_n, input_precision=PRECISION) + b_hn
        n = _tanh(tl.load(gx + 2 * H, mask=ok, other=0.0).to(tl.float32) + r * hn)
        h = (1.0 - z) * n + z * h
        tl.store(HS + t * B * H + state, h, mask=ok)
        act = ACT + t * B * 4 * H + b[:, None] * 4 * H + j * D + u[None, :]
        tl.store(act, r, mask=ok)
        tl.store(act + H, z, mask=ok)
        tl.store(act + 2 * H, n, mask=ok)
        tl.store(act + 3 * H, hn, mask=ok)


@tuned("T", "B", "heads", "D", "HAS_KEEP")
@triton.jit
def gru_backward_kernel(DHS, R, H0, KEEP, HS, ACT, DGX, DH0, T, B, heads, D: tl.constexpr,
                        DP: tl.constexpr, BB: tl.constexpr, HAS_KEEP: tl.constexpr, PRECISION: tl.constexpr):
    j, _, b, u, H, ok = _program(B, heads, D, DP, BB)
    r_r, r_z, r_n = _blocks3(R, j, heads, u[:, None], u[None, :], D)  # R_g, [out, in]
    state = b[:, None] * H + j * D + u[None, :]
    dh = tl.zeros((BB, DP), dtype=tl.float32)
    for step in range(T):
        t = T - 1 - step
        dh += tl.load(DHS + t * B * H + state, mask=ok, other=0.0)
        keep = tl.full((BB, 1), 1.0, tl.float32)
        if HAS_KEEP:
            keep = tl.load(KEEP + t * B + b, mask=b < B, other=1.0).to(tl.float32)[:, None]
        h_prev = tl.load(tl.where(t > 0, HS + (t - 1) * B * H + state, H0 + state), mask=ok, other=0.0) * keep
        act = ACT + t * B * 4 * H + b[:, None] * 4 * H + j * D + u[None, :]
        r = tl.load(act, mask=ok, other=0.0)
        z = tl.load(act + H, mask=ok, other=0.0)
        n = tl.load(act + 2 * H, mask=ok, other=0.0)
        hn = tl.load(act + 3 * H, mask=ok, other=0.0)
        da_n = dh * (1.0 - z) * (1.0 - n * n)
        da_r = da_n * hn * r * (1.0 - r)
        da_z = dh * (h_prev - n) * z * (1.0 - z)
        d_hn = da_n * r
        dgx = DGX + t * B * 3 * H + b[:, None] * 3 * H + j * D + u[None, :]
        tl.store(dgx, da_r, mask=ok)
        tl.store(dgx + H, da_z, mask=ok)
        tl.store(dgx + 2 * H, da_n, mask=ok)
        dh = (dh * z + tl.dot(da_r, r_r, input_precision=PRECISION) + tl.dot(da_z, r_z, input_precision=PRECISION)
              + tl.dot(d_hn, r_n, input_precision=PRECISION)) * keep
    tl.store(DH0 + state, dh, mask=ok)


# The loop as a pair of torch custom operators (see lstm.py): torch.compile traces through them in one graph.
@torch.library.custom_op("rpt::triton_gru_loop", mutates_args=())
def gru_loop(gx: Tensor, r: Tensor, b_hn: Tensor, h0: Tensor, keep: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """(GX [T, B, 3H], R [3, heads, d, d], b_hn [H], h0 [B, H], keep [T, B] or None) -> hs [T, B, H] and the
    values the backward reads (r, z, n and h R_n^T + b_hn)."""
    T, B, _ = gx.shape
    heads, d = r.shape[1], r.shape[2]
    hs, act = _gru_buffers(gx, heads * d)
    gru_forward_kernel[(heads, triton.cdiv(B, BLOCK_B))](
        gx.contiguous(), r.contiguous(), b_hn.contiguous(), h0.float().contiguous(), keep if keep is not None else hs,
        hs, act, T, B, heads, D=d, DP=padded(d), BB=BLOCK_B, HAS_KEEP=keep is not None, PRECISION=_precision(gx))
    return hs, act


def _gru_buffers(gx: Tensor, H: int):
    T, B, _ = gx.shape
    return gx.new_empty(T, B, H, dtype=torch.float32), gx.new_empty(T, B, 4 * H, dtype=torch.float32)


gru_loop.register_fake(lambda gx, r, b_hn, h0, keep: _gru_buffers(gx, gx.shape[2] // 3))


@torch.library.custom_op("rpt::triton_gru_loop_backward", mutates_args=())
def gru_loop_backward(d_hs: Tensor, r: Tensor, h0: Tensor, keep: Optional[Tensor], hs: Tensor,
                      act: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The gradients of GX, R, b_hn and h0 (float32)."""
    T, B, H = hs.shape
    heads, d = r.shape[1], r.shape[2]
    dgx, dh0 = _gru_grads(hs)
    gru_backward_kernel[(heads, triton.cdiv(B, BLOCK_B))](
        d_hs.float().contiguous(), r.contiguous(), h0.float().contiguous(), keep if keep is not None else hs, hs, act,
        dgx, dh0, T, B, heads, D=d, DP=padded(d), BB=BLOCK_B, HAS_KEEP=keep is not None, PRECISION=_precision(hs))
    d_hp = dgx.clone()  # the gradient of h R^T (+ b_hn): n's reaches it through the reset gate r
    d_hp[:, :, 2 * H:] *= act[:, :, :H]
    return dgx, recurrent_grad(d_hp, hs, h0, keep, heads), d_hp[:, :, 2 * H:].sum((0, 1)), dh0


def _gru_grads(hs: Tensor):
    T, B, H = hs.shape
    return hs.new_empty(T, B, 3 * H, dtype=torch.float32), hs.new_empty(B, H, dtype=torch.float32)


@gru_loop_backward.register_fake
def _(d_hs, r, h0, keep, hs, act):
    dgx, dh0 = _gru_grads(hs)
    return dgx, hs.new_empty(r.shape, dtype=torch.float32), hs.new_empty(hs.shape[2], dtype=torch.float32), dh0


def _gru_setup(ctx, inputs, output):
    gx, r, b_hn, h0, keep = inputs
    ctx.save_for_backward(r, h0, keep, *output)
    ctx.dtypes = gx.dtype, r.dtype, b_hn.dtype, h0.dtype


def _gru_backward(ctx, d_hs, _):
    r, h0, keep, hs, act = ctx.saved_tensors
    grads = gru_loop_backward(torch.zeros_like(hs) if d_hs is None else d_hs, r, h0, keep, hs, act)
    return *(g.to(dtype) for g, dtype in zip(grads, ctx.dtypes)), None


gru_loop.register_autograd(_gru_backward, setup_context=_gru_setup)


def gru_triton_loop(x, w_ih, w_hh, b_ih, b_hh, h0, keep, heads: int):
    """The head-wise GRU over x [B, T, D] from h0: (y [B, T, H], (h_T,)). w_hh holds the recurrent blocks
    ([3H, H / heads]); keep [T, B] float (0 where a row's state resets before that step) or None."""
    B, T, _ = x.shape
    H = w_hh.shape[0] // 3
    d = H // heads
    b_rz = torch.cat([b_ih[:2 * H] + b_hh[:2 * H], b_ih[2 * H:]])
    gx = torch.addmm(b_rz, x.transpose(0, 1).reshape(T * B, -1), w_ih.t()).view(T, B, 3 * H)
    hs, _ = gru_loop(gx, w_hh.view(3, heads, d, d), b_hh[2 * H:], h0, keep)
    return hs.transpose(0, 1), (hs[-1],)
