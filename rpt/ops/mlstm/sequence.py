"""The mLSTM over a window: which form runs it (`forms`, asked of the backend once per call), and running it:
rpt's chunkwise form in torch (chunkwise.py) on any device, or the spec one token at a time (`steps`: the ATen
form, the reference). A library kernel (the xLSTM authors' mlstm_kernels) would be a third form here.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from rpt import kernels
from rpt.kernels.backend import Form
from rpt.ops.mlstm.chunkwise import chunkwise
from rpt.ops.mlstm.spec import mlstm_step


def forms(x: Tensor) -> set[Form]:
    return {Form.CHUNKWISE, Form.ATEN}


def forward(q, k, v, i_pre, log_f, reset: Optional[Tensor], state, chunk: int):
    """As chunkwise.chunkwise (the same arguments and results), in the form the backend picks."""
    if kernels.current().form(q, forms(q)) is Form.CHUNKWISE:
        return chunkwise(q, k, v, i_pre, log_f, reset, state, chunk)
    return steps(q, k, v, i_pre, log_f, reset, state)


def steps(q, k, v, i_pre, log_f, reset: Optional[Tensor], state):
    """The spec over the window one token at a time (q, k, v [B, heads, T, d], i_pre, log_f [B, heads, T]); a
    reset restores the zero state before its token."""
    hs = []
    for t in range(q.shape[2]):
        if reset is not None:
            keep = (~reset[:, t]).to(q.dtype)[:, None]
            state = (state[0] * keep[..., None, None], state[1] * keep[..., None], state[2] * keep)
        h, state = mlstm_step(q[:, :, t], k[:, :, t], v[:, :, t], i_pre[:, :, t], log_f[:, :, t], state)
        hs.append(h)
    return torch.stack(hs, dim=2), state
