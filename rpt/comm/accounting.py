"""What the gradient synchronisation cost this step: bytes each rank put on the wire, and time.

Every codec and mode reports each transfer here with the tensor it really handed to the backend.
Wire bytes are what this rank sends for it: a point-to-point send is its size; a ring all-reduce
of n bytes sends 2(p-1)/p n from every rank; a ring all-gather sends (p-1) times the rank's own
part. (gloo and NCCL run rings for large buffers; these are the figures the cost model uses too.)

Time: every transfer has a launch and a completion time; their union is the communication time
of the step. The exposed part is how long the step waited for communication after its backward
computation was done; hidden = 1 - exposed / communication time.

Completion callbacks run on the backend's threads, hence the lock.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict


def allreduce_wire_bytes(nbytes: int, world_size: int) -> int:
    return 2 * (world_size - 1) * nbytes // world_size


def allgather_wire_bytes(own_nbytes: int, world_size: int) -> int:
    return (world_size - 1) * own_nbytes


def fsdp_wire_bytes(param_bytes: int, fsdp: int, replicas: int, grad_accum: int = 1, kept_bytes: int = 0,
                    reshard_microsteps: bool = False) -> dict:
    """What one rank sends a step under FSDP for `param_bytes` of a stage's parameters, counted from the shard
    sizes: all-gathers, (f - 1) / f of the parameters each, before the first forward and before every backward
    (accumulation keeps them gathered from one backward to the next forward), except `kept_bytes` (the last
    block and the root's own, which stay gathered from forward to backward: once a step); one reduce-scatter of
    the gradients; under HSDP an all-reduce of the gradient shards across the replicas. `reshard_microsteps`:
    every micro-step gathers as a whole step does."""
    share = lambda b: b * (fsdp - 1) // fsdp  # noqa: E731
    if reshard_microsteps:
        gathers = grad_accum * (2 * share(param_bytes - kept_bytes) + share(kept_bytes))
    else:
        gathers = share(param_bytes - kept_bytes) * (grad_accum + 1) + share(kept_bytes)
    return {"all_gather": gathers,
            "reduce_scatter": share(param_bytes),
            "replica_all_reduce": allreduce_wire_bytes(param_bytes // fsdp, replicas) if replicas > 1 else 0}


class CommMeter:
    def __init__(self):
        self._lock = threading.Lock()
        self.steps, self.total_bytes, self.total_seconds, self.total_exposed = 0, 0, 0.0, 0.0
        self._begin()

    def _begin(self) -> None:
        self.by_bucket: dict[int, int] = defaultdict(int)
        self.seconds_by_bucket: dict[int, float] = defaultdict(float)  # launch to completion, per bucket
        self.intervals: list[tuple[float, float]] = []
        self.exposed = 0.0
        self.last_launch = 0.0

    def launched(self) -> float:
        """Call as a transfer starts; returns its start time for `completed`."""
        now = time.perf_counter()
        with self._lock:
            self.last_launch = max(self.last_launch, now)
        return now

    def completed(self, start: float, bucket: int, wire_bytes: int) -> None:
        end = time.perf_counter()
        with self._lock:
            self.by_bucket[bucket] += int(wire_bytes)
            self.seconds_by_bucket[bucket] += end - start
            self.intervals.append((start, end))

    def add_exposed(self, seconds: float) -> None:
        with self._lock:
            self.exposed += max(0.0, seconds)

    def end_step(self, count: bool = True) -> dict:
        """The step's figures; starts the next step. `count=False`: transfers after the last step (DiLoCo's
        closing outer step) join the totals without counting as a step."""
        with self._lock:
            comm = _union_length(self.intervals)
            step_bytes = sum(self.by_bucket.values())
            record = {"comm_bytes": step_bytes, "comm_bytes_by_bucket": dict(sorted(self.by_bucket.items())),
                      "comm_seconds_by_bucket": dict(sorted(self.seconds_by_bucket.items())),
                      "comm_seconds": comm, "exposed_comm_seconds": min(self.exposed, comm) if comm else self.exposed,
                      "hidden_comm_fraction": (1.0 - min(self.exposed, comm) / comm) if comm > 0 else None}
            self.steps += count
            self.total_bytes += step_bytes
            self.total_seconds += record["comm_seconds"]
            self.total_exposed += record["exposed_comm_seconds"]
            self._begin()
        return record


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end_so_far = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= end_so_far:
            continue
        total += end - max(start, end_so_far)
        end_so_far = end
    return total
