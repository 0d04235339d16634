"""The device's matrix-product peak in FLOP/s per precision: what model FLOP utilisation (MFU: the model's
training FLOPs a second over this peak, summary.json's `mfu`) is measured against.

Measured once per machine and kept in ~/.cache/rpt/peak_flops.json (RPT_PEAK_CACHE names another file), keyed by
the device's name, the precision, torch's version and, on a CPU, the threads a process uses: the best of a few
large square products (up to 2,048 on a CPU, 8,192 on a GPU), under a second the first time. Delete the file to measure
again (a peak measured beside other work is low, and every MFU after it high).
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def cache_file() -> Path:
    return Path(os.environ.get("RPT_PEAK_CACHE") or Path.home() / ".cache" / "rpt" / "peak_flops.json")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        model = ""
    return f"{model or platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def peak_flops(device: torch.device, precision: str) -> float:
    """FLOP/s of a large product in `precision` (fp32, bf16, fp16) on `device`: cached, else measured now."""
    key = f"{device_name(device)} | {precision} | torch {torch.__version__}"
    path = cache_file()
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return float(known[key])
    peak = measure(device, DTYPES[precision])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        latest = {**(json.loads(path.read_text()) if path.is_file() else {}), key: peak}
        scratch = path.with_suffix(f".{os.getpid()}.tmp")
        scratch.write_text(json.dumps(latest, indent=1) + "\n")
        scratch.replace(path)  # whole or not at all: processes starting together may both write it
    except (OSError, ValueError):
        pass  # a read-only home: measured again next time
    return peak


def measure(device: torch.device, dtype: torch.dtype, repeats: int = 5) -> float:
    """The best rate of n x n products, in FLOP/s: n from 512 doubling up to 2,048 (8,192 on a GPU) while the next
    size's product would take under a tenth of a second (a CPU without bf16 units emulates them, slowly), each n timed
    `repeats` times after one product to warm up."""
    largest = 8192 if device.type == "cuda" else 2048
    best, n = 0.0, 512
    while n <= largest:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        fastest = float("inf")
        for i in range(repeats + 1):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            began = time.perf_counter()
            torch.mm(a, b)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i:
                fastest = min(fastest, time.perf_counter() - began)
        best = max(best, 2 * n ** 3 / fastest)
        if 8 * fastest > 0.1:  # the next size's product would take longer
            break
        n *= 2
    return best
