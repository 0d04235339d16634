"""DiLoCo (rpt/comm/diloco.py) on real gloo process groups: the outer step's identities, its payloads' bytes.

The exact resume mid-way through an inner phase, through `rpt train --nproc 2`: test_train_processes.py.
"""

from __future__ import annotations

import pytest

from diloco_workers import averaging_identity, one_rank_equals_inner, payload
from ranks import run_ranks
from rpt.comm.accounting import allgather_wire_bytes, allreduce_wire_bytes


@pytest.mark.parametrize("world_size", [2, 3])
def test_one_local_step_then_an_outer_step_of_rate_one_is_averaging_the_replicas(tmp_path, world_size):
    results = run_ranks(averaging_identity, world_size, tmp_path, 4)
    for r in results:
        assert r["apart"] > 1e-3  # the local steps really moved the replicas apart
        assert r["worst"] < 1e-14  # float64: the mean up to rounding


def test_with_one_rank_the_outer_steps_leave_the_inner_optimiser_alone(tmp_path):
    [r] = run_ranks(one_rank_equals_inner, 1, tmp_path, 7, 3)  # two outer steps and a last partial phase
    assert r["moved"] > 1e-3 and r["worst"] < 1e-14


@pytest.mark.parametrize("compression,width", [("none", 4), ("bf16", 2), ("int8", 1)])
def test_outer_payloads_are_counted_exactly_and_average_within_their_width(tmp_path, compression, width):
    world = 2
    results = run_ranks(payload, world, tmp_path, compression)
    numel, tensors = results[0]["numel"], results[0]["tensors"]
    expected = (allgather_wire_bytes(numel + 4 * tensors, world) if compression == "int8" else
                allreduce_wire_bytes(width * numel, world))
    assert [r["bytes"] for r in results] == [expected] * world
    change = max(r["change"] for r in results)  # the largest entry of the updates being averaged
    bound = {"none": 1e-6, "bf16": 2 ** -8, "int8": 1 / 127}[compression] * change + 1e-7
    assert all(r["error"] <= bound for r in results), [r["error"] for r in results]
