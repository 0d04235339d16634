"""Helpers to build trainers on the small prepared dataset."""

from __future__ import annotations

import pytest

from rpt.config import Config
import torch

from rpt.parallel.launch import Dist


@pytest.fixture
def make_cfg(tiny_data):
    def make(*overrides: str) -> Config:
        base = [f"data.path={tiny_data}", "model.d_model=32", "model.n_layers=2", "train.batch_size=4",
                "train.seq_len=16", "train.max_steps=6", "train.warmup_steps=2", "train.eval_interval=0",
                "train.eval_tokens=2048", "monitor.log_interval=1", "monitor.tensorboard=false"]
        return Config.load(None, base + list(overrides))
    return make


@pytest.fixture
def solo() -> Dist:
    """One process on the CPU: no process group."""
    return Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
