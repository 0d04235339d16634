"""Context parallelism (parallel.cp) against one process: training tokens/s over one long window.

A model of `--layers` blocks x `--d-model` (vocabulary 8,192 with a 1,024-token shortlist head), batch 1, one
window of `--window` random tokens with every token's loss: forward, backward and the gradients' all-reduce (DDP,
as comm.mode = "allreduce" runs it), timed over `--steps` steps after one warm-up step. Three runs per cell, each
in fresh processes: one process on one core, one process on two cores (two threads), and cp = 2 on two processes
with one core (one thread) each.

    .venv/bin/python benchmarks/long/context_parallel.py [--cells mingru,lstm] [--window 16384] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
V = 8192


def worker(rank: int, world: int, port: int, cell: str, window: int, steps: int, threads: int, layers: int,
           d_model: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT))
    from rpt.config import ModelConfig
    from rpt.models.lm import RecurrentLM
    from rpt.parallel.context import ContextGroup, split_windows

    torch.set_num_threads(threads)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = RecurrentLM(ModelConfig(cell=cell, n_layers=layers, d_model=d_model, vocab_size=V, head_shortlist=1024))
    run = model
    if world > 1:
        split_windows(model, ContextGroup(world, rank, world))
        run = torch.nn.parallel.DistributedDataParallel(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, V, (1, window), generator=g), torch.randint(0, V, (1, window), generator=g)
    times = []
    for k in range(steps + 1):
        began = time.perf_counter()
        nats, _ = run(x, None, None, y)
        nats.mean().backward()
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - began)
    if world > 1:
        dist.destroy_process_group()
    if rank == 0:
        seconds = sorted(times[1:])[len(times[1:]) // 2]  # the median step
        Path(out).write_text(json.dumps({"seconds": seconds, "tokens_per_s": window / seconds}))


def measure(cell: str, window: int, steps: int, world: int, threads: int, layers: int, d_model: int) -> dict:
    import torch.multiprocessing as mp

    from rpt.parallel.launch import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.start_processes(worker, args=(world, free_port(), cell, window, steps, threads, layers, d_model, out),
                           nprocs=world, start_method="spawn")
        return json.loads(Path(out).read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", default="mingru,lstm")
    ap.add_argument("--window", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    rows = []
    for cell in args.cells.split(","):
        one_core = measure(cell, args.window, args.steps, 1, 1, args.layers, args.d_model)
        two_cores = measure(cell, args.window, args.steps, 1, 2, args.layers, args.d_model)
        cp2 = measure(cell, args.window, args.steps, 2, 1, args.layers, args.d_model)
        row = {"cell": cell, "window": args.window, "one process, one core": round(one_core["tokens_per_s"]),
               "one process, two cores": round(two_cores["tokens_per_s"]), "cp=2, one core each":
               round(cp2["tokens_per_s"]), "cp2 / one core": round(cp2["tokens_per_s"] / one_core["tokens_per_s"], 2),
               "cp2 / two cores": round(cp2["tokens_per_s"] / two_cores["tokens_per_s"], 2)}
        print(json.dumps(row), flush=True)
        rows.append(row)


if __name__ == "__main__":
    main()
