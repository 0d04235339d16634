"""Step hooks (rpt/train/hooks.py): a run installs only those it asks for, and the loop calls each point in
order, with the step numbers its docstring gives, and goes on with the loss a hook returns."""

from __future__ import annotations

import torch

from rpt.testing.faults import FaultHooks, hooks_from_env
from rpt.train.hooks import StepHooks
from rpt.train.step_profiler import StepProfiler
from rpt.train.trainer import Trainer


class Recorder(StepHooks):
    def __init__(self, scale: float = 1.0):
        self.calls, self.scale = [], scale

    def phase(self, step, name):
        self.calls.append(("phase", step, name))

    def step_begins(self, step):
        self.calls.append(("step_begins", step))

    def in_forward(self, step, loss):
        self.calls.append(("in_forward", step))
        return loss * self.scale

    def step_ends(self, step):
        self.calls.append(("step_ends", step))

    def checkpoint_written(self, step):
        self.calls.append(("checkpoint_written", step))

    def checkpoint_complete(self, step, path):
        self.calls.append(("checkpoint_complete", step, path is not None))

    def run_ends(self):
        self.calls.append(("run_ends",))


def test_a_run_installs_only_the_hooks_it_asks_for(make_cfg, tmp_path, monkeypatch, solo):
    assert Trainer(make_cfg(), tmp_path / "plain", solo, show_progress=False).hooks == []
    monkeypatch.setenv("RPT_FAULT", "nan@2")
    trainer = Trainer(make_cfg("monitor.profile=2:3"), tmp_path / "both", solo, show_progress=False,
                      extra_hooks=hooks_from_env)
    assert [type(h) for h in trainer.hooks] == [FaultHooks, StepProfiler] and trainer.profiler is trainer.hooks[1]


def test_the_loop_calls_each_point_in_order(make_cfg, tmp_path, solo):
    trainer = Trainer(make_cfg("train.max_steps=2", "checkpoint.interval=2"), tmp_path / "r", solo, show_progress=False)
    recorder = Recorder()
    trainer.hooks.append(recorder)
    trainer.run()
    steps = [c for c in recorder.calls if c[0] != "phase"]
    assert steps == [("step_begins", 0), ("in_forward", 0), ("step_ends", 1),
                     ("step_begins", 1), ("in_forward", 1), ("step_ends", 2),
                     ("checkpoint_written", 2), ("checkpoint_complete", 2, True), ("run_ends",)]
    phases = [c[1:] for c in recorder.calls if c[0] == "phase"]
    for phase in ("data", "forward", "backward", "optimizer"):  # a step's phases count as the step being run
        assert (1, phase) in phases and (2, phase) in phases
    assert (2, "checkpoint") in phases  # after step 2
    assert phases.index((1, "forward")) < phases.index((1, "backward")) < phases.index((1, "optimizer"))


def test_the_step_goes_on_with_the_loss_a_hook_returns(make_cfg, tmp_path, solo):
    trainer = Trainer(make_cfg("train.max_steps=2", "train.weight_decay=0"), tmp_path / "r", solo, show_progress=False)
    before = [p.detach().clone() for p in trainer.runner.model.parameters()]
    trainer.hooks.append(Recorder(scale=0.0))  # no gradient: AdamW moves nothing
    trainer.run()
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, trainer.runner.model.parameters()))
