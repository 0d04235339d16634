"""lstm over a sequence: which form runs it (`forms`, asked of the backend once per call), and running it.

torch's fused LSTM (cuDNN on a GPU, oneDNN on the CPU) with the cell's own parameters, so that regularisers such
as weight normalisation act on them; a head-wise cell on a GPU runs its Triton loop (triton.py) instead, a
program per head with its blocks on chip.
"""

from typing import Optional

import torch
from torch import Tensor

from rpt import kernels
from rpt.kernels.backend import Form
from rpt.kernels.triton import on_chip
from rpt.ops.precision import as_fp32, cpu_bf16, full_precision
from rpt.ops.segments import over_segments


def forms(d_hidden: int, heads: int, on_gpu: bool) -> set[Form]:
    """torch's LSTM everywhere, and the Triton loop for heads of 16-64 units on a GPU."""
    return {Form.LIBRARY} | ({Form.TRITON_LOOP} if on_gpu and heads > 1 and on_chip(d_hidden, heads) else set())


def forward(cell, x: Tensor, state: tuple, reset: Optional[Tensor]):
    """The cell (rpt.models.cells.lstm.LSTM: its parameters) over x, from `state`: (y, state)."""
    form = kernels.current().form(x, forms(cell.d_hidden, cell.heads, x.is_cuda))
    if form is Form.TRITON_LOOP:
        from rpt.ops.lstm.triton import lstm_triton_loop

        keep = None if reset is None else (~reset).float().t().contiguous()
        y, new = lstm_triton_loop(x, cell.w_ih, cell.recurrent_blocks(), cell.b_ih, cell.b_hh, state[0], state[1], keep,
                               cell.heads)
        return y.to(x.dtype), tuple(s.to(state[0].dtype) for s in new)
    weights = [cell.w_ih, cell.recurrent_weight(), cell.b_ih, cell.b_hh]

    def run(xs, st):
        y, h, c = torch.lstm(xs, (st[0][None], st[1][None]), weights, True, 1, 0.0, cell.training, False, True)
        return y, (h[0], c[0])

    if x.is_cuda or cpu_bf16(x):  # cuDNN, and oneDNN under bf16, run the autocast dtype; the state keeps the caller's
        dtype = state[0].dtype
        y, state = over_segments(run, x, state, reset)
        return y, tuple(s.to(dtype) for s in state)
    with full_precision(x):
        return over_segments(run, as_fp32(x), state, reset)
