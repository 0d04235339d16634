"""What AllReduceSync checkpoints for its stateful codecs, in a world of one (the resume itself, across real
processes: tests/dist/test_train_processes.py)."""

from __future__ import annotations

import logging

import torch

from rpt.comm.modes import AllReduceSync
from rpt.config import CommConfig


def trained_sync(bucket_mb: float) -> AllReduceSync:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    sync = AllReduceSync(model, CommConfig(compression="topk", topk_fraction=0.1, bucket_mb=bucket_mb), 1,
                         powersgd_start=2, seed=0, example=lambda m: torch.randn(1, 8))
    for _ in range(2):
        sync.module(torch.randn(5, 8)).pow(2).sum().backward()
        sync.wait_gradients()
    return sync


def test_topk_error_buffers_come_back_and_another_bucket_size_starts_afresh(world_of_one, caplog):
    saved = trained_sync(25.0).state_dict()
    errors = saved["hooks"][0]["errors"]
    assert errors and any(e.abs().sum() > 0 for e in errors.values())  # what top-k did not send yet

    same = trained_sync(25.0)
    same.load_state_dict(saved)
    assert same.hooks[0].errors.keys() == errors.keys()
    for k in errors:
        assert torch.equal(same.hooks[0].errors[k], errors[k])

    other = trained_sync(0.0001)  # another layout: the buffers would not fit
    before = dict(other.hooks[0].errors)
    with caplog.at_level(logging.WARNING, logger="rpt.comm"):
        other.load_state_dict(saved)
    assert "start afresh" in caplog.text
    assert other.hooks[0].errors.keys() == before.keys()
    assert all(other.hooks[0].errors[k] is before[k] for k in before)
