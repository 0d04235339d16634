"""TensorBoard event files (monitor.tensorboard = true): one writer, on rank 0, in RUN_DIR/tb.

Written from the same records as the SQLite store at the same moments, so the two never disagree.
Only rank 0 writes: several ranks appending event files to one shared folder is how TensorBoard
folders get corrupted. The per-rank figures appear as rankR/... scalars.
"""

from __future__ import annotations

from pathlib import Path

from rpt.errors import RptError

PER_RANK = ("step_s", "compute_s", "forward_s", "backward_s", "optimizer_s", "data_s", "exposed_comm_s",
            "memory_bytes")


def require_tensorboard() -> None:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise RptError("monitor.tensorboard = true needs the tensorboard package, which is not installed",
                       "pip install tensorboard (or rpt[tensorboard]), or set monitor.tensorboard = false: "
                       "`rpt monitor RUN_DIR` reads RUN_DIR/metrics.sqlite") from None


class TensorBoardWriter:
    def __init__(self, run_dir: Path):
        require_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tb"))

    def interval(self, record: dict, ranks: list[dict]) -> None:
        step = int(record["step"])
        for key in ("loss", "grad_norm", "lr", "tokens_per_s"):
            if record.get(key) is not None:
                self.writer.add_scalar(f"train/{key}", record[key], step)
        for row in ranks:
            for key in PER_RANK:
                if row.get(key) is not None:
                    self.writer.add_scalar(f"rank{int(row['rank'])}/{key}", row[key], step)
        self.writer.flush()

    def evaluation(self, record: dict) -> None:
        for key in ("loss", "ppl", "bpb"):
            self.writer.add_scalar(f"val/{key}" + ("_final" if record["final"] else ""), record[key], record["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
