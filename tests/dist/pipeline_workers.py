"""What each rank runs in the pipeline tests (importable by spawned workers)."""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import torch


def pipeline_overrides(data: str) -> list[str]:
    return [f"data.path={data}", "model.d_model=32", "model.n_layers=4", "model.dropout=0", "train.batch_size=4",
            "train.seq_len=16", "train.max_steps=6", "train.warmup_steps=2", "train.eval_interval=0",
            "train.eval_tokens=1024", "monitor.log_interval=1", "parallel.microbatches=2"]


def losses_of(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "train"}


def whole(p: torch.Tensor) -> torch.Tensor:
    """A parameter as one tensor: an FSDP shard's full value (a collective: every rank calls it, in order)."""
    from torch.distributed.tensor import DTensor

    return (p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()).clone()


def train_runs(data: str, out_dir: str, runs: list[tuple[str, list[str], bool]]) -> dict:
    """Train each (name, overrides, resume) in turn in this process group; a run with resume=True continues
    the run directory of the same name. Returns per run: summary, this rank's parameters, losses (rank 0)."""
    from rpt.config import Config
    from rpt.parallel import launch
    from rpt.testing.faults import hooks_from_env  # RPT_FAULT, as `rpt train` installs it
    from rpt.train.trainer import Trainer

    d = launch.setup("cpu")
    torch.set_num_threads(1)
    results = {}
    try:
        for name, overrides, resume in runs:
            cfg = Config.load(None, pipeline_overrides(data) + overrides)
            run_dir = Path(out_dir) / name
            trainer = Trainer(cfg, run_dir, d, resume=resume, show_progress=False, extra_hooks=hooks_from_env)
            summary = trainer.run()
            results[name + ("+resumed" if resume else "")] = {
                "summary": summary, "losses": losses_of(run_dir) if d.rank == 0 else {},
                "params": {n: whole(p) for n, p in trainer.runner.model.named_parameters()},
                "stage_blocks": sorted(int(k) for k in trainer.runner.model.blocks.keys()) if trainer.runner.partial else None}
    except BaseException:
        traceback.print_exc()  # now: the other ranks may wait for this one in a collective until the test's timeout
        raise
    finally:
        launch.teardown()
    return results


def train_runs_with_env(env: dict, data: str, out_dir: str, runs: list[tuple[str, list[str], bool]]) -> dict:
    """train_runs with `env` set in the worker (the fork server's environment is that of its start)."""
    import os

    os.environ.update(env)
    return train_runs(data, out_dir, runs)


def resize_runs(data: str, out_dir: str, runs: list[tuple[str, list[str], str | None]]) -> dict:
    """Train each (name, overrides, source) in turn; a run with a source first copies that run directory (of
    `out_dir`, or a path) and resumes it on this layout. Returns per run what train_runs does, and for a resumed
    one what it held right after loading: whole parameters, the loader's state, the first matrix's AdamW moment."""
    import shutil

    import torch.distributed as dist

    from rpt.config import Config
    from rpt.parallel import launch
    from rpt.train.trainer import Trainer

    d = launch.setup("cpu")
    torch.set_num_threads(1)
    results = {}
    try:
        for name, overrides, source in runs:
            run_dir = Path(out_dir) / name
            if source is not None and d.rank == 0:
                shutil.copytree(Path(out_dir) / source, run_dir)
            if d.enabled:
                dist.barrier()
            trainer = Trainer(Config.load(None, pipeline_overrides(data) + overrides), run_dir, d,
                              resume=source is not None, show_progress=False)
            first = next(p for n, p in trainer.runner.model.named_parameters() if n.endswith("w_ih"))
            moments = trainer.runner.optimizer.state.get(first, {})
            loaded = {"params": {n: whole(p) for n, p in trainer.runner.model.named_parameters()},
                      "loader": trainer.loader.state_dict(), "step": trainer.progress.step,
                      "exp_avg": whole(moments["exp_avg"]) if "exp_avg" in moments else None}
            summary = trainer.run()
            results[name] = {"summary": summary, "losses": losses_of(run_dir) if d.rank == 0 else {},
                             "params": {n: whole(p) for n, p in trainer.runner.model.named_parameters()},
                             "loaded": loaded}
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        launch.teardown()
    return results
