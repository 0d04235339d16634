"""How much code one training step of the default lstm runs: the rpt files and distinct lines executed from
`rpt train` to the first `optimizer.step()`, and those inside `Trainer.train_step` alone (issue 21's reading
measure; a tracer counts executed lines, so docstrings, comments and untaken branches are not counted).

    .venv/bin/python benchmarks/step_reading.py --data DATA_DIR
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

import rpt

ROOT = Path(rpt.__file__).parent


class Lines:
    """Distinct executed lines per rpt file, while `on` is set."""

    def __init__(self):
        self.lines, self.on = defaultdict(set), True

    def trace(self, frame, event, arg):
        path = frame.f_code.co_filename
        if not path.startswith(str(ROOT)):
            return None
        if event == "line" and self.on:
            self.lines[str(Path(path).relative_to(ROOT))].add(frame.f_lineno)
        return self.trace


def report(name: str, lines: Lines) -> None:
    total = sum(len(v) for v in lines.lines.values())
    print(f"{name}: {len(lines.lines)} files, {total} executed lines")
    for path, seen in sorted(lines.lines.items(), key=lambda kv: -len(kv[1])):
        print(f"  {len(seen):5d}  {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    args = parser.parse_args()
    from rpt.cli import main as cli
    from rpt.train.trainer import Trainer

    whole, step = Lines(), Lines()
    step.on = False
    real_step = torch.optim.AdamW.step

    def first_step(self, *a, **k):  # the end of the measure: the first optimiser step
        whole.on = step.on = False
        sys.settrace(None)
        raise SystemExit(0)

    real_train_step = Trainer.train_step

    def traced_train_step(self, batch):
        step.on = True
        return real_train_step(self, batch)

    torch.optim.AdamW.step, Trainer.train_step = first_step, traced_train_step

    def both(frame, event, arg):
        a, b = whole.trace(frame, event, arg), step.trace(frame, event, arg)
        return both if (a or b) else None

    with tempfile.TemporaryDirectory() as run_dir:
        sys.settrace(both)
        try:
            cli(["train", "--run-dir", run_dir, "--set", f"data.path={args.data}", "--set", "train.max_steps=1"])
        except SystemExit:
            pass
        finally:
            sys.settrace(None)
            torch.optim.AdamW.step, Trainer.train_step = real_step, real_train_step
    report("from `rpt train` to the first optimizer.step()", whole)
    report("inside Trainer.train_step", step)


if __name__ == "__main__":
    main()
