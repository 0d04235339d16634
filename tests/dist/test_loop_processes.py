"""A looped model (depth recurrence, rpt/models/loop.py) on real gloo processes: data parallelism in each comm
mode trains exactly as one process on the whole batch, at the depth each step draws (the same on every rank);
DiLoCo trains it with replicas that agree after the last outer step; FSDP and a pipeline train it as one process."""

from __future__ import annotations

import json

import torch
from ranks import run_ranks
from pipeline_workers import train_runs
from test_pipeline import assert_same_training, reference

from rpt.config import ModelConfig
from rpt.models.loop import draw_depth

LOOP = ["model.loop_prelude=1", "model.loop_core=2", "model.loop_mean=3", "model.loop_backprop=2",
        "model.loop_max=6", "model.attention_every=3", "model.attention_window=8"]
SHALLOW = ["train.eval_depths=[1, 3]"]  # the final validation at two depths, not six: training is the subject here


def test_data_parallel_and_the_comm_modes_train_a_looped_model_as_one_process(tiny_data, tmp_path):
    depths = [draw_depth(ModelConfig(n_layers=4, loop_core=2, loop_mean=3, loop_max=6), 0, s) for s in range(6)]
    assert len(set(depths)) > 1  # the six steps run at different depths
    ref_losses, ref_params = reference(tiny_data, tmp_path, "ref", "train.batch_size=8", *LOOP, *SHALLOW)
    runs = [("allreduce", [*LOOP, *SHALLOW], False), ("accum", [*LOOP, *SHALLOW, "train.grad_accum=2"], False),
            ("ps", [*LOOP, *SHALLOW, "comm.mode=ps-sharded"], False),
            ("diloco", [*LOOP, *SHALLOW, "comm.mode=diloco", "comm.diloco_steps=3", "comm.compression=bf16"], False)]
    ranks = run_ranks(train_runs, 2, tmp_path / "ranks", str(tiny_data), str(tmp_path), runs, timeout=240)
    for name, params in ranks[0]["diloco"]["params"].items():  # DiLoCo: its own algorithm; replicas agree
        torch.testing.assert_close(params, ranks[1]["diloco"]["params"][name], atol=0, rtol=0)
    assert ranks[0]["diloco"]["losses"][6] < ranks[0]["diloco"]["losses"][1]
    for run, _, _ in runs[:3]:
        for r in ranks:
            assert_same_training({"losses": ranks[0][run]["losses"], "params": r[run]["params"]}, ref_losses,
                                 ref_params)
    logged = [r["depth"] for r in map(json.loads, (tmp_path / "allreduce" / "metrics.jsonl").read_text().splitlines())
              if r["kind"] == "train"]
    assert logged == depths  # each step at its draw (the trainer's steps count from 0)


def test_fsdp_and_the_pipeline_train_a_looped_model_as_one_process(tiny_data, tmp_path):
    """FSDP2 (the core blocks and the loop in the root unit: gathered once a forward) and a two-stage pipeline
    (the core inside one stage, two micro-batches) train as one process does, at each step's drawn depth."""
    runs = [("fsdp", [*LOOP, *SHALLOW, "parallel.fsdp=2"], False), ("pp", [*LOOP, "parallel.pp=2"], False)]
    ranks = run_ranks(train_runs, 2, tmp_path / "ranks", str(tiny_data), str(tmp_path), runs, timeout=240)
    ref_losses, ref_params = reference(tiny_data, tmp_path, "ref8", "train.batch_size=8", *LOOP, *SHALLOW)
    for r in ranks:
        assert_same_training({"losses": ranks[0]["fsdp"]["losses"], "params": r["fsdp"]["params"]}, ref_losses,
                             ref_params)
    ref_losses, ref_params = reference(tiny_data, tmp_path, "ref4", *LOOP, *SHALLOW)  # the pipeline: one replica
    for r in ranks:
        assert_same_training({"losses": ranks[0]["pp"]["losses"], "params": r["pp"]["params"]}, ref_losses,
                             ref_params)
    held = [r["pp"]["stage_blocks"] for r in ranks]
    assert sorted(sum(held, [])) == [0, 1, 2, 3] and any({1, 2} <= set(b) for b in held)  # the core in one stage
    assert any(name.startswith("loop.") for name in ranks[0]["pp"]["params"]) == (1 in held[0])
    finals = [r for r in map(json.loads, (tmp_path / "pp" / "metrics.jsonl").read_text().splitlines())
              if r["kind"] == "eval"]
    assert finals and sorted(finals[-1]["by_depth"]) == ["1", "12", "2", "3", "4", "6"]  # validated at each depth
