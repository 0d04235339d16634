"""The matrix-memory LSTM (xLSTM's mLSTM, Beck et al. 2024), as the xLSTM 7B layer shapes it: from the block's
input, per head, a query, key and value and two scalar gates (an exponential input gate, a sigmoid forget gate);
the recurrence keeps a [d, d] memory per head; its read is normalised per head (RMS, a learned scale), gated by a
sigmoid output gate of the input, and projected back to d_model. The spec of all of it is rpt/ops/mlstm/spec.py.

Training runs the chunkwise form (rpt/ops/mlstm/chunkwise.py, chunks of `model.chunk_size` steps): within a
chunk masked, gated products like attention's, between chunks the recurrence on the state; generation runs the
step. The state is three tensors a row: the memory [heads, d, d], the normaliser [heads, d], the stabiliser
[heads]: its size does not grow with the text.
"""

from __future__ import annotations

import torch
from torch import nn

from rpt.errors import RptError
from rpt.kernels.cpu.products import linear
from rpt.models.cells.base import Cell, head_width
from rpt.models.registry import register_cell
from rpt.ops.mlstm import sequence
from rpt.ops.mlstm.chunkwise import Summary, advance, summary
from rpt.ops.mlstm.spec import mlstm_layer_step, project, read_out


@register_cell("mlstm")
class MLSTM(Cell):
    options = ("heads", "chunk_size")
    export_spec = "rpt.ops.mlstm.spec"

    def __init__(self, d_model: int, d_hidden: int = 0, heads: int = 1, chunk_size: int = 64):
        super().__init__(d_model, d_hidden or d_model)
        if chunk_size < 1:
            raise RptError(f"model.chunk_size = {chunk_size}: the mlstm's chunks need at least one step",
                           "set model.chunk_size to 32-128 (64 by default)")
        H, D = self.d_hidden, d_model
        self.heads, self.head_dim, self.chunk_size = heads, head_width(H, heads), chunk_size
        self.qkvo = nn.Linear(D, 4 * H, bias=False)  # query, key, value, output gate
        self.gates = nn.Linear(D, 2 * heads)  # input and forget gate pre-activations, one per head
        with torch.no_grad():  # the gates start from their biases: forget gates open (3 to 6 across heads)
            self.gates.weight.zero_()
            self.gates.bias[:heads].normal_(0, 0.1)
            self.gates.bias[heads:] = torch.linspace(3.0, 6.0, heads)
        self.norm_weight = nn.Parameter(torch.ones(H))
        self.out_proj = nn.Linear(H, D, bias=False)

    def state_shapes(self):
        n, d = self.heads, self.head_dim
        return [(n, d, d), (n, d), (n,)]

    def step(self, x_t, state):
        return mlstm_layer_step(x_t, state, self.qkvo.weight, self.gates.weight, self.gates.bias, self.norm_weight,
                                self.out_proj.weight, self.heads, self.linear)

    def forward(self, x, state=None, reset=None):
        state = state if state is not None else self.init_state(x.shape[0], x.device, x.dtype)
        q, k, v, i_pre, log_f, o = project(x, self.qkvo.weight, self.gates.weight, self.gates.bias, self.heads, linear)
        by_head = [t.transpose(1, 2) for t in (q, k, v, i_pre, log_f)]  # [B, heads, T, ...]
        h, state = sequence.forward(*by_head, reset, state, self.chunk_size)
        return read_out(h.transpose(1, 2), o, self.norm_weight, self.out_proj.weight, linear), state

    def piece_forward(self, x, state, reset, entering):
        """Context parallelism: the piece's summary (its own memory at its end and its gate sums), the earlier
        pieces' folded into the window's state, the piece chunkwise from there."""
        q, k, v, i_pre, log_f, o = project(x, self.qkvo.weight, self.gates.weight, self.gates.bias, self.heads, linear)
        q, k, v, i_pre, log_f = (t.transpose(1, 2) for t in (q, k, v, i_pre, log_f))  # [B, heads, T, ...]
        with torch.autocast(x.device.type, enabled=False):
            wide = torch.promote_types(q.dtype, torch.float32)
            own = summary(k.to(wide), v.to(wide), i_pre.to(wide), log_f.to(wide),
                          None if reset is None else reset[:, None])
            present = tuple(t if t.dtype != torch.bool else t.to(wide) for t in own if t is not None)
            layout = [t is not None for t in own]

            def fold(parts, state):
                parts = iter(parts)
                found = [next(parts) if there else None for there in layout]
                if found[4] is not None:
                    found[4] = found[4] > 0.5  # `clean`, travelled as a number
                return advance(state, Summary(*found))
            start = entering(present, tuple(t.to(wide) for t in state), fold)
        h, new = sequence.forward(q, k, v, i_pre, log_f, reset, start, self.chunk_size)
        return read_out(h.transpose(1, 2), o, self.norm_weight, self.out_proj.weight, linear), new

    def summary_numbers(self):
        """Its memory, normaliser, stabiliser and log-gate sum per head, and with resets two more numbers a head."""
        d = self.head_dim
        return self.heads * (d * d + d + 4)

    def flops_per_token(self):
        """The projections, and the chunkwise form's products per head: L (d_k + d_v) within a chunk, d_k d_v twice
        for the state (read and write), at L = chunk_size."""
        H, D, d, L = self.d_hidden, self.d_model, self.head_dim, self.chunk_size
        return 2 * D * (4 * H + 2 * self.heads) + 2 * H * D + self.heads * 2 * (2 * L * d + 2 * d * d)
