"""Fault injection: make a chosen rank fail at a chosen step, as real faults do, to test that a run (or a
deployment's launcher) recovers. The faults are step hooks (rpt/train/hooks.py); `rpt train` installs them when
RPT_FAULT asks (rpt/cli.py: the trainer itself knows none), a test hands them to the Trainer.

    RPT_FAULT="kill@5"            rank 0 kills itself (SIGKILL) when step 5 begins
    RPT_FAULT="kill@5:rank=1"     rank 1 does
    RPT_FAULT="killsave@6:rank=1" rank 1 kills itself inside the checkpoint of step 6: shards written, no manifest
    RPT_FAULT="corrupt@6:rank=1"  once the checkpoint of step 6 is complete, rank 1 flips a byte of its shard
    RPT_FAULT="nan@3"             the loss of step 3 becomes NaN on every rank (non-finite gradients)
    RPT_FAULT="nan@3-99"          steps 3 to 99
    RPT_FAULT="slow@1-99:rank=1:seconds=0.05"   rank 1 computes 0.05 s longer in every step's forward (a straggler)
    RPT_FAULT="stall@4:rank=1:seconds=120"      rank 1 hangs for 120 s in the forward of step 4

A worker that the elastic launcher restarted (TORCHELASTIC_RESTART_COUNT > 0) does not kill
itself again, so a restarted run can finish. Unset, nothing is installed.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from rpt.train.hooks import StepHooks


@dataclass(frozen=True)
class Fault:
    kind: str
    first: int
    last: int
    rank: int | None
    seconds: float = 0.0

    def active(self, step: int, rank: int) -> bool:
        return self.first <= step <= self.last and (self.rank is None or self.rank == rank)


def from_env() -> Fault | None:
    spec = os.environ.get("RPT_FAULT", "")
    if not spec:
        return None
    head, *options = spec.split(":")
    kind, _, steps = head.partition("@")
    first, _, last = steps.partition("-")
    opts = dict(o.split("=", 1) for o in options)
    rank = int(opts["rank"]) if "rank" in opts else (0 if kind in ("kill", "killsave", "corrupt") else None)
    return Fault(kind, int(first), int(last or first), rank, float(opts.get("seconds", 0.0)))


class FaultHooks(StepHooks):
    """The hooks that act out one `Fault` on this rank."""

    def __init__(self, fault: Fault, rank: int):
        self.fault, self.rank = fault, rank
        self.first_run = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0  # a restarted worker goes on

    def _on(self, kind: str, step: int) -> bool:
        return self.fault.kind == kind and self.fault.active(step, self.rank)

    def step_begins(self, step: int) -> None:
        if self._on("kill", step) and self.first_run:
            os.kill(os.getpid(), signal.SIGKILL)

    def in_forward(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        if self._on("slow", step + 1) or self._on("stall", step + 1):  # numbered as in the logs
            time.sleep(self.fault.seconds)
        return loss * float("nan") if self._on("nan", step) else loss

    def checkpoint_written(self, step: int) -> None:
        if self._on("killsave", step) and self.first_run:
            os.kill(os.getpid(), signal.SIGKILL)

    def checkpoint_complete(self, step: int, path: str | None) -> None:
        if self._on("corrupt", step) and path:
            corrupt(path, self.rank)


def hooks_from_env(rank: int) -> list[StepHooks]:
    """The hooks RPT_FAULT asks of this rank: none when it is unset."""
    fault = from_env()
    return [FaultHooks(fault, rank)] if fault else []


def corrupt(checkpoint: str, rank: int) -> None:
    """Flip one byte in the middle of this rank's largest shard of a complete (local) checkpoint: same size,
    wrong checksum, as a bad disk or an interrupted copy leaves it."""
    shards = sorted(Path(checkpoint).glob(f"__{rank}_*.distcp")) or sorted(Path(checkpoint).glob("*.distcp"))
    if not shards:  # not a local folder (an fsspec URL): nothing to corrupt here
        return
    shard = max(shards, key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
