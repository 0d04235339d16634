"""What every recurrent cell is: three forms of one recurrence, with an explicit state.

A cell maps x: [B, T, d_model] to y: [B, T, d_model] and a state (a tuple of tensors, each [B, *shape]:
vectors for the classic cells, a matrix per head for mlstm) to the state after the last step. Every cell has three forms, as
flash-linear-attention keeps for its ops, and the tests hold them equal, gradients included:

- `step(x_t, state)`: one token; what generation runs. The built-in cells write it as a pure function of
  tensors beside the module (`lstm_step`, `gru_step`, `modlstm_step`: F.linear and pointwise ops), the
  readable spec of the recurrence.
- `reference(x, state, reset)`: the spec over a sequence, `step` in a plain loop.
- `forward(x, state, reset)`: the fast training path (cuDNN/oneDNN, a parallel scan, or a fused kernel whose
  loops come from a backend of rpt.kernels).

`reset[b, t]` (bool) sets row b's state back to the initial (zero) state before x[b, t] is read.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from rpt.errors import RptError
from rpt.ops.segments import reset_rows
from rpt.ops.stack.spec import block_diagonal


State = tuple[torch.Tensor, ...]


class Cell(nn.Module):
    name = "cell"
    # The product the step forms run: F.linear. Generation on the CPU swaps in another from outside, for the
    # duration (rpt.kernels.cpu.products.row_products).
    linear = staticmethod(F.linear)
    # The model.* options this cell takes beside d_model and d_hidden, passed to __init__ by name. A cell declares
    # its own; setting one it does not declare is refused at start (rpt.models.registry.check_options).
    options: tuple[str, ...] = ()
    # Whether its training form runs rpt's compiled CPU loops (built once per machine: `rpt train` builds them
    # before anything is timed)
    native_loops = False
    # The module whose `Layer` is this cell's exported step (`rpt export` ships that file as spec_cell.py: torch
    # alone, the parameters by this cell's names); None: the cell cannot be exported
    export_spec: str | None = None

    def __init__(self, d_model: int, d_hidden: int):
        super().__init__()
        self.d_model, self.d_hidden = d_model, d_hidden

    # --- what a cell defines
    def state_sizes(self) -> list[int]:
        """The width of each state vector (a cell whose state is vectors defines this)."""
        raise NotImplementedError

    def state_shapes(self) -> list[tuple[int, ...]]:
        """The shape of each state tensor, one row's (the state is [B, *shape] each): the vectors of
        `state_sizes`, unless a cell with other state (mlstm's matrices) defines this instead."""
        return [(n,) for n in self.state_sizes()]

    def step(self, x_t: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, state: State | None = None, reset: torch.Tensor | None = None):
        raise NotImplementedError

    def flops_per_token(self) -> int:
        """Forward multiply-adds x 2 of the cell's matrix products per token (elementwise work not counted)."""
        raise NotImplementedError

    # --- context parallelism (rpt/parallel/context.py): a window's time axis split over the ranks of a group
    # A cell that defines `piece_forward(x, state, reset, entering)` runs its piece of the window at once: it
    # summarises what its piece does to a state from its own inputs, and `entering(own, state, fold)` (a collective
    # of the group, differentiable) gives the state entering its piece: every rank's `own` (a tuple of tensors)
    # gathered and the earlier ones folded into `state` by `fold(own, state) -> state`. `summary_numbers()`: the
    # numbers a row of its summaries holds (what a rank sends). A cell without it hands its state from rank to rank.
    piece_forward = None

    def summary_numbers(self) -> int:
        raise NotImplementedError

    # --- shared
    def init_state(self, batch: int, device=None, dtype=None) -> State:
        p = next(self.parameters())
        return tuple(torch.zeros(batch, *shape, device=device or p.device, dtype=dtype or p.dtype)
                     for shape in self.state_shapes())

    def state_numbers(self) -> int:
        """How many numbers one row's state holds (its bytes: this x the state's element size)."""
        return sum(math.prod(shape) for shape in self.state_shapes())

    def reference(self, x: torch.Tensor, state: State | None = None, reset: torch.Tensor | None = None):
        state = state if state is not None else self.init_state(x.shape[0], x.device, x.dtype)
        ys = []
        for t in range(x.shape[1]):
            if reset is not None:
                state = reset_rows(state, reset[:, t])
            y, state = self.step(x[:, t], state)
            ys.append(y)
        return torch.stack(ys, dim=1), state


class GatedRNNCell(Cell):
    """Parameters in PyTorch's RNN layout for `n_gates` gate groups (w_ih, w_hh, b_ih, b_hh), as LSTM and GRU
    keep them, so torch's fused kernels take them as they are; a projection back to d_model when d_hidden differs.
    With `heads` > 1 the recurrent matrix is block-diagonal and w_hh holds only its blocks (`block_diagonal`)."""

    n_gates = 1

    def __init__(self, d_model: int, d_hidden: int = 0, weight_drop: float = 0.0, heads: int = 1):
        super().__init__(d_model, d_hidden or d_model)
        self.weight_drop, self.heads = weight_drop, heads
        G, H, D = self.n_gates, self.d_hidden, d_model
        self.w_ih = nn.Parameter(torch.empty(G * H, D))
        self.w_hh = nn.Parameter(torch.empty(G * H, head_width(H, heads)))
        self.b_ih = nn.Parameter(torch.zeros(G * H))
        self.b_hh = nn.Parameter(torch.zeros(G * H))
        nn.init.uniform_(self.w_ih, -1 / math.sqrt(H), 1 / math.sqrt(H))
        nn.init.uniform_(self.w_hh, -1 / math.sqrt(H // heads), 1 / math.sqrt(H // heads))  # its fan-in
        self.proj = nn.Linear(H, D, bias=False) if H != D else None

    def recurrent_blocks(self) -> torch.Tensor:
        """w_hh, with DropConnect while training (one mask for the whole sequence; the step form is for generation)."""
        return F.dropout(self.w_hh, self.weight_drop, self.training) if self.weight_drop else self.w_hh

    def recurrent_weight(self) -> torch.Tensor:
        """The dense recurrent matrix of `recurrent_blocks`."""
        return block_diagonal(self.recurrent_blocks(), self.n_gates, self.heads)

    def step_weight(self) -> torch.Tensor:
        """The dense recurrent matrix the step forms read (generation: no DropConnect)."""
        return block_diagonal(self.w_hh, self.n_gates, self.heads)

    def _out(self, h):
        return self.linear(h, self.proj.weight) if self.proj is not None else h

    def flops_per_token(self):
        H, D = self.d_hidden, self.d_model
        return 2 * self.n_gates * H * (D + H // self.heads) + (2 * H * D if self.proj is not None else 0)


def head_width(d_hidden: int, heads: int) -> int:
    """The state width of one head; refuses a head count that does not divide the state."""
    if heads < 1 or d_hidden % heads:
        raise RptError(f"model.heads = {heads} does not divide the cell's state width {d_hidden}",
                       "choose a head count that divides d_hidden (d_model unless set), e.g. 4 or 8")
    return d_hidden // heads


# The cuDNN cells (lstm, gru) keep their four weights as separate parameters, so that weight norm and
# DropConnect act on them; cuDNN copies them into one buffer per call (at no measurable cost next to nn.LSTM's
# flattened weights: benchmarks/results/cells.md) and warns once per process.
warnings.filterwarnings("ignore", message="RNN module weights are not part of single contiguous chunk")
