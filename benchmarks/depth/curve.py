"""Depth recurrence against the same blocks without the loop, at equal wall time (issue 46's targets).

Three runs of `rpt train` on the same data for the same seconds each: a looped model (1 prelude, 1 core, 1 coda
block; model.loop_mean 4, loop_backprop 2), the same three blocks without the loop, and six blocks without it.
Then held-out bits per byte over the whole validation split: the looped model at each test-time depth (the depth
curve), the others as they are; and greedy generation tokens/s of the looped model at its mean depth against the
three unlooped blocks'. Prints a markdown table with the targets' checks; `--out` keeps the runs.

    .venv/bin/python benchmarks/depth/curve.py [--data data/stdlib] [--seconds 150] [--cell mingru]
        [--depths 1,2,3,4,8,16] [--out /tmp/depth-curve]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness.py
from harness import generation_speed, rpt_train, summary

ROOT = Path(__file__).resolve().parents[2]


def train(name: str, out: Path, args, *overrides: str) -> Path:
    run = out / name
    began = time.perf_counter()
    rpt_train(run, [f"data.path={args.data}", f"model.cell={args.cell}", "train.max_steps=0",
                    f"train.max_time={args.seconds}", "train.eval_interval=0", "checkpoint.interval=0", *overrides],
              config=ROOT / "configs" / "demo-cpu.toml")
    s = summary(run)
    print(f"{name}: {s['steps']} steps, {s['tokens']:,} tokens in {s['wall_seconds']:.0f} s "
          f"({time.perf_counter() - began:.0f} s with start and final evaluation)", file=sys.stderr, flush=True)
    return run


def run_generation_speed(run: Path, depth: int | None) -> float:
    """Greedy tokens per second of a run's last weights after a short prompt, one row, on this process's threads."""
    from rpt.train.run_dir import load_run

    _, model, _, _, _ = load_run(str(run), "latest", "cpu")
    return generation_speed(model, depth=depth)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=str(ROOT / "data" / "stdlib"))
    p.add_argument("--seconds", type=float, default=150)
    p.add_argument("--cell", default="mingru")
    p.add_argument("--depths", default="1,2,3,4,8,16")
    p.add_argument("--mean", type=float, default=4)
    p.add_argument("--backprop", type=int, default=2)
    p.add_argument("--out", default="/tmp/depth-curve")
    p.add_argument("--only-looped", action="store_true", help="train and measure the looped model alone")
    p.add_argument("--set", action="append", default=[], help="another override of the looped model's run")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from rpt.train.evaluate import eval_run

    runs = {"looped": train("looped", out, args, "model.n_layers=3", "model.loop_prelude=1", "model.loop_core=1",
                            f"model.loop_mean={args.mean}", f"model.loop_backprop={args.backprop}", *args.set)}
    if args.only_looped:
        for d in [int(d) for d in args.depths.split(",")]:
            print(f"depth {d}: {eval_run(str(runs['looped']), 'latest', 'cpu', None, d)['bpb']:.4f}", flush=True)
        return
    runs.update(three=train("three", out, args, "model.n_layers=3"), six=train("six", out, args, "model.n_layers=6"))
    depths = [int(d) for d in args.depths.split(",")]
    curve = {d: eval_run(str(runs["looped"]), "latest", "cpu", None, d)["bpb"] for d in depths}
    plain = {name: eval_run(str(runs[name]), "latest", "cpu", None)["bpb"] for name in ("three", "six")}
    mean_depth = round(args.mean)
    speed = {"looped": run_generation_speed(runs["looped"], mean_depth),
             "three": run_generation_speed(runs["three"], None)}
    tokens = {name: summary(run)["tokens"] for name, run in runs.items()}
    r = mean_depth
    at = lambda d: curve.get(d, float("nan"))  # noqa: E731
    checks = {
        "depth 1 - depth 4 >= 0.05": at(1) - at(4) >= 0.05,
        "non-increasing 1 .. 4": all(curve[a] >= curve[b] for a, b in zip(depths, depths[1:]) if b <= 4),
        "depth 16 <= depth 4 + 0.01": at(16) <= at(4) + 0.01,
        "looped at 4 <= three - 0.02": at(4) <= plain["three"] - 0.02,
        "generation >= 0.8 x three x 3 / (2 + r)": speed["looped"] >= 0.8 * speed["three"] * 3 / (2 + r),
    }
    print(f"\n{args.cell}, d 256, {args.seconds:g} s of training each (configs/demo-cpu.toml otherwise), "
          f"loop_mean {args.mean:g}, loop_backprop {args.backprop}\n")
    print("| model | tokens trained | held-out bpb |\n|---|---|---|")
    for d in depths:
        print(f"| looped (1 + 1 x r + 1 blocks), depth {d} | {tokens['looped']:,} | {curve[d]:.4f} |")
    print(f"| three blocks | {tokens['three']:,} | {plain['three']:.4f} |")
    print(f"| six blocks | {tokens['six']:,} | {plain['six']:.4f} |")
    print(f"\ngeneration (greedy, one row): looped at depth {r} {speed['looped']:.0f} tokens/s, three blocks "
          f"{speed['three']:.0f} tokens/s (target >= {0.8 * speed['three'] * 3 / (2 + r):.0f})")
    for name, ok in checks.items():
        print(f"- {name}: {'met' if ok else 'NOT met'}")
    (out / "depth_curve.json").write_text(json.dumps({"curve": curve, "plain": plain, "speed": speed,
                                                      "tokens": tokens, "checks": checks}, indent=1))


if __name__ == "__main__":
    main()
