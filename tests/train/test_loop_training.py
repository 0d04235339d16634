"""A looped model (model.loop_core) through the trainer on one process: each step at its drawn depth, logged;
learning; activation checkpointing per iteration giving the plain step's gradients; validations at each depth."""

from __future__ import annotations

import json

import pytest
import torch

from rpt.errors import RptError
from rpt.models.loop import draw_depth
from rpt.train.trainer import Trainer

LOOP = ["model.n_layers=3", "model.loop_prelude=1", "model.loop_core=1", "model.loop_mean=3",
        "model.loop_backprop=2", "model.loop_max=6"]


def train_records(run_dir):
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]


def test_a_looped_run_trains_at_each_steps_drawn_depth(make_cfg, tmp_path, solo):
    cfg = make_cfg(*LOOP, "train.max_steps=12", "train.seed=3")
    summary = Trainer(cfg, tmp_path / "r", solo, show_progress=False).run()
    records = train_records(tmp_path / "r")
    assert [r["depth"] for r in records] == [draw_depth(cfg.model, 3, step) for step in range(12)]
    assert len({r["depth"] for r in records}) > 1
    losses = [r["loss"] for r in records]
    assert sum(losses[-3:]) < sum(losses[:3]) and summary["val_loss"] < losses[0]


def test_activation_checkpointing_gives_a_looped_step_the_same_result(make_cfg, tmp_path, solo):
    params = []
    for recompute in ("false", "true"):
        trainer = Trainer(make_cfg(*LOOP, f"model.activation_checkpointing={recompute}", "model.loop_mean=4",
                                   "model.loop_sampler=fixed", "model.dropout=0.1"),
                          tmp_path / recompute, solo, show_progress=False)
        torch.manual_seed(0)
        for step in range(2):
            trainer.progress.step = step
            trainer.train_step(trainer.loader.batch(step))
        params.append(torch.cat([p.detach().flatten() for p in trainer.runner.model.parameters()]))
    torch.testing.assert_close(params[0], params[1], rtol=0, atol=1e-5)


def test_validations_run_at_each_depth_and_record_the_state(make_cfg, tmp_path, solo):
    from rpt.monitor.store import MetricsReader

    cfg = make_cfg(*LOOP, "train.max_steps=4", "train.eval_interval=2", "train.eval_depths=[1, 3, 5]")
    summary = Trainer(cfg, tmp_path / "r", solo, show_progress=False).run()
    evals = [r for r in map(json.loads, (tmp_path / "r" / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "eval"]
    assert [(e["step"], e["final"]) for e in evals] == [(2, False), (4, False), (4, True)]
    for e in evals:
        assert list(e["by_depth"]) == ["1", "3", "5"] and e["depth"] == 3
        assert e["by_depth"]["3"]["bpb"] == e["bpb"]  # the default depth is the validation itself
        assert len({r["bpb"] for r in e["by_depth"].values()}) == 3
        assert len(e["loop"]["state_change"]) == 3 and e["loop"]["state_change"][0] > 0
        assert 0 < e["loop"]["token_spread"] and all(v > 0 for v in e["loop"]["state_rms"])
    assert summary["val_bpb"] == evals[-1]["bpb"]
    rows = MetricsReader(tmp_path / "r").rows("depths")
    assert [(r["step"], r["final"], r["depth"]) for r in rows if r["step"] == 2] == [(2, 0, 1), (2, 0, 3), (2, 0, 5)]


def test_the_loops_two_known_failures_are_warned_about_once():
    from rpt.train.loop_health import LoopHealth

    health = LoopHealth(after=0.25)
    result = lambda shallow, deep, spread=0.5: {  # noqa: E731
        "depth": 4, "by_depth": {1: {"bpb": shallow}, 4: {"bpb": deep}}, "loop": {"token_spread": spread}}
    assert health.check(result(2.0, 2.0), spent=0.2) == []  # too early to say
    assert health.check(result(2.0, 1.9), spent=0.5) == []  # the loop helps
    ignored = health.check(result(2.0, 2.01), spent=0.5)
    assert len(ignored) == 1 and "ignored" in ignored[0] and "2.0100" in ignored[0]
    assert health.check(result(2.0, 2.01), spent=0.6) == []  # once
    collapsed = health.check(result(2.0, 1.9, spread=0.01), spent=0.6)
    assert len(collapsed) == 1 and "collapsed" in collapsed[0]
    assert LoopHealth(0.25).check({"loss": 1.0, "bpb": 1.0}, spent=1.0) == []  # an unlooped model's validation


def test_eval_depths_without_a_loop_are_refused(make_cfg):
    with pytest.raises(RptError, match="without a loop"):
        make_cfg("train.eval_depths=[1, 2]")
