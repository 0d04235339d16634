"""What a new user meets on a first day with rpt: which checkpoint `eval` picks, budgets, resume and extension,
the messages of mistyped names. Each test runs the CLI as a user does."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TIMEOUT = 300
SMALL = ["--set", "model.d_model=32", "--set", "train.batch_size=4", "--set", "train.seq_len=16",
         "--set", "monitor.log_interval=5"]


def rpt(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rpt", *args], capture_output=True, text=True, timeout=TIMEOUT,
                          cwd=cwd)


def manifests(run: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((run / "checkpoints").glob("step_*/manifest.json"))]


def lrs(run: Path) -> dict[int, float]:
    records = (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["lr"] for r in records if r["kind"] == "train"}


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_data) -> Path:
    """A run of 20 steps, evaluated on its first 512 validation tokens every 5 steps, a checkpoint at each."""
    run = tmp_path_factory.mktemp("first-day") / "run"
    proc = rpt("train", "--run-dir", str(run), "--set", f"data.path={tiny_data}", *SMALL, "--set", "train.max_steps=20",
               "--set", "train.eval_interval=5", "--set", "train.eval_tokens=512", "--set", "checkpoint.interval=5",
               "--set", "checkpoint.keep_last=10", "--set", "train.warmup_steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def test_best_is_ranked_by_one_measure_and_eval_says_which(finished):
    found = manifests(finished)
    assert [m["step"] for m in found] == [5, 10, 15, 20]
    # every checkpoint, the last one too, is ranked by the periodic measure: the same 512 tokens (whole windows)
    assert {m["val_tokens"] for m in found} == {found[0]["val_tokens"]} and found[0]["val_tokens"] <= 512
    best = min(found, key=lambda m: m["val_loss"])
    proc = rpt("eval", str(finished))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"step_{best['step']:08d}" in proc.stdout and f"{best['val_loss']:.4f}" in proc.stdout
    assert "whole validation split" in proc.stdout
    latest = rpt("eval", str(finished), "--checkpoint", "latest")
    summary = json.loads((finished / "summary.json").read_text())
    assert f"val loss {summary['val_loss']:.4f}" in latest.stdout  # latest repeats the run's final evaluation
    assert "best (the default" in rpt("eval", "--help").stdout


def test_a_mistyped_checkpoint_names_the_ones_there_are(finished):
    for name in ("step_00000010", "10"):
        proc = rpt("eval", str(finished), "--checkpoint", name)
        assert proc.returncode == 0 and "step_00000010" in proc.stdout, proc.stderr[-2000:]
    for command, name in (("eval", "step_00006000"), ("eval", "bestt"), ("generate", "no/such/folder")):
        proc = rpt(command, str(finished), "--checkpoint", name)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr and f"no complete checkpoint '{name}'" in proc.stderr
        assert "step_00000005, step_00000010, step_00000015, step_00000020" in proc.stderr


def test_a_budget_given_on_the_command_line_is_not_cut_short_by_the_presets(tmp_path, tiny_data):
    repo = Path(__file__).resolve().parents[2]
    run = tmp_path / "run"
    proc = rpt("train", "--config", str(repo / "configs" / "tiny-cpu.toml"), "--run-dir", str(run),
               "--set", f"data.path={tiny_data}", "--set", "train.max_time=3")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    assert "train.max_steps = 20 is off" in out and "budget: 3 s of training (train.max_time)" in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["ended_by"] == "train.max_time = 3" and summary["steps"] > 20
    assert "ended by train.max_time = 3" in out


def test_resume_of_a_folder_without_a_run_is_refused(tmp_path, finished):
    missing = finished.parent / "runn"
    proc = rpt("train", "--resume", "--run-dir", str(missing))
    assert proc.returncode == 2 and "holds no run" in proc.stderr and f"did you mean {finished}" in proc.stderr
    assert not missing.exists()


def test_extending_a_finished_run_continues_the_decay(tmp_path, finished, tiny_data):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    (run / "config.toml").write_text((run / "config.toml").read_text().replace(str(finished), str(run)))
    again = rpt("train", "--resume", "--run-dir", str(run))
    assert again.returncode == 2 and "already spent its budget (train.max_steps = 20" in again.stderr
    assert "--set train.max_steps=40" in again.stderr
    longer = rpt("train", "--resume", "--run-dir", str(run), "--set", "train.max_steps=40")
    assert longer.returncode == 0, longer.stderr[-2000:]
    assert "extending the run from train.max_steps = 20 to 40 steps" in longer.stdout + longer.stderr
    rates = lrs(run)
    assert max(rates[s] for s in range(25, 41, 5)) <= rates[20]  # no jump back up
    assert all(rates[s] >= rates[s + 5] for s in range(20, 40, 5))
    assert json.loads((run / "summary.json").read_text())["steps"] == 40
