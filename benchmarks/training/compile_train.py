"""Benchmark: `train.compile` against eager through `rpt train` itself, and what compiling prints.

Each round trains the same preset twice, eagerly and with each block compiled (the two alternate, these machines
are noisy), and reads the steady speed from metrics.jsonl: the median tokens/s of the log lines after `--skip`
steps (compiling happens in the first steps). It also counts the lines torch._dynamo printed (graph breaks,
recompiles): issue 43 found about 35, from the gate probe's counting inside the compiled blocks.

    .venv/bin/python benchmarks/training/compile_train.py --data data/shakespeare-512 [--steps 400] [--rounds 2]
        [--set model.d_model=64 ...]
"""

from __future__ import annotations

import argparse
import sys
import statistics
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness.py
from harness import REPO, metrics, rpt_train


def train(data: str, steps: int, backend: str, extra: list[str], run_dir: Path) -> tuple[list[float], int]:
    done = rpt_train(run_dir, [f"data.path={data}", f"train.max_steps={steps}", "train.max_time=0", "train.early_stop=0",
                               "monitor.log_interval=25", f"train.compile={backend}", *extra],
                     config=REPO / "configs" / "shakespeare-bench.toml", timeout=3600)
    speeds = [r["tokens_per_s"] for r in metrics(run_dir, "train")]
    dynamo = sum("torch/_dynamo" in line for line in done.stderr.splitlines())
    return speeds, dynamo


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--skip", type=int, default=100, help="log lines of the first this many steps are left out")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--set", dest="extra", action="append", default=[])
    args = p.parse_args()
    results = {"": [], "inductor": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for backend in results:
                speeds, dynamo = train(args.data, args.steps, backend, args.extra, Path(tmp) / f"{r}-{backend or 'eager'}")
                steady = statistics.median(speeds[args.skip // 25:])
                results[backend].append(steady)
                print(f"round {r + 1} {backend or 'eager':8s} {steady:9,.0f} tokens/s (steady, after step {args.skip}); "
                      f"torch._dynamo printed {dynamo} lines", flush=True)
    eager, compiled = max(results[""]), max(results["inductor"])
    print(f"best rounds: eager {eager:,.0f}, inductor {compiled:,.0f} tokens/s: compiled / eager = {compiled / eager:.2f}")


if __name__ == "__main__":
    main()
