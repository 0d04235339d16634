"""The short causal convolution Gated DeltaNet runs on q, k and v (depthwise, `width` taps, 4 in the paper): each
channel's output at t mixes its inputs t - width + 1 .. t (its step, the spec, is spec.py's `conv_step`). Its last width - 1 inputs are part of the layer's
recurrent state: carried from window to window, and after a reset (a document's start) the inputs before it are
not seen, inside a window and across its end alike.

The window form is `width` shifted products in the tokens' own layout, with a hand-written backward that adds
each lag's gradient into one buffer: autograd's (a zero-filled slice per lag) took 2.4x as long, and F.conv1d
(channels first: two transposes) 1.9x, at 16 x 512 tokens of 2,304 channels. Resets touch only the width - 1
outputs after each: those are corrected on their own, gathered.
"""

from typing import Optional

import torch
from torch import Tensor


class _Shifted(torch.autograd.Function):
    """y[:, t] = sum over taps j of xp[:, t + j] * weight[:, j], for xp [B, width - 1 + T, C], weight [C, width]."""

    @staticmethod
    def forward(ctx, xp, weight):
        width = weight.shape[-1]
        T = xp.shape[1] - width + 1
        y = xp[:, width - 1:] * weight[:, width - 1]
        for j in range(width - 1):
            y.addcmul_(xp[:, j: j + T], weight[:, j])
        ctx.save_for_backward(xp, weight)
        return y

    @staticmethod
    def backward(ctx, gy):
        xp, weight = ctx.saved_tensors
        T = gy.shape[1]
        gxp, gw, product = torch.zeros_like(xp), torch.empty_like(weight), torch.empty_like(gy)
        for j in range(weight.shape[-1]):
            gxp[:, j: j + T].addcmul_(gy, weight[:, j])
            gw[:, j] = torch.mul(gy, xp[:, j: j + T], out=product).sum((0, 1))
        return gxp, gw


def conv_window(x: Tensor, inputs: Tensor, weight: Tensor, reset: Optional[Tensor] = None):
    """x [B, T, C]; inputs: the last width - 1 inputs before the window [B, width - 1, C]; weight [C, width] (the
    last tap on the current input); reset [B, T] bool or None. Returns y [B, T, C] and the inputs to carry."""
    B, T, C = x.shape
    width = weight.shape[-1]
    xp = torch.cat([inputs.to(x.dtype), x], dim=1)  # [B, width - 1 + T, C]
    y = _Shifted.apply(xp, weight)
    if reset is not None:  # the segment of each padded position (the carried inputs: before any reset)
        seg = torch.cat([reset.new_zeros(B, width - 1, dtype=torch.long), reset.long().cumsum(-1)], dim=1)
        b, t = (seg[:, :T] != seg[:, width - 1:]).nonzero(as_tuple=True)  # outputs reading across a reset
        if b.numel():
            wrong = sum(xp[b, t + j] * weight[:, j] * (seg[b, t + j] != seg[b, t + width - 1])[:, None].to(x.dtype)
                        for j in range(width - 1))
            y.index_put_((b, t), -wrong, accumulate=True)
    return y, carried(xp, reset, width)


def carried(x: Tensor, reset: Optional[Tensor], width: int) -> Tensor:
    """The last width - 1 inputs of x [B, >= width - 1, C] as the next window's convolution reads them: those
    before the last reset among them (reset [B, T] for x's last T steps) dropped, another document's."""
    carry = x[:, x.shape[1] - (width - 1):]
    if reset is None:
        return carry
    tail = reset[:, reset.shape[1] - (width - 1):] if reset.shape[1] >= width - 1 else \
        torch.cat([reset.new_zeros(reset.shape[0], width - 1 - reset.shape[1]), reset], dim=1)
    later = tail.flip(1).long().cumsum(1).flip(1) - tail.long()  # resets after each position
    return carry * (later == 0)[..., None].to(x.dtype)

