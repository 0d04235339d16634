"""The gated delta rule over a window: which form runs it (`forms`, asked of the backend once per call), and
running it: flash-linear-attention's kernel (library.py) on CUDA where fla-core is installed, rpt's chunkwise form
in torch (chunkwise.py) on any device, or the spec one token at a time (`steps`: the ATen form, the reference).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from rpt import kernels
from rpt.kernels.backend import Form
from rpt.ops.gdn import library
from rpt.ops.gdn.chunkwise import chunkwise
from rpt.ops.gdn.spec import gdn_step


def forms(x: Tensor) -> set[Form]:
    return {Form.LIBRARY, Form.CHUNKWISE, Form.ATEN} if x.is_cuda and library.kernel() is not None else \
        {Form.CHUNKWISE, Form.ATEN}


def forward(q, k, v, g, beta, reset: Optional[Tensor], S: Tensor, chunk: int):
    """As chunkwise.chunkwise (the same arguments and results), in the form the backend picks."""
    form = kernels.current().form(q, forms(q))
    if form is Form.LIBRARY:
        return library.by_sequences(library.kernel(), q, k, v, g.float(), beta, reset, S.float())
    if form is Form.CHUNKWISE:
        return chunkwise(q, k, v, g, beta, reset, S, chunk)
    return steps(q, k, v, g, beta, reset, S)


def steps(q, k, v, g, beta, reset: Optional[Tensor], S: Tensor):
    """The spec over the window one token at a time (q, k, v [B, heads, T, d], g, beta [B, heads, T]); a reset
    restores the zero state before its token."""
    outs = []
    for t in range(q.shape[2]):
        if reset is not None:
            S = S * (~reset[:, t]).to(S.dtype)[:, None, None, None]
        o, S = gdn_step(q[:, :, t], k[:, :, t], v[:, :, t], g[:, :, t], beta[:, :, t], S)
        outs.append(o)
    return torch.stack(outs, dim=2), S
