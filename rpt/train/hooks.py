"""Step hooks: what acts at fixed points of the training loop without being part of the step.

The trainer walks a list of installed hooks at each point; a run that asks for none has an empty list, and its
loop reads no line of them. What installs one:

    faults.FaultHooks     RPT_FAULT (tests make ranks fail on purpose)
    watchdog.Watchdog     a run of several processes with train.stall_timeout > 0
    step_profiler.StepProfiler   monitor.profile = "START:END" (rpt train --profile)

A hook overrides the points it needs; the others do nothing.
"""

from __future__ import annotations

import torch


class StepHooks:
    def phase(self, step: int, name: str) -> None:
        """This rank enters phase `name` ("data", "forward", ..., "checkpoint"; rpt.monitor.metrics.PHASES) of
        step `step`."""

    def step_begins(self, step: int) -> None:
        """The batch of step `step + 1` is read, its forward not begun (`step` steps are done)."""

    def in_forward(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """Inside the forward of step `step + 1`, with its loss; returns the loss the step goes on with."""
        return loss

    def step_ends(self, step: int) -> None:
        """Step `step` is done (its optimiser step taken)."""

    def checkpoint_written(self, step: int) -> None:
        """Every shard of the checkpoint of `step` written, the manifest not yet."""

    def checkpoint_complete(self, step: int, path: str | None) -> None:
        """The checkpoint of `step` complete (path None while an asynchronous save is still writing)."""

    def run_ends(self) -> None:
        """The loop is over (the run finished, or stopped on an interrupt)."""
