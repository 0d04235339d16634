"""The GPU backend's shared pieces: which gates have a Triton form (GATE_FORMS), whether triton is installed and a
head fits on chip, what the loop kernels share (common.py), and CUDA-graph replay (graphs.py). The kernels
themselves are the recurrences' own, in rpt/ops/CELL/triton.py (lstm, gru, modlstm: a program per (head, batch
block) holding its head's recurrent blocks on chip for the whole sequence, FlashRNN's layout;
modlstm/triton_steps.py: the wider modlstm, a product and one kernel a step, replayed as a CUDA graph;
minrnn: minGRU's and minLSTM's scan). Every kernel also runs on the CPU under TRITON_INTERPRET=1, where the tests
hold it to the float64 reference; on a GPU it compiles.
"""

from __future__ import annotations

import importlib.util

# A registered gate's Triton form, by name: (fn, grad) as triton.jit functions (rpt.models.register_gate fills it)
GATE_FORMS: dict[str, tuple] = {}


def available() -> bool:
    """Whether triton is installed (the GPU paths of the cells take it only then)."""
    return importlib.util.find_spec("triton") is not None


def on_chip(d_hidden: int, heads: int, power_of_two: bool = False) -> bool:
    """Whether a head of `d_hidden / heads` units fits the Triton loops (and triton is installed): 16 to 64 units
    (a width that is not a power of two is padded to the next one, the padding masked)."""
    width = d_hidden // heads
    fits = 16 <= width <= 64 and (not power_of_two or width & (width - 1) == 0)
    return fits and available()
