"""Gate saturation telemetry: near zero at initialisation, and it sees a gate forced into its tail."""

from __future__ import annotations

import pytest
import torch

from rpt.config import ModelConfig
from rpt.models import RecurrentLM
from rpt.monitor.metrics import InputProbe, gate_saturation


@pytest.mark.parametrize("cell", ["lstm", "gru", "modlstm", "mingru", "minlstm", "mlstm", "gdn"])
def test_fresh_cells_have_few_saturated_gates(cell):
    torch.manual_seed(0)
    model = RecurrentLM(ModelConfig(cell=cell, n_layers=2, d_model=32, vocab_size=50))
    shares = gate_saturation(model, torch.randint(0, 50, (2, 8)), model.init_state(2), 2)
    assert all(0.0 <= s < 0.05 for s in shares), shares


def test_a_forget_gate_pinned_open_shows_as_saturated_in_its_layer_only():
    torch.manual_seed(0)
    model = RecurrentLM(ModelConfig(cell="lstm", n_layers=2, d_model=32, vocab_size=50))
    cell = model.blocks["1"].cell
    H = cell.w_hh.shape[1]
    with torch.no_grad():
        cell.b_ih[H:2 * H] = 30.0  # sigmoid(f) = 1: one of the five gate outputs (i, f, o, tanh g, tanh c)
    first, second = gate_saturation(model, torch.randint(0, 50, (2, 8)), model.init_state(2), 2)
    assert first < 0.05 and second == pytest.approx(0.2, abs=0.02)


def test_the_probe_takes_one_input_after_arming_and_leaves_no_hook():
    model = RecurrentLM(ModelConfig(cell="lstm", n_layers=1, d_model=16, vocab_size=50))
    probe = InputProbe([model], tokens=4)
    first, second = torch.randint(0, 50, (2, 8)), torch.randint(0, 50, (2, 8))
    model(first)
    assert probe.inputs == [None] and not model._forward_pre_hooks  # not armed: nothing taken, no hook run
    probe.arm()
    model(first)
    model(second)
    assert torch.equal(probe.inputs[0], first[:1, :4]) and not model._forward_pre_hooks  # the armed step's only
