"""What a new user met on a third day with rpt (issue 58): a resumed run that trained nothing and rewrote its summary,
figures of different spans in one summary, a budget spent on the compiler, origins lost on resume, a validation
score that followed the training batch, a recipe that contradicted itself, and silent settings."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch

from rpt.config import ModelConfig
from rpt.models.lm import RecurrentLM
from rpt.train.evaluate import EVAL_STREAMS, STREAM_TOKENS, eval_streams, evaluate

TIMEOUT = 300
REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny-cpu.toml")


def rpt(*args: str, env: dict | None = None, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rpt", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def small(data: Path, *extra: str) -> list[str]:
    """The tiny preset on `data`, with a short evaluation."""
    return ["--config", TINY, "--set", f"data.path={data}", "--set", "model.d_model=32", "--set", "train.seq_len=16",
            "--set", "train.eval_tokens=512", *extra]


# ---------------------------------------------------------------------------------------------- item 5: one layout
def _split(n: int, documents: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 40, n)
    tokens[0] = 0
    tokens[rng.choice(np.arange(1, n), documents - 1, replace=False)] = 0  # 0: end-of-text, which opens a document
    return tokens


@pytest.mark.parametrize("eot", [0, None])
def test_the_whole_split_scores_the_same_whatever_the_batch_window_or_world_size(eot):
    """Before: the same weights scored 5.5560 at batch 4 and 5.5655 at batch 8 (the streams followed the batch)."""
    torch.manual_seed(0)
    model = RecurrentLM(ModelConfig(cell="gru", n_layers=1, d_model=16, vocab_size=40, attention_every=1,
                                    attention_window=8, attention_heads=2)).double()
    tokens = _split(6 * STREAM_TOKENS + 777, documents=25)
    byte_lengths = np.r_[0, np.full(39, 2)]
    scores = []
    for batch, window, world in ((4, 32, 1), (8, 32, 1), (1, 100, 1), (3, 17, 2), (2, 64, 3)):
        parts = [evaluate(model, tokens, byte_lengths, batch_size=batch, seq_len=window, device=torch.device("cpu"),
                          rank=rank, world_size=world, eot_id=eot) for rank in range(world)]
        nats = sum(p["loss"] * p["tokens"] for p in parts)  # what the all-reduce adds up across ranks
        scores.append((nats, sum(p["tokens"] for p in parts), sum(p["bytes"] for p in parts)))
    assert {s[1] for s in scores} == {len(tokens) - 1}  # every token after the first scored once
    assert len({s[2] for s in scores}) == 1
    for nats, _, _ in scores[1:]:
        assert nats == pytest.approx(scores[0][0], rel=1e-12)


def test_streams_start_at_documents_and_cover_the_split():
    from rpt.train.evaluate import HEAD_TOKENS

    tokens = _split(EVAL_STREAMS * STREAM_TOKENS * 2, documents=20_000)
    streams = eval_streams(tokens, eot_id=0)
    assert len(streams) == EVAL_STREAMS
    assert streams[0, 0] == 0 and streams[-1, 1] == len(tokens) - 1 and (streams[1:, 0] == streams[:-1, 1]).all()
    assert (tokens[streams[:, 0]] == 0).all()  # every stream opens a document
    assert len(eval_streams(tokens[:2 * STREAM_TOKENS - 10], 0)) == 1  # a short split: one stream
    head = eval_streams(tokens, 0, max_tokens=4096)  # a periodic validation: the heads of streams spread over all
    assert len(head) == 4096 // HEAD_TOKENS and set(head[:, 0]) <= set(streams[:, 0])
    assert head[-1, 0] > streams[EVAL_STREAMS // 2, 0] and ((head[:, 1] - head[:, 0]) == HEAD_TOKENS).all()


# ---------------------------------------------------------------------------------------------- items 1, 2, 4: resume
def _worsening(monkeypatch):
    """Periodic validations that get worse after the second: the run stops early."""
    from rpt.train import evaluate as module

    measure, periodic = module.evaluate, []

    def worse(*args, max_tokens=0, **kwargs):
        result = measure(*args, max_tokens=max_tokens, **kwargs)
        if max_tokens:
            periodic.append(result)
            return {**result, "loss": result["loss"] + len(periodic)} if len(periodic) > 2 else result
        return result
    monkeypatch.setattr(module, "evaluate", worse)


def _reload(run: Path, *overrides: str):
    from rpt.cli import load_config

    return load_config(str(run / "config.toml"), list(overrides), run_file=True)


def test_an_early_stopped_run_is_refused_unextended_and_trains_on_extended(make_cfg, tmp_path, solo, monkeypatch,
                                                                          capsys):
    """Before: `--resume --set train.max_time=45` on an early-stopped run trained 0 steps, and rewrote summary.json
    (wall_seconds 0.017, eval_share 185.37, train_loss null) and config.toml."""
    from rpt.errors import RptError
    from rpt.train.trainer import Trainer

    _worsening(monkeypatch)
    run = tmp_path / "r"
    first = Trainer(make_cfg("train.max_steps=20", "train.eval_interval=2", "train.early_stop=0.25"), run,
                    solo).run()
    assert first["ended_by"].startswith("train.early_stop") and first["steps"] < 20
    files = {name: (run / name).read_bytes() for name in ("summary.json", "config.toml")}
    with pytest.raises(RptError) as refused:
        Trainer(_reload(run, "train.batch_size=8"), run, solo, resume=True)
    assert "this run was ended by train.early_stop = 0.25" in str(refused.value)
    assert "--set train.max_steps=40" in refused.value.fix and "train.early_stop=0" in refused.value.fix
    assert {name: (run / name).read_bytes() for name in files} == files  # nothing written
    capsys.readouterr()
    # 20 -> 24 steps: the validations' shares rescaled to the new budget still stop it, so the patience restarts
    extended = Trainer(_reload(run, "train.max_steps=24"), run, solo, resume=True).run()
    assert "its patience starts afresh here" in capsys.readouterr().out
    assert first["steps"] < extended["steps"] < 24 and extended["ended_by"].startswith("train.early_stop")
    assert extended["train_loss"] is not None and extended["segment_first_step"] == first["steps"]


def test_after_a_resume_every_figure_of_the_summary_covers_the_whole_run(cut_and_resumed):
    """Before: wall_seconds counted the last segment only, eval_seconds / tokens / steps the whole run."""
    full, resumed = cut_and_resumed("train.eval_interval=1", "train.eval_tokens=256")
    before = resumed.progress.elapsed_before
    summary = resumed.run()
    assert summary["steps"] == 6 and summary["segment_first_step"] == 3
    assert summary["wall_seconds"] >= before + summary["segment_wall_seconds"] - 1e-3
    assert summary["eval_seconds"] < summary["wall_seconds"]
    assert abs(summary["eval_share"] * summary["wall_seconds"] - summary["eval_seconds"]) < 2e-3  # (rounded)
    assert abs(summary["tokens"] / summary["tokens_per_second"] - summary["wall_seconds"]) < 2e-3


def test_a_resume_keeps_each_values_origin_and_marks_what_it_changed(tmp_path, tiny_data):
    """Before: after --resume every key said `# RUN/config.toml`; and `recipe = "auto"  # --set` with no --set."""
    from rpt.config import read_origins

    run = tmp_path / "run"
    first = rpt("train", "--run-dir", str(run), *small(tiny_data, "--set", "train.max_steps=4"))
    assert first.returncode == 0, first.stderr[-2000:]
    origins = read_origins(run / "config.toml")
    assert origins["train.max_steps"] == "--set" and origins["model.cell"] == TINY
    assert origins["model.vocab_size"] == "the data (meta.json)" and "train.lr" in origins
    resumed = rpt("train", "--run-dir", str(run), "--resume", "--set", "train.max_steps=6")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    after = read_origins(run / "config.toml")
    assert after == {**origins, "train.max_steps": "--set with --resume"}
    assert 'batch_size = 4  # ' + TINY in (run / "config.toml").read_text()  # a default stays marked so
    assert "# default" in (run / "config.toml").read_text()


def test_without_a_preset_the_recipe_is_marked_as_the_commands_and_defaults_go_unmentioned(capsys):
    from rpt.cli import load_config

    cfg = load_config(None, ["train.max_time=60"])
    assert cfg.train.recipe == "auto" and cfg.origins["train.recipe"].startswith("no --config")
    assert not any("max_steps" in note for note in cfg.notes)  # a default the user never set: off, quietly
    preset = load_config(TINY, ["train.max_time=60"])
    assert any("train.max_steps = 20 is off" in note for note in preset.notes)  # the preset's: said


def test_origins_are_read_back_whatever_a_string_holds(tmp_path):
    from rpt.config import Config, read_origins

    cfg = Config.load(None, ["data.path=a  # b", "model.d_model=32"])
    path = tmp_path / "config.toml"
    path.write_text(cfg.to_toml(origins=True))
    assert read_origins(path) == {"data.path": "--set", "model.d_model": "--set"}
    assert Config.load(path).data.path == "a  # b"


# ---------------------------------------------------------------------------------------------- item 3: the compiler
def test_the_native_loops_are_built_before_the_clock_starts(make_cfg, tmp_path, solo, monkeypatch):
    """Before: the first mingru run built the loops (~25 s) inside its first step, its budget's clock running."""
    from rpt.kernels.cpu import build
    from rpt.train import trainer

    order = []
    monkeypatch.setattr(build, "_built", {})  # this process has not loaded them yet
    loaded = build._compile_and_load
    monkeypatch.setattr(build, "_compile_and_load", lambda: order.append("built") or loaded())
    real = trainer.Trainer.run
    monkeypatch.setattr(trainer.Trainer, "run", lambda self: order.append("clock") or real(self))
    monkeypatch.setattr(trainer.launch, "setup", lambda device: solo)
    trainer.train_worker(make_cfg("model.cell=mingru", "train.max_steps=2"), str(tmp_path / "r"), False, None,
                         show_progress=False)
    assert order == ["built", "clock"]


