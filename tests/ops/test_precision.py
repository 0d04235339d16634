"""Mixed precision on the CPU: under bf16 autocast (train.precision = "bf16") oneDNN's LSTM runs its products in
bf16, its carried state kept in float32; the other recurrences run in float32 inside the autocast region."""

from __future__ import annotations

import pytest
import torch

from rpt.config import ModelConfig
from rpt.models.decoder import Decoder
from rpt.models.lm import build_cell


def cell_of(name: str, **more):
    torch.manual_seed(0)
    return build_cell(ModelConfig(cell=name, d_model=64, **more))


def test_the_lstm_runs_in_bf16_under_cpu_autocast_and_carries_its_state_in_float32():
    cell = cell_of("lstm")
    x = torch.randn(4, 48, 64)
    reset = torch.zeros(4, 48, dtype=torch.bool)
    reset[1, 20] = True  # a document starts mid-window in one row
    y32, state32 = cell(x, None, reset)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y16, state16 = cell(x, None, reset)
    assert y16.dtype == torch.bfloat16 and all(s.dtype == torch.float32 for s in state16)
    assert (y16.float() - y32).abs().max() < 0.05  # bf16's 8 bits of mantissa, over 48 steps
    assert all((a - b).abs().max() < 0.05 for a, b in zip(state16, state32))
    y16.float().pow(2).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in cell.parameters())


@pytest.mark.parametrize("name", ["gru", "modlstm", "mingru"])
def test_the_other_recurrences_stay_in_float32_under_cpu_autocast(name):
    cell = cell_of(name)
    x = torch.randn(2, 16, 64)
    y32, _ = cell(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y16, state = cell(x)
    assert all(s.dtype == torch.float32 for s in state)
    assert (y16.float() - y32).abs().max() < 0.05  # the projections around them in bf16 only


def test_a_run_resumes_across_precisions_and_its_model_generates_in_float32(make_cfg, tmp_path, solo):
    from rpt.train.run_dir import load_run
    from rpt.train.trainer import Trainer

    run = tmp_path / "run"
    Trainer(make_cfg("checkpoint.interval=3", "train.max_steps=3"), run, solo, show_progress=False).run()
    resumed = Trainer(make_cfg("checkpoint.interval=3", "train.max_steps=6", "train.precision=bf16"), run, solo,
                      resume=True, show_progress=False)
    assert resumed.progress.step == 3 and all(s.dtype == torch.float32 for s in torch.utils._pytree.tree_leaves(
        resumed.progress.state) if isinstance(s, torch.Tensor))
    summary = resumed.run()
    assert summary["steps"] == 6 and summary["precision"] == "bf16" and summary["val_loss"] < 20
    _, model, *_ = load_run(run, "latest", "cpu")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    tokens = list(Decoder(model).generate(torch.tensor([0]), 4, temperature=0.0))
    assert len(tokens) == 4
