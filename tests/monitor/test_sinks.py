"""TensorBoard event files and the W&B run hold what the store holds; a missing package is refused on every rank."""

from __future__ import annotations

import json

import pytest

from rpt.errors import RptError
from rpt.monitor import sinks
from rpt.monitor.store import MetricsReader
from rpt.train.trainer import Trainer


def test_tensorboard_scalars_equal_the_store(make_cfg, tmp_path, solo):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = make_cfg("train.max_steps=6", "monitor.log_interval=2", "train.eval_interval=3", "monitor.tensorboard=true")
    Trainer(cfg, tmp_path / "r", solo, show_progress=False).run()
    events = EventAccumulator(str(tmp_path / "r" / "tb"))
    events.Reload()
    store = MetricsReader(tmp_path / "r")
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [r["step"] for r in store.rows("train")] == [2, 4, 6]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in store.rows("train")])
    assert [e.value for e in events.Scalars("rank0/compute_s")] == pytest.approx(
        [r["compute_s"] for r in store.rows("ranks")])
    assert [e.step for e in events.Scalars("val/bpb")] == [3, 6]
    final = store.rows("evals")[-1]
    assert events.Scalars("val/bpb_final")[0].value == pytest.approx(final["bpb"])


def test_tensorboard_auto_writes_when_installed_and_is_quiet_when_not(make_cfg, tmp_path, solo, monkeypatch):
    Trainer(make_cfg("train.max_steps=2", "monitor.tensorboard=auto"), tmp_path / "on", solo, show_progress=False).run()
    assert list((tmp_path / "on" / "tb").iterdir())
    monkeypatch.setattr(sinks, "installed", lambda package: False)
    Trainer(make_cfg("train.max_steps=2", "monitor.tensorboard=auto"), tmp_path / "off", solo, show_progress=False).run()
    assert not (tmp_path / "off" / "tb").exists()


@pytest.mark.parametrize("setting, package", [("monitor.tensorboard=true", "tensorboard"),
                                              ("monitor.wandb=true", "wandb")])
def test_an_asked_for_sink_whose_package_is_missing_is_refused(make_cfg, tmp_path, solo, monkeypatch, setting,
                                                                package):
    monkeypatch.setattr(sinks, "installed", lambda name: name != package)
    with pytest.raises(RptError, match=f"needs the {package} package") as info:
        Trainer(make_cfg(setting), tmp_path / "r", solo, show_progress=False)
    assert f"pip install {package}" in info.value.fix
    assert not (tmp_path / "r").exists()  # refused before anything was written


def test_wandb_offline_run_holds_the_stores_figures_and_resume_continues_it(make_cfg, tmp_path, solo, monkeypatch):
    """A real W&B run in offline mode (no network): its record log holds every logged value as W&B's JSON."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "r"
    cfg = make_cfg("train.max_steps=4", "monitor.log_interval=2", "train.eval_interval=4", "monitor.wandb=true",
                   "checkpoint.interval=2")
    Trainer(cfg, run, solo, show_progress=False).run()
    run_id = (run / "wandb_run_id").read_text().strip()
    logs = list((run / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(logs) == 1
    blob = logs[0].read_bytes()
    store = MetricsReader(run)
    for name in ("train/loss", "train/lr", "rank0/compute_s", "val/bpb", "val/bpb_final"):
        assert name.encode() in blob
    for row in store.rows("train"):
        assert json.dumps(row["loss"]).encode() in blob  # the very float the store holds
    assert json.dumps(store.rows("evals")[-1]["bpb"]).encode() in blob
    # resuming the rpt run continues the same W&B run id
    Trainer(make_cfg("train.max_steps=6", "monitor.log_interval=2", "monitor.wandb=true"), run, solo, resume=True,
            show_progress=False).run()
    assert (run / "wandb_run_id").read_text().strip() == run_id
    assert len(list((run / "wandb").glob(f"offline-run-*-{run_id}"))) >= 1
