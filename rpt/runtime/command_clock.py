"""When the command began: what a run's summary counts its seconds from (`seconds.command` in summary.json).

A command started from a shell began when its process did (the interpreter's start and torch's import count);
`rpt train --nproc N` hands its start to its workers through RPT_COMMAND_START. A Trainer made from Python with
neither counts from the Trainer's making.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager

ENV = "RPT_COMMAND_START"


def process_started() -> float | None:
    """This process's start as an epoch second (Linux's /proc), or None where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time, clock ticks after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


def command_started(default: float) -> float:
    """The command's start (epoch seconds): RPT_COMMAND_START where a command set it, else `default`."""
    try:
        return float(os.environ[ENV])
    except (KeyError, ValueError):
        return default


@contextmanager
def command_clock(started: float | None):
    """Within: RPT_COMMAND_START holds `started` (for this process and the workers it starts); restored after."""
    before = os.environ.get(ENV)
    if started is not None:
        os.environ[ENV] = repr(started)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before
