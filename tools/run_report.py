"""One markdown row per finished run: steady tokens/s, model FLOP/s against a peak, the step split, memory.

Reads RUN_DIR/summary.json and RUN_DIR/metrics.sqlite (rank 0's gathered rows) only, so it works on
any finished run, here or copied from a GPU machine. Steady tokens/s is the median of the log
intervals after the first (which holds start-up and warm-up); model FLOP/s = flops_per_token x tokens/s
(summary.json's training count: forward + backward, recurrent products included), over `--peak-tflops`.

    python tools/run_report.py RUN_DIR [RUN_DIR ...] [--peak-tflops 790]
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
from pathlib import Path

PHASES = ("data", "forward", "backward", "optimizer")


def report(run: Path, peak_tflops: float | None) -> str:
    summary = json.loads((run / "summary.json").read_text())
    db = sqlite3.connect(f"file:{run / 'metrics.sqlite'}?mode=ro", uri=True)
    rates = [r for (r,) in db.execute("SELECT tokens_per_s FROM train ORDER BY step")][1:]
    steady = statistics.median(rates) if rates else summary["tokens_per_second"]
    cols = ", ".join(f"AVG({p}_s)" for p in PHASES)
    phases = db.execute(f"SELECT {cols}, MAX(memory_bytes) FROM ranks WHERE rank = 0 AND step > "
                        "(SELECT MIN(step) FROM ranks)").fetchone()
    split = " / ".join(f"{p} {1e3 * (v or 0):.1f}" for p, v in zip(PHASES, phases[:-1]))
    tflops = summary["flops_per_token"] * steady / 1e12
    mfu = f"{tflops / peak_tflops:.3f}" if peak_tflops else ""
    profile = db.execute("SELECT compute_s, comm_s, overlap_s, idle_s, wall_s FROM profile WHERE rank = 0").fetchone()
    prof = (" / ".join(f"{k} {v / profile[4]:.2f}" for k, v in zip(("compute", "comm", "overlap", "idle"), profile))
            if profile else "")
    return (f"| {run.name} | {summary['device']} {summary['precision']} | {summary['params'] / 1e6:.2f}M | "
            f"{summary['steps']} | {steady:,.0f} | {tflops:.2f} | {mfu} | {split} | "
            f"{(phases[-1] or 0) / 2**30:.2f} | {summary['skipped_steps']} | {summary['val_bpb']:.4f} | {prof} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--peak-tflops", type=float, default=None)
    args = ap.parse_args()
    print("| run | device, precision | params | steps | steady tokens/s | model TFLOP/s | of peak | "
          "ms per step: data / fwd / bwd / opt (rank 0) | memory GiB | skipped | val bpb | profile share |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for run in args.runs:
        try:
            print(report(run, args.peak_tflops))
        except Exception as exc:  # a run that failed still gets its row, saying why
            print(f"| {run.name} | failed to read: {type(exc).__name__}: {exc} |")


if __name__ == "__main__":
    main()
