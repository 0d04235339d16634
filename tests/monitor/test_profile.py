"""The timeline summary of a profiled rank, on a trace whose answer is known."""

from __future__ import annotations

import pytest

from rpt.monitor.profile import STEP, summarize


def _x(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "cat": cat}


def test_compute_communication_overlap_and_idle_partition_the_step():
    trace = {"traceEvents": [
        _x(f"{STEP}1", 0, 100, cat="user_annotation"),
        _x("aten::mm", 0, 30), _x("aten::addmm", 10, 10),           # nested: compute 0-30
        _x("c10d::allreduce_", 30, 5),                             # the main thread launching: not compute
        _x("aten::mm", 40, 30),                                    # compute 40-70
        _x("gloo:all_reduce", 35, 50, tid=9, cat="user_annotation"),  # on a gloo thread: 35-85
        _x("aten::mm", 120, 10),                                   # outside the step: ignored
    ]}
    s = summarize(trace)
    assert s["steps"] == 1
    assert s["wall_s"] == pytest.approx(100e-6)
    assert s["compute_s"] == pytest.approx(60e-6)
    assert s["comm_s"] == pytest.approx(55e-6)      # 30-35 on the main thread and 35-85 on the gloo thread
    assert s["overlap_s"] == pytest.approx(30e-6)   # 40-70
    assert s["idle_s"] == pytest.approx(15e-6)      # 85-100
    assert s["compute_s"] + s["comm_s"] - s["overlap_s"] + s["idle_s"] == pytest.approx(s["wall_s"])


def test_gpu_kernels_make_the_timeline_when_present():
    trace = {"traceEvents": [
        _x(f"{STEP}1", 0, 100, cat="user_annotation"),
        _x("aten::mm", 0, 100),                                       # the CPU is busy launching: not the timeline
        _x("ampere_sgemm_128x64", 10, 40, tid=7, cat="kernel"),
        _x("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 30, 40, tid=8, cat="kernel"),
    ]}
    s = summarize(trace)
    assert (s["compute_s"], s["comm_s"], s["overlap_s"]) == pytest.approx((40e-6, 40e-6, 20e-6))
    assert s["idle_s"] == pytest.approx(40e-6)
