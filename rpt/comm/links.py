"""Measured links between ranks, and the alpha-beta cost of each gradient-synchronisation mode.

`measure()` times one link at a time with point-to-point messages (everyone else waits at a
barrier): latency alpha is half the median round trip of a 4-byte message, bandwidth is from the
median of a few `message_mb` sends, each acknowledged (B = bytes / (time - round trip), or bytes / time
where the send does not clearly outlast the round trip: never an impossible figure from a noisy difference). The
table is summed across ranks, so every rank holds the same figures and `fastest()` gives every
rank the same answer (a disagreement would hang the first collective).

A rank's node is torchrun's GROUP_RANK (the node index), else its hostname: pairs on one node
are "intra", the rest "inter". The cost of one step's synchronisation of n gradient bytes on p
ranks, where B_r is rank r's slowest measured link and alpha the slowest latency:

    allreduce   2(p-1) (alpha + n/p / B_ring)               ring; B_ring = slowest link of the ring
    ps          2 (alpha + max((p-1) n / B_s, n / B_w))      every gradient in, every parameter out, via rank 0
    ps-sharded  2 (alpha + max_r (p-1)/p n / B_r)            each rank the server of 1/p of the buckets

B_s is rank 0's link measured as such: every other rank sends to it at once (incast).
(Patarasuk & Yuan's ring bound, and the parameter-server bound of BytePS's analysis.) With equal
links the ring and the sharded server move the same bytes per link, and the ring pays p-1 times
the latency; a central server wins only where its link is much faster than the workers'.

The model explains; `time_modes()` decides. It runs each mode's own traffic pattern once on a
gradient-sized buffer (capped at 8 MB, scaled linearly): on the emulated 4-node cluster the
ring measured 3x its model (four ranks on two cores stall the ring's pipeline) while the central
server matched its model, so a model-only choice picked the slower mode (benchmarks/results/comm.md).
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from dataclasses import dataclass, field
from itertools import combinations

import torch
import torch.distributed as dist

MODES = ("allreduce", "ps", "ps-sharded")


@dataclass
class Topology:
    world_size: int
    nodes: list[str]                     # node name of each rank
    latency: dict[tuple[int, int], float] = field(default_factory=dict)    # seconds, one way
    bandwidth: dict[tuple[int, int], float] = field(default_factory=dict)  # bytes per second
    server_bandwidth: float = 0.0  # rank 0 receiving from every other rank at once (0: not measured)

    def kind(self, i: int, j: int) -> str:
        return "intra" if self.nodes[i] == self.nodes[j] else "inter"

    def link(self, i: int, j: int) -> tuple[float, float]:
        key = (min(i, j), max(i, j))
        if key in self.bandwidth:
            return self.latency[key], self.bandwidth[key]
        return max(self.latency.values()), min(self.rank_bandwidth(i), self.rank_bandwidth(j))

    def rank_bandwidth(self, r: int) -> float:
        """The slowest measured link of rank r (its inter-node links when it has any)."""
        mine = [(k, b) for k, b in self.bandwidth.items() if r in k]
        inter = [b for k, b in mine if self.kind(*k) == "inter"]
        return min(inter or [b for _, b in mine] or [float("inf")])


def node_name() -> str:
    return os.environ.get("GROUP_RANK") or socket.gethostname()


def pairs_to_measure(world_size: int) -> list[tuple[int, int]]:
    """Every pair up to 8 ranks; beyond, the ring's links and rank 0's (what the cost model reads)."""
    if world_size <= 8:
        return list(combinations(range(world_size), 2))
    ring = {(min(r, (r + 1) % world_size), max(r, (r + 1) % world_size)) for r in range(world_size)}
    return sorted(ring | {(0, r) for r in range(1, world_size)})


def bandwidth_of(nbytes: int, sends: list[float], rtt: float) -> float:
    """Bytes per second of a link from acknowledged sends of `nbytes` (seconds each) and its round trip: the
    median send less the round trip, where the send clearly outlasts it; else (a message too small for the
    link, or noise) the median send whole, a lower bound, never a division by a noisy difference."""
    send = statistics.median(sends)
    return nbytes / (send - rtt if send > 2 * rtt else send)


def measure(message_mb: float = 4.0, repeats: int = 5, pings: int = 10) -> Topology:
    rank, p = dist.get_rank(), dist.get_world_size()
    names = [None] * p
    dist.all_gather_object(names, node_name())
    pairs = pairs_to_measure(p)
    table = torch.zeros(len(pairs), 2, dtype=torch.float64)
    one = torch.zeros(1)
    payload = torch.zeros(max(1, int(message_mb * 2**20) // 4))
    for k, (i, j) in enumerate(pairs):
        if rank == i:
            trips = []
            for _ in range(pings):
                t = time.perf_counter()
                dist.send(one, j)
                dist.recv(one, j)
                trips.append(time.perf_counter() - t)
            rtt = statistics.median(trips)
            sends = []
            for _ in range(repeats):
                t = time.perf_counter()
                dist.send(payload, j)
                dist.recv(one, j)
                sends.append(time.perf_counter() - t)
            table[k] = torch.tensor([rtt / 2, bandwidth_of(payload.nbytes, sends, rtt)])
        elif rank == j:
            for _ in range(pings):
                dist.recv(one, i)
                dist.send(one, i)
            for _ in range(repeats):
                dist.recv(payload, i)
                dist.send(one, i)
        dist.barrier()
    incast = torch.zeros(1, dtype=torch.float64)  # every worker sends to rank 0 at once: the server's own link
    receives = []
    for _ in range(repeats):
        dist.barrier()
        t = time.perf_counter()
        if rank == 0:
            parts = [torch.empty_like(payload) for _ in range(p - 1)]
            for w in [dist.irecv(buf, src) for buf, src in zip(parts, range(1, p))]:
                w.wait()
            receives.append(time.perf_counter() - t)
        else:
            dist.send(payload, 0)
    if rank == 0:
        incast[0] = (p - 1) * payload.nbytes / statistics.median(receives)
    dist.all_reduce(table)  # each pair was filled by its first rank only
    dist.all_reduce(incast)
    return Topology(p, names, {pq: float(table[k, 0]) for k, pq in enumerate(pairs)},
                    {pq: float(table[k, 1]) for k, pq in enumerate(pairs)}, float(incast[0]))


def time_modes(grad_bytes: int, cap_mb: float = 8.0, repeats: int = 2) -> dict[str, float]:
    """Each mode's own traffic pattern, run once for real on min(grad_bytes, cap) bytes (best of `repeats`),
    scaled linearly to grad_bytes. The alpha-beta model misses what the machines add (contended cores,
    the backend's chunking, TCP over shaped links); this does not. Every rank returns the same numbers."""
    rank, p = dist.get_rank(), dist.get_world_size()
    probe = max(p, min(int(grad_bytes), int(cap_mb * 2**20)) // 4)
    buf = torch.zeros(probe)
    chunks = list(buf.tensor_split(p))

    def allreduce():
        dist.all_reduce(buf)

    def ps():
        if rank == 0:
            parts = [torch.empty_like(buf) for _ in range(p - 1)]
            for w in [dist.irecv(t, r) for t, r in zip(parts, range(1, p))]:
                w.wait()
            for w in [dist.isend(buf, r) for r in range(1, p)]:
                w.wait()
        else:
            dist.send(buf, 0)
            dist.recv(buf, 0)

    def ps_sharded():
        for direction in (0, 1):  # gradients to the owners, then parameters back
            works, spare = [], [torch.empty_like(chunks[rank]) for _ in range(p)]
            for r in range(p):
                if r == rank:
                    continue
                if direction == 0:
                    works += [dist.isend(chunks[r], r), dist.irecv(spare[r], r)]
                else:
                    works += [dist.isend(chunks[rank], r), dist.irecv(chunks[r], r)]
            for w in works:
                w.wait()

    out = {}
    for mode, run in (("allreduce", allreduce), ("ps", ps), ("ps-sharded", ps_sharded)):
        best = float("inf")
        for _ in range(repeats):
            dist.barrier()
            t = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - t)
        worst = torch.tensor([best], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # a pattern is as slow as its slowest rank
        out[mode] = float(worst) * grad_bytes / (4 * probe)
    return out


def predict(topo: Topology, grad_bytes: int) -> dict[str, float]:
    """Seconds of synchronisation per optimiser step for each mode (see the module docstring)."""
    p, n = topo.world_size, float(grad_bytes)
    if p == 1:
        return {mode: 0.0 for mode in MODES}
    alpha = max(topo.latency.values())
    ring = [topo.link(r, (r + 1) % p) for r in range(p)]
    b_ring = min(b for _, b in ring)
    bw = [topo.rank_bandwidth(r) for r in range(p)]
    server = topo.server_bandwidth or bw[0]
    return {
        "allreduce": 2 * (p - 1) * (max(a for a, _ in ring) + n / p / b_ring),
        "ps": 2 * (alpha + max((p - 1) * n / server, max(n / b for b in bw[1:]))),
        "ps-sharded": 2 * (alpha + max((p - 1) / p * n / b for b in bw)),
    }


def fastest(predictions: dict[str, float]) -> str:
    """The cheapest mode of those predicted; ties go to the order of MODES (all-reduce first: DDP is the
    best-trodden path). Within 5% counts as a tie: the measurements are not finer than that."""
    best = min(predictions.values())
    return next(m for m in MODES if m in predictions and predictions[m] <= 1.05 * best)


def format_table(topo: Topology, predictions: dict[str, float] | None = None, grad_bytes: int = 0,
                 timed: dict[str, float] | None = None) -> str:
    lines = [f"{'pair':>9}  {'link':>5}  {'latency':>10}  {'bandwidth':>14}"]
    for (i, j), lat in sorted(topo.latency.items()):
        lines.append(f"{f'{i}-{j}':>9}  {topo.kind(i, j):>5}  {lat * 1e6:>8.0f}us  "
                     f"{topo.bandwidth[(i, j)] * 8 / 1e6:>9,.0f} Mbit/s")
    if topo.server_bandwidth:
        lines.append(f"{'0 <- all':>9}  {'':>5}  {'':>10}  {topo.server_bandwidth * 8 / 1e6:>9,.0f} Mbit/s  (rank 0's own link)")
    if predictions:
        lines.append("")
        lines.append(f"synchronisation per step for {grad_bytes / 2**20:.1f} MiB of gradients:")
        lines.append(f"  {'mode':<11} {'alpha-beta model':>17} {'pattern timed':>14}")
        best = fastest(timed or predictions)
        for mode in MODES:
            t = f"{timed[mode] * 1e3:11.2f} ms" if timed else f"{'-':>14}"
            lines.append(f"  {mode:<11} {predictions[mode] * 1e3:14.2f} ms {t}"
                         + ("   <- chosen by comm.mode = auto" if mode == best else ""))
    return "\n".join(lines)
