"""Which form runs a recurrence, asked of one object for CPU and GPU alike (rpt.kernels.current()).

A recurrence's op (rpt/ops/CELL/) says which forms it has for a configuration on a device; `Backend.form` picks
one, once per call, and the op's forward and backward both run that one (the backward reads it from what the
forward saved, so a backend changed between the two cannot split them). The preference is fixed: on a GPU the
Triton forms, then a library's kernel (cuDNN's LSTM, flash-linear-attention's gated delta rule), then a matrix
memory's chunkwise form, then rpt's C++ loops, then ATen ops; on the CPU the library's kernel (oneDNN's LSTM), the
chunkwise form, rpt's C++ loops (each step's pointwise part in one pass, else ATen ops inside them), then ATen ops
from Python. The ATen form always exists: it is each op's readable loop over time, the same computation.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from enum import Enum

from rpt.kernels.triton import available as triton_available


class Form(str, Enum):
    """The forms a recurrence may have (a str, so that a torch custom operator takes it as its argument)."""
    TRITON_LOOP = "triton_loop"  # the whole sequence in one Triton kernel, a program per head (rpt/ops/CELL/triton.py)
    TRITON_STEPS = "triton_steps"  # a product and one Triton kernel a step, replayed as a CUDA graph (modlstm)
    LIBRARY = "library"  # a library's fused kernel: cuDNN's or oneDNN's LSTM, flash-linear-attention's (gdn)
    CHUNKWISE = "chunkwise"  # a matrix memory's chunkwise-parallel form in torch (mlstm, gdn: rpt/ops/CELL/chunkwise.py)
    NATIVE_ONE_PASS = "native_one_pass"  # rpt's C++ loops, each step's pointwise part one vector pass (CPU)
    NATIVE = "native"  # rpt's C++ loops, each step's pointwise part as ATen ops (the GPU's arithmetic)
    ATEN = "aten"  # ATen ops driven from Python: the op's readable loop or scan


ON_GPU = (Form.TRITON_LOOP, Form.TRITON_STEPS, Form.LIBRARY, Form.CHUNKWISE, Form.NATIVE, Form.ATEN)
ON_CPU = (Form.LIBRARY, Form.CHUNKWISE, Form.NATIVE_ONE_PASS, Form.NATIVE, Form.ATEN)


@dataclass(frozen=True)
class Backend:
    native: bool = True  # rpt's compiled time loops where they build (else the ATen form, the same computation)
    small_batch: bool = True  # rpt's small-batch product for few-row products in a time loop (else oneDNN's)
    one_pass: bool = True  # on the CPU, each step's pointwise part as one pass (else ATen ops: the GPU's form)
    triton: bool = True  # on a GPU, rpt's Triton forms where triton is installed
    force: Form | None = None  # a test's choice: this form wherever an op offers it, on any device
    ops: object = None  # the compiled loops to use instead of the built ones (their self-test at load)

    def form(self, x, offered: Collection[Form]) -> Form:
        """The form that runs an op offering `offered` on x's device."""
        if self.force is not None and self.force in offered:
            return self.force
        return next(f for f in (ON_GPU if x.is_cuda else ON_CPU) if f is Form.ATEN or
                    (f in offered and self._allows(f)))

    def _allows(self, form: Form) -> bool:
        if form in (Form.TRITON_LOOP, Form.TRITON_STEPS):
            return self.triton and triton_available()
        if form in (Form.NATIVE_ONE_PASS, Form.NATIVE):
            return (self.one_pass or form is Form.NATIVE) and self.loops() is not None
        return True

    def loops(self):
        """The compiled loops (torch.ops.rpt_loops), built on first use; None where they cannot be built or are
        not wanted."""
        if self.ops is not None:
            return self.ops
        if not self.native:
            return None
        from rpt.kernels.cpu.build import built_loops

        return built_loops()

    def loops_for_backward(self):
        """The compiled loops for the backward of a forward that ran them: this backend's, or the built ones where
        it would not choose them now (a backend changed between forward and backward does not change the form)."""
        from rpt.kernels.cpu.build import built_loops

        return self.loops() or built_loops()