# ---------------------------------------------------------------------------------------------- item 6: the recipe
def _recipe(make_cfg, monkeypatch, speed: float, train_tokens: int, *sets: str, larger: float = 1.0):
    """The recipe under a 60 s budget on a machine whose one measured size runs at `speed` tokens/s at 16 rows a
    step, and `larger` times that at more."""
    import re
    from types import SimpleNamespace

    from rpt.train import recipe

    timed = []
    monkeypatch.setattr(recipe, "measure_speed", lambda *a, **k: timed.append((a[1], a[0].train.batch_size)) or
                        (speed * (larger if a[0].train.batch_size > 16 else 1.0), True))
    cfg = make_cfg("train.max_steps=0", "train.max_time=60", "train.recipe=auto", "train.batch_size=16",
                   "train.seq_len=64", *sets).thawed()
    cfg.given = frozenset()
    recipe.apply_recipe(cfg, SimpleNamespace(rank=0, world_size=1, device="cpu"), train_tokens, 10_000, np.ones(512))
    passes = {float(p) for note in cfg.notes for p in re.findall(r"([\d.]+) passes(?! with| without)", note)}
    return cfg, timed, passes


@pytest.mark.parametrize("larger", [1.0, 1.6])
@pytest.mark.parametrize("speed", [5e3, 1e4, 3e4, 2e5])
def test_every_line_of_the_recipe_speaks_of_the_same_passes(make_cfg, monkeypatch, speed, larger):
    """Before: under load the recipe chose attention "for 10.1 passes", then sized the model and switched dropout
    and early stopping off "for 0.1 passes" (a second timing that disagreed with the first). Each batch is timed
    itself (`larger`: 64 rows a step faster than 16, as on a CPU), and the lines still agree."""
    from rpt.train import recipe

    cfg, timed, passes = _recipe(make_cfg, monkeypatch, speed, 300_000, larger=larger)
    assert len(timed) == len(set(timed)) and {size for size, _ in timed} == {recipe.Timing.REFERENCE}  # once a batch
    assert len(passes) == 1, "\n".join(cfg.notes)  # one figure in every line that gives the passes
    (p,) = passes
    assert (cfg.model.attention_every > 0) == (p > recipe.REGIME_PASSES)
    assert (cfg.model.dropout > 0) == (p > recipe.FREE_PASSES) and (cfg.train.early_stop > 0) == (p > 1)
    assert (cfg.train.batch_size == 64) == (p < recipe.REGIME_PASSES)


