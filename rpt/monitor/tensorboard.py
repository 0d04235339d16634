"""TensorBoard event files in RUN_DIR/tb (rpt/monitor/sinks.py says when and what)."""

from __future__ import annotations

from pathlib import Path


class TensorBoardWriter:
    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tb"))

    def scalars(self, values: dict[str, float], step: int) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def finish(self, summary: dict) -> None:
        self.writer.close()
