"""`rpt lm-eval DIR --tasks T[,T...]`: lm-evaluation-harness on an exported model (or a run, exported first).

This is lm-eval's own `hf` model type on the folder `rpt export` wrote, as

    lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True,dtype=float32 --tasks T

would run it: the same requests, tokenisation and scoring as for any transformers model. The exported model reads
every request as a document from the end-of-text token's state, as rpt's evaluation does. A looped model
(docs/depth.md) runs at `depth` iterations, passed as `loop_depth=N` in the model's arguments (a key of its
configuration, which from_pretrained sets), its training mean where not given.
"""

from __future__ import annotations

import functools
import json
import subprocess
import tempfile
from pathlib import Path

from rpt.errors import RptError
from rpt.train.init_from import is_export


def run_lm_eval(path: str | Path, tasks: list[str], include_path: str | None = None, limit: float | None = None,
                batch_size: int = 8, device: str = "cpu", num_fewshot: int | None = None, log_samples: bool = False,
                checkpoint: str = "best", max_length: int | None = None, depth: int | None = None) -> dict:
    """lm-eval's results dict (with the per-request samples when `log_samples`)."""
    try:
        from lm_eval import evaluator, simple_evaluate
    except ImportError:
        raise RptError("rpt lm-eval needs lm-evaluation-harness",
                       "pip install 'rpt[hf]' (or: pip install 'lm-eval>=0.4.9,<0.5')") from None
    evaluator.get_git_commit_hash = quiet_git_hash
    path = Path(path)
    with tempfile.TemporaryDirectory(prefix="rpt-export-") as tmp:
        if (path / "config.toml").is_file():  # a run directory: its depth checked, then its checkpoint exported
            from rpt.config import Config
            from rpt.export.hf_export import export_run
            from rpt.train.evaluate import check_depth as check_run_depth

            if depth is not None:
                check_run_depth(Config.load(path / "config.toml").model, depth)
            path = Path(export_run(path, Path(tmp) / "export", checkpoint)["out"])
        elif not is_export(path):
            raise RptError(f"{path} is neither an rpt export nor a run directory",
                           "pass a folder `rpt export` wrote, or a run directory (runs/NAME) to export first")
        check_depth(path, depth)
        manager = task_manager(include_path)
        unknown = [t for t in tasks if t not in manager.all_tasks]
        if unknown:
            raise RptError(f"lm-eval knows no task {', '.join(map(repr, unknown))}",
                           "name tasks from `lm_eval --tasks list`, or give --include-path with your task's YAML")
        args = f"pretrained={path},trust_remote_code=True,dtype=float32"
        args += f",max_length={max_length}" if max_length else ""
        args += f",loop_depth={depth}" if depth is not None else ""
        return simple_evaluate(model="hf", model_args=args,
                               tasks=tasks, task_manager=manager, limit=limit, batch_size=batch_size, device=device,
                               num_fewshot=num_fewshot, log_samples=log_samples)


def check_depth(export: Path, depth: int | None) -> None:
    """Refuse a depth for an export without a loop, below 1, and above DEPTH_FACTOR x the most it trained at."""
    if depth is None:
        return
    from rpt.train.evaluate import DEPTH_FACTOR

    config = json.loads((export / "config.json").read_text())
    if not config.get("loop_core", 0):
        raise RptError(f"--depth {depth} for a model without a loop (loop_core = 0 in its config.json)",
                       "leave out --depth: only a looped model (docs/depth.md) runs at a chosen depth")
    if depth < 1:
        raise RptError(f"--depth {depth}: a looped model runs its core at least once", "use --depth 1 or more")
    if depth > DEPTH_FACTOR * config["loop_slots"]:
        raise RptError(f"--depth {depth:,}: more than {DEPTH_FACTOR} x the most iterations the model trained at "
                       f"(loop_slots = {config['loop_slots']} in its config.json)",
                       f"use --depth {DEPTH_FACTOR * config['loop_slots']} or less")


@functools.lru_cache(maxsize=4)
def task_manager(include_path: str | None):
    """lm-eval's index of its tasks (and those of `include_path`): building it reads every task's YAML, seconds
    each time, so a process that evaluates several times (a sweep over depths) builds it once."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path) if include_path else TaskManager()


def quiet_git_hash() -> str | None:
    """lm-eval records the git commit of the working directory, asking git with its stderr left on the terminal,
    where a directory outside a repository printed "fatal: not a git repository": the same question, quietly."""
    try:
        return subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL).strip().decode()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return None


def summary(results: dict) -> str:
    """One line per task and metric, as lm-eval prints its table."""
    lines = []
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            if isinstance(value, float) and not key.endswith("_stderr,none") and "stderr" not in key:
                lines.append(f"{task:24s} {key.replace(',none', ''):24s} {value:.4f}")
    return "\n".join(lines)
