"""A recurrence runs in float32 under mixed precision (what every op's fast forms do, and why)."""

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
