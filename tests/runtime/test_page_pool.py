"""rpt's page pool (rpt/runtime/page_pool.cpp), the CPU allocator of exact BPTT in chunks.

It replaces the allocator of the whole process, so each check runs in a fresh one: blocks keep what is written to
them when built from the pages of freed blocks, the pool never holds more than the most its blocks had in use at
once, small blocks stay with the allocator it replaced, a chunked backward under it gives the gradients it gives
without it, and its memory stays flat in the window where glibc's heap grew. Where the pool cannot be built, the
trainer's setting falls back to returning large blocks to the OS.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rpt.runtime import memory as runtime
from rpt.kernels.cpu.build import built_loops

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or built_loops() is None,
                                reason="the page pool is Linux's and lives in the native library")

BLOCKS = """
import json, torch
from rpt.runtime.memory import pool_large_blocks
assert pool_large_blocks() == "pool"
stats = lambda: dict(zip(["used", "held", "high_water", "moved"],
                         torch.ops.rpt_loops.page_pool_stats()))
out = {}
a, b, c = torch.full((3 * 2**18,), 1.0), torch.full((2**18,), 2.0), torch.full((2**19,), 3.0)  # 3, 1 and 2 MiB
before = stats()
small = [torch.ones(1000) for _ in range(100)]  # 4 KB each: not the pool's
out["small_untouched"] = stats() == before
where = a.data_ptr()
del a
again = torch.empty(3 * 2**18)  # the same size: the freed block itself
out["same_block"] = again.data_ptr() == where
del again, b, c  # 4 and 2 MiB held (b, 1 MiB, was never the pool's)
held = stats()["held"]
big = torch.arange(2**21, dtype=torch.float32)  # 8 MiB: built from their pages and 2 MiB of new ones
after = stats()
out["moved"], out["held_before"], out["held_after"], out["high_water"] = after["moved"], held, after["held"], after["high_water"]
out["intact"] = bool((big == torch.arange(2**21, dtype=torch.float32)).all())
big.mul_(2).add_(1)
out["written"] = bool((big == torch.arange(2**21, dtype=torch.float32) * 2 + 1).all())
print(json.dumps(out))
"""


def _run(code: str, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_blocks_reuse_freed_pages_whatever_their_sizes():
    out = _run(BLOCKS)
    assert out["small_untouched"]  # blocks under 2 MiB go to the replaced allocator
    assert out["same_block"]
    assert out["held_before"] == 6 * MIB  # 3 MiB rounds up to 4: whole 2 MiB pages
    assert out["moved"] >= 1  # the 8 MiB block took the held pages (one range where the two mappings adjoined)
    assert out["held_after"] == out["high_water"] == 8 * MIB  # and only the pages they lacked were new
    assert out["intact"] and out["written"]


CHUNKED = """
import json, sys, torch
from rpt.runtime.memory import pool_large_blocks
from rpt.config import ModelConfig
from rpt.models.lm import RecurrentLM
from rpt.parallel.bptt import chunk_windows
pool = sys.argv[1] == "pool"
if pool:
    assert pool_large_blocks() == "pool"
torch.manual_seed(0)
model = RecurrentLM(ModelConfig(cell="lstm", n_layers=2, d_model=256, vocab_size=8192, head_shortlist=512)).double()
chunk_windows(model, 128)
g = torch.Generator().manual_seed(1)
out = {}
for window in (512, 2048):
    x, y = torch.randint(0, 8192, (1, window), generator=g), torch.randint(0, 8192, (1, window), generator=g)
    model.zero_grad(set_to_none=True)
    nats, _ = model(x, targets=y)
    nats.mean().backward()
    out[window] = {"held": torch.ops.rpt_loops.page_pool_stats()[1] if pool else 0,
                   "grads": [p.grad.double().sum().item() for p in model.parameters()],
                   "grad_norms": [p.grad.double().norm().item() for p in model.parameters()]}
print(json.dumps(out))
"""


def test_a_chunked_backward_under_the_pool_gives_the_same_gradients_in_flat_memory():
    pooled, plain = _run(CHUNKED, "pool"), _run(CHUNKED, "plain")
    for window in ("512", "2048"):
        for key in ("grads", "grad_norms"):
            assert pooled[window][key] == pytest.approx(plain[window][key], rel=1e-9, abs=1e-12)  # float64
    # 4 chunks then 16: the pool holds one chunk's working set (its high water), not the window's
    assert 0 < pooled["2048"]["held"] <= pooled["512"]["held"] * 1.1


def test_without_the_native_library_large_blocks_go_back_to_the_os(monkeypatch):
    calls = []
    monkeypatch.setattr("rpt.kernels.cpu.build.built_loops", lambda: None)
    monkeypatch.setattr(runtime, "return_large_blocks", lambda *a: calls.append("mmap") or True)
    assert runtime.pool_large_blocks() == "mmap" and calls == ["mmap"]

