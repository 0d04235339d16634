"""What each rank runs in the communication tests (importable by spawned workers)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def base_overrides(data: str) -> list[str]:
    return [f"data.path={data}", "model.d_model=32", "model.n_layers=2", "model.dropout=0.1", "train.batch_size=4",
            "train.seq_len=16", "train.max_steps=6", "train.warmup_steps=2", "train.eval_interval=0",
            "train.eval_tokens=1024", "monitor.log_interval=1", "comm.bucket_mb=0.005"]


def train_variants(data: str, out_dir: str, variants: list[tuple[str, list[str]]]) -> dict:
    """Train each (name, overrides) in turn in this process group; return what the tests compare."""
    from rpt.config import Config
    from rpt.parallel import launch
    from rpt.train.trainer import Trainer

    d = launch.setup("cpu")
    torch.set_num_threads(1)
    results = {}
    try:
        for name, overrides in variants:
            cfg = Config.load(None, base_overrides(data) + overrides)
            run_dir = Path(out_dir) / name
            trainer = Trainer(cfg, run_dir, d, progress=False)
            summary = trainer.run()
            opt = trainer.optimizer
            optim_numel = sum(t.numel() for st in (opt.state.values() if opt else ()) for t in st.values()
                              if torch.is_tensor(t) and t.dim() > 0)
            losses = {}
            if d.rank == 0:
                for line in (run_dir / "metrics.jsonl").read_text().splitlines():
                    record = json.loads(line)
                    if record["kind"] == "train":
                        losses[record["step"]] = record
            results[name] = {"summary": summary, "optim_numel": optim_numel, "losses": losses,
                             "params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
                             "owned": sum(p.numel() for p in trainer.sync.owned)}
    finally:
        launch.teardown()
    return results


def build_auto_with_timings(timed: dict) -> dict:
    """comm.mode = auto with the pattern timings replaced by `timed`: which sync it built, what this rank owns."""
    from rpt.comm.sync import build_sync
    from rpt.config import CommConfig
    from rpt.comm import topology
    from rpt.parallel import launch

    d = launch.setup("cpu")
    try:
        topology.time_modes = lambda grad_bytes, **_: dict(timed)
        model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
        sync = build_sync(model, CommConfig(mode="auto", bucket_mb=0.0005), rank=d.rank, world_size=d.world_size,
                          distributed=True)
        return {"mode": sync.mode, "owned": sum(p.numel() for p in sync.owned),
                "total": sum(p.numel() for p in model.parameters())}
    finally:
        launch.teardown()
