"""A looped model (model.loop_core) through the trainer on one process: each step at its drawn depth, logged;
learning; activation checkpointing per iteration giving the plain step's gradients; the layouts not built yet
refused with the fix."""

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
            trainer.step = step
            trainer.train_step(trainer.loader.batch(step))
        params.append(torch.cat([p.detach().flatten() for p in trainer.runner.model.parameters()]))
    torch.testing.assert_close(params[0], params[1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("layout", ["parallel.pp=2", "parallel.fsdp=2"])
def test_layouts_the_loop_does_not_run_in_yet_are_refused_with_the_fix(make_cfg, layout):
    with pytest.raises(RptError, match="looped model") as refused:
        make_cfg(*LOOP, layout, "model.n_layers=4")
    assert "= 1" in refused.value.fix
