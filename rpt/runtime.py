"""Process-wide settings for fast CPU training, applied by the entry points (never on import).

`keep_freed_memory()`: glibc returns large freed blocks to the OS (they are mmap'ed), so every
new activation buffer of a training step page-faults its memory back in: on the build machine
that costs 5-25% of a recurrent layer's forward+backward (measured with benchmarks/cells.py;
nn.LSTM itself gains 20%). Telling malloc to serve large blocks from its heap and not to trim
it keeps the pages mapped across steps. PyTorch's CPU tuning guide reaches the same effect with
jemalloc or tcmalloc through LD_PRELOAD; this needs no extra library. A no-op off glibc. Not under FSDP: its
units' parameters are gathered and freed in turn, and a heap that keeps every freed block grew to more than
DDP's whole state (benchmarks/RESULTS.md). Nor with `train.bptt_chunk`: a long window's chunks leave small
long-lived blocks (boundary states, losses) between their large freed ones, and that heap grew with the window
(2.8x a 1,024-token window's peak at 65,536 tokens); `pool_large_blocks()` instead gives blocks of 2 MiB and more
from rpt's page pool (rpt/kernels/cpu/page_pool.cpp), which reuses a chunk's pages in the next whatever their
sizes, and keeps the heap setting for the rest; where the native library cannot be built, `return_large_blocks()`
hands large blocks back to the OS as they are freed, which keeps the peak flat for half again the time a token
(benchmarks/RESULTS.md, "Long sequences").
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
