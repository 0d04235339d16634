"""`monitor.profile = "START:END"` (rpt train --profile): torch.profiler over steps START to END (1-based,
inclusive) on every rank, each step a `rpt_step#N` span, written to RUN_DIR/traces/rankR.json and summarised
by rpt.monitor.trace_summary. A step hook (rpt/train/hooks.py), installed only when a range is asked for.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rpt.monitor.trace_summary import STEP, parse_range, summarize
from rpt.train.hooks import StepHooks


class StepProfiler(StepHooks):
    def __init__(self, spec: str, run_dir: Path, rank: int, device: torch.device):
        self.range = parse_range(spec)
        self.path = Path(run_dir) / "traces" / f"rank{rank}.json"
        self.device = device
        self.prof = None
        self.step_span = None
        self.summary: dict | None = None  # of this rank's trace, once written

    def step_begins(self, step: int) -> None:
        if self.prof is None and step + 1 == self.range[0]:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.__enter__()
        if self.prof is not None:
            self.step_span = torch.profiler.record_function(f"{STEP}{step + 1}")
            self.step_span.__enter__()

    def step_ends(self, step: int) -> None:
        if self.prof is None:
            return
        self.step_span.__exit__(None, None, None)
        self.step_span = None
        if step >= self.range[1]:
            self.finish()

    def finish(self) -> None:
        """Stop and write the trace (at END, or when the run ends inside the range)."""
        if self.prof is None:
            return
        if self.step_span is not None:
            self.step_span.__exit__(None, None, None)
            self.step_span = None
        self.prof.__exit__(None, None, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.prof.export_chrome_trace(str(self.path))
        self.prof = None
        self.summary = summarize(json.loads(self.path.read_text()))
