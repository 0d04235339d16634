"""Exact BPTT over a long window (train.bptt_chunk) against the plain backward: peak memory and time per token.

Each measurement runs in a fresh process: an lstm of 4 blocks x 512 (vocabulary 32,768 with a 2,048-token
shortlist head, as the CPU presets), batch 1, `--steps` forwards and backwards over a window of T random tokens
with every token's loss, under the allocator setting `rpt train` uses for it (rpt/runtime/memory.py: the plain backward
keeps freed blocks in the heap, exact BPTT takes large ones from rpt's page pool); the peak RSS above the
process's RSS just before the first step (after a 64-token warm-up step), and the seconds per token of the last
step (a training run's steps after its first: the memory its allocator keeps is mapped; the first step's time is
shown too). Rows: the plain backward at each `--plain` window, exact BPTT over `--long` tokens in chunks of
`--chunk`, and both at `--cost-window`, where both fit, for the time per token.

    .venv/bin/python benchmarks/long/long_sequences.py [--long 65536] [--chunk 1024] [--plain 1024,8192]
        [--cost-window 8192] [--allocator trainer|mmap|heap] [--steps 2] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
V = 32768


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def one(window: int, chunk: int, allocator: str, steps: int) -> dict:
    """`steps` forwards and backwards in this process, under the trainer's allocator setting for it
    (rpt/runtime/memory.py), with large blocks returned to the OS for both ("mmap"), or freed memory kept in the heap for
    both ("heap"): peak bytes above the start, and the seconds of the first step and the last."""
    from rpt.runtime.memory import keep_freed_memory, pool_large_blocks, return_large_blocks

    if allocator == "trainer":
        pool_large_blocks() if chunk else keep_freed_memory()
    else:
        return_large_blocks() if allocator == "mmap" else keep_freed_memory()
    import torch

    from rpt.config import ModelConfig
    from rpt.models.lm import RecurrentLM
    from rpt.parallel.bptt import chunk_windows

    torch.manual_seed(0)
    model = RecurrentLM(ModelConfig(cell="lstm", n_layers=4, d_model=512, vocab_size=V, head_shortlist=2048))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, V, (1, window), generator=g), torch.randint(0, V, (1, window), generator=g)
    if chunk:
        chunk_windows(model, chunk)
    nats, _ = model(x[:, :64], targets=y[:, :64])  # the first use builds what it builds
    nats.mean().backward()
    model.zero_grad(set_to_none=True)
    del nats
    before = rss()
    times = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        began = time.perf_counter()
        nats, _ = model(x, targets=y)
        nats.mean().backward()
        del nats
        times.append(time.perf_counter() - began)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {"window": window, "chunk": chunk, "peak_bytes": peak, "seconds": times[-1],
            "us_per_token": 1e6 * times[-1] / window, "first_us_per_token": 1e6 * times[0] / window}


def measure(window: int, chunk: int, allocator: str, steps: int) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--one", str(window), str(chunk), "--allocator", allocator,
                           "--steps", str(steps)],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"window {window:,}, {'plain' if not chunk else f'chunks of {chunk:,}'}: peak {r['peak_bytes'] / 2**20:,.0f} "
          f"MiB above the start, last step {r['seconds']:.1f} s ({r['us_per_token']:.0f} us a token; the first "
          f"{r['first_us_per_token']:.0f})", flush=True)
    return r


def median_of(runs: int, window: int, chunk: int, allocator: str, steps: int) -> dict:
    """`measure` in `runs` fresh processes: the median of each figure on its own."""
    found = [measure(window, chunk, allocator, steps) for _ in range(runs)]
    mid = lambda key: sorted(r[key] for r in found)[len(found) // 2]  # noqa: E731
    return {"window": window, "chunk": chunk, **{key: mid(key) for key in
                                                 ("peak_bytes", "seconds", "us_per_token", "first_us_per_token")}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--long", type=int, default=65536)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--plain", default="1024,8192")
    p.add_argument("--cost-window", type=int, default=8192)
    p.add_argument("--allocator", choices=["trainer", "mmap", "heap"], default="trainer",
                   help="trainer: each mode under rpt train's setting; mmap: large blocks returned to the OS in both; "
                        "heap: freed memory kept in the heap in both")
    p.add_argument("--steps", type=int, default=2, help="steps per process: the last one's time counts")
    p.add_argument("--repeat", type=int, default=3, help="fresh processes per measurement: their medians count")
    p.add_argument("--one", nargs=2, type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(*args.one, args.allocator, args.steps)))
        return
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    print(f"commit {commit.strip()}; lstm 4 x 512, vocabulary {V:,} (shortlist 2,048), batch 1, "
          f"{os.cpu_count()} cores, allocator: {args.allocator}")
    n, measured = args.repeat, lambda window, chunk: median_of(args.repeat, window, chunk, args.allocator, args.steps)
    plain = {w: measured(w, 0) for w in map(int, args.plain.split(","))}
    long = measured(args.long, args.chunk)
    base = plain[min(plain)]
    cost_plain = plain.get(args.cost_window) or measured(args.cost_window, 0)
    cost_chunked = measured(args.cost_window, args.chunk)
    print(f"\nmedians of {n} fresh processes each, {args.steps} steps in each")
    print(f"\n| run | window | peak above start | x plain {min(plain):,} | us per token (last step) | first step |"
          f"\n|---|---|---|---|---|---|")
    for r in [*plain.values(), long, cost_chunked]:
        name = "plain" if not r["chunk"] else f"exact BPTT, chunks of {r['chunk']:,}"
        print(f"| {name} | {r['window']:,} | {r['peak_bytes'] / 2**20:,.0f} MiB | "
              f"{r['peak_bytes'] / base['peak_bytes']:.2f} | {r['us_per_token']:.0f} | {r['first_us_per_token']:.0f} |")
    ratio = cost_chunked["us_per_token"] / cost_plain["us_per_token"]
    first = cost_chunked["first_us_per_token"] / cost_plain["first_us_per_token"]
    memory = long["peak_bytes"] / base["peak_bytes"]
    print(f"\n- memory: exact BPTT over {args.long:,} at {memory:.2f}x the plain {min(plain):,}-token window "
          f"(target <= 2x): {'met' if memory <= 2 else 'NOT met'}")
    print(f"- cost: {ratio:.2f}x the plain backward's time per token at {args.cost_window:,} (target <= 1.4x): "
          f"{'met' if ratio <= 1.4 else 'NOT met'}; in a process's first step {first:.2f}x")


if __name__ == "__main__":
    main()
