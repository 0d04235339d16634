"""Ctrl-C and SIGTERM on real processes: the first stops every rank after the same step with a checkpoint and
says how to resume (which then continues exactly); a second stops at once. One process and `--nproc 2`."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

TIMEOUT = 240


def start(run_dir: Path, data: Path, *extra: str, slow: float = 0.05) -> subprocess.Popen:
    args = [sys.executable, "-m", "rpt", "train", "--run-dir", str(run_dir), "--set", f"data.path={data}",
            "--set", "model.d_model=32", "--set", "train.batch_size=4", "--set", "train.seq_len=16",
            "--set", "train.warmup_steps=2", "--set", "train.eval_interval=0", "--set", "monitor.log_interval=1",
            "--set", "train.max_steps=400", *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RPT_FAULT": f"slow@1-999:seconds={slow}"}
    # a session of its own: signals to its process group reach only this job, as a terminal's Ctrl-C would
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists() and any(json.loads(line).get("step", 0) >= step for line in metrics.read_text().splitlines()):
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    raise AssertionError(f"step {step} never came")


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"did not stop: {out[-2000:]} {err[-2000:]}")
    return proc.returncode, out, err


def losses(run_dir: Path) -> dict[int, float]:
    records = (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def test_ctrl_c_checkpoints_the_step_and_the_resume_is_exact(tmp_path, tiny_data):
    proc = start(tmp_path / "cut", tiny_data, "--set", "train.max_steps=60")
    wait_for_step(tmp_path / "cut", 5, proc)
    os.killpg(proc.pid, signal.SIGINT)
    code, out, err = finish(proc)
    assert code == 130, err[-2000:]
    stopped = int(re.search(r"interrupted at step (\d+)", out).group(1))
    assert f"Continue with: rpt train --run-dir {tmp_path / 'cut'} --resume" in out
    assert (tmp_path / "cut" / "checkpoints" / f"step_{stopped:08d}" / "manifest.json").exists()
    assert not (tmp_path / "cut" / "summary.json").exists() and "Traceback" not in err
    # the resumed run (same budget) continues exactly as the uninterrupted run
    resumed = subprocess.run([sys.executable, "-m", "rpt", "train", "--run-dir", str(tmp_path / "cut"), "--resume"],
                             capture_output=True, text=True, timeout=TIMEOUT)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    whole = start(tmp_path / "whole", tiny_data, "--set", "train.max_steps=60", slow=0.0)
    assert finish(whole)[0] == 0
    a, b = losses(tmp_path / "whole"), losses(tmp_path / "cut")
    assert stopped < 60 and [b[s] for s in range(stopped + 1, 61)] == [a[s] for s in range(stopped + 1, 61)]


def test_under_nproc_2_a_terminal_ctrl_c_and_a_sigterm_stop_every_rank_at_one_step(tmp_path, tiny_data):
    for sig, to_group in ((signal.SIGINT, True), (signal.SIGTERM, False)):
        run = tmp_path / sig.name
        proc = start(run, tiny_data, "--nproc", "2")
        wait_for_step(run, 5, proc)
        if to_group:
            os.killpg(proc.pid, sig)  # what Ctrl-C does: the launcher and both workers get it
        else:
            os.kill(proc.pid, sig)  # a scheduler's SIGTERM to the launcher alone
        code, out, err = finish(proc)
        assert code == 130, err[-3000:]
        assert "Traceback" not in err and "SignalException" not in err and "leaked semaphore" not in err, err[-3000:]
        stopped = int(re.search(r"interrupted at step (\d+)", out).group(1))
        assert f"stopping after step {stopped:,} ({sig.name})" in out  # the signal sent, not the launcher's copy
        assert "--resume --nproc 2" in out
        assert (run / "checkpoints" / f"step_{stopped:08d}" / "manifest.json").exists()
        for r in (0, 1):  # every rank saved the same step
            assert (run / "checkpoints" / f"step_{stopped:08d}" / "extras" / f"rank{r}.pt").exists()


def test_a_second_ctrl_c_stops_at_once(tmp_path, tiny_data):
    proc = start(tmp_path / "r", tiny_data, slow=2.0)  # two seconds a step: the second signal comes mid-step
    wait_for_step(tmp_path / "r", 1, proc)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGINT)
    code, out, err = finish(proc)
    assert code == 130 and "interrupted at step" not in out and "Traceback" not in err, (out[-1000:], err[-1000:])
