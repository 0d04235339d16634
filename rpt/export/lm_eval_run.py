"""`rpt lm-eval DIR --tasks T[,T...]`: lm-evaluation-harness on an exported model (or a run, exported first).

This is lm-eval's own `hf` model type on the folder `rpt export` wrote, as

    lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True,dtype=float32 --tasks T

would run it: the same requests, tokenisation and scoring as for any transformers model. The exported model reads
every request as a document from the end-of-text token's state, as rpt's evaluation does. A looped model
(docs/depth.md) runs at `depth` iterations, passed as `loop_depth=N` in the model's arguments (a key of its
configuration, which from_pretrained sets), its training mean where not given.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from rpt.errors import RptError
from rpt.train.init_from import is_export


def run_lm_eval(path: str | Path, tasks: list[str], include_path: str | None = None, limit: float | None = None,
                batch_size: int = 8, device: str = "cpu", num_fewshot: int | None = None, log_samples: bool = False,
                checkpoint: str = "best", max_length: int | None = None, depth: int | None = None) -> dict:
    """lm-eval's results dict (with the per-request samples when `log_samples`)."""
    try:
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise RptError("rpt lm-eval needs lm-evaluation-harness",
                       "pip install 'rpt[hf]' (or: pip install 'lm-eval>=0.4.9,<0.5')") from None
    path = Path(path)
    with tempfile.TemporaryDirectory(prefix="rpt-export-") as tmp:
        if (path / "config.toml").is_file():  # a run directory: export its checkpoint first
            from rpt.export.hf_export import export_run

            path = Path(export_run(path, Path(tmp) / "export", checkpoint)["out"])
        elif not is_export(path):
            raise RptError(f"{path} is neither an rpt export nor a run directory",
                           "pass a folder `rpt export` wrote, or a run directory (runs/NAME) to export first")
        check_depth(path, depth)
        manager = TaskManager(include_path=include_path) if include_path else TaskManager()
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
    """Refuse a depth for an export without a loop, and a depth below 1."""
    if depth is None:
        return
    if not json.loads((export / "config.json").read_text()).get("loop_core", 0):
        raise RptError(f"--depth {depth} for a model without a loop (loop_core = 0 in its config.json)",
                       "leave out --depth: only a looped model (docs/depth.md) runs at a chosen depth")
    if depth < 1:
        raise RptError(f"--depth {depth}: a looped model runs its core at least once", "use --depth 1 or more")


def summary(results: dict) -> str:
    """One line per task and metric, as lm-eval prints its table."""
    lines = []
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            if isinstance(value, float) and not key.endswith("_stderr,none") and "stderr" not in key:
                lines.append(f"{task:24s} {key.replace(',none', ''):24s} {value:.4f}")
    return "\n".join(lines)
