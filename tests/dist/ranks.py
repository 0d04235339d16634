"""Run a function in N real processes joined by a gloo process group, with a timeout and full cleanup.

The function must be importable by a fresh interpreter (a top-level function of a module on
sys.path). The workers fork from a fork server that imported torch and the first function's module once
(as `rpt train --nproc` starts its workers; the server has sys.path, so modules beside the tests work), not
spawned: spawn imported torch again in every worker. Each worker's return value comes back through a file;
a worker that raises fails the call with its traceback.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import time
import traceback
from pathlib import Path

import torch.multiprocessing as mp

from rpt.parallel.launch import free_port


def _entry(fn, rank: int, world_size: int, port: int, out: str, args: tuple) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        result = ("ok", fn(*args))
    except BaseException:  # noqa: BLE001 - carried back to the test as text
        result = ("error", traceback.format_exc())
    Path(out, f"result{rank}.pkl").write_bytes(pickle.dumps(result))


def run_ranks(fn, world_size: int, out_dir: Path, *args, timeout: float = 240) -> list:
    out_dir.mkdir(parents=True, exist_ok=True)
    multiprocessing.set_forkserver_preload(["torch", fn.__module__])  # read when the server starts (once)
    ctx = mp.get_context("forkserver")
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, str(out_dir), args)) for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        if hung:
            raise TimeoutError(f"ranks {hung} still running after {timeout} s")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    results = []
    for r in range(world_size):
        path = out_dir / f"result{r}.pkl"
        if not path.exists():
            raise RuntimeError(f"rank {r} died without a result (exit code {procs[r].exitcode})")
        status, value = pickle.loads(path.read_bytes())
        if status != "ok":
            raise RuntimeError(f"rank {r} failed:\n{value}")
        results.append(value)
    return results
