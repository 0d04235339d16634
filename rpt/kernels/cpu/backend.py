"""The CPU backend's choices, as one object (rpt.kernels.current() is the one in force)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


class Gate(IntEnum):
    """The gate functions the native modlstm loops know, by the code they take."""
    EXP = -1  # the stabilised exponential gate
    SIGMOID = 0
    HARD_SIGMOID = 1


class MinScan(IntEnum):
    """The linear recurrences of rpt/ops/minrnn/minrnn_cpu.cpp, by the code it takes."""
    MINGRU = 0
    MINLSTM = 1


@dataclass(frozen=True)
class CPUBackend:
    native: bool = True  # rpt's compiled time loops where they build (else the Python loops, the same computation)
    small_batch: bool = True  # rpt's small-batch product for few-row products in a time loop (else oneDNN's)
    fused_steps: bool = True  # each step's pointwise part as one pass on the CPU (else ATen ops: the GPU form)
    ops: object = None  # the compiled loops to use instead of the built ones (their self-test at load)

    def loops(self):
        """The compiled loops (torch.ops.rpt_loops), built on first use; None where they cannot be built or are
        not wanted."""
        if self.ops is not None:
            return self.ops
        if not self.native:
            return None
        from rpt.kernels.cpu.build import built_loops

        return built_loops()
