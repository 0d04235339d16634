"""Benchmark: peak RSS per rank and tokens/s of FSDP2 (`parallel.fsdp = 2`) against DDP on the same 2 processes.

Each layout runs in two fresh processes (spawned, so each one's peak RSS is its own), the same model, data and
steps; every rank reports the OS's peak resident set (getrusage ru_maxrss) and the run its tokens/s over the
steps after the first (which sets up buckets and gathers). The peak is read when the steps are done, before the
final evaluation and checkpoint (reported too, as the whole run's); prepare the data with a small validation
split (`--val-fraction 0.002`) so that the final evaluation of a model this size takes seconds. Issue 24's targets: peak RSS with fsdp 2 at most
0.6x DDP's for a model of about 250M parameters (4 GB of fp32 weights, gradients and AdamW state), and
tokens/s at least 0.8x DDP's for a model that fits both ways.

    rpt prepare --input TEXT --out data/fsdp-bench --vocab-size 512 --val-fraction 0.002
    .venv/bin/python benchmarks/parallel/fsdp.py --data data/fsdp-bench [--layouts ddp,fsdp] [--steps 4]
        [--set model.d_model=2048 --set model.n_layers=7 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

# about 250M parameters: 7 LSTM blocks of 2048 (33.6M each) and a tied 512 x 2048 embedding
MODEL = ["model.cell=lstm", "model.d_model=2048", "model.n_layers=7", "model.dropout=0", "train.batch_size=2",
         "train.seq_len=64", "train.eval_interval=0", "train.eval_tokens=2048", "train.warmup_steps=0",
         "monitor.log_interval=1", "train.select_best=false", "train.early_stop=0", "checkpoint.interval=0"]
LAYOUTS = {"ddp": [], "fsdp": ["parallel.fsdp=2"]}


def worker(rank: int, world: int, port: int, overrides: list[str], run_dir: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from rpt.config import Config
    from rpt.parallel import launch
    from rpt.runtime.memory import keep_freed_memory, pool_large_blocks
    from rpt.train.trainer import Trainer

    # as `rpt train` does: FSDP's gathered units from rpt's page pool, DDP's freed blocks kept in the heap
    pool_large_blocks() if "parallel.fsdp=2" in overrides else keep_freed_memory()
    d = launch.setup("cpu")
    try:
        cfg = Config.load(None, overrides)
        trainer = Trainer(cfg, Path(run_dir), d, show_progress=False)
        finish, seen = trainer._finish, {}

        def peak_then_finish():  # the training steps' peak, before the final evaluation and checkpoint
            seen["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            return finish()

        trainer._finish = peak_then_finish
        summary = trainer.run()
        rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()] \
            if rank == 0 else []
        train = [r for r in rows if r["kind"] == "train"][1:]  # the first step sets things up
        result = {"peak_rss": seen["peak_rss"], "peak_rss_whole_run": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "params": trainer.params, "steps": summary.get("steps"),
                  "tokens_per_s": sum(r["tokens_per_s"] for r in train) / len(train) if train else None,
                  "comm_bytes_per_step": summary.get("comm_bytes_per_step")}
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        launch.teardown()


def run_layout(name: str, data: str, steps: int, extra: list[str], port: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [f"data.path={data}", *MODEL, f"train.max_steps={steps}", *LAYOUTS[name], *extra]
        began = time.perf_counter()
        mp.start_processes(worker, args=(2, port, overrides, str(Path(tmp) / "run"), tmp), nprocs=2,
                           start_method="spawn")
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(2)]
    return {"layout": name, "wall_s": time.perf_counter() - began, "params": ranks[0]["params"],
            "peak_rss_gib": [r["peak_rss"] / 2**30 for r in ranks],
            "peak_rss_whole_run_gib": [r["peak_rss_whole_run"] / 2**30 for r in ranks],
            "tokens_per_s": ranks[0]["tokens_per_s"],
            "comm_bytes_per_step": ranks[0]["comm_bytes_per_step"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--layouts", default="ddp,fsdp")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--port", type=int, default=29613)
    args = ap.parse_args()
    results = []
    for i, name in enumerate(args.layouts.split(",")):
        r = run_layout(name, args.data, args.steps, args.overrides, args.port + i)
        results.append(r)
        print(json.dumps(r), flush=True)
    by = {r["layout"]: r for r in results}
    if "ddp" in by and "fsdp" in by:
        rss = max(by["fsdp"]["peak_rss_gib"]) / max(by["ddp"]["peak_rss_gib"])
        speed = by["fsdp"]["tokens_per_s"] / by["ddp"]["tokens_per_s"]
        print(f"{by['ddp']['params']:,} parameters: peak RSS per rank fsdp/ddp {rss:.3f} (target <= 0.6), "
              f"tokens/s fsdp/ddp {speed:.3f} (target >= 0.8)")


if __name__ == "__main__":
    main()
