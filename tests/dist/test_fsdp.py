"""FSDP2 (`parallel.fsdp`) on real gloo processes: the same losses and parameters as one process on the whole
batch, alone, under HSDP and inside pipeline stages; clipping and accumulation included."""

from __future__ import annotations

import json

import pytest
import torch

from ranks import run_ranks
from pipeline_workers import train_runs, train_runs_with_env
from test_pipeline import GDN, MLSTM, assert_same_training, reference

from rpt.comm.accounting import fsdp_wire_bytes

CLIP = ["train.grad_clip=0.05"]  # below the gradient norms of these runs: every step clips


def assert_params_within(got: dict, ref: dict, atol: float = 1e-5) -> None:
    for name, p in got.items():
        other = ref["embed.weight"] if name == "head.weight" and "head.weight" not in ref else ref[name]
        torch.testing.assert_close(p, other, atol=atol, rtol=0, msg=lambda m: f"{name}: {m}")


def grad_norms(run_dir) -> list[float]:
    return [r["grad_norm"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "train"]


@pytest.fixture(scope="module")
def reference_run(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    # two ranks of 4 rows read the streams one process reads with 8 rows
    return (out, *reference(tiny_data, out, "ref", "train.batch_size=8", *CLIP))


def test_fsdp2_on_two_processes_trains_exactly_as_one(tiny_data, tmp_path, reference_run):
    ref_dir, ref_losses, ref_params = reference_run
    runs = [("fsdp", ["parallel.fsdp=2", *CLIP], False),
            ("accum", ["parallel.fsdp=2", "train.grad_accum=2", *CLIP], False),
            ("reshard", ["parallel.fsdp=2", "train.grad_accum=2", "parallel.fsdp_reshard_microsteps=true", *CLIP],
             False),
            # a new run from the reference's weights: each rank loads its shards of them
            ("init", ["parallel.fsdp=2", f"train.init_from={ref_dir / 'ref'}", *CLIP], False),
            ("mlstm", ["parallel.fsdp=2", *MLSTM, *CLIP], False),  # a matrix-memory cell's parameters sharded
            ("gdn", ["parallel.fsdp=2", *GDN, *CLIP], False)]
    ranks = run_ranks(train_runs, 2, tmp_path / "ranks", str(tiny_data), str(tmp_path), runs, timeout=240)
    init_losses, init_params = reference(tiny_data, tmp_path, "init-ref", "train.batch_size=8",
                                         f"train.init_from={ref_dir / 'ref'}", *CLIP)
    assert init_losses[1] < ref_losses[1] - 0.01  # the same first batch, read with the trained weights
    for r in ranks:
        assert_same_training({"losses": ranks[0]["init"]["losses"], "params": r["init"]["params"]}, init_losses,
                             init_params)
    for cell, settings in (("mlstm", MLSTM), ("gdn", GDN)):
        cell_losses, cell_params = reference(tiny_data, tmp_path, f"{cell}-ref", "train.batch_size=8", *settings, *CLIP)
        for r in ranks:
            assert_same_training({"losses": ranks[0][cell]["losses"], "params": r[cell]["params"]}, cell_losses,
                                 cell_params)
    assert all(n > 0.05 for n in grad_norms(ref_dir / "ref"))  # clipping was active
    for run in ("fsdp", "accum", "reshard"):
        for r in ranks:  # every rank's gathered parameters, and rank 0's losses
            assert_same_training({"losses": ranks[0][run]["losses"], "params": r[run]["params"]}, ref_losses,
                                 ref_params)
            assert_params_within(r[run]["params"], ref_params)  # after 6 clipped AdamW steps
        s = ranks[0][run]["summary"]
        every = 4 * sum(p.numel() for p in ref_params.values())
        kept = 4 * sum(p.numel() for k, p in ref_params.items() if k.startswith(("blocks.3.", "embed.", "norm.")))
        accum = 1 if run == "fsdp" else 2  # the tied embedding and norm are the root's own; blocks.3 is the last
        assert s["comm_mode"] == "fsdp"
        assert s["comm_bytes_per_step"] == sum(fsdp_wire_bytes(every, 2, 1, accum, kept, run == "reshard").values())
        assert s["val_loss"] == pytest.approx(json.loads((ref_dir / "ref" / "summary.json").read_text())["val_loss"],
                                              abs=1e-5)


def test_hsdp_and_fsdp_inside_pipeline_stages_train_exactly_as_one_process(tiny_data, tmp_path, reference_run):
    _, ref_losses, ref_params = reference_run  # pp 2 x fsdp 2: two data ranks of 4 rows, as the 8-row reference
    runs = [("pp-fsdp", ["parallel.pp=2", "parallel.fsdp=2", *CLIP], False),
            ("hsdp", ["parallel.fsdp=2", *CLIP], False)]  # 4 ranks: 2 replicas x 2 shards
    ranks = run_ranks(train_runs, 4, tmp_path / "ranks", str(tiny_data), str(tmp_path), runs, timeout=300)
    s = ranks[0]["pp-fsdp"]["summary"]
    assert (s["pp"], s["dp"], s["comm_mode"]) == (2, 2, "fsdp")
    params = {**ranks[0]["pp-fsdp"]["params"], **ranks[2]["pp-fsdp"]["params"]}  # stage 0 on ranks 0-1, 1 on 2-3
    assert_same_training({"losses": ranks[0]["pp-fsdp"]["losses"], "params": params}, ref_losses, ref_params)
    assert_params_within(params, ref_params)
    for a, b in ((0, 1), (2, 3)):  # both shard holders gathered the same stage
        assert ranks[a]["pp-fsdp"]["params"].keys() == ranks[b]["pp-fsdp"]["params"].keys()
    hsdp_losses, hsdp_params = reference(tiny_data, tmp_path, "ref16", "train.batch_size=16", *CLIP)
    assert ranks[0]["hsdp"]["summary"]["dp"] == 4
    for r in ranks:
        assert_same_training({"losses": ranks[0]["hsdp"]["losses"], "params": r["hsdp"]["params"]}, hsdp_losses,
                             hsdp_params)
        assert_params_within(r["hsdp"]["params"], hsdp_params)


def test_fsdp2_skips_a_non_finite_step_and_recomputes_activations_as_one_process(tiny_data, tmp_path, monkeypatch):
    monkeypatch.setenv("RPT_FAULT", "nan@3")  # the loss of step 3 is NaN on every rank: that step is skipped
    # (here for the one-process reference; the ranks get it from their fork server's worker)
    extra = ["model.activation_checkpointing=true", *CLIP]
    ranks = run_ranks(train_runs_with_env, 2, tmp_path / "ranks", {"RPT_FAULT": "nan@3"}, str(tiny_data),
                      str(tmp_path), [("nan", ["parallel.fsdp=2", *extra], False)], timeout=240)
    ref_losses, ref_params = reference(tiny_data, tmp_path, "ref", "train.batch_size=8", *extra)
    assert ranks[0]["nan"]["summary"]["skipped_steps"] == 1
    got = ranks[0]["nan"]["losses"]
    assert sum(v != v for v in got.values()) == 1  # the one NaN loss, at the same step as in one process
    assert got == pytest.approx(ref_losses, abs=1e-5, nan_ok=True)
    for r in ranks:
        assert_params_within(r["nan"]["params"], ref_params)
