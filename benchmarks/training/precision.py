"""Benchmark: train.precision = "bf16" against "fp32" on this CPU, every family, through `rpt train` itself.

Each family trains the same configuration twice, float32 then bf16 (one after the other, nothing beside them),
for the same steps on the same data; the figures: training tokens/s (the median of the log lines after the
first, validations and checkpoints left out), and the validation loss at equal steps in bits per byte (the same
validation tokens). Under bf16 on a CPU oneDNN's LSTM runs its products in bf16; the other recurrences run in
float32 inside the autocast region (only the projections, the MLP, attention and the head in bf16).

    .venv/bin/python benchmarks/training/precision.py --data data/stdlib [--steps 200] [--cells lstm,gru,...]
        [--set model.d_model=512 ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness.py
from harness import REPO, commit, metrics, rpt_train, summary

CELLS = ("lstm", "gru", "modlstm", "mingru", "minlstm", "mlstm", "gdn")
HEADED = ("mlstm", "gdn")  # 4 heads, as the quality rows train them


def run(data: str, cell: str, precision: str, steps: int, extra: list[str], run_dir: Path) -> dict:
    rpt_train(run_dir, [f"data.path={data}", f"model.cell={cell}", f"train.precision={precision}",
                        f"train.max_steps={steps}", "train.max_time=0", f"train.eval_interval={steps}",
                        "train.final_eval_tokens=65536", "checkpoint.interval=0", "monitor.log_interval=25",
                        *(["model.heads=4"] if cell in HEADED else []), *extra],
              config=REPO / "configs" / "demo-cpu.toml", timeout=7200)
    speeds = [r["tokens_per_s"] for r in metrics(run_dir, "train")][1:]
    s = summary(run_dir)
    return {"tokens_per_s": statistics.median(speeds), "bpb": s["val_bpb"], "mfu": s["mfu"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="data/stdlib", help="a prepared dataset (rpt prepare)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--cells", default=",".join(CELLS))
    parser.add_argument("--set", dest="sets", action="append", default=["model.d_model=512"],
                        help="more settings for every run (default: model.d_model=512, demo-cpu's 64 x 64 batch)")
    args = parser.parse_args()
    print(f"commit {commit()}, {args.steps} steps, configs/demo-cpu.toml with {' '.join(args.sets)}")
    print("| cell | fp32 tokens/s | bf16 tokens/s | bf16 / fp32 | fp32 bpb | bf16 bpb | bf16 - fp32 | MFU fp32, bf16 |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="rpt-precision-") as work:
        for cell in args.cells.split(","):
            fp32, bf16 = (run(args.data, cell, p, args.steps, args.sets, Path(work) / f"{cell}-{p}")
                          for p in ("fp32", "bf16"))
            print(f"| {cell} | {fp32['tokens_per_s']:,.0f} | {bf16['tokens_per_s']:,.0f} | "
                  f"{bf16['tokens_per_s'] / fp32['tokens_per_s']:.2f}x | {fp32['bpb']:.4f} | {bf16['bpb']:.4f} | "
                  f"{bf16['bpb'] - fp32['bpb']:+.4f} | {fp32['mfu']:.1%}, {bf16['mfu']:.1%} |", flush=True)


if __name__ == "__main__":
    main()
