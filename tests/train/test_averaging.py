"""Polyak averaging (train.average): the run ends with the mean of its last iterates, validates and checkpoints
that mean, and a resume from a checkpoint inside the averaged stretch continues exactly."""

from __future__ import annotations

import shutil

import pytest
import torch

from rpt.errors import RptError
from rpt.train.checkpoint.store import CheckpointStore
from rpt.train.trainer import Trainer


def test_the_run_ends_with_the_mean_of_the_iterates_of_its_last_share(make_cfg, tmp_path, solo, monkeypatch):
    iterates = []
    step = Trainer.train_step

    def recording(self, batch, lr=None):
        out = step(self, batch, lr)
        iterates.append({n: p.detach().clone() for n, p in self.runner.model.named_parameters()})
        return out
    monkeypatch.setattr(Trainer, "train_step", recording)
    trainer = Trainer(make_cfg("train.max_steps=8", "train.average=0.5"), tmp_path / "r", solo, show_progress=False)
    trainer.run()
    assert len(iterates) == 8 and trainer.averaging.count == 4  # the steps begun at 4/8 of the budget or later
    for name, p in trainer.runner.model.named_parameters():
        mean = torch.stack([it[name] for it in iterates[4:]]).mean(0)
        torch.testing.assert_close(p.detach(), mean, rtol=1e-5, atol=1e-6, msg=name)
        assert not torch.allclose(p.detach(), iterates[-1][name])  # not the last iterate
    # the last checkpoint holds the average as its model, what rpt eval and export read
    saved = CheckpointStore(str(tmp_path / "r" / "checkpoints")).read_model(
        str(tmp_path / "r" / "checkpoints" / "step_00000008"))
    for name, p in trainer.runner.model.named_parameters():
        assert torch.equal(saved[name], p.detach())


def test_a_resume_inside_the_averaged_stretch_continues_exactly(make_cfg, tmp_path, solo):
    overrides = ("train.max_steps=8", "train.average=0.6", "checkpoint.interval=3", "checkpoint.keep_last=5",
                 "model.dropout=0.1")
    whole = Trainer(make_cfg(*overrides), tmp_path / "whole", solo, show_progress=False)
    whole.run()
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "whole", cut)
    shutil.rmtree(cut / "checkpoints" / "step_00000008")  # as if killed after the checkpoint of step 6
    (cut / "config.toml").write_text((cut / "config.toml").read_text().replace(str(tmp_path / "whole"), str(cut)))
    again = Trainer(make_cfg(*overrides), cut, solo, resume=True, show_progress=False)
    assert again.progress.step == 6 and again.averaging.count == 2  # the average of steps 5 and 6, and their iterate
    again.run()
    assert again.averaging.count == whole.averaging.count == 4
    for (name, a), b in zip(whole.runner.model.named_parameters(), again.runner.model.parameters()):
        assert torch.equal(a, b), name


def test_averaging_is_refused_where_it_cannot_hold(make_cfg):
    with pytest.raises(RptError, match="outside"):
        make_cfg("train.average=1.0")
    with pytest.raises(RptError, match="diloco"):
        make_cfg("train.average=0.3", "comm.mode=diloco", "comm.diloco_steps=2", "train.eval_interval=0")
