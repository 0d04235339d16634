"""Each family's FLOP count (`RecurrentLM.flops_per_token`: the matrix products, forward, x3 for training) against
torch's own counter on the plain-torch form of the same model (benchmarks/quality/flops.py: the step form token
by token, the mlstm's chunkwise form): forward within 5%, and forward + backward within 5% of the training count.
The per-FLOP figures of the quality benchmarks stand on this count."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

SPEC = importlib.util.spec_from_file_location(
    "flops", Path(__file__).resolve().parents[2] / "benchmarks" / "quality" / "flops.py")
flops = importlib.util.module_from_spec(SPEC)
sys.modules["flops"] = flops
SPEC.loader.exec_module(flops)


@pytest.mark.parametrize("family", flops.FAMILIES)
def test_each_familys_count_is_what_torch_counts(family):
    model = flops.model_of(family)
    assert model.flops_per_token(training=False) == pytest.approx(flops.counted(model, backward=False), rel=0.05)
    assert model.flops_per_token() == pytest.approx(flops.counted(flops.model_of(family), backward=True), rel=0.05)


def test_a_block_diagonal_recurrence_counts_its_blocks_where_the_step_form_multiplies_the_whole_matrix():
    """heads > 1 (xLSTM's sLSTM layout): the count is the model's FLOPs, its blocks' products; the step form (and
    the CPU's sequence forms) multiply the dense block-diagonal matrix, zeros included: torch counts exactly the
    off-diagonal blocks more."""
    layers, gates, H, heads = 2, 4, 96, 3
    model = flops.model_of("lstm", d_hidden=H, heads=heads)
    zeros = layers * 2 * gates * H * (H - H // heads)
    assert model.flops_per_token(training=False) + zeros == pytest.approx(flops.counted(model, False), rel=1e-6)


def test_the_two_level_heads_count_is_what_torch_counts_at_its_tail_share():
    model = flops.model_of("lstm", head_shortlist=64)
    x = flops.tokens()
    model.order_head(torch.bincount(x[:, 1:].flatten(), minlength=flops.V).numpy())  # the tail share these have
    h = torch.randn(flops.B, flops.T, 64, requires_grad=True)
    assert model.head.flops_per_token() == pytest.approx(flops.per_token(lambda: model.head.nats(h, x[:, 1:])),
                                                         rel=0.05)


def test_the_training_count_is_three_forwards_once():
    """summary.json's flops_per_token is the training count already: what a benchmark multiplies by tokens, once."""
    model = flops.model_of("lstm")
    assert model.flops_per_token() == 3 * model.flops_per_token(training=False)
