"""PowerSGD on gloo overlaps backward (its rounds run on a worker thread) and learns exactly what the blocking
rounds learned, on 2 real processes."""

from __future__ import annotations

import torch

from comm_workers import powersgd_overlap
from ranks import run_ranks


def test_powersgd_rounds_overlap_backward_and_change_nothing_learned(tmp_path):
    threaded = run_ranks(powersgd_overlap, 2, tmp_path / "threaded", False, 5)
    blocking = run_ranks(powersgd_overlap, 2, tmp_path / "blocking", True, 5)
    for rank in range(2):
        for a, b in zip(threaded[rank]["params"], blocking[rank]["params"]):
            assert torch.equal(a, b)
        steps = threaded[rank]["overlapped"]
        assert all(s["buckets"] >= 3 for s in steps), steps  # DDP's re-cut layout: 1 MiB first (torch's), then 0.3 MB
        # backward went on while the rounds were under way: each round, held until backward had computed the
        # first layer's gradient, saw it (events, not wall-clock intervals: beside a busy core the round's thread
        # may not be scheduled until backward has ended, which says nothing of whether backward waited for it)
        assert all(s["gates_opened"] == s["buckets"] for s in steps), steps
        # a blocking round holds backward up: no gradient is computed while one is under way
        assert all(s["computed_during_a_round"] == 0 for s in blocking[rank]["overlapped"])
    assert torch.equal(threaded[0]["params"][0], threaded[1]["params"][0])  # replicas agree
