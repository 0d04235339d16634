"""A recurrence runs in float32 under mixed precision (what every op's fast forms do, and why), but where a form
runs the autocast dtype itself: cuDNN's LSTM and GRU, and oneDNN's LSTM under bf16 autocast on a CPU
(`cpu_bf16`)."""

from contextlib import contextmanager

import torch


@contextmanager
def full_precision(x: torch.Tensor):
    """Run a recurrence in float32 under mixed precision: autocast off inside, inputs cast by the caller.

    Long recurrences accumulate rounding step after step, oneDNN has no fp16 LSTM on CPU, and the
    fused kernels are written for one dtype; the projections around a cell still run in the
    autocast dtype.
    """
    with torch.autocast(x.device.type, enabled=False):
        yield


def as_fp32(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def cpu_bf16(x: torch.Tensor) -> bool:
    """Whether x is on a CPU under bf16 autocast (train.precision = "bf16"): oneDNN's LSTM then runs its products
    in bf16 on the CPU's bf16 units (AMX, avx512_bf16), its carried state kept in float32 between windows;
    1.6x float32's forward + backward at 2 x 512 (benchmarks/results/quality.md, issue 70)."""
    return x.device.type == "cpu" and torch.is_autocast_enabled("cpu") and \
        torch.get_autocast_dtype("cpu") == torch.bfloat16


def cpu_has_bf16_units() -> bool:
    """Whether this CPU multiplies bf16 natively (oneDNN's test: avx512_bf16 or AMX), where elsewhere it emulates
    bf16, slower than float32."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
