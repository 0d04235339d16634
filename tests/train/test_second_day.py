"""What a new user met on a second day with rpt (issue 43): work lost on resume and on kill, checks that came after
the budget instead of before step 1, settings accepted silently. Most tests run the CLI as a user does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rpt.config import Config

TIMEOUT = 300
REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny-cpu.toml")


def rpt(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rpt", *args], capture_output=True, text=True, timeout=TIMEOUT,
                          env={**os.environ, **(env or {})})


def small(data: Path, *extra: str) -> list[str]:
    """The tiny preset on `data`, with a short evaluation."""
    return ["--config", TINY, "--set", f"data.path={data}", "--set", "model.d_model=32", "--set", "train.seq_len=16",
            "--set", "train.eval_tokens=512", *extra]


def test_a_small_sharded_corpus_trains_from_the_command_line(tmp_path, small_corpus):
    from rpt.data.prepare import PrepareOptions, prepare

    data = tmp_path / "sharded"
    meta = prepare(PrepareOptions(out=data, inputs=[str(small_corpus)], vocab_size=300, shard_tokens=1500,
                                  progress=False))
    assert all("shards" in meta["splits"][split] for split in ("train", "val"))  # both splits are shard folders
    run = rpt("train", "--run-dir", str(tmp_path / "run"), *small(data, "--set", "train.max_steps=4"))
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 4


def test_resume_with_another_batch_size_starts_the_state_afresh_and_keeps_the_config_until_it_ran(tmp_path,
                                                                                                  tiny_data):
    run = tmp_path / "run"
    first = rpt("train", "--run-dir", str(run), *small(tiny_data, "--set", "train.max_steps=6",
                                                      "--set", "checkpoint.interval=3"))
    assert first.returncode == 0, first.stderr[-2000:]
    # killed as the first step of the resume begins: the run's config.toml still holds what it trained with
    killed = rpt("train", "--run-dir", str(run), "--resume", "--set", "train.batch_size=8",
                 "--set", "train.max_steps=9", env={"RPT_FAULT": "kill@6"})
    assert killed.returncode != 0
    assert tomllib.loads((run / "config.toml").read_text())["train"]["batch_size"] == 4
    resumed = rpt("train", "--run-dir", str(run), "--resume", "--set", "train.batch_size=8",
                  "--set", "train.max_steps=9")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "the recurrent state starts afresh: it was saved for 4 rows, this run has 8" in resumed.stdout
    assert tomllib.loads((run / "config.toml").read_text())["train"]["batch_size"] == 8
    assert json.loads((run / "summary.json").read_text())["steps"] == 9
    again = rpt("train", "--run-dir", str(run), "--resume", "--set", "train.max_steps=10")  # plain, at 8 rows now
    assert again.returncode == 0, again.stderr[-3000:]
    assert "starts afresh" not in again.stdout


def test_checkpoints_come_on_a_timer_by_default_and_are_announced(tmp_path, tiny_data):
    assert 10 <= Config().checkpoint.interval_minutes <= 30  # every run checkpoints while it trains
    run = tmp_path / "run"
    proc = rpt("train", "--run-dir", str(run), *small(tiny_data, "--set", "train.max_steps=40",
                                                      "--set", "checkpoint.interval_minutes=0.0002",
                                                      "--set", "checkpoint.keep_last=100"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "checkpoints: every 0.0002 min of training (checkpoint.interval_minutes), and at the end" in proc.stdout
    steps = sorted(int(p.name.removeprefix("step_")) for p in (run / "checkpoints").glob("step_*"))
    assert len(steps) > 3 and steps[-1] == 40  # the timer's, then the end's


def test_restarts_without_checkpoints_are_warned_of(tmp_path, tiny_data):
    proc = rpt("train", "--run-dir", str(tmp_path / "run"), "--max-restarts", "1",
               *small(tiny_data, "--set", "train.max_steps=2", "--set", "checkpoint.interval_minutes=0"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "warning: --max-restarts 1 with no periodic checkpoint" in proc.stderr
    assert "checkpoints: at the end only" in proc.stdout


def test_keeping_no_checkpoint_at_all_is_refused_and_the_newest_is_always_kept(tmp_path, cli):
    code, _, err = cli("config", "--set", "checkpoint.keep_last=0", "--set", "checkpoint.keep_best=0")
    assert code == 2 and "would delete every checkpoint" in err
    from rpt.train.checkpoint.store import CheckpointStore

    model = torch.nn.Linear(3, 2)
    ck = CheckpointStore(str(tmp_path / "ck"), keep_last=0, keep_best=1)
    for step in (1, 2, 3):  # no validation loss yet: nothing is "best", and the newest is what a resume needs
        ck.save(step, model, None, {})
    assert [p.rsplit("/", 1)[-1] for p, _ in ck.complete()] == ["step_00000003"]


def test_a_validation_split_shorter_than_a_window_is_scored_whole(tmp_path, tiny_data):
    """Before the fixed evaluation layout (issue 58) such a split was refused: its windows followed the batch."""
    val = json.loads((tiny_data / "meta.json").read_text())["splits"]["val"]["tokens"]
    run = tmp_path / "run"
    proc = rpt("train", "--run-dir", str(run), *small(tiny_data, "--set", "train.batch_size=1", "--set",
                                                      f"train.seq_len={val + 64}", "--set", "train.max_steps=2",
                                                      "--set", "train.eval_interval=0"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((run / "summary.json").read_text())["val_tokens"] == val - 1  # every token after the first


def test_the_recipe_measures_within_its_share_of_the_budget(make_cfg, monkeypatch):
    """A machine where a step of 64 tokens a row takes seconds (here a forward that sleeps 20 ms a token): the
    recipe measures short steps, keeps within about its share (5% of 20 s) and says it stopped."""
    from rpt.models import RecurrentLM
    from rpt.train import recipe

    forward = RecurrentLM.forward

    def slow(self, x, *args, **kwargs):
        import time
        time.sleep(0.02 * x.shape[1])
        return forward(self, x, *args, **kwargs)
    monkeypatch.setattr(RecurrentLM, "forward", slow)
    cfg = make_cfg("train.recipe=auto", "train.max_time=20", "train.seq_len=64", "train.max_steps=0").thawed()
    seconds = recipe.apply_recipe(cfg, SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu")), 50_000, 10_000,
                             np.ones(300))
    assert seconds < 2.0  # two whole-window steps alone would take 2.6 s
    assert any("measuring stopped at the recipe's share of the budget" in n for n in cfg.notes)
    assert cfg.train.max_time == 20  # the recipe's time is outside the budget of training


def test_an_oversubscribed_machine_is_named_by_threads_against_cores():
    from rpt.train.recipe import CoreUse, contention

    assert contention(0.1, 2, 2) is None and contention(0.0, 1, 2) is None
    assert contention(1.0, 1, 2) is None  # one core busy elsewhere, one thread here: they fit
    said = contention(1.6, 2, 2)
    assert "oversubscribed" in said and "1.6 of its 2 cores" in said and "2 threads" in said
    if not Path("/proc/stat").exists():
        return
    spinner = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 3\nwhile time.time() < end: pass"])
    try:
        import time
        time.sleep(0.5)
        use = CoreUse()
        time.sleep(1.0)
        busy = use.elsewhere()
    finally:
        spinner.kill()
        spinner.wait()
    assert busy is not None and busy > 0.3  # the spinning process is seen (about one core; the machine may be busy)


def test_data_path_and_data_mix_are_not_both_taken(tmp_path, tiny_data, cli):
    mix = f'data.mix={{"{tiny_data}" = 0.5, "{tiny_data}/../other" = 0.5}}'
    code, _, err = cli("config", "--set", f"data.path={tiny_data}", "--set", mix)
    assert code == 2 and "data.mix are both given" in err and "data.mix={}" in err
    code, out, err = cli("config", "--config", TINY, "--set", mix)  # the preset's path, a mixture given
    assert code == 0, err
    assert "data.mix replaces the preset's data.path = data/stdlib" in err
    saved = tmp_path / "config.toml"  # what a mixture run writes reads back (a resume) without the refusal
    saved.write_text(out)
    assert Config.load(saved).data.mix and "path" not in tomllib.loads(saved.read_text())["data"]


def test_the_final_evaluation_names_the_step_whose_weights_it_scores(make_cfg, tmp_path, solo, monkeypatch, capsys):
    from rpt.train import evaluate
    from rpt.train.trainer import Trainer

    measure, periodic = evaluate.evaluate, []

    def worse_after_step_4(*args, max_tokens=0, **kwargs):  # the periodic validations (of steps 2, 4, 6, 8)
        result = measure(*args, max_tokens=max_tokens, **kwargs)
        if max_tokens:
            periodic.append(result)
            return {**result, "loss": result["loss"] + 10.0} if len(periodic) > 2 else result
        return result
    monkeypatch.setattr(evaluate, "evaluate", worse_after_step_4)
    summary = Trainer(make_cfg("train.eval_interval=2", "train.max_steps=8", "train.early_stop=0"), tmp_path / "r",
                      solo).run()
    assert summary["selected_step"] == 4
    assert "step 8: val loss" in capsys.readouterr().out.split("(final, whole split, the weights of step 4)")[0]
    final = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
             if '"final": true' in line]
    assert [r["weights_step"] for r in final] == [4]


def test_a_link_figure_never_comes_from_a_noisy_difference():
    from rpt.comm.links import bandwidth_of

    nbytes = 4 << 20
    noisy = bandwidth_of(nbytes, [1.0e-3, 1.1e-3, 0.9e-3], rtt=1.2e-3)  # the round trip outlasted the sends
    assert noisy == pytest.approx(nbytes / 1.0e-3)  # bytes over the median send: a lower bound, not 4e15 B/s
    clear = bandwidth_of(nbytes, [10e-3, 11e-3, 50e-3], rtt=1e-3)  # one slow outlier does not count
    assert clear == pytest.approx(nbytes / 10e-3)


def test_resuming_on_data_of_another_tokenizer_says_so(tmp_path, tiny_data, small_corpus):
    from rpt.data.prepare import PrepareOptions, prepare

    other = tmp_path / "other"
    prepare(PrepareOptions(out=other, inputs=[str(small_corpus)], vocab_size=280, val_fraction=0.2, progress=False))
    run = tmp_path / "run"
    assert rpt("train", "--run-dir", str(run), *small(tiny_data, "--set", "train.max_steps=2")).returncode == 0
    before = (run / "config.toml").read_text()
    proc = rpt("train", "--run-dir", str(run), "--resume", "--set", f"data.path={other}", "--set", "train.max_steps=4")
    assert proc.returncode == 2 and "another tokenizer" in proc.stderr and "vocab_size = 0" not in proc.stderr
    assert (run / "config.toml").read_text() == before


def test_rpt_config_without_a_preset_marks_what_the_recipe_chooses(cli):
    code, out, err = cli("config", "--set", "model.d_model=64")
    assert code == 0, err
    assert out.startswith("# No --config: `rpt train` runs the default recipe")
    lines = out.splitlines()
    assert "n_layers = 2  # the default recipe chooses" in lines
    assert "d_model = 64" in lines  # given: the recipe leaves it alone
    assert "cell = \"lstm\"  # the default recipe chooses" in lines  # the family, by the device's measurements
    assert "seq_len = 64" in lines  # the recipe does not choose the window


def test_settings_that_cannot_take_effect_are_warned_of_or_refused(tmp_path, cli):
    code, _, err = cli("config", "--config", TINY, "--set", "train.warmup_steps=50",
                       "--set", "monitor.profile=30:32")
    assert code == 0
    assert "train.warmup_steps = 50 is beyond train.max_steps = 20" in err
    assert "profiled range 30:32 comes within train.max_steps = 20" in err
    for flags, said in ((["--temperature", "-1"], "--temperature -1.0 is negative"),
                        (["--top-p", "2"], "--top-p 2.0 is outside (0, 1]"), (["--top-k", "-3"], "--top-k -3")):
        code, _, err = cli("generate", str(tmp_path / "no-run-needed"), *flags)  # refused before loading
        assert code == 2 and said in err, err
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text("")
    code, _, err = cli("train", "--run-dir", str(run), "--resume", "--set", f"train.init_from={run}")
    assert code == 2 and "continues from its own checkpoint" in err
