"""`rpt train --profile START:END`: each rank's torch.profiler trace of those steps (taken by
rpt/train/step_profiler.py) summarised into compute, communication, their overlap, and idle time.

The traces land in RUN_DIR/traces/rankR.json (Chrome trace format: open in Perfetto or chrome://tracing).
The summary is computed here from the trace events rather than with HTA (Holistic Trace Analysis),
which reads GPU kernel timelines only: a CPU job, and gloo's collectives, would show nothing there.

    wall           the profiled steps (the rpt_step#N spans)
    compute        union of the operators on the training thread (or of the GPU kernels, when there are
                   any), communication operators excluded
    communication  union of the collective and point-to-point events (gloo:*, nccl:*, c10d::*, send/recv,
                   all_reduce, ..., on any thread, or NCCL kernels)
    overlap        time in both; idle = wall - (compute U communication)
"""

from __future__ import annotations

import re

COMM = re.compile(r"gloo|nccl|c10d|record_param_comms|all_?reduce|all_?gather|reduce_?scatter|broadcast|"
                  r"alltoall|barrier|\bsend\b|\brecv\b|isend|irecv|batch_isend_irecv", re.IGNORECASE)


STEP = "rpt_step#"  # the span of each profiled training step in the trace


def parse_range(spec: str) -> tuple[int, int] | None:
    if not spec:
        return None
    first, _, last = spec.partition(":")
    return int(first), int(last or first)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _intersect(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def _clip(intervals, window: list[tuple[float, float]]):
    return _intersect(_union(intervals), window)


def summarize(trace: dict) -> dict:
    """Seconds of wall, compute, communication, overlap and idle over the profiled steps of one rank."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    steps = [e for e in events if str(e.get("name", "")).startswith(STEP)]
    if not steps:
        return {"steps": 0, "wall_s": 0.0, "compute_s": 0.0, "comm_s": 0.0, "overlap_s": 0.0, "idle_s": 0.0}
    window = _union([(e["ts"], e["ts"] + e["dur"]) for e in steps])
    main_tid = steps[0].get("tid")
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if kernels:  # the device timeline is the one that matters on a GPU
        comm = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if COMM.search(e["name"])]
        compute = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if not COMM.search(e["name"])]
    else:
        comm = [(e["ts"], e["ts"] + e["dur"]) for e in events if COMM.search(str(e.get("name", "")))
                and not str(e["name"]).startswith(STEP)]
        ops = [(e["ts"], e["ts"] + e["dur"]) for e in events
               if e.get("cat") == "cpu_op" and e.get("tid") == main_tid and not COMM.search(e["name"])]
        main_comm = _union([(e["ts"], e["ts"] + e["dur"]) for e in events
                            if e.get("tid") == main_tid and COMM.search(str(e.get("name", "")))
                            and not str(e["name"]).startswith(STEP)])
        compute = _subtract(_union(ops), main_comm)  # an operator that only waits for a collective is not compute
    compute, comm = _clip(compute, window), _clip(comm, window)
    both = _intersect(compute, comm)
    wall = _length(window)
    busy = _length(compute) + _length(comm) - _length(both)
    us = 1e-6
    return {"steps": len(steps), "wall_s": wall * us, "compute_s": _length(compute) * us, "comm_s": _length(comm) * us,
            "overlap_s": _length(both) * us, "idle_s": max(0.0, wall - busy) * us}


def _subtract(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """x minus y, both unions (sorted, disjoint): x intersected with the gaps of y."""
    if not x:
        return []
    gaps, start = [], min(x[0][0], y[0][0]) if y else x[0][0]
    for a, b in y:
        if start < a:
            gaps.append((start, a))
        start = max(start, b)
    gaps.append((start, max(x[-1][1], start)))
    return _intersect(x, gaps)
