"""What a new user met on a fourth day with rpt (issue 69): a final evaluation that ran silently for minutes outside
every figure, a validation split of 10 tokens trusted, `rpt config` validating less than `rpt train`, messages
that named the wrong fix, and noise after a clean error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from rpt.config import ModelConfig
from rpt.models.lm import RecurrentLM
from rpt.train.evaluate import STREAM_TOKENS, EvalProgress, evaluate, forward_tokens

TIMEOUT = 300
REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny-cpu.toml")


def rpt(*args: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rpt", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _split(n: int, documents: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 40, n)
    tokens[0] = 0
    tokens[rng.choice(np.arange(1, n), documents - 1, replace=False)] = 0
    return tokens


# ------------------------------------------------------------------ item 5: the final evaluation, seen and counted
def test_longer_windows_and_more_rows_score_the_split_as_the_training_window_does():
    """The state carries from window to window: the windows a forward may take change no score."""
    torch.manual_seed(0)
    model = RecurrentLM(ModelConfig(cell="mlstm", n_layers=1, d_model=16, heads=2, vocab_size=40)).double()
    tokens, lengths = _split(5 * STREAM_TOKENS + 333, documents=20), np.r_[0, np.full(39, 2)]
    calls = []

    model_forward = model.forward

    def counted(*a, **k):
        calls.append(1)
        return model_forward(*a, **k)

    model.forward = counted
    short = evaluate(model, tokens, lengths, batch_size=2, seq_len=16, device=torch.device("cpu"), eot_id=0)
    short_calls, calls[:] = len(calls), []
    long = evaluate(model, tokens, lengths, batch_size=2, seq_len=16, device=torch.device("cpu"), eot_id=0,
                    tokens_per_forward=forward_tokens(2, 16, 40))
    model.forward = model_forward
    assert long["tokens"] == short["tokens"] and long["bytes"] == short["bytes"]
    assert long["loss"] == pytest.approx(short["loss"], rel=1e-9)
    assert len(calls) * 20 < short_calls  # 5 streams of ~1,067 tokens: one forward, against 3 x 67 windows


def test_a_slow_evaluation_says_its_progress_at_every_interval():
    class Slow(torch.nn.Module):
        """Forwards that take 30 ms each."""
        def __init__(self):
            super().__init__()
            self.inner = RecurrentLM(ModelConfig(cell="gru", n_layers=1, d_model=8, vocab_size=40))
            self.cfg = self.inner.cfg

        def forward(self, *a, **k):
            time.sleep(0.03)
            return self.inner(*a, **k)

    lines, stamps = [], []
    progress = EvalProgress(lambda line: (lines.append(line), stamps.append(time.perf_counter())), "final", every=0.2)
    began = time.perf_counter()
    evaluate(Slow(), _split(4 * STREAM_TOKENS, 8), np.r_[0, np.full(39, 1)], batch_size=1, seq_len=64,
             device=torch.device("cpu"), eot_id=0, progress=progress)  # 64 forwards: about 2 s
    assert len(lines) >= 3, lines
    gaps = np.diff([began, *stamps])
    assert gaps.max() < 0.2 + 0.5, gaps  # at every interval, give or take a forward on a loaded machine
    assert all(" of 4,095 tokens (" in line and "s to go" in line for line in lines), lines


def test_the_final_evaluation_is_bounded_on_request_and_said_so(make_cfg, tmp_path, solo, capsys):
    from rpt.train.trainer import Trainer

    whole = Trainer(make_cfg(), tmp_path / "whole", solo, show_progress=False).run()
    bounded = Trainer(make_cfg("train.final_eval_tokens=1024"), tmp_path / "bounded", solo, show_progress=False).run()
    out = capsys.readouterr().out
    assert bounded["val_tokens"] <= 1024 < whole["val_tokens"]
    assert "final, bounded by train.final_eval_tokens = 1,024" in out and "final evaluation: the heads" in out
    assert bounded["final_eval_scope"].startswith("the heads of its streams, 1,024 of the split's")
    assert whole["final_eval_scope"].startswith("the whole split")


def test_summary_json_is_written_before_the_final_evaluation_and_counts_every_second(tmp_path, tiny_data):
    run = tmp_path / "run"
    began = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "rpt", "train", "--config", TINY, "--set", f"data.path={tiny_data}",
                             "--set", "model.cell=mlstm", "--set", "train.max_steps=30", "--set", "train.eval_interval=10",
                             "--set", "train.eval_tokens=512", "--run-dir", str(run)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    early = None
    for line in proc.stdout:  # the summary as it stands when the final evaluation begins
        if line.startswith("final evaluation:") and early is None:
            early = json.loads((run / "summary.json").read_text())
    assert proc.wait(timeout=TIMEOUT) == 0
    command = time.time() - began
    assert early is not None and early["val_loss"] is None and early["final_eval_scope"].startswith("pending")
    assert early["steps"] == 30 and early["train_loss"] is not None
    summary = json.loads((run / "summary.json").read_text())
    seconds = summary["seconds"]
    assert summary["val_loss"] is not None and seconds["final_eval"] > 0
    parts = seconds["start"] + seconds["training"] + seconds["final_eval"] + seconds["closing"]
    assert parts == pytest.approx(seconds["command"], abs=0.01)
    assert seconds["closing"] >= 0 and seconds["start"] > 0
    # the command as measured from outside, from before its process started to after it ended
    assert seconds["command"] == pytest.approx(command, rel=0.05, abs=0.3), (seconds, command)


# --------------------------------------------------------------------------- item 6: a split too short to trust
def test_a_validation_split_too_short_is_refused_at_start_or_every_figure_says_its_tokens(tmp_path, shakespeare_text,
                                                                                        cli):
    text = tmp_path / "play.txt"
    text.write_text(shakespeare_text[:100_000])
    assert cli("prepare", "--input", str(text), "--out", str(tmp_path / "d"), "--val-fraction", "0.0001",
               "--vocab-size", "300").returncode == 0
    args = ["train", "--config", TINY, "--set", f"data.path={tmp_path / 'd'}", "--set", "train.max_steps=4",
            "--set", "model.d_model=16"]
    refused = cli(*args, "--run-dir", str(tmp_path / "r1"))
    assert refused.returncode == 2 and "too few for a meaningful validation figure" in refused.stderr
    assert "--val-fraction" in refused.stderr and not (tmp_path / "r1").exists()
    went_on = cli(*args, "--run-dir", str(tmp_path / "r2"), "--set", "train.min_val_tokens=0")
    assert went_on.returncode == 0, went_on.stderr
    evaluations = [line for line in went_on.stdout.splitlines() if "val loss" in line]
    assert evaluations and all(" tokens" in line for line in evaluations), evaluations
    assert "validation tokens" in went_on.stdout  # the final line says what the figure rests on


# --------------------------------------------------------------------- item 11: one list of checks, run by both
def test_rpt_config_refuses_what_rpt_train_would(cli):
    code, out, err = cli("config", "--config", TINY, "--set", "model.cell=mlstm", "--set", "model.heads=5")
    assert code == 2 and "model.heads = 5 does not divide" in err and out == ""


# ------------------------------------------------------------------------------------------ item 12: wording
def test_an_unknown_option_gets_its_commands_usage_and_the_nearest_option(cli):
    code, out, err = cli("serve", "RUN", "--prot", "80")
    assert code == 2 and "usage: rpt serve" in err and "did you mean --port?" in err


def test_a_missing_default_dataset_is_met_with_the_command_that_makes_it(cli, tmp_path):
    code, out, err = cli("train", "--config", TINY, "--set", f"data.path={tmp_path / 'stdlib'}",
                         "--run-dir", str(tmp_path / "r"))
    assert code == 2 and f"rpt prepare --out {tmp_path / 'stdlib'}` (the embedded corpus" in err


def test_the_recipes_family_says_it_is_a_fixed_rule_and_where_it_was_measured():
    from rpt.config import Config
    from rpt.train.recipe import cell_choice

    [choice] = cell_choice(Config.load(None, []), torch.device("cpu"))
    assert "fixed rule" in choice.why and "measured best on this device" not in choice.why


# ------------------------------------------------------------------------- item 10: no noise after a clean error
def test_a_clean_error_after_torch_imported_triton_ends_without_leak_reports(tmp_path, tiny_data):
    """Where torch has imported Triton (torch._dynamo does, from the optimiser or the checkpoint reader) and start-up's
    objects are frozen out of the collector (as `rpt serve` freezes them), the interpreter's teardown printed
    nanobind's report of Triton's objects under a clean one-line error. The command now ends past it."""
    run = tmp_path / "run"
    trained = rpt("train", "--config", TINY, "--set", f"data.path={tiny_data}", "--set", "model.d_model=16",
                  "--set", "train.max_steps=2", "--set", "train.eval_interval=0", "--set", "train.final_eval_tokens=256",
                  "--run-dir", str(run))
    assert trained.returncode == 0, trained.stderr
    program = ("import gc, sys, torch._dynamo; gc.collect(); gc.freeze(); "
               f"sys.argv = ['rpt', 'generate', {str(run)!r}, '--exit', 'kl:1e-3']; "
               "from rpt.cli import main; main()")
    refused = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=TIMEOUT)
    assert refused.returncode == 2 and "for a model without a loop" in refused.stderr
    assert "nanobind" not in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
    assert refused.stderr.strip().count("\n") <= 1  # the error and its fix
