"""Process-wide settings for fast CPU training, applied by the entry points (never on import).

`keep_freed_memory()`: glibc returns large freed blocks to the OS (they are mmap'ed), so every
new activation buffer of a training step page-faults its memory back in: on the build machine
that costs 5-25% of a recurrent layer's forward+backward (measured with benchmarks/cells/speed.py;
nn.LSTM itself gains 20%). Telling malloc to serve large blocks from its heap and not to trim
it keeps the pages mapped across steps. PyTorch's CPU tuning guide reaches the same effect with
jemalloc or tcmalloc through LD_PRELOAD; this needs no extra library. A no-op off glibc.

`pool_large_blocks()`, for `train.bptt_chunk` and FSDP on the CPU: a long window's chunks, and FSDP's units (their
parameters gathered and freed in turn), free and reallocate large blocks all step long, and a heap that keeps
every freed block fragments and grows (with the window: 2.8x a 1,024-token window's peak at 65,536 tokens; under
FSDP past DDP's whole state), while glibc's default returns them to the OS, so that each one page-faults in again.
Blocks of 2 MiB and more then come from rpt's page pool (rpt/runtime/page_pool.cpp), which hands freed pages
to later blocks whatever their sizes and holds no more than the most in use at once; smaller ones from the heap
setting. Where the native library cannot be built, `return_large_blocks()` hands blocks of 1 MiB and more back to
the OS as they are freed: flat memory for half again the time (benchmarks/results/long.md and
benchmarks/results/parallel.md, "Sharding and resizing").
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
_applied = False


def keep_freed_memory() -> bool:
    """Serve large allocations from the heap and never trim it; True when it took effect."""
    global _applied
    if not _applied:
        _applied = _mallopt((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1))
    return _applied


def return_large_blocks(threshold: int = 1 << 20) -> bool:
    """Serve blocks of `threshold` bytes and more by mmap, each returned to the OS when freed (a fixed threshold:
    glibc's own rises to 32 MiB once such a block is freed); True when it took effect."""
    return _mallopt((M_MMAP_THRESHOLD, threshold))


def pool_large_blocks(threshold: int = 2 << 20) -> str:
    """Blocks of `threshold` bytes and more from rpt's page pool and smaller ones from a heap that keeps them
    ("pool"); large blocks returned to the OS as they are freed where the pool cannot be built ("mmap")."""
    from rpt.kernels.cpu.build import built_loops

    ops = built_loops()
    if ops is not None and ops.use_page_pool(threshold):
        keep_freed_memory()
        return "pool"
    return_large_blocks()
    return "mmap"


def _mallopt(*settings: tuple[int, int]) -> bool:
    """glibc's mallopt for each (parameter, value); False off glibc or where one did not take."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all([bool(mallopt(parameter, value)) for parameter, value in settings])
