"""Model FLOP utilisation: the device's matrix-product peak per precision, measured once and cached
(rpt/runtime/peak.py), and the run's training FLOPs a second over it in summary.json and the progress line."""

from __future__ import annotations

import json

import pytest
import torch

from rpt.runtime import peak
from rpt.train.telemetry import progress_line


def test_the_peak_is_measured_once_per_precision_and_read_back_after(tmp_path, monkeypatch):
    monkeypatch.setenv("RPT_PEAK_CACHE", str(tmp_path / "peak.json"))
    measured = []
    monkeypatch.setattr(peak, "measure", lambda device, dtype: measured.append(dtype) or 1e11 * (1 + len(measured)))
    cpu = torch.device("cpu")
    assert peak.peak_flops(cpu, "fp32") == 2e11 and peak.peak_flops(cpu, "bf16") == 3e11
    assert peak.peak_flops(cpu, "fp32") == 2e11 and measured == [torch.float32, torch.bfloat16]  # cached
    kept = json.loads((tmp_path / "peak.json").read_text())
    assert sorted(kept.values()) == [2e11, 3e11] and all("threads" in k and "torch" in k for k in kept)


def test_a_real_measure_is_a_plausible_rate():
    rate = peak.measure(torch.device("cpu"), torch.float32, repeats=1)
    assert 1e8 < rate < 1e14


def test_the_summary_and_the_progress_line_give_the_runs_mfu(make_cfg, tmp_path, solo):
    from rpt.train.trainer import Trainer

    trainer = Trainer(make_cfg(), tmp_path / "run", solo, show_progress=False)
    summary = trainer.run()
    assert summary["peak_flops_per_device"] == trainer.peak > 0
    assert summary["mfu"] == pytest.approx(summary["flops_per_token"] * summary["tokens_per_second"] /
                                           summary["peak_flops_per_device"], rel=1e-9)
    assert 0 < summary["mfu"] < 1
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < r["mfu"] < 1 for r in logged if r["kind"] == "train")
    where = {"step": 5, "max_steps": 10, "spent": 0.5, "budget": "train.max_steps", "eta_s": 3.0}
    assert "MFU 12.5%" in progress_line(where, 2.0, 1e-3, 1000.0, 0.0, 0.125)
