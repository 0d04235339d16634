"""The communication modes and codecs in a real 2-process gloo group, through the trainer.

Without compression every mode must train as plain DDP does (within float rounding), keep the
replicas identical and hold optimiser state where the mode says; codecs must send the bytes
they claim and still train.
"""

from __future__ import annotations

import pytest
import torch

from comm_workers import build_auto_with_timings, train_variants
from ranks import run_ranks

MODES = [("allreduce", []), ("ps", ["comm.mode=ps"]), ("ps-sharded", ["comm.mode=ps-sharded"])]
ACCUM = [("allreduce-accum", ["train.grad_accum=2"]), ("ps-sharded-accum", ["comm.mode=ps-sharded", "train.grad_accum=2"])]
CODECS = [("fp16", ["comm.compression=fp16"]), ("bf16", ["comm.compression=bf16"]),
          ("ps-bf16", ["comm.mode=ps-sharded", "comm.compression=bf16"]),
          ("topk", ["comm.compression=topk", "comm.topk_fraction=0.1"]),
          ("powersgd", ["comm.compression=powersgd", "comm.powersgd_rank=2"])]

TIMED = [("timed", ["train.max_steps=0", "train.max_time=2"])]  # the learning rate follows rank 0's clock
ADAPTIVE = [("adaptive", ["comm.adaptive=true", "comm.adaptive_interval=2", "comm.adaptive_period=3",
                          "comm.adaptive_keep=0.3", "train.max_steps=9"])]
AUTO = [("auto", ["comm.mode=auto"]), ("auto-topk", ["comm.mode=auto", "comm.compression=topk"])]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_data):
    out = tmp_path_factory.mktemp("comm")
    return run_ranks(train_variants, 2, out, str(tiny_data), str(out), MODES + ACCUM + CODECS + TIMED + AUTO + ADAPTIVE, timeout=280)


def test_every_mode_trains_as_ddp_does_and_keeps_replicas_identical(runs):
    base = runs[0]["allreduce"]["params"]
    for name, _ in MODES:
        r0, r1 = runs[0][name]["params"], runs[1][name]["params"]
        for key in base:
            assert torch.equal(r0[key], r1[key]), f"{name}: replicas differ at {key}"
            assert torch.allclose(r0[key], base[key], rtol=1e-4, atol=1e-5), f"{name}: {key} differs from DDP"
        losses = [runs[0][name]["losses"][s]["loss"] for s in range(1, 7)]
        expected = [runs[0]["allreduce"]["losses"][s]["loss"] for s in range(1, 7)]
        assert losses == pytest.approx(expected, rel=1e-5)


def test_gradient_accumulation_sends_once_per_step_in_every_mode(runs):
    base, ps = runs[0]["allreduce-accum"], runs[0]["ps-sharded-accum"]
    for key in base["params"]:
        assert torch.allclose(ps["params"][key], base["params"][key], rtol=1e-4, atol=1e-5), key
    # the inner micro-step sends nothing: the same bytes per optimiser step as without accumulation
    assert ps["summary"]["comm_bytes_per_step_by_rank"] == runs[0]["ps-sharded"]["summary"]["comm_bytes_per_step_by_rank"]
    assert base["summary"]["comm_bytes_per_step"] == runs[0]["allreduce"]["summary"]["comm_bytes_per_step"]


def test_optimiser_state_lives_where_the_mode_puts_it(runs):
    full = runs[0]["allreduce"]["optim_numel"]
    assert full > 0 and runs[1]["allreduce"]["optim_numel"] == full  # replicated under all-reduce
    assert runs[0]["ps"]["optim_numel"] == full and runs[1]["ps"]["optim_numel"] == 0  # only the server
    shards = [runs[r]["ps-sharded"]["optim_numel"] for r in (0, 1)]
    assert sum(shards) == full and min(shards) > 0  # partitioned, nothing twice
    params = sum(p.numel() for p in runs[0]["allreduce"]["params"].values())
    assert sum(runs[r]["ps-sharded"]["owned"] for r in (0, 1)) == params


def test_bytes_on_the_wire_follow_the_mode_and_codec(runs):
    s = {name: runs[0][name]["summary"] for name in runs[0]}
    grad_bytes = 4 * s["allreduce"]["params"]
    # ring all-reduce with 2 ranks: each sends 2(p-1)/p = 1 x the gradient bytes per step
    assert s["allreduce"]["comm_bytes_per_step"] == grad_bytes
    assert s["fp16"]["comm_bytes_per_step"] == s["bf16"]["comm_bytes_per_step"] == grad_bytes // 2
    # ps: the worker sends its gradients, the server sends the parameters back: one gradient's worth each
    assert s["ps"]["comm_bytes_per_step_by_rank"] == [grad_bytes, grad_bytes]
    assert sum(s["ps-sharded"]["comm_bytes_per_step_by_rank"]) == 2 * grad_bytes
    by_rank = s["ps-bf16"]["comm_bytes_per_step_by_rank"]
    assert sum(by_rank) == pytest.approx(1.5 * grad_bytes)  # bf16 gradients out, fp32 parameters back
    assert 0 < s["topk"]["comm_bytes_per_step"] < 0.25 * grad_bytes  # 10% of entries, value + index each
    assert 0 < s["powersgd"]["comm_bytes_per_step"] < grad_bytes  # plain all-reduce until warm-up ends
    for name in s:
        assert s[name]["exposed_comm_fraction"] is not None and 0.0 <= s[name]["exposed_comm_fraction"] <= 1.0


