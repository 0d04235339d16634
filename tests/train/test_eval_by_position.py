"""Validation by position in the documents (rpt eval --by-position, train.eval_by_position): positions count from
each document's start across windows, unknown before a stream's first start; the bins' sums are the whole's."""

from __future__ import annotations

import math

import numpy as np
import torch

from rpt.config import ModelConfig
from rpt.models.lm import RecurrentLM
from rpt.train.evaluate import POSITION_EDGES, evaluate, positions


def test_positions_count_from_each_document_start():
    x = torch.tensor([[5, 0, 7, 8, 0, 9], [1, 2, 3, 4, 5, 6]])
    got = positions(x, 0, torch.tensor([-2 ** 40, 10]))
    assert got[0, 1:].tolist() == [1, 2, 3, 1, 2] and got[0, 0] < 1  # before the first start: unknown
    assert got[1].tolist() == [11, 12, 13, 14, 15, 16]  # no start in the window: carried on
    assert positions(x, None, torch.tensor([0, 3]))[1].tolist() == [4, 5, 6, 7, 8, 9]


def test_the_bins_add_up_to_the_whole_validation():
    torch.manual_seed(0)
    model = RecurrentLM(ModelConfig(cell="mingru", n_layers=1, d_model=16, vocab_size=30)).double()
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 30, 6000)
    tokens[rng.integers(0, 6000, 4)] = 0  # a few documents, one of them longer than 1,024 tokens
    byte_lengths = rng.integers(1, 5, 30)
    byte_lengths[0] = 0
    for eot in (None, 0):
        r = evaluate(model, tokens, byte_lengths, batch_size=2, seq_len=100, device=torch.device("cpu"),
                     eot_id=eot, by_position=True)
        bins = r["by_position"]
        assert [b["from"] for b in bins] == [1, 65, 257, 1025, 4097] and len(bins) == len(POSITION_EDGES) + 1
        counted = sum(b["tokens"] for b in bins)
        assert counted == r["tokens"] if eot is None else 0 < counted < r["tokens"]
        assert bins[2]["tokens"] > 0  # positions past 256: carried across the 100-token windows
        if eot is None:  # every token in a bin: the bins' nats make the whole's
            nats = sum(b["bpb"] * math.log(2) * b["bytes"] for b in bins if b["tokens"])
            assert abs(nats - r["loss"] * r["tokens"]) < 1e-6 * r["loss"] * r["tokens"]

