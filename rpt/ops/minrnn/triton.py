"""minGRU's and minLSTM's recurrence on a GPU in two Triton kernels, from the projected input u to h and back.

    minGRU:  u = [z_pre, h~],        a = 1 - sigmoid(z_pre),   b = sigmoid(z_pre) h~
    minLSTM: u = [f_pre, i_pre, h~], f, i = sigmoid(...),      a = f / (f + i),  b = i / (f + i) h~
    h_t = keep_t a_t h_{t-1} + b_t   (keep_t = 0 where a row's state resets before step t)

A program takes one row and a block of units and walks time in tiles of CT steps: it reads the tile of u (in
the autocast dtype), forms a and b, scans the tile with tl.associative_scan and carries the last h into the next
tile, so the whole recurrence is one read of u and one write of h. The backward walks the tiles in reverse, scans
g_t = dL/dh_t + keep_{t+1} a_{t+1} g_{t+1} the same way (reading a_{t+1} from the next step's u), and writes dL/du
whole, the gates' derivatives included. The ATen form (rpt.ops.minrnn.scan.linear_scan after the cell's
`coefficients`) issues some forty kernels a layer and step of the chunk loops and keeps a, b and their
intermediates; this keeps only h.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

MINGRU, MINLSTM = 0, 1  # KIND: u holds 2 (minGRU) or 3 (minLSTM) groups of H
CT = 16  # time steps a tile scans at once
BH = 64  # units a program takes


@triton.jit
def _combine(a1, b1, a2, b2):
    """Two steps of h -> a h + b, the earlier first, as one."""
    return a1 * a2, a2 * b1 + b2


@triton.jit
def _load(U, g, rows, cols, ok, H, KIND: tl.constexpr, ACC: tl.constexpr):
    """Group g of u at [rows, cols] (rows: row * T + t), in the accumulation dtype ACC (float32; float64 for
    float64 inputs, as the model tests run on a GPU)."""
    return tl.load(U + rows * (KIND + 2) * H + g * H + cols, mask=ok, other=0.0).to(ACC)


@triton.jit
def _a(U, rows, cols, ok, H, KIND: tl.constexpr, ACC: tl.constexpr):
    """The decay a at [rows, cols]."""
    if KIND == 0:
        a = 1.0 - tl.sigmoid(_load(U, 0, rows, cols, ok, H, KIND, ACC))
    else:
        f = tl.sigmoid(_load(U, 0, rows, cols, ok, H, KIND, ACC))
        i = tl.sigmoid(_load(U, 1, rows, cols, ok, H, KIND, ACC))
        a = f / (f + i)
    return a


@triton.jit
def _b(U, rows, cols, ok, H, KIND: tl.constexpr, ACC: tl.constexpr):
    """The input b at [rows, cols]."""
    if KIND == 0:
        b = tl.sigmoid(_load(U, 0, rows, cols, ok, H, KIND, ACC)) * _load(U, 1, rows, cols, ok, H, KIND, ACC)
    else:
        f = tl.sigmoid(_load(U, 0, rows, cols, ok, H, KIND, ACC))
        i = tl.sigmoid(_load(U, 1, rows, cols, ok, H, KIND, ACC))
        b = i / (f + i) * _load(U, 2, rows, cols, ok, H, KIND, ACC)
    return b


@triton.jit
def _keep(KEEP, row, t, T, HAS_KEEP: tl.constexpr, ACC: tl.constexpr):
    """keep_t as a [CT, 1] column (1 without resets; 0 past the end)."""
    keep = (t < T).to(ACC)
    if HAS_KEEP:
        keep = tl.load(KEEP + row * T + t, mask=t < T, other=0.0).to(ACC)
    return keep[:, None]


@triton.jit
def min_scan_forward_kernel(U, H0, KEEP, HS, T, H, CT: tl.constexpr, BH: tl.constexpr, KIND: tl.constexpr,
                            HAS_KEEP: tl.constexpr, ACC: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    steps = tl.arange(0, CT)
    h = tl.load(H0 + row * H + cols, mask=cols < H, other=0.0).to(ACC)
    for t0 in range(0, T, CT):
        t = t0 + steps
        ok = (t < T)[:, None] & (cols < H)[None, :]
        rows, at = (row * T + t)[:, None], cols[None, :]
        keep = _keep(KEEP, row, t, T, HAS_KEEP, ACC)
        a = tl.where(ok, _a(U, rows, at, ok, H, KIND, ACC) * keep, 1.0)  # past T: h stays
        b = tl.where(ok, _b(U, rows, at, ok, H, KIND, ACC), 0.0)
        decay, local = tl.associative_scan((a, b), 0, _combine)
        hs = decay * h[None, :] + local
        tl.store(HS + rows * H + at, hs, mask=ok)
        h = tl.sum(tl.where(steps[:, None] == CT - 1, hs, 0.0), axis=0)


@triton.jit
def min_scan_backward_kernel(DHS, U, HS, H0, KEEP, DU, DH0, T, H, CT: tl.constexpr, BH: tl.constexpr,
                             KIND: tl.constexpr, HAS_KEEP: tl.constexpr, ACC: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    steps = tl.arange(0, CT)
    at = cols[None, :]
    g_later = tl.zeros((BH,), dtype=ACC)  # g of the step after the tile
    dh0 = tl.zeros((BH,), dtype=ACC)
    tiles = tl.cdiv(T, CT)
    for k in range(tiles):
        t = (tiles - 1 - k) * CT + (CT - 1 - steps)  # the tile's steps, latest first: the scan runs back in time
        ok = (t < T)[:, None] & (cols < H)[None, :]
        rows = (row * T + t)[:, None]
        later = ok & (t + 1 < T)[:, None]
        keep_next = _keep(KEEP, row, t + 1, T, HAS_KEEP, ACC)
        a_next = tl.where(later, _a(U, rows + 1, at, later, H, KIND, ACC) * keep_next, 0.0)
        dh = tl.load(DHS + rows * H + at, mask=ok, other=0.0).to(ACC)
        decay, local = tl.associative_scan((a_next, dh), 0, _combine)
        g = decay * g_later[None, :] + local  # dL/dh_t, all that reaches h_t
        g_later = tl.sum(tl.where(steps[:, None] == CT - 1, g, 0.0), axis=0)
        earlier = ok & (t > 0)[:, None]
        h_prev = tl.load(HS + (rows - 1) * H + at, mask=earlier, other=0.0)
        h_prev = tl.where((t == 0)[:, None], tl.load(H0 + row * H + cols, mask=cols < H, other=0.0)[None, :], h_prev)
        keep = _keep(KEEP, row, t, T, HAS_KEEP, ACC)
        d_a = g * h_prev * keep
        _coefficient_grads(DU, U, rows, at, ok, H, d_a, g, KIND, ACC)
        a = _a(U, rows, at, ok, H, KIND, ACC) * keep
        dh0 += tl.sum(tl.where((t == 0)[:, None] & ok, a * g, 0.0), axis=0)
    tl.store(DH0 + row * H + cols, dh0, mask=cols < H)


@triton.jit
def _coefficient_grads(DU, U, rows, at, ok, H, d_a, d_b, KIND: tl.constexpr, ACC: tl.constexpr):
    """dL/du from dL/da and dL/db, through the gates."""
    base = DU + rows * (KIND + 2) * H + at
    if KIND == 0:
        z = tl.sigmoid(_load(U, 0, rows, at, ok, H, KIND, ACC))
        h_tilde = _load(U, 1, rows, at, ok, H, KIND, ACC)
        tl.store(base, (d_b * h_tilde - d_a) * z * (1.0 - z), mask=ok)
        tl.store(base + H, d_b * z, mask=ok)
    else:
        f = tl.sigmoid(_load(U, 0, rows, at, ok, H, KIND, ACC))
        i = tl.sigmoid(_load(U, 1, rows, at, ok, H, KIND, ACC))
        h_tilde = _load(U, 2, rows, at, ok, H, KIND, ACC)
        s = f + i
        shared = (d_a - d_b * h_tilde) / (s * s)  # da/df = i / s^2, db/df = -i h~ / s^2; f's mirror for i
        tl.store(base, i * shared * f * (1.0 - f), mask=ok)
        tl.store(base + H, -f * shared * i * (1.0 - i), mask=ok)
        tl.store(base + 2 * H, d_b * i / s, mask=ok)


_ACC = {torch.float32: tl.float32, torch.float64: tl.float64}


def _acc(u: Tensor) -> torch.dtype:
    """The dtype of h and of the accumulation: float64 for float64 u, float32 otherwise."""
    return torch.float64 if u.dtype == torch.float64 else torch.float32


def _grid(B: int, H: int) -> tuple[int, int]:
    return B, triton.cdiv(H, BH)


@torch.library.custom_op("rpt::triton_min_scan", mutates_args=())
def min_scan(u: Tensor, h0: Tensor, keep: Optional[Tensor], kind: int) -> Tensor:
    """(u [B, T, (kind + 2) H] in any float dtype, h0 [B, H], keep [B, T] float or None, kind: MINGRU or MINLSTM)
    -> h [B, T, H] in float32 (float64 for float64 u)."""
    B, T, _ = u.shape
    H = h0.shape[1]
    hs = u.new_empty(B, T, H, dtype=_acc(u))
    min_scan_forward_kernel[_grid(B, H)](u.contiguous(), h0.to(hs.dtype).contiguous(),
                                         keep if keep is not None else hs, hs, T, H, CT=CT, BH=BH, KIND=kind,
                                         HAS_KEEP=keep is not None, ACC=_ACC[hs.dtype])
    return hs


@min_scan.register_fake
def _(u, h0, keep, kind):
    return u.new_empty(u.shape[0], u.shape[1], h0.shape[1], dtype=_acc(u))


@torch.library.custom_op("rpt::triton_min_scan_backward", mutates_args=())
def min_scan_backward(grad_h: Tensor, u: Tensor, hs: Tensor, h0: Tensor, keep: Optional[Tensor],
                      kind: int) -> tuple[Tensor, Tensor]:
    """The gradients of u (in u's dtype) and of h0 (in h's)."""
    B, T, H = hs.shape
    du = torch.empty_like(u)  # the kernel stores in its dtype
    dh0 = hs.new_empty(B, H)
    min_scan_backward_kernel[_grid(B, H)](grad_h.to(hs.dtype).contiguous(), u.contiguous(), hs,
                                          h0.to(hs.dtype).contiguous(), keep if keep is not None else hs, du, dh0, T,
                                          H, CT=CT, BH=BH, KIND=kind, HAS_KEEP=keep is not None, ACC=_ACC[hs.dtype])
    return du, dh0


@min_scan_backward.register_fake
def _(grad_h, u, hs, h0, keep, kind):
    return torch.empty_like(u), hs.new_empty(hs.shape[0], hs.shape[2])


def _setup(ctx, inputs, output):
    u, h0, keep, kind = inputs
    ctx.save_for_backward(u, output, h0, keep)
    ctx.kind, ctx.h0_dtype = kind, h0.dtype


def _backward(ctx, grad_h):
    u, hs, h0, keep = ctx.saved_tensors
    du, dh0 = min_scan_backward(grad_h, u, hs, h0, keep, ctx.kind)
    return du, dh0.to(ctx.h0_dtype), None, None


min_scan.register_autograd(_backward, setup_context=_setup)
