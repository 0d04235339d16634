"""The Triton kernels compile for an H200 (sm_90) here, without a GPU: Triton's interpreter, which the other tests
run them through, accepts programs its compiler refuses. benchmarks/cells/triton_compile.py --quick compiles one or two
variants of each kernel (recorded from the cells' own host code) with Triton's ptxas, in a process of its own
(the compiled kernels must not be the interpreter's)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[2]


def test_every_triton_kernel_compiles_for_sm90():
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this triton wheel carries no NVIDIA toolchain")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(REPO), TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "cells" / "triton_compile.py"), "--quick"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "_kernel" in line]
    kernels = {row.split()[1] for row in rows}
    assert kernels == {"lstm_forward_kernel", "lstm_backward_kernel", "gru_forward_kernel", "gru_backward_kernel",
                       "modlstm_forward_kernel", "modlstm_backward_kernel", "modlstm_step_kernel",
                       "modlstm_step_backward_kernel", "min_scan_forward_kernel", "min_scan_backward_kernel"}
    for row in rows:  # registers / thread, stack bytes, shared bytes: compiled, so present and in range
        registers = int(row.split("|")[3])
        assert 0 < registers <= 255, row
