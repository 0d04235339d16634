"""minGRU's and minLSTM's recurrence from the projected input u to h: which form runs it (`forms`, asked of the
backend once per call), and running it.

The built-in cells' coefficients are known to the fast forms, which fold them into the scan from the sigmoid
gates: on the CPU one C++ pass each way (minrnn_cpu.cpp, where rpt.kernels.cpu's loops are built), on a GPU one
Triton kernel each way (triton.py). Elsewhere, and for a cell with coefficients of its own, the coefficients and
the chunked scan (scan.py) run as ATen ops.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Callable, Optional

import torch
from torch import Tensor

from rpt import kernels
from rpt.kernels.backend import Form
from rpt.ops.minrnn.scan import linear_scan
from rpt.ops.precision import as_fp32, full_precision


class MinScan(IntEnum):
    """The built-in recurrences, by the code minrnn_cpu.cpp and triton.py take."""
    MINGRU = 0
    MINLSTM = 1


def forms(kind: MinScan | None) -> set[Form]:
    """A built-in cell's recurrence (`kind`) has the Triton scan and the C++ pass; any other the ATen scan only."""
    return {Form.ATEN} if kind is None else {Form.TRITON_LOOP, Form.NATIVE_ONE_PASS, Form.ATEN}


def forward(u: Tensor, h0: Tensor, reset: Optional[Tensor], kind: MinScan | None,
            coefficients: Callable[[Tensor], tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """h ([B, T, H]) and the final state from u, the projected input, and h0; `coefficients(u)` gives (a, b) for
    the ATen form. The Triton form's state keeps h0's dtype; the others' is float32, as they run."""
    backend = kernels.current()
    form = backend.form(u, forms(kind))
    if form is Form.TRITON_LOOP:  # one Triton kernel each way, u read in its own dtype
        from rpt.ops.minrnn.triton import min_scan

        keep = None if reset is None else (~reset).float().contiguous()
        h = min_scan(u, h0, keep, int(kind))
        return h, h[:, -1].to(h0.dtype)
    with full_precision(u):
        u = as_fp32(u)
        if form is Form.NATIVE_ONE_PASS:
            keep = None if reset is None else (~reset).to(u.dtype).contiguous()
            h = NativeMinScan.apply(u.contiguous(), h0.to(u.dtype).contiguous(), keep, int(kind), backend.loops())
            return h, h[:, -1]
        a, b = coefficients(u)
        if reset is not None:
            a = a * (~reset).to(a.dtype)[..., None]
        h = linear_scan(a, b, h0)
        return h, h[:, -1]


class NativeMinScan(torch.autograd.Function):
    """The recurrence through minrnn_cpu.cpp. The gates' sigmoid stays in ATen (vectorised); the backward reads the
    saved gates and returns the gradient of u whole."""

    @staticmethod
    def forward(ctx, u, h0, keep, kind, ops):
        gates = torch.sigmoid(u[..., : (kind + 1) * h0.shape[1]])
        h = ops.min_scan_forward(gates, u, h0, keep, kind)
        ctx.save_for_backward(gates, u, h, h0, keep)
        ctx.kind, ctx.ops = kind, ops
        return h

    @staticmethod
    def backward(ctx, grad_h):
        gates, u, h, h0, keep = ctx.saved_tensors
        du, dh0 = ctx.ops.min_scan_backward(grad_h, gates, u, h, h0, keep, ctx.kind)
        return du, dh0, None, None, None