def test_a_short_run_of_known_steps_validates_and_decays(make_cfg, monkeypatch):
    """Before: eval_interval = 160 and warmup 50 for a run of 58 steps: no validation, no decay. Where the steps are
    known (a token budget) the recipe plans four validations and a warm-up of a tenth; under a time budget the
    trainer's own rule sees to it (test_a_slower_machine_than_the_recipe_timed_still_validates_and_decays)."""
    from types import SimpleNamespace

    from rpt.train import recipe

    cfg = make_cfg("train.max_steps=0", "train.max_tokens=120000", "train.recipe=auto", "train.batch_size=16",
                   "train.seq_len=64").thawed()
    cfg.given = frozenset()
    recipe.apply_recipe(cfg, SimpleNamespace(rank=0, world_size=1, device="cpu"), 10**6, 10_000, np.ones(512))
    steps = 120_000 / (cfg.train.batch_size * cfg.train.seq_len)  # 29 steps at 64 rows
    assert steps // cfg.train.eval_interval >= 3 and cfg.train.warmup_steps <= steps / 10
    assert cfg.origins["train.warmup_steps"] == "the default recipe"


# ---------------------------------------------------------------------------------------------- items 8-12: messages
def test_loop_options_without_a_loop_are_refused():
    from rpt.cli import load_config
    from rpt.errors import RptError

    for key, value in (("loop_mean", "2"), ("loop_prelude", "1"), ("loop_backprop", "3")):
        with pytest.raises(RptError, match=f"model.{key} = .* without model.loop_core: a model without a loop would "
                                           "ignore it") as refused:
            load_config(None, [f"model.{key}={value}"])
        assert "set model.loop_core" in refused.value.fix


