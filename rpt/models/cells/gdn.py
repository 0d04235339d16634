"""Gated DeltaNet (Yang, Kautz and Hatamizadeh, ICLR 2025): per head a [d, d] memory that each token corrects
toward its value (the delta rule) after a data-dependent decay. From the block's input: q, k, v through a short
causal convolution (4 taps) and SiLU, keys and queries L2-normalised; a decay from a softplus (Mamba2's form) and a
write strength beta; the read normalised per head and gated by SiLU of an output gate, projected back. The spec of
all of it is rpt/ops/gdn/spec.py.

Training runs the chunkwise form (rpt/ops/gdn/chunkwise.py, chunks of `model.chunk_size` steps), or on CUDA
flash-linear-attention's kernel where it is installed (rpt/ops/gdn/sequence.py); generation runs the step. The state is two tensors a row, neither growing with the text: the memory [heads, d, d] and the
convolution's last three inputs [3, 3 d_hidden].
"""

from __future__ import annotations

import math

import torch
from torch import nn

from rpt.errors import RptError
from rpt.kernels.cpu.products import linear
from rpt.models.cells.base import Cell, head_width
from rpt.models.registry import register_cell
from rpt.ops.gdn import sequence
from rpt.ops.gdn.chunkwise import chunked, composed, run
from rpt.ops.gdn.conv import carried, conv_window
from rpt.ops.gdn.spec import gdn_layer_step, heads_of, read_out, split

CONV_WIDTH = 4  # the paper's; its last CONV_WIDTH - 1 inputs are state


@register_cell("gdn")
class GatedDeltaNet(Cell):
    options = ("heads", "chunk_size")
    export_spec = "rpt.ops.gdn.spec"

    def __init__(self, d_model: int, d_hidden: int = 0, heads: int = 1, chunk_size: int = 64):
        super().__init__(d_model, d_hidden or d_model)
        if chunk_size < 1:
            raise RptError(f"model.chunk_size = {chunk_size}: the gdn's chunks need at least one step",
                           "set model.chunk_size to 32-128 (64 by default)")
        H, D = self.d_hidden, d_model
        self.heads, self.head_dim, self.chunk_size = heads, head_width(H, heads), chunk_size
        self.proj = nn.Linear(D, 4 * H + 2 * heads, bias=False)  # q, k, v, output gate, decay, write strength
        self.conv_weight = nn.Parameter(torch.empty(3 * H, CONV_WIDTH).uniform_(-CONV_WIDTH ** -0.5,
                                                                                CONV_WIDTH ** -0.5))
        # the decay's rate A in [1, 16] and its step dt in [1e-3, 1e-1] (log-uniform) at a zero input, as Mamba2
        self.A_log = nn.Parameter(torch.empty(heads).uniform_(1, 16).log())
        dt = torch.exp(torch.empty(heads).uniform_(math.log(1e-3), math.log(1e-1)))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt
        self.norm_weight = nn.Parameter(torch.ones(H))
        self.out_proj = nn.Linear(H, D, bias=False)

    def state_shapes(self):
        d = self.head_dim
        return [(self.heads, d, d), (CONV_WIDTH - 1, 3 * self.d_hidden)]

    def step(self, x_t, state):
        return gdn_layer_step(x_t, state, self.proj.weight, self.conv_weight, self.A_log, self.dt_bias,
                              self.norm_weight, self.out_proj.weight, self.heads, self.head_dim, self.linear)

    def forward(self, x, state=None, reset=None):
        S, inputs = state if state is not None else self.init_state(x.shape[0], x.device, x.dtype)
        d = self.head_dim
        qkv, gate, a, b = split(linear(x, self.proj.weight), self.heads, d, d)
        qkv, inputs = conv_window(qkv, inputs, self.conv_weight, reset)
        q, k, v, g, beta = heads_of(qkv, a, b, self.A_log, self.dt_bias, self.heads, d)
        o, S = sequence.forward(*(t.transpose(1, 2) for t in (q, k, v, g, beta)), reset, S, self.chunk_size)
        return read_out(o.transpose(1, 2), gate, self.norm_weight, self.out_proj.weight, linear), (S, inputs)

    def piece_forward(self, x, state, reset, entering):
        """Context parallelism: the convolution's last inputs of the piece before as a halo (its own are this
        piece's summary to the next), then the piece's affine map S -> A S + B, the earlier pieces' folded into the
        window's memory, the piece chunkwise from there."""
        S, inputs = state
        d = self.head_dim
        qkv, gate, a, b = split(linear(x, self.proj.weight), self.heads, d, d)
        if qkv.shape[1] < CONV_WIDTH - 1:
            raise RptError(f"a piece of {qkv.shape[1]} tokens: gdn's convolution reads the last {CONV_WIDTH - 1} "
                           "inputs of the piece before", "use fewer context-parallel ranks or longer windows")
        (inputs,) = entering((carried(qkv, reset, CONV_WIDTH),), (inputs,), _replaced)
        qkv, carry = conv_window(qkv, inputs, self.conv_weight, reset)
        q, k, v, g, beta = heads_of(qkv, a, b, self.A_log, self.dt_bias, self.heads, d)
        q, k, v, g, beta = (t.transpose(1, 2) for t in (q, k, v, g, beta))
        with torch.autocast(x.device.type, enabled=False):
            wide = torch.promote_types(q.dtype, torch.float32)
            c = chunked(*(t.to(wide) for t in (q, k, v, g, beta)), reset, self.chunk_size)
            (start,) = entering(composed(c), (S.to(wide),), _affine)
            o, S = run(c, start)
        return read_out(o.to(q.dtype).transpose(1, 2), gate, self.norm_weight, self.out_proj.weight, linear), \
            (S, carry)

    def summary_numbers(self):
        """Its piece's map per head (A [d, d], B [d, d]) and the convolution's last inputs."""
        d = self.head_dim
        return self.heads * 2 * d * d + (CONV_WIDTH - 1) * 3 * self.d_hidden

    def flops_per_token(self):
        """The projections, and the chunkwise form's products per head at L = chunk_size: within a chunk k k^T,
        q k^T and its read (6 L d), the triangular solve (2 L d), the entering state's reads by the solve's keys and
        by q, and the state handed on (6 d^2). The convolution is elementwise work, not counted."""
        H, D, d, L = self.d_hidden, self.d_model, self.head_dim, self.chunk_size
        return 2 * D * (4 * H + 2 * self.heads) + 2 * H * D + self.heads * (8 * L * d + 6 * d * d)


def _replaced(own, state):
    """The convolution's inputs after a piece: that piece's own last ones."""
    return own


def _affine(own, state):
    """The memory after a piece whose map is own = (A, B)."""
    return (own[0] @ state[0] + own[1],)
