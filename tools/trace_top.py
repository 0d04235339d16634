"""Where a profiled run's GPU time went: the kernels of its `--profile` steps, summed by name, largest first.

    python tools/trace_top.py RUN_DIR [--top 12]

Reads RUN_DIR/traces/rank0.json (written by `rpt train --profile START:END`) and prints the profiled steps' wall
time, the time the GPU was busy (the union of its kernels), and each of the top kernels' total time, call count and
share of the busy time: what a session lent a GPU reads to see which part of a step to make faster (the run report
gives the split by phase only).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from rpt.monitor.trace_summary import STEP, _length, _union


def top_kernels(trace: dict, top: int) -> list[str]:
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    steps = [e for e in events if str(e.get("name", "")).startswith(STEP)]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not steps or not kernels:
        return ["no profiled steps or no GPU kernels in this trace"]
    wall = _length(_union([(e["ts"], e["ts"] + e["dur"]) for e in steps]))
    busy = _length(_union([(e["ts"], e["ts"] + e["dur"]) for e in kernels]))
    total, calls = defaultdict(float), defaultdict(int)
    for e in kernels:
        total[e["name"]] += e["dur"]
        calls[e["name"]] += 1
    lines = [f"{len(steps)} profiled steps: wall {wall / 1e3:.1f} ms, GPU busy {busy / 1e3:.1f} ms "
             f"({busy / wall:.0%}), {len(kernels)} kernels",
             "| kernel | ms | calls | share of busy |", "|---|---|---|---|"]
    for name, us in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"| {name[:100]} | {us / 1e3:.2f} | {calls[name]} | {us / busy:.1%} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    trace = json.loads((args.run_dir / "traces" / "rank0.json").read_text())
    print(f"{args.run_dir.name}:")
    print("\n".join(top_kernels(trace, args.top)))


if __name__ == "__main__":
    main()