def test_the_loops_messages_name_what_the_user_set():
    from rpt.cli import load_config
    from rpt.errors import RptError

    with pytest.raises(RptError) as low:  # before: "outside [1 (exclusive), loop_max = 1]", loop_max never set
        load_config(None, ["model.n_layers=3", "model.loop_core=1", "model.loop_mean=0"])
    assert "loop_max" not in str(low.value) and "not above 1" in str(low.value)
    with pytest.raises(RptError) as high:  # before: the fix suggested "a mean such as 4", the value refused
        load_config(None, ["model.n_layers=3", "model.loop_core=1", "model.loop_max=2", "model.loop_mean=4"])
    assert "above the cap on the depth, model.loop_max = 2" in str(high.value)
    assert "use loop_mean <= 2" in high.value.fix and "such as 4" not in high.value.fix


def test_an_exit_threshold_that_is_not_a_number_is_named():
    from rpt.errors import RptError
    from rpt.models.loop_exit import Exit

    with pytest.raises(RptError, match="its threshold 'abc' is not a number"):
        Exit.parse("kl:abc")
    with pytest.raises(RptError, match="it has no threshold after the criterion"):
        Exit.parse("kl")


def test_a_smaller_budget_on_resume_is_called_shortening():
    from rpt.config import TrainConfig
    from rpt.train.budget import Budget

    budget = Budget(TrainConfig(max_steps=0, max_time=30.0, warmup_steps=0))
    budget.load_state_dict({"limits": {"max_time": 60.0}, "segment": None, "lr": 1e-3})
    said = budget.resume(100, 10_000, 20.0, refuse_spent=True)
    assert said.startswith("shortening the run from train.max_time = 60 to 30 s")  # before: "extending"


def test_the_log_line_reports_training_throughput_with_validation_apart():
    from rpt.train.telemetry import progress_line

    where = {"step": 10, "max_steps": 0, "spent": 0.5, "eta_s": 5.0, "budget": "train.max_time"}
    assert "12,000 tokens/s (+0.4 s validating)" in progress_line(where, 3.0, 1e-3, 12_000, 0.4)
    assert "validating" not in progress_line(where, 3.0, 1e-3, 12_000, 0.0)


def test_the_log_throughput_leaves_validation_out(make_cfg, tmp_path, solo):
    """Before: the log's tokens/s swung 805 <-> 10,045 around each validation, which it counted as training time."""
    from rpt.train import evaluate as module
    from rpt.train.trainer import Trainer

    measure = module.evaluate

    def slow(*args, **kwargs):  # a validation that takes 0.5 s
        import time
        time.sleep(0.5)
        return measure(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, "evaluate", slow)
        Trainer(make_cfg("train.max_steps=8", "train.eval_interval=2", "monitor.log_interval=2"), tmp_path / "r",
                solo, show_progress=False).run()
    lines = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if r["kind"] == "train"]
    after = [r for r in train if r["eval_s"] > 0.4]  # the intervals a validation fell into
    assert after and all(r["tokens_per_s"] > 2 * 64 / 0.5 for r in after)  # 128 tokens an interval, not over 0.5 s


def test_the_loop_warning_names_a_section_that_exists():
    from rpt.train.loop_health import LoopHealth

    said = LoopHealth(0.0).check({"depth": 4, "by_depth": {1: {"bpb": 1.0}, 4: {"bpb": 1.1}}}, 0.5)
    section = said[0].split("docs/depth.md, '")[1].split("'")[0]
    assert f"## {section}" in (REPO / "docs" / "depth.md").read_text()


