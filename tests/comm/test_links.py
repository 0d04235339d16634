"""The cost model and the choice of mode, on given link tables (no processes)."""

from __future__ import annotations

import pytest

from rpt.comm.links import Topology, fastest, pairs_to_measure, predict

MB = 2**20


def uniform(p: int, bw: float, lat: float = 1e-4, nodes=None) -> Topology:
    pairs = pairs_to_measure(p)
    return Topology(p, nodes or [str(r) for r in range(p)], {k: lat for k in pairs}, {k: bw for k in pairs})


def test_equal_links_follow_the_textbook_formulas():
    p, n, bw, lat = 4, 100 * MB, 1e9, 1e-4
    got = predict(uniform(p, bw, lat), n)
    assert got["allreduce"] == pytest.approx(2 * (p - 1) * lat + 2 * (p - 1) / p * n / bw)
    assert got["ps-sharded"] == pytest.approx(2 * lat + 2 * (p - 1) / p * n / bw)
    assert got["ps"] == pytest.approx(2 * lat + 2 * (p - 1) * n / bw)
    assert fastest(got) == "allreduce"  # equal bandwidth terms within 5%: the tie goes to DDP


def test_latency_bound_small_gradients_favour_the_sharded_server():
    got = predict(uniform(8, 1e9, lat=5e-3), 64 * 1024)
    assert fastest(got) == "ps-sharded"  # 2 latencies instead of 2(p-1)


def test_a_central_server_at_best_ties_the_ring_even_on_a_much_faster_link():
    # the server's link 100x the workers': every worker still sends n and receives n through its own
    # link, while the ring moves 2(p-1)/p n per link (BytePS's argument, ANCHORS.md)
    n, bw = 100 * MB, 1e8
    for p in (2, 4, 16):
        topo = uniform(p, bw)
        topo.server_bandwidth = 100 * bw
        got = predict(topo, n)
        assert got["ps"] == pytest.approx(2 * 1e-4 + 2 * n / bw)
        assert got["ps"] >= got["allreduce"]
        topo.server_bandwidth = bw  # a server no faster than a worker is (p-1) times worse
        assert predict(topo, n)["ps"] == pytest.approx(2 * 1e-4 + 2 * (p - 1) * n / bw)


def test_a_slow_link_bounds_every_mode_that_crosses_it():
    p = 4
    fast, slow = uniform(p, 1e9), uniform(p, 1e9)
    slow.bandwidth = {k: (1e8 if 3 in k else 1e9) for k in slow.bandwidth}
    a, b = predict(fast, 50 * MB), predict(slow, 50 * MB)
    assert all(b[m] > 5 * a[m] for m in a)


def test_large_worlds_measure_only_the_links_the_model_reads():
    assert len(pairs_to_measure(8)) == 28
    pairs = pairs_to_measure(4096)
    assert len(pairs) < 2 * 4096 and (0, 4095) in pairs and (100, 101) in pairs
