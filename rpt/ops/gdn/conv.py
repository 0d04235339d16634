"""The short causal convolution Gated DeltaNet runs on q, k and v (depthwise, `width` taps, 4 in the paper): each
channel's output at t mixes its inputs t - width + 1 .. t. Its last width - 1 inputs are part of the layer's
recurrent state: carried from window to window, and after a reset (a document's start) the inputs before it are
not seen, inside a window and across its end alike.

Written as `width` shifted products rather than F.conv1d: the resets mask each lag on its own, and at width 4
these passes cost little beside the layer's projections.
"""

from typing import Optional

import torch
from torch import Tensor


def conv_window(x: Tensor, inputs: Tensor, weight: Tensor, reset: Optional[Tensor] = None):
    """x [B, T, C]; inputs: the last width - 1 inputs before the window [B, width - 1, C]; weight [C, width] (the
    last tap on the current input); reset [B, T] bool or None. Returns y [B, T, C] and the inputs to carry."""
    B, T, C = x.shape
    width = weight.shape[-1]
    xp = torch.cat([inputs.to(x.dtype), x], dim=1)  # [B, width - 1 + T, C]
    seg = None
    if reset is not None:  # the segment of each padded position (the carried inputs: before any reset)
        seg = torch.cat([reset.new_zeros(B, width - 1, dtype=torch.long), reset.long().cumsum(-1)], dim=1)
    y = 0
    for lag in range(width):
        term = xp[:, width - 1 - lag: width - 1 - lag + T] * weight[:, width - 1 - lag]
        if seg is not None and lag:
            same = seg[:, width - 1 - lag: width - 1 - lag + T] == seg[:, width - 1:]
            term = term * same[..., None].to(x.dtype)
        y = y + term
    carry = xp[:, T:]
    if seg is not None:  # inputs before the window's last reset are another document's
        carry = carry * (seg[:, T:] == seg[:, -1:])[..., None].to(x.dtype)
    return y, carry


def conv_step(x_t: Tensor, inputs: Tensor, weight: Tensor):
    """One token: x_t [B, C]; inputs [B, width - 1, C]. Returns y_t [B, C] and the new inputs."""
    window = torch.cat([inputs.to(x_t.dtype), x_t[:, None]], dim=1)  # [B, width, C]
    return (window * weight.T).sum(1), window[:, 1:]
