"""`RPT_TEST_DEVICE=cuda pytest tests/models` runs the model tests on a GPU (benchmarks/gpu_check.sh does).

Every tensor and module a test makes without naming a device lands on the default device, so
the same parity checks (fast path vs reference, float64 where the path allows) cover cuDNN and
the CUDA paths of the scan and the fused kernels without a second copy of the tests. CI runs
them on the CPU, where the variable is unset.
"""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(autouse=True)
def test_device():
    device = os.environ.get("RPT_TEST_DEVICE", "cpu")
    if device == "cpu":
        yield torch.device("cpu")
        return
    torch.set_default_device(device)
    try:
        yield torch.device(device)
    finally:
        torch.set_default_device("cpu")
