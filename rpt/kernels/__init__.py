"""What the recurrences' fast forms run on: `cpu/` builds their C++ loops (rpt/ops/CELL/CELL_cpu.cpp, with the
per-step product they share) and holds the matrix products the CPU runs fastest; `triton/` what their Triton
forms share.

What a fast path may use is one object, `current()` (rpt/kernels/backend.py): a recurrence asks it once per call
which form runs, and passes it down to the products and loops it runs. Tests and benchmarks that compare forms
choose another for a block (`with use(native=False): ...`, `use(force=Form.TRITON_STEPS)`): there are no switches
elsewhere.
"""

from __future__ import annotations

import contextlib
import dataclasses

from rpt.kernels.backend import Backend, Form

__all__ = ["Backend", "Form", "current", "use"]

_current = Backend()


def current() -> Backend:
    """The backend in force."""
    return _current


@contextlib.contextmanager
def use(**changes):
    """Inside this block the backend in force is the current one with `changes` (its fields, by name)."""
    global _current
    before, _current = _current, dataclasses.replace(_current, **changes)
    try:
        yield _current
    finally:
        _current = before
