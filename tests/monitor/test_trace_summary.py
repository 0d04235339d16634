"""The timeline summary of a profiled rank, on a trace whose answer is known."""

from __future__ import annotations

from pathlib import Path

import pytest

from rpt.monitor.trace_summary import STEP, summarize


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


def test_trace_top_sums_each_kernel_and_the_gpu_busy_time_over_the_profiled_steps():
    """tools/trace_top.py on a synthetic trace: kernels summed by name, largest first, their shares of the
    busy time, which is the union of overlapping kernels (not their sum)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "trace_top", Path(__file__).resolve().parents[2] / "tools" / "trace_top.py")
    trace_top = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trace_top)
    step = lambda n, ts: {"ph": "X", "name": f"{STEP}{n}", "ts": ts, "dur": 1000, "cat": "annotation"}  # noqa: E731
    kernel = lambda name, ts, dur: {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": "kernel"}  # noqa: E731
    trace = {"traceEvents": [step(1, 0), step(2, 1000), kernel("gemm", 100, 300), kernel("scan", 300, 200),
                             kernel("gemm", 1100, 300), kernel("cpu_op_not_a_kernel", 0, 50) | {"cat": "cpu_op"}]}
    lines = trace_top.top_kernels(trace, top=5)
    assert lines[0].startswith("2 profiled steps: wall 2.0 ms, GPU busy 0.7 ms (35%), 3 kernels")  # 100-500, 1100-1400
    assert lines[3] == "| gemm | 0.60 | 2 | 85.7% |" and lines[4] == "| scan | 0.20 | 1 | 28.6% |"
    no_kernels = trace_top.top_kernels({"traceEvents": [step(1, 0)]}, 5)
    assert no_kernels == ["no profiled steps or no GPU kernels in this trace"]
