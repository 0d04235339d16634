"""How much code one training step of the default lstm runs (issue 21's reading measure). A tracer records the
rpt files and distinct lines executed, so docstrings, comments and untaken branches are not counted:

    chain   the rpt frames on the stack when the step runs: the calls a reader follows from `rpt train`
    step    one steady-state step (the second): from the top of the loop to its `optimizer.step()`; then the
            files of the step and the chain together
    whole   everything from `rpt train` to the first `optimizer.step()`, set-up included

    .venv/bin/python benchmarks/architecture/step_reading.py --data DATA_DIR
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


def relative(path: str) -> str:
    return str(Path(path).relative_to(ROOT))


class Lines:
    """Distinct executed lines per rpt file, while `on` is set."""

    def __init__(self, on: bool):
        self.lines, self.on = defaultdict(set), on
        self.functions = defaultdict(set)  # (file, function) -> its executed lines

    def record(self, frame) -> None:
        if self.on:
            path = relative(frame.f_code.co_filename)
            self.lines[path].add(frame.f_lineno)
            self.functions[path, frame.f_code.co_name].add(frame.f_lineno)


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

    whole, step, chain, steps = Lines(on=True), Lines(on=False), [], [0]
    real_step, real_agreed = torch.optim.AdamW.step, Trainer._agreed

    def agreed(self, stop):  # the top of the loop: step 2 begins when step 1 is done
        if self.step == 1:
            step.on = True
            frame = sys._getframe(1)
            while frame is not None:
                if frame.f_code.co_filename.startswith(str(ROOT)):
                    chain.append(f"{relative(frame.f_code.co_filename)}:{frame.f_lineno} {frame.f_code.co_name}")
                frame = frame.f_back
        return real_agreed(self, stop)

    def optimizer_step(self, *a, **k):
        steps[0] += 1
        whole.on = False  # the whole path ends at the first step
        if steps[0] == 2:
            sys.settrace(None)
            raise SystemExit(0)
        return real_step(self, *a, **k)

    def trace(frame, event, arg):
        if not frame.f_code.co_filename.startswith(str(ROOT)):
            return None
        if event == "line":
            whole.record(frame)
            step.record(frame)
        return trace

    torch.optim.AdamW.step, Trainer._agreed = optimizer_step, agreed
    with tempfile.TemporaryDirectory() as run_dir:
        sys.settrace(trace)
        try:
            cli(["train", "--run-dir", run_dir, "--set", f"data.path={args.data}", "--set", "train.max_steps=3"])
        except SystemExit:
            pass
        finally:
            sys.settrace(None)
            torch.optim.AdamW.step, Trainer._agreed = real_step, real_agreed
    print(f"chain: {len({c.split(':')[0] for c in chain})} files")
    for call in reversed(chain):
        print(f"  {call}")
    report("one steady-state step, from the top of the loop to optimizer.step()", step)
    calls = {(c.split(":")[0], c.split(" ")[1]) for c in chain}  # the chain's functions, set-up lines included
    reached = {path for path, _ in calls} | set(step.lines)
    lines = sum(len(v) for v in step.lines.values()) + sum(len(whole.functions[c]) for c in calls)
    print(f"the step with the chain of calls that reaches it from `rpt train`: {len(reached)} files, "
          f"{lines} executed lines")
    report("from `rpt train` to the first optimizer.step(), set-up included", whole)


if __name__ == "__main__":
    main()
