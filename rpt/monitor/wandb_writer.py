"""A Weights & Biases run for an rpt run (rpt/monitor/sinks.py says when and what).

The W&B run's id is kept in RUN_DIR/wandb_run_id, so `rpt train --resume` continues the same W&B
run instead of starting a second one; its files go to RUN_DIR/wandb (offline runs are uploaded
later with `wandb sync RUN_DIR/wandb/offline-run-*`).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path


class WandbWriter:
    def __init__(self, run_dir: Path, config: dict):
        import wandb

        run_dir = Path(run_dir)
        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(6)
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "rpt"), name=run_dir.name, id=run_id,
                              resume="allow", dir=str(run_dir), config=config)

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def finish(self, summary: dict) -> None:
        self.run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float, str))})
        self.run.finish()
