"""Outside metric sinks, TensorBoard and Weights & Biases: the store's figures, under the same names in both.

rank 0 writes them from the records it has just written to metrics.sqlite, at the same moments, so
the store and a sink never disagree (the tests compare them). Only rank 0 writes: several ranks
appending to one TensorBoard folder or W&B run is how those get corrupted.

`monitor.tensorboard = "auto"` (the default) writes TensorBoard files when the package is installed;
`true` requires it. `monitor.wandb = true` requires wandb; W&B's own variables choose the project,
entity and mode (WANDB_PROJECT, WANDB_ENTITY, WANDB_MODE=offline for a machine without network).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from rpt.config import MonitorConfig
from rpt.errors import RptError

PER_RANK = ("step_s", "compute_s", "forward_s", "backward_s", "optimizer_s", "data_s", "exposed_comm_s",
            "memory_bytes")


def interval_scalars(record: dict, ranks: list[dict]) -> dict[str, float]:
    """One log interval: train/... from rank 0's record, rankR/... from every rank's row."""
    out = {f"train/{k}": record[k] for k in ("loss", "grad_norm", "lr", "tokens_per_s") if record.get(k) is not None}
    for row in ranks:
        out.update({f"rank{int(row['rank'])}/{k}": row[k] for k in PER_RANK if row.get(k) is not None})
    return out


def eval_scalars(record: dict) -> dict[str, float]:
    suffix = "_final" if record["final"] else ""
    by_depth = {f"val/bpb_depth_{d}{suffix}": r["bpb"] for d, r in record.get("by_depth", {}).items()}
    return {**{f"val/{k}{suffix}": record[k] for k in ("loss", "ppl", "bpb")}, **by_depth}


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def require(cfg: MonitorConfig) -> None:
    """On every rank at start, so that a missing package stops all of them, not rank 0 alone."""
    if cfg.tensorboard is True and not installed("tensorboard"):
        raise RptError("monitor.tensorboard = true needs the tensorboard package, which is not installed",
                       "pip install tensorboard (or rpt[tensorboard]), or set monitor.tensorboard = \"auto\" "
                       "(files when installed) or false")
    if cfg.wandb and not installed("wandb"):
        raise RptError("monitor.wandb = true needs the wandb package, which is not installed",
                       "pip install wandb (or rpt[wandb]), or set monitor.wandb = false: "
                       "`rpt monitor RUN_DIR` reads RUN_DIR/metrics.sqlite")


def open_sinks(cfg: MonitorConfig, run_dir: Path, config: dict) -> list:
    """rank 0's writers for this run (none asked for, none installed: an empty list)."""
    sinks = []
    if cfg.tensorboard is True or (cfg.tensorboard == "auto" and installed("tensorboard")):
        from rpt.monitor.tensorboard import TensorBoardWriter

        sinks.append(TensorBoardWriter(run_dir))
    if cfg.wandb:
        from rpt.monitor.wandb_writer import WandbWriter

        sinks.append(WandbWriter(run_dir, config))
    return sinks