def test_compressed_training_still_learns_and_stays_in_sync(runs):
    for name, _ in CODECS:
        r0, r1 = runs[0][name]["params"], runs[1][name]["params"]
        assert all(torch.equal(r0[k], r1[k]) for k in r0), f"{name}: replicas differ"
        losses = runs[0][name]["losses"]
        assert losses[6]["loss"] < losses[1]["loss"], name
        assert "comm_bytes_by_bucket" in losses[6] and losses[6]["comm_bytes_by_bucket"]


def test_a_time_budget_ends_every_rank_at_the_same_step_with_identical_replicas(runs):
    steps = [runs[r]["timed"]["summary"]["steps"] for r in (0, 1)]
    assert steps[0] == steps[1] > 6
    r0, r1 = runs[0]["timed"]["params"], runs[1]["timed"]["params"]
    assert all(torch.equal(r0[k], r1[k]) for k in r0)  # each rank's own clock would give each its own lr


def test_auto_measures_and_every_rank_takes_the_same_mode(runs):
    from rpt.comm.links import fastest

    for name in ("auto", "auto-topk"):
        s0, s1 = runs[0][name]["summary"], runs[1][name]["summary"]
        assert s0["comm_mode"] == s1["comm_mode"] and s0["comm_auto"] == s1["comm_auto"]
        for kind in ("model", "timed"):
            assert set(s0["comm_auto"][kind]) == {"allreduce", "ps", "ps-sharded"}
            assert all(t > 0 for t in s0["comm_auto"][kind].values())
        r0, r1 = runs[0][name]["params"], runs[1][name]["params"]
        assert all(torch.equal(r0[k], r1[k]) for k in r0)
    auto = runs[0]["auto"]["summary"]
    if auto["compression"] == "none":  # loopback: a half-width codec saves less than its threshold here
        assert auto["comm_mode"] == fastest(auto["comm_auto"]["timed"])
    assert runs[0]["auto-topk"]["summary"]["comm_mode"] == "allreduce"  # the servers do not take topk
    # two ranks on one machine: in the model the ring and the sharded server tie, a central server costs twice
    model = runs[0]["auto"]["summary"]["comm_auto"]["model"]
    assert model["ps"] > model["allreduce"]


def test_adaptive_sync_sends_less_keeps_replicas_identical_and_shows_its_schedule(runs):
    r0, r1 = runs[0]["adaptive"]["params"], runs[1]["adaptive"]["params"]
    assert all(torch.equal(r0[k], r1[k]) for k in r0)  # minor groups wait on every rank alike
    records = runs[0]["adaptive"]["losses"]
    full = 4 * runs[0]["adaptive"]["summary"]["params"]
    assert [records[s]["comm_bytes_per_step"] for s in (1, 2)] == [full, full]  # all sync until the first ranking
    later = [records[s]["comm_bytes_per_step"] for s in range(3, 10)]
    assert max(later) <= full and min(later) < 0.9 * full  # minor groups skipped their turn
    minor = records[9]["adaptive_minor"]
    assert minor and not any(g.startswith(("embed", "head")) for g in minor)  # pinned groups stay important
    assert records[9]["loss"] < records[1]["loss"]


def test_auto_builds_the_mode_it_chose(tmp_path):
    sharded = run_ranks(build_auto_with_timings, 2, tmp_path / "s", {"allreduce": 2.0, "ps": 3.0, "ps-sharded": 1.0})
    assert [r["mode"] for r in sharded] == ["ps-sharded"] * 2
    assert all(0 < r["owned"] < r["total"] for r in sharded) and sum(r["owned"] for r in sharded) == sharded[0]["total"]
    central = run_ranks(build_auto_with_timings, 2, tmp_path / "c", {"allreduce": 2.0, "ps": 1.0, "ps-sharded": 3.0})
    assert [r["owned"] for r in central] == [central[0]["total"], 0]
    # seconds a step: a half-width codec pays, and the servers send only their gradients at half width
    assert {(r["mode"], r["compression"], r["wire"]) for r in sharded + central} == {
        ("ps-sharded", "bf16", "torch.bfloat16"), ("ps", "bf16", "torch.bfloat16")}
    ring = run_ranks(build_auto_with_timings, 2, tmp_path / "r", {"allreduce": 1.4, "ps": 1.0, "ps-sharded": 1.2})
    assert [(r["mode"], r["compression"]) for r in ring] == [("allreduce", "bf16")] * 2  # 0.70 s against ps' 0.75
    fast = run_ranks(build_auto_with_timings, 2, tmp_path / "f", {"allreduce": 0.004, "ps": 0.002, "ps-sharded": 0.003})
    assert [(r["mode"], r["compression"]) for r in fast] == [("ps", "none")] * 2  # bf16 would save 1 ms: not worth it
