"""`rpt train`, `rpt eval` and `rpt generate` from the command line, as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys

TIMEOUT = 300


def rpt(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rpt", *args], capture_output=True, text=True, timeout=TIMEOUT)


def test_train_eval_generate(tmp_path, tiny_data, cli):
    run = tmp_path / "run"
    common = ["--set", f"data.path={tiny_data}", "--set", "model.d_model=32", "--set", "train.batch_size=4",
              "--set", "train.seq_len=16", "--set", "train.max_steps=8"]
    proc = rpt("train", "--run-dir", str(run), *common)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == str(run / "summary.json")  # the last line names the summary
    summary = json.loads((run / "summary.json").read_text())

    proc = cli("eval", str(run))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"val loss {summary['val_loss']:.4f}" in proc.stdout  # the saved model evaluates as it did in training
    proc = cli("eval", str(run), "--depth", "2")
    assert proc.returncode == 2 and "without a loop" in proc.stderr and "leave out --depth" in proc.stderr
    proc = cli("generate", str(run), "--exit", "kl:1e-3")
    assert proc.returncode == 2 and "--exit for a model without a loop" in proc.stderr

    first = cli("generate", str(run), "--prompt", "KING", "--max-new-tokens", "20", "--seed", "3")
    again = cli("generate", str(run), "--prompt", "KING", "--max-new-tokens", "20", "--seed", "3")
    assert first.returncode == 0, first.stderr[-2000:]
    assert first.stdout.startswith("KING") and len(first.stdout) > len("KING\n")
    assert first.stdout == again.stdout  # seeded sampling repeats

    proc = rpt("train", "--run-dir", str(run), *common)
    assert proc.returncode == 2 and "already holds a run" in proc.stderr and "--resume" in proc.stderr


def test_user_errors_are_one_message(tmp_path):
    proc = rpt("train", "--set", "train.max_stepz=3")
    assert proc.returncode == 2 and "did you mean 'train.max_steps'" in proc.stderr and "Traceback" not in proc.stderr
    proc = rpt("train", "--resume")
    assert proc.returncode == 2 and "--run-dir" in proc.stderr
    proc = rpt("train", "--run-dir", str(tmp_path / "r"), "--set", f"data.path={tmp_path / 'nodata'}")
    assert proc.returncode == 2 and "not a prepared dataset" in proc.stderr and "rpt prepare" in proc.stderr
    proc = rpt("eval", str(tmp_path))
    assert proc.returncode == 2 and "not a run directory" in proc.stderr


def test_a_looped_model_evaluates_and_generates_at_a_chosen_depth(tmp_path, tiny_data, cli):
    run = tmp_path / "looped"
    proc = rpt("train", "--run-dir", str(run), "--set", f"data.path={tiny_data}", "--set", "model.d_model=32",
               "--set", "train.batch_size=4", "--set", "train.seq_len=16", "--set", "train.max_steps=6",
               "--set", "model.n_layers=3", "--set", "model.loop_prelude=1", "--set", "model.loop_core=1",
               "--set", "model.loop_mean=2", "--set", "model.loop_sampler=fixed", "--set", "train.eval_interval=0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    at = {}
    for depth in ("1", "2", "5"):
        proc = cli("eval", str(run), "--depth", depth)
        assert proc.returncode == 0 and f"whole validation split at depth {depth}:" in proc.stdout, proc.stderr[-2000:]
        at[depth] = proc.stdout.split(f"at depth {depth}: val loss ")[1].split()[0]
    assert at["2"] == f"{summary['val_loss']:.4f}"  # the training's final validation ran at loop_mean
    deep = cli("generate", str(run), "--prompt", "KING", "--max-new-tokens", "12", "--temperature", "0",
               "--depth", "3")
    assert deep.returncode == 0 and deep.stdout.startswith("KING"), deep.stderr[-2000:]
    never = cli("generate", str(run), "--prompt", "KING", "--max-new-tokens", "12", "--temperature", "0",
                "--depth", "3", "--exit", "change:0")  # a threshold of 0 never ends a token's iterations early
    assert never.stdout == deep.stdout and "3.00 iterations a token on average, at most 3" in never.stderr
    shared = cli("generate", str(run), "--prompt", "KING", "--max-new-tokens", "12", "--temperature", "0",
                 "--exit", "kl:1e-3", "--shared-state")
    assert shared.returncode == 0 and "at most 8)" in shared.stderr, shared.stderr[-2000:]
    for args, message in ((("eval", str(run), "--depth", "0"), "at least once"),
                          (("generate", str(run), "--depth", "-1"), "at least once"),
                          (("generate", str(run), "--exit", "kl"), "no threshold")):
        proc = cli(*args)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
