"""The modified LSTM: gate functions chosen by name, optional gate layer norm, coupled gates, peepholes.

One step is the spec, `modlstm_step` in rpt/ops/modlstm/spec.py (its docstring writes the recurrence out): the
sigmoid-family gates (sigmoid, hard_sigmoid, or one registered with register_gate) and the stabilised exponential
gate of xLSTM's sLSTM, with gate layer norm, coupled gates and peepholes as options. This module holds the
parameters; the sequence runs in rpt/ops/modlstm/sequence.py, in the form the backend picks: a fused kernel with
a hand-written backward whose time loops run in C++ on the CPU, or on a GPU one Triton kernel for the whole
sequence (heads of 16-64 units) or a cuBLAS product and one Triton kernel a step, replayed as one CUDA graph.
"""

import math

import torch
from torch import nn

from rpt.errors import RptError
from rpt.models.cells.base import Cell, head_width
from rpt.ops.stack.spec import block_diagonal
from rpt.models.registry import GateFunction, default_forget_bias, get_gate, register_cell
from rpt.ops.modlstm import sequence
from rpt.ops.modlstm.sequence import Variant
from rpt.ops.modlstm.spec import modlstm_step


@register_cell("modlstm")
class ModLSTM(Cell):
    options = ("gate", "gate_norm", "coupled_gates", "forget_bias", "peepholes", "heads")
    export_spec = "rpt.ops.modlstm.spec"
    native_loops = True

    def __init__(self, d_model: int, d_hidden: int = 0, gate: str = "sigmoid", gate_norm: bool = False,
                 coupled_gates: bool = False, forget_bias: float | None = None, peepholes: bool = False,
                 heads: int = 1):
        super().__init__(d_model, d_hidden or d_model)
        H, D = self.d_hidden, d_model
        self.gate_fn: GateFunction | None = get_gate(gate)
        forget_bias = default_forget_bias(gate) if forget_bias is None else forget_bias  # each gate's own
        self.exp = self.gate_fn is None
        if self.exp and coupled_gates:
            raise RptError("model.coupled_gates needs gates in [0, 1]; the exponential gate is not",
                           "use model.gate = 'sigmoid' with coupled gates, or turn coupled_gates off")
        if self.exp and peepholes:
            raise RptError("model.peepholes are not defined for the exponential gate (its cell state is unnormalised)",
                           "use model.gate = 'sigmoid' or 'hard_sigmoid' with peepholes")
        self.gate, self.coupled, self.gate_norm, self.peepholes = gate, coupled_gates, gate_norm, peepholes
        self.variant = Variant(gate, coupled_gates, gate_norm, peepholes)
        self.groups = self.variant.groups
        G = len(self.groups)
        self.heads, d = heads, head_width(H, heads)
        self.w_x = nn.Parameter(torch.empty(G * H, D))
        self.w_h = nn.Parameter(torch.empty(G * H, d))  # the recurrent matrix's blocks (base.block_diagonal)
        nn.init.uniform_(self.w_x, -1 / math.sqrt(D), 1 / math.sqrt(D))
        for block in range(G * heads):  # each gate group's block of each head orthogonal
            nn.init.orthogonal_(self.w_h.data[block * d:(block + 1) * d])
        f = self.groups.index("f")
        if gate_norm:
            self.bias = None
            self.ln_weight = nn.Parameter(torch.ones(G, H))
            self.ln_bias = nn.Parameter(torch.zeros(G, H))
            with torch.no_grad():
                self.ln_bias[f] = forget_bias
        else:
            self.bias = nn.Parameter(torch.zeros(G * H))
            with torch.no_grad():
                self.bias[f * H:(f + 1) * H] = forget_bias
            self.ln_weight = self.ln_bias = None
        # Peephole weights for (i, f, o), or (f, o) with coupled gates.
        self.peep = nn.Parameter(torch.zeros(G - 1, H)) if peepholes else None
        self.proj = nn.Linear(H, D, bias=False) if H != D else None

    def state_shapes(self):
        return [(self.d_hidden,)] * (4 if self.exp else 2)

    def step(self, x_t, state):
        gate = None if self.exp else self.gate_fn.fn
        h, state = modlstm_step(x_t, state, self.w_x, self.recurrent_weight(), self.bias, self.ln_weight, self.ln_bias,
                                self.peep, gate, self.coupled, self.linear)
        return self._out(h), state

    def recurrent_weight(self) -> torch.Tensor:
        """The dense recurrent matrix (block-diagonal with heads)."""
        return block_diagonal(self.w_h, len(self.groups), self.heads)

    def forward(self, x, state=None, reset=None):
        state = state if state is not None else self.init_state(x.shape[0], x.device, x.dtype)
        y, state = sequence.forward(self, x, state, reset)
        return self._out(y), state

    def _out(self, h):
        return self.linear(h, self.proj.weight) if self.proj is not None else h

    def flops_per_token(self):
        H, D, G = self.d_hidden, self.d_model, len(self.groups)
        return 2 * G * H * (D + H // self.heads) + (2 * H * D if self.proj is not None else 0)