@pytest.fixture(scope="module")
def looped_run(tmp_path_factory, tiny_data) -> Path:
    from rpt.config import Config
    from rpt.parallel.launch import Dist
    from rpt.train.trainer import Trainer

    run = tmp_path_factory.mktemp("looped") / "run"
    cfg = Config.load(None, [f"data.path={tiny_data}", "model.d_model=16", "model.cell=mingru", "model.n_layers=3",
                             "model.loop_prelude=1", "model.loop_core=1", "model.loop_mean=2", "train.batch_size=2",
                             "train.seq_len=8", "train.max_steps=2", "train.eval_interval=0", "train.eval_tokens=64",
                             "train.eval_depths=[2]", "monitor.tensorboard=false"])
    Trainer(cfg, run, Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")), show_progress=False).run()
    return run


def test_generation_refuses_an_exit_or_a_depth_it_cannot_run_before_printing(looped_run):
    import io

    from rpt.errors import RptError
    from rpt.train.generation import generate_text

    out = io.StringIO()
    with pytest.raises(RptError, match="this model's head has no shortlist"):
        generate_text(str(looped_run), "def ", 5, 0.0, 0, 1.0, 0, "latest", "cpu", out=out, exit="shortlist:1e-3")
    assert out.getvalue() == ""  # before: refused only after the text was printed
    with pytest.raises(RptError, match="--depth 100,000: more than 4 x the most iterations") as deep:
        generate_text(str(looped_run), "def ", 5, 0.0, 0, 1.0, 0, "latest", "cpu", out=out, depth=100_000)
    assert "use --depth 32 or less" in deep.value.fix and out.getvalue() == ""


def test_eval_by_position_says_why_a_split_without_document_starts_has_no_positions(tmp_path, shakespeare_text,
                                                                                      capsys):
    from rpt.cli import main
    from rpt.data.prepare import PrepareOptions, prepare

    (tmp_path / "play.txt").write_text(shakespeare_text[:60_000])  # one file: one document, held out by its tail
    prepare(PrepareOptions(out=tmp_path / "data", inputs=[str(tmp_path / "play.txt")], vocab_size=300,
                           progress=False))
    run = tmp_path / "run"
    main(["train", "--run-dir", str(run), *small(tmp_path / "data", "--set", "train.max_steps=2")])
    capsys.readouterr()
    main(["eval", str(run), "--by-position"])
    out = capsys.readouterr().out
    assert "no token's position is known: the validation split holds no document start" in out
    assert "position " not in out.split("by position:")[0].split("\n", 2)[-1]  # no empty buckets printed


def test_the_dashboards_empty_position_chart_names_only_what_fills_it():
    """Before: "not measured: train.eval_by_position = true, or rpt eval --by-position", which writes nothing to the
    run's metrics.sqlite that the dashboard reads."""
    app = (REPO / "rpt" / "monitor" / "static" / "app.js").read_text()
    hint = app.split('empty("position", "')[1].split('")')[0]
    assert "train.eval_by_position = true" in hint and "to the terminal" in hint


def test_lm_eval_asks_git_quietly(tmp_path, capfd, monkeypatch):
    from rpt.export.lm_eval_run import quiet_git_hash

    monkeypatch.chdir(tmp_path)  # no repository here
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert quiet_git_hash() is None
    assert "fatal" not in capfd.readouterr().err


def test_a_slower_machine_than_the_recipe_timed_still_validates_and_decays():
    """Under load a run made 73 of the 503 steps its recipe expected: its step-sized validations and warm-up must
    not depend on that pace. Under a time budget a validation comes at least every third of it; the warm-up's rise
    ends where it meets the decay."""
    from types import SimpleNamespace

    from rpt.config import TrainConfig
    from rpt.train.budget import lr_at
    from rpt.train.evaluate import Evaluation

    timed = SimpleNamespace(eval_interval=125, max_time=60.0)
    ev = Evaluation.__new__(Evaluation)
    ev.cfg, ev.last = timed, None
    assert ev.should_evaluate(125, 0.1) and not ev.should_evaluate(20, 0.3)
    assert ev.should_evaluate(24, 0.34) and not ev.should_evaluate(25, 0.34, align=4)  # DiLoCo: an outer step
    ev.last = {"progress": 0.34}
    assert not ev.should_evaluate(40, 0.6) and ev.should_evaluate(50, 0.68)
    ev.cfg = SimpleNamespace(eval_interval=125, max_time=0.0)  # a step budget: its steps are known
    assert not ev.should_evaluate(50, 0.68)
    cfg = TrainConfig(lr=1.0, warmup_steps=50, min_lr_ratio=0.1)
    assert lr_at(9, 0.05, cfg) == pytest.approx(10 / 50)  # the rise, early
    assert lr_at(40, 0.9, cfg) == pytest.approx(lr_at(100, 0.9, cfg)) and lr_at(40, 0.9, cfg) < 0.2  # 90% spent
