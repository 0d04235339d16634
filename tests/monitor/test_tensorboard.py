"""TensorBoard event files hold what the store holds."""

from __future__ import annotations

import pytest

from rpt.monitor.store import MetricsReader
from rpt.train.trainer import Trainer


def test_tensorboard_scalars_equal_the_store(make_cfg, tmp_path, solo):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = make_cfg("train.max_steps=6", "monitor.log_interval=2", "train.eval_interval=3", "monitor.tensorboard=true")
    Trainer(cfg, tmp_path / "r", solo, progress=False).run()
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
