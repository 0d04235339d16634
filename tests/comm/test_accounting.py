"""Communication accounting and the parameter-server bucket plan, without processes."""

from __future__ import annotations

import torch

from rpt.comm.accounting import CommMeter, _union_length, allgather_wire_bytes, allreduce_wire_bytes
from rpt.comm.modes import _assign_owners, _cut


def test_overlapping_transfers_count_once():
    assert _union_length([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (5.5, 5.8)]) == 4.0
    assert _union_length([]) == 0.0


def test_wire_bytes_of_ring_collectives():
    assert allreduce_wire_bytes(1000, 2) == 1000 and allreduce_wire_bytes(1000, 4) == 1500
    assert allgather_wire_bytes(100, 4) == 300 and allreduce_wire_bytes(1000, 1) == 0


def test_meter_reports_a_step_and_starts_the_next():
    m = CommMeter()
    start = m.launched()
    m.completed(start, 0, 10)
    m.completed(m.launched(), 1, 30)
    m.add_exposed(1e9)  # more than the communication itself: capped at it
    step = m.end_step()
    assert step["comm_bytes"] == 40 and step["comm_bytes_by_bucket"] == {0: 10, 1: 30}
    assert step["exposed_comm_seconds"] == step["comm_seconds"] and step["hidden_comm_fraction"] == 0.0
    assert m.end_step()["comm_bytes"] == 0 and m.total_bytes == 40 and m.steps == 2


def test_buckets_are_cut_by_size_and_owned_in_balance():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (100, 100, 300, 50, 50, 400)]
    groups = _cut(params, cap_bytes=4 * 200)
    assert [[p.numel() for p in g] for g in groups] == [[100, 100], [300], [50, 50], [400]]
    assert {b.owner for b in _assign_owners(groups, 4, sharded=False)} == {0}
    owned = _assign_owners(groups, 2, sharded=True)
    load = [sum(b.numel for b in owned if b.owner == r) for r in (0, 1)]
    assert sorted(load) == [500, 500]
