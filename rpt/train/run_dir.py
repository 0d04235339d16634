"""Run directories: a new run's default folder, each rank's log (RUN_DIR/logs/rank{R}.log; rank 0 also talks to
the terminal), and a finished or running run's model loaded back (`load_run`: what eval, generate, export and
serving start from)."""

from __future__ import annotations

import logging
import sys
from datetime import datetime
from pathlib import Path

from rpt.config import Config
from rpt.errors import RptError
from rpt.parallel import launch


def default_run_dir(config_path: str | None) -> Path:
    name = Path(config_path).stem if config_path else "default"
    return Path("runs") / f"{name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


class _LazyFileHandler(logging.FileHandler):
    """Creates its folder and file with the first record: a run refused at start leaves no run directory."""

    def _open(self):
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        return super()._open()


def setup_logging(run_dir: Path, rank: int) -> None:
    handler = _LazyFileHandler(run_dir / "logs" / f"rank{rank}.log", delay=True)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("rpt")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)


def load_run(run_dir: str | Path, checkpoint: str = "best", device: str | None = None):
    """(config, model with weights, tokenizer, checkpoint path, its CheckpointStore) of a finished or running run."""
    from rpt.data.tokenizer import load_tokenizer
    from rpt.models import RecurrentLM
    from rpt.train.checkpoint.store import CheckpointStore

    run_dir = Path(run_dir)
    if not (run_dir / "config.toml").is_file():
        raise RptError(f"{run_dir} is not a run directory (no config.toml)", "pass the folder `rpt train` wrote, e.g. runs/NAME")
    cfg = Config.load(run_dir / "config.toml")
    dev = launch.pick_device(device, 0)
    model = RecurrentLM(cfg.model).to(dev)
    ck = CheckpointStore(cfg.checkpoint.path or str(run_dir / "checkpoints"))
    path = ck.find(checkpoint, str(run_dir))
    for damaged, problem in ck.damaged.items():
        print(f"skipping the damaged checkpoint {damaged}: {problem}", file=sys.stderr)
    ck.load(path, model)
    model.eval()
    tokenizer = load_tokenizer(run_dir / "tokenizer.json")
    return cfg, model, tokenizer, path, ck
