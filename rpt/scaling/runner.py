"""Running a scaling grid's points, and reading what they measured.

Each pending point is its own `rpt train` process (the command `rpt scaling commands` prints, so a point runs the
same by hand, under torchrun or as one task of a SLURM array); its output goes to logs/NAME.log in the grid's
folder. `--worker I/N` takes every N-th point from the I-th, so N processes or machines sharing the folder split
the grid. A point whose run stopped before its final evaluation is started again (its folder kept beside it as
NAME.partial): the points are short, and a run resumed from a checkpoint is not the run the grid describes.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from rpt.errors import RptError
from rpt.scaling.grid import Grids, Point, finished, run_dir


def worker_share(points: list[Point], worker: tuple[int, int]) -> list[Point]:
    index, count = worker
    return [p for i, p in enumerate(points) if i % count == index]


def run_points(folder: Path, grid: Grids, worker: tuple[int, int] = (0, 1), out=sys.stdout) -> list[str]:
    """Train this worker's pending points, one after another; the names of those that failed."""
    mine = worker_share(grid.points(), worker)
    pending = [p for p in mine if finished(folder, p) is None]
    print(f"scaling grid {folder}: {len(grid.points())} points, {len(mine)} this worker's, {len(mine) - len(pending)} "
          f"done, {len(pending)} to run", file=out, flush=True)
    logs = folder / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    failed, began, flops_done = [], time.perf_counter(), 0.0
    for i, point in enumerate(pending, 1):
        where = run_dir(folder, point)
        if where.exists():  # a run that stopped before its final evaluation
            partial = where.with_name(where.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            where.rename(partial)
            print(f"  {point.name}: its earlier run did not finish; kept as {partial.name}, starting again",
                  file=out, flush=True)
        print(f"[{i}/{len(pending)}] {point.name} ...", file=out, flush=True)
        started = time.perf_counter()
        with open(logs / f"{point.name}.log", "w") as log:
            code = subprocess.run(point.command(where, (sys.executable, "-m", "rpt")), stdout=log,
                                  stderr=subprocess.STDOUT).returncode
        summary = finished(folder, point)
        if code or summary is None:
            failed.append(point.name)
            print(f"  failed (exit {code}); its output: {logs / f'{point.name}.log'}", file=out, flush=True)
            continue
        flops_done += point.flops
        left = sum(p.flops for p in pending[i:])
        eta = (time.perf_counter() - began) / flops_done * left
        print(f"  {summary['val_bpb']:.4f} bits/byte, {summary['tokens']:,} tokens, {summary['steps']:,} steps, "
              f"{time.perf_counter() - started:.0f} s; about {eta / 60:.0f} min left", file=out, flush=True)
    return failed


def run_shape(point_dir: Path) -> tuple[int, int]:
    """(the run's parameters beside its embedding and head: N of the law, as Kaplan et al. 2020 count it; the rows
    a step it trained with)."""
    from rpt.config import Config
    from rpt.models import RecurrentLM
    from rpt.models.shapes import on_meta

    cfg = Config.load(point_dir / "config.toml")
    with on_meta():
        model = RecurrentLM(cfg.model)
    n = sum(p.numel() for name, p in model.named_parameters() if not name.startswith(("embed.", "head.")))
    return n, cfg.train.batch_size


def results(folder: Path, grid: Grids) -> list[dict]:
    """Each finished point: what the law is fitted to (N, tokens, the unique tokens, bits per byte) and more."""
    rows = []
    for point in grid.points():
        summary = finished(folder, point)
        if summary is None:
            continue
        meta = json.loads((Path(point.data) / "meta.json").read_text())
        where = run_dir(folder, point)
        n, rows_a_step = run_shape(where)
        unique = meta["splits"]["train"]["tokens"]
        rows.append({"name": point.name, "data": point.data, "family": point.family,
                     # the grid's batch (0: the recipe's, which moves with the passes: one law for all of them)
                     "batch": point.batch, "rows": rows_a_step,
                     "vocab": meta["vocab_size"], "size": [point.n_layers, point.d_model], "budget": point.flops,
                     "n": n, "tokens": summary["tokens"], "unique_tokens": unique,
                     "passes": summary["tokens"] / unique, "flops_per_token": summary["flops_per_token"],
                     "train_flops": summary["flops_per_token"] * summary["tokens"], "bpb": summary["val_bpb"],
                     "steps": summary["steps"], "wall_s": summary.get("wall_seconds"),
                     "rpt_commit": summary.get("rpt_commit")})
    if not rows:
        raise RptError(f"no point of {folder}'s grid has finished", f"run it first: rpt scaling run {folder}")
    return rows
