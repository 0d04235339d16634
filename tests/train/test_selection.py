"""Selection by validation: the run ends with the weights of its best periodic validation (final evaluation,
summary, the checkpoint `best`), and stops early once none improved for `train.early_stop` of its budget."""

from __future__ import annotations

import itertools

import pytest

import rpt.train.evaluate as evaluate_module
from rpt.train.checkpoint.store import CheckpointStore
from rpt.parallel.fsdp import param_digest
from rpt.train.trainer import Trainer


@pytest.fixture
def scripted(monkeypatch):
    """Periodic validations return the losses of a script (the model is still evaluated, so its weights are
    what each call sees); returns the (max_tokens, weights digest) of every call."""
    calls, real = [], evaluate_module.evaluate

    def install(losses):
        curve = iter(losses)

        def evaluate(model, *args, max_tokens=0, **kwargs):
            result = real(model, *args, max_tokens=max_tokens, **kwargs)
            calls.append((max_tokens, param_digest(model)))
            return {**result, "loss": next(curve)} if max_tokens else result

        monkeypatch.setattr(evaluate_module, "evaluate", evaluate)
        return calls
    return install


def test_a_validation_that_stops_improving_ends_the_run_with_the_best_weights(make_cfg, tmp_path, solo, scripted):
    calls = scripted(itertools.chain([5.0, 4.0, 3.0], itertools.repeat(3.5)))  # best: the third, at step 6
    cfg = make_cfg("train.max_steps=20", "train.eval_interval=2", "train.early_stop=0.2")
    trainer = Trainer(cfg, tmp_path / "r", solo, show_progress=False)
    summary = trainer.run()
    # the best was measured after step 6 (5 of 20 steps spent when it began); the validation after step 10 is the
    # first 0.2 of the budget later, and finds nothing better: the run stops there
    assert summary["steps"] == 10 and "train.early_stop" in summary["ended_by"]
    assert summary["selected_step"] == 6 and summary["best_periodic_val_loss"] == 3.0
    periodic = [digest for tokens, digest in calls if tokens]
    final = [digest for tokens, digest in calls if not tokens]
    assert len(periodic) == 5  # steps 2, 4, 6, 8, 10
    assert final == [periodic[2]] and periodic[2] != periodic[-1]  # the final evaluation saw step 6's weights
    store = CheckpointStore(str(trainer.run_dir / "checkpoints"))
    best = store.best()
    assert best.endswith("step_00000006") and store.latest().endswith("step_00000010")
    loaded = Trainer(make_cfg("train.max_steps=20"), tmp_path / "other", solo, show_progress=False).runner.model
    store.load(best, loaded)
    assert param_digest(loaded) == periodic[2]
    assert 0 < summary["eval_share"] < 1 and summary["eval_seconds"] > 0


def test_told_not_to_the_run_goes_to_its_budget_and_ends_with_its_last_weights(make_cfg, tmp_path, solo, scripted):
    calls = scripted(itertools.chain([5.0, 4.0, 3.0], itertools.repeat(3.5)))
    cfg = make_cfg("train.max_steps=12", "train.eval_interval=2", "train.early_stop=0", "train.select_best=false")
    summary = Trainer(cfg, tmp_path / "r", solo, show_progress=False).run()
    assert summary["steps"] == 12 and summary["ended_by"] == "train.max_steps = 12"
    assert summary["selected_step"] == 12
    periodic = [digest for tokens, digest in calls if tokens]
    assert [digest for tokens, digest in calls if not tokens] == [periodic[-1]]


def test_early_stop_is_a_share_of_the_budget(make_cfg):
    from rpt.errors import RptError

    with pytest.raises(RptError, match="train.early_stop = 1.5 is outside"):
        make_cfg("train.early_stop=1.5")


def test_early_stop_waits_for_a_validation_that_share_of_the_budget_after_the_best():
    from contextlib import nullcontext
    from types import SimpleNamespace

    import numpy as np

    from rpt.train.evaluate import Evaluation

    cfg = SimpleNamespace(eval_interval=1, eval_tokens=1, select_best=False, early_stop=0.25, seq_len=1,
                          loop_ignored_after=0.25, min_val_tokens=0)
    ev = Evaluation(cfg, SimpleNamespace(eot_id=0, tokens=lambda split: np.zeros(2)), np.zeros(1), "cpu", 0, 1, False,
                    nullcontext)
    for step, (loss, progress) in enumerate([(3.0, 0.1), (2.0, 0.2), (2.5, 0.3), (2.4, 0.44)]):
        ev.last = {"loss": loss, "tokens": 1, "step": step}
        ev.keep_if_best(lambda: None, progress)
        assert ev.stale is None, step  # the best (step 1) is less than 0.25 of the budget behind
    ev.last = {"loss": 2.1, "tokens": 1, "step": 4}
    ev.keep_if_best(lambda: None, 0.45)
    assert "the best at step 1" in ev.stale
    ev.last = {"loss": 1.9, "tokens": 1, "step": 5}  # a better one later: no stop
    ev.keep_if_best(lambda: None, 0.5)
    assert ev.stale is None and ev.best["step"] == 5
