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
    from rpt.errors import RptError
    from rpt.train.checkpoint.store import CheckpointStore

    ck = CheckpointStore(str(finished / "checkpoints"))
    for name in ("step_00000010", "10", str(finished / "checkpoints" / "step_00000010")):
        assert ck.find(name, str(finished)).endswith("step_00000010")
    for name in ("step_00006000", "bestt", "no/such/folder"):
        with pytest.raises(RptError, match=f"no complete checkpoint '{name}'") as refused:
            ck.find(name, str(finished))
        assert "step_00000005, step_00000010, step_00000015, step_00000020" in str(refused.value)
    # the CLI says it as one message (the bad-input catalogue holds more of these)
    proc = rpt("eval", str(finished), "--checkpoint", "step_00006000")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "step_00000020" in proc.stderr


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


def test_outside_a_terminal_progress_is_printed_as_plain_lines(tmp_path, tiny_data):
    proc = rpt("train", "--run-dir", str(tmp_path / "run"), "--set", f"data.path={tiny_data}", *SMALL,
               "--set", "train.max_steps=10", "--set", "train.eval_interval=0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()  # stdout is a pipe here, as under tee, nohup or SLURM
    assert lines[0].startswith("training ") and "parameters" in lines[0]
    progress = [line for line in lines if line.startswith("step ") and "tokens/s" in line]
    assert [line.split()[1] for line in progress] == ["5/10", "10/10"]
    assert all("of train.max_steps" in line and "loss " in line and "lr " in line and "ETA " in line
               for line in progress)


def test_generate_prints_whole_characters_only(finished):
    import io

    from rpt.train.generation import generate_text

    for seed in (0, 1):  # hot sampling over a vocabulary with tokens that hold parts of characters
        out = io.StringIO()
        generate_text(str(finished), "", 300, 1.5, 0, 1.0, seed, "best", "cpu", out=out)
        assert len(out.getvalue()) > 100 and "\ufffd" not in out.getvalue()


def test_debug_after_the_sub_command_and_a_closed_pipe(finished):
    proc = rpt("config", "--set", "model.cell=lstmm", "--debug")
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "did you mean 'lstm'" in proc.stderr
    shell = subprocess.run(f"'{sys.executable}' -m rpt generate '{finished}' --max-new-tokens 2000 | head -c 10",
                           shell=True, capture_output=True, timeout=TIMEOUT)
    assert len(shell.stdout) == 10  # bytes: the sample may hold characters of several
    stderr = shell.stderr.decode()
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr


def test_the_docs_custom_gate_runs_from_the_working_directory_with_either_program(tmp_path):
    """docs/cells.md: a gate in a module beside the user, named in model.imports, works with `rpt` (the console
    script, which does not put the working directory on the path) as with `python -m rpt`; a config file's
    own folder is searched too."""
    (tmp_path / "mygates.py").write_text(
        "from rpt.models import register_gate\n"
        "register_gate('softsign01', fn=lambda x: 0.5 + 0.5 * x / (1 + x.abs()),\n"
        "              grad=lambda x, y: 0.5 / (1 + x.abs()) ** 2)\n")
    console = Path(sys.executable).with_name("rpt")
    args = ["config", "--set", "model.cell=modlstm", "--set", "model.gate=softsign01"]
    for program in ([str(console)], [sys.executable, "-m", "rpt"]):
        proc = subprocess.run([*program, *args, "--set", "model.imports=[\"mygates\"]"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=TIMEOUT)
        assert proc.returncode == 0 and 'gate = "softsign01"' in proc.stdout, proc.stderr[-2000:]
    missing = subprocess.run([str(console), *args], cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT)
    assert missing.returncode == 2 and "unknown gate function 'softsign01'" in missing.stderr
    assert "model.imports" in missing.stderr
    elsewhere = tmp_path / "configs"
    elsewhere.mkdir()
    (tmp_path / "mygates.py").rename(elsewhere / "mygates.py")
    (elsewhere / "gates.toml").write_text('[model]\ncell = "modlstm"\ngate = "softsign01"\nimports = ["mygates"]\n')
    proc = subprocess.run([str(console), "config", "--config", str(elsewhere / "gates.toml")], cwd=tmp_path.parent,
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-2000:]
