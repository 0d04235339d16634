"""Validation loss of modlstm per gate function and forget-gate bias, on a prepared corpus, in one run.

    .venv/bin/python benchmarks/cells/gate_init.py --data data/shakespeare [--steps 300] [--cases exp:1,exp:auto,...]

Each case is GATE:FORGET_BIAS ("auto" is the gate's own default); every case trains the same 2 x 128 model
for the same steps and prints its periodic and final validation losses, as the rows of benchmarks/results/cells.md show them.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness.py
from harness import metrics, rpt_train

DEFAULT_CASES = "sigmoid:auto,hard_sigmoid:auto,exp:1.0,exp:0.0,exp:-0.5,exp:auto,exp:-2.0,exp:-3.0"


def run(data: str, gate: str, bias: str, steps: int, folder: Path) -> dict:
    run_dir = folder / f"{gate}_{bias}"
    sets = [f"data.path={data}", "model.cell=modlstm", f"model.gate={gate}", f"model.forget_bias={bias}",
            "model.d_model=128", "model.n_layers=2", "train.batch_size=16", "train.seq_len=64",
            f"train.max_steps={steps}", f"train.eval_interval={steps // 3}", "train.eval_tokens=16384",
            "train.warmup_steps=20", "monitor.tensorboard=false"]
    rpt_train(run_dir, sets)
    evals = metrics(run_dir, "eval")
    return {"periodic": [round(r["loss"], 4) for r in evals if not r["final"]],
            "final": round(next(r["loss"] for r in evals if r["final"]), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="a folder `rpt prepare` wrote")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--cases", default=DEFAULT_CASES)
    args = parser.parse_args()
    print("| gate | forget bias | periodic val loss (nats/token) | final val loss (whole split) |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases.split(","):
            gate, bias = case.split(":")
            r = run(args.data, gate, bias, args.steps, Path(tmp))
            print(f"| {gate} | {bias} | {', '.join(map(str, r['periodic']))} | {r['final']} |", flush=True)


if __name__ == "__main__":
    main()
