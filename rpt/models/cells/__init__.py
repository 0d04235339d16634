"""The built-in cells; importing this package registers them (and the check the native loops pass on load)."""

import torch

from rpt import kernels
from rpt.kernels.cpu import build
from rpt.models.cells import gdn, gru, lstm, minrnn, mlstm, modlstm  # noqa: F401
from rpt.models.cells.base import Cell, State

__all__ = ["Cell", "State"]


def run_cells_on(ops) -> None:
    """Every cell that uses the native loops, forward and backward once on the CPU with either per-step product
    (rpt's small-batch one, oneDNN's) on `ops`: a torch whose operator schemas differ from the build's fails here."""
    torch.manual_seed(0)
    for small_batch in (True, False):
        with kernels.use(ops=ops, small_batch=small_batch):
            for cell in (modlstm.ModLSTM(8, gate_norm=True, peepholes=True), modlstm.ModLSTM(8, gate="exp"),
                         gru.GRU(8), minrnn.MinGRU(8), minrnn.MinLSTM(8)):
                x = torch.randn(2, 3, 8, requires_grad=True)
                reset = torch.zeros(2, 3, dtype=torch.bool)
                reset[0, 1] = True
                y, _ = cell(x, None, reset)
                y.sum().backward()


build.on_load(run_cells_on)
