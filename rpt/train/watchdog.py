"""Stall detection: a rank that stops making progress does not hang the job silently.

Every rank publishes a heartbeat (step, phase, time of the last phase change) to the process group's
key-value store from a background thread (every second, or every world_size / 256 seconds on large
jobs, to keep the store's load bounded). When a rank has sat in one phase for longer than
`train.stall_timeout` seconds (usually: waiting in a collective for a rank that never arrives), it
reads every rank's heartbeat; if the ranks are not all at the same step and phase (all of them in
one long evaluation is no stall), it names the rank that is furthest behind and what it was doing,
logs that together with its own position, and exits with code 3, so that torchrun or `--max-restarts`
restarts the group from the newest checkpoint instead of waiting out the 10-minute collective
timeout (whose gloo error names neither the rank nor the operation). The stalled rank itself, if
its thread still runs, reports the same diagnosis.

    rank 1 made no progress for 12.0 s: last at step 5 in forward (its own computation); rank 0 waits
    at step 5 in optimizer (gradient synchronisation, clip-norm all-reduce, AdamW)

The watchdog is a step hook (rpt/train/hooks.py): the trainer tells it each phase change, and installs it only
on runs of several processes with `train.stall_timeout` > 0.

Why written here: torch's own watchdog (TORCH_NCCL_*) covers NCCL only and reports the collective's
sequence number, not which rank is behind or where; gloo has none.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from rpt.parallel.launch import STALL_EXIT
from rpt.train.hooks import StepHooks

log = logging.getLogger("rpt.watchdog")
DESCRIBE = {
    "data": "reading the next batch",
    "forward": "its own computation",
    "backward": "backward, with the gradient all-reduce overlapped",
    "optimizer": "gradient synchronisation, clip-norm all-reduce, AdamW",
    "eval": "validation (its all-reduce of the sums)",
    "checkpoint": "writing a checkpoint (barriers)",
    "log": "gathering the metrics of the log interval",
    "start": "setting up",
}
ORDER = ["start", "data", "forward", "backward", "optimizer", "log", "eval", "checkpoint"]


class Watchdog(StepHooks):
    def __init__(self, rank: int, world_size: int, timeout: float):
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.interval = max(1.0, world_size / 256)
        self.last_check = 0.0
        self.step, self.in_phase, self.since = 0, "start", time.monotonic()
        self.store = dist.distributed_c10d._get_default_store()  # installed on runs of several processes only
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rpt-watchdog", daemon=True)
        self._thread.start()

    def phase(self, step: int, name: str) -> None:
        """At every phase change (a few attribute writes: free)."""
        if name != self.in_phase or step != self.step:
            self.step, self.in_phase, self.since = step, name, time.monotonic()

    def run_ends(self) -> None:
        self._stop.set()
        self._thread.join(5)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                now = time.time()
                since = now - (time.monotonic() - self.since)
                self.store.set(f"rpt/heartbeat/{self.rank}", f"{self.step}:{self.in_phase}:{since}")
                stuck = time.monotonic() - self.since
                if stuck > self.timeout and time.monotonic() - self.last_check > 5 * self.interval:
                    self.last_check = time.monotonic()
                    self._check()
            except Exception as exc:  # noqa: BLE001 - the store may go away at shutdown
                if self._stop.is_set():
                    return
                log.debug("heartbeat failed: %s", exc)

    def _check(self) -> None:
        beats = {}
        for r in range(self.world_size):
            try:
                self.store.wait([f"rpt/heartbeat/{r}"], timedelta(seconds=2))
                step, phase, since = self.store.get(f"rpt/heartbeat/{r}").decode().split(":")
                beats[r] = (int(step), phase, float(since))
            except Exception:  # noqa: BLE001 - a rank that never published is the laggard
                beats[r] = (-1, "start", 0.0)
        if len({(step, phase) for step, phase, _ in beats.values()}) == 1:
            return  # every rank in the same place: a long phase, not a rank left behind
        message = diagnose(beats, self.rank, time.time())
        log.error("stall: %s", message)
        for handler in logging.getLogger("rpt").handlers:
            handler.flush()
        print(f"rpt: stall on rank {self.rank}: {message}", file=sys.stderr, flush=True)
        os._exit(STALL_EXIT)


def diagnose(beats: dict[int, tuple[int, str, float]], me: int, now: float) -> str:
    """Name the rank furthest behind (lowest step, earliest phase, oldest change) and where this rank waits."""
    def position(r):
        step, phase, since = beats[r]
        return step, ORDER.index(phase) if phase in ORDER else 0, -(now - since)

    laggard = min(beats, key=position)
    step, phase, since = beats[laggard]
    where = f"at step {step} in {phase} ({DESCRIBE.get(phase, phase)})" if step >= 0 else "before its first step"
    text = f"rank {laggard} made no progress for {now - since:.1f} s: last {where}"
    if laggard != me:
        my_step, my_phase, _ = beats[me]
        text += f"; rank {me} waits at step {my_step} in {my_phase} ({DESCRIBE.get(my_phase, my_phase)})"
    return text
