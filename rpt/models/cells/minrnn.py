"""minGRU and minLSTM (Feng et al. 2024, "Were RNNs All We Needed?").

Their gates read the input only, so the recurrence is linear in h,
    h_t = a_t * h_{t-1} + b_t (the spec: rpt/ops/minrnn/spec.py),
and the whole sequence runs as one parallel scan (rpt/ops/minrnn/scan.py) after one input projection:
    minGRU:  z = sigmoid(W_z x),  h~ = W_h x,                 a = 1 - z,         b = z * h~
    minLSTM: f = sigmoid(W_f x),  i = sigmoid(W_i x), h~ = W_h x,  a = f / (f + i),  b = i / (f + i) * h~
The hidden state is wider than the model (d_hidden, default 2 * d_model) and projected back
down, as in the paper's expansion. A reset sets a_t = 0: the carry is dropped at that step.

On the CPU, where rpt.kernels.cpu's loops are built, the two cells' recurrence runs as one C++ pass each way
(rpt/ops/minrnn/minrnn_cpu.cpp: the scan with the coefficients folded in, from the sigmoid gates); on a GPU with
triton, one Triton kernel each way (rpt/ops/minrnn/triton.py, the same fold); elsewhere, and for a subclass
with its own `coefficients`, the coefficients and the chunked scan below run as ATen ops.
"""

from __future__ import annotations

import torch
from torch import nn

from rpt import kernels
from rpt.kernels.cpu.backend import MinScan
from rpt.kernels.cpu.products import linear
from rpt.kernels.triton import available as triton_available
from rpt.models.cells.base import Cell, as_fp32, full_precision
from rpt.models.registry import register_cell
from rpt.ops.minrnn.scan import linear_scan
from rpt.ops.minrnn.spec import min_step, minlstm_coefficients, mingru_coefficients


class _MinRNN(Cell):
    n_proj = 2

    def __init__(self, d_model: int, d_hidden: int = 0):
        super().__init__(d_model, d_hidden or 2 * d_model)
        self.in_proj = nn.Linear(d_model, self.n_proj * self.d_hidden)
        self.out_proj = nn.Linear(self.d_hidden, d_model, bias=False)

    def state_sizes(self):
        return [self.d_hidden]

    def coefficients(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(a, b) of the linear recurrence from the projected input u."""
        raise NotImplementedError

    def step(self, x_t, state):
        h, state = min_step(self.in_proj(x_t), state, self.coefficients)
        return self.out_proj(h), state

    def forward(self, x, state=None, reset=None):
        (h0,) = state if state is not None else self.init_state(x.shape[0], x.device, x.dtype)
        u = linear(x, self.in_proj.weight, self.in_proj.bias)
        kind = _NATIVE_KIND.get(type(self).coefficients)
        if triton_scan(u, kind):  # one Triton kernel each way, u read in its own dtype
            from rpt.ops.minrnn.triton import min_scan

            keep = None if reset is None else (~reset).float().contiguous()
            h = min_scan(u, h0, keep, kind)
            return linear(h, self.out_proj.weight), (h[:, -1].to(h0.dtype),)
        with full_precision(u):
            u = as_fp32(u)
            backend = kernels.current()
            ops = backend.loops() if kind is not None and u.is_cpu and backend.fused_steps else None
            if ops is not None:
                keep = None if reset is None else (~reset).to(u.dtype).contiguous()
                h = _NativeMinScan.apply(u.contiguous(), h0.to(u.dtype).contiguous(), keep, kind, ops)
            else:
                a, b = self.coefficients(u)
                if reset is not None:
                    a = a * (~reset).to(a.dtype)[..., None]
                h = linear_scan(a, b, h0)
        return linear(h, self.out_proj.weight), (h[:, -1],)

    def flops_per_token(self):
        return 2 * self.d_model * self.d_hidden * (self.n_proj + 1)


@register_cell("mingru")
class MinGRU(_MinRNN):
    n_proj = 2

    def coefficients(self, u):
        return mingru_coefficients(u)


@register_cell("minlstm")
class MinLSTM(_MinRNN):
    n_proj = 3

    def coefficients(self, u):
        return minlstm_coefficients(u)


def triton_scan(u: torch.Tensor, kind: int | None) -> bool:
    """Whether the recurrence runs rpt.ops.minrnn.triton: a built-in cell's (`kind`), on a GPU with triton."""
    return u.is_cuda and kind is not None and triton_available()


_NATIVE_KIND = {MinGRU.coefficients: int(MinScan.MINGRU), MinLSTM.coefficients: int(MinScan.MINLSTM)}


class _NativeMinScan(torch.autograd.Function):
    """The recurrence from the projected input u to h, through rpt/ops/minrnn/minrnn_cpu.cpp. The gates' sigmoid stays
    in ATen (vectorised); the backward reads the saved gates and returns the gradient of u whole."""

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
