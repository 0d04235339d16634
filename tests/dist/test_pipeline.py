"""Pipeline parallelism on real gloo processes: the same losses and parameters as one process, the
recurrent state carried per micro-batch, dp x pp replicas identical, checkpoints shared with pp = 1."""

from __future__ import annotations

import json

import pytest
import torch

from ranks import run_ranks
from pipeline_workers import losses_of, pipeline_overrides, train_runs

from rpt.config import Config
from rpt.monitor.store import MetricsReader
from rpt.parallel.launch import Dist
from rpt.testing.faults import hooks_from_env
from rpt.train.evaluate import eval_run
from rpt.train.trainer import Trainer

MLSTM = ["model.cell=mlstm", "model.heads=2", "model.chunk_size=4"]  # windows of 16: four chunks a window
GDN = ["model.cell=gdn", "model.heads=2", "model.chunk_size=5"]  # and chunks that do not divide them
SOLO = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def reference(data, tmp_path, name: str, *overrides: str) -> tuple[dict, dict]:
    """The same model trained in this one process, without a pipeline: (losses by step, parameters)."""
    torch.set_num_threads(1)
    cfg = Config.load(None, pipeline_overrides(str(data)) + list(overrides))
    trainer = Trainer(cfg, tmp_path / name, SOLO, show_progress=False, extra_hooks=hooks_from_env)  # RPT_FAULT
    trainer.run()
    return losses_of(tmp_path / name), {n: p.detach() for n, p in trainer.runner.model.named_parameters()}


def assert_same_training(got: dict, ref_losses: dict, ref_params: dict) -> None:
    """Losses within 1e-5 at every step; parameters within 1e-4 after the six AdamW steps (Adam divides by the
    gradient's own size, so summation-order noise in a near-zero gradient moves an entry by up to ~lr x 1e-2,
    while a real mistake moves them by ~lr = 3e-3 per step)."""
    assert got["losses"].keys() == ref_losses.keys() and len(ref_losses) == 6
    for step, loss in ref_losses.items():
        assert got["losses"][step] == pytest.approx(loss, abs=1e-5), f"step {step}"
    for name, p in got["params"].items():
        # the last stage's copy of a tied embedding is named head.weight; it must equal the embedding
        ref = ref_params["embed.weight"] if name == "head.weight" and "head.weight" not in ref_params else ref_params[name]
        torch.testing.assert_close(p, ref, atol=1e-4, rtol=0, msg=lambda m: f"{name}: {m}")


@pytest.fixture(scope="module")
def two_stages(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("pp2")
    runs = [("1f1b", ["parallel.pp=2"], False),
            ("gpipe", ["parallel.pp=2", "parallel.schedule=gpipe"], False),
            # 4 blocks as 4 virtual stages, two on each rank
            ("interleaved", ["parallel.pp=2", "parallel.schedule=interleaved", "parallel.microbatches=2"], False),
            ("recompute", ["parallel.pp=2", "model.activation_checkpointing=true"], False),
            # the last stage's loss is the model's own nats: a two-level head trains there as in one process
            ("shortlist", ["parallel.pp=2", "model.head_shortlist=64"], False),
            # a matrix state ([B, heads, d, d]) handed between micro-batches, its chunkwise form within each stage
            ("mlstm", ["parallel.pp=2", *MLSTM], False),
            ("gdn", ["parallel.pp=2", *GDN], False),  # a memory and the convolution's inputs handed on
            # a warm-up longer than the runs: the learning rate depends on the step alone, not on max_steps
            ("whole", ["parallel.pp=2", "train.warmup_steps=100"], False),
            # a new run from the weights of the one above: each stage loads its own blocks
            ("init", ["parallel.pp=2", f"train.init_from={out / 'whole'}"], False),
            ("resume", ["parallel.pp=2", "train.warmup_steps=100", "train.max_steps=3", "checkpoint.interval=3"], False),
            ("resume", ["parallel.pp=2", "train.warmup_steps=100"], True)]
    return out, run_ranks(train_runs, 2, out / "ranks", str(tiny_data), str(out), runs, timeout=240)


def test_two_stages_train_exactly_as_one_process(two_stages, tiny_data, tmp_path):
    out, ranks = two_stages
    ref_losses, ref_params = reference(tiny_data, tmp_path, "ref")
    for schedule in ("1f1b", "gpipe", "interleaved"):
        first, last = ranks[0][schedule], ranks[1][schedule]
        if schedule == "interleaved":  # four stages of one block: stage j on rank j % 2
            assert (first["stage_blocks"], last["stage_blocks"]) == ([0, 2], [1, 3])
        else:  # the cut follows costs measured at start (so it may differ by machine): contiguous, every stage some
            assert first["stage_blocks"] + last["stage_blocks"] == [0, 1, 2, 3] and first["stage_blocks"]
            assert last["stage_blocks"]
        assert_same_training({"losses": first["losses"], "params": {**first["params"], **last["params"]}},
                             ref_losses, ref_params)
        s = first["summary"]
        assert (s["pp"], s["dp"], s["pipeline_schedule"]) == (2, 1, schedule)
        assert s["pipeline_bubble_theory"] == pytest.approx(1 / 5 if schedule == "interleaved" else 1 / 3)
        ref_val = json.loads((tmp_path / "ref" / "summary.json").read_text())["val_loss"]
        assert s["val_loss"] == pytest.approx(ref_val, abs=1e-5)  # evaluation hops through every stage
        assert 0.0 < s["pipeline_bubble"] < 1.0 and len(s["pipeline_bubble_by_stage"]) == 2
    # a two-level softmax head (model.head_shortlist) on the last stage: its nats are the loss, as in one process
    short_losses, short_params = reference(tiny_data, tmp_path, "ref-shortlist", "model.head_shortlist=64")
    first, last = ranks[0]["shortlist"], ranks[1]["shortlist"]
    assert_same_training({"losses": first["losses"], "params": {**first["params"], **last["params"]}},
                         short_losses, short_params)
    assert short_losses[1] != pytest.approx(ref_losses[1], abs=1e-3)  # the shortlist head is really another head
    short_val = json.loads((tmp_path / "ref-shortlist" / "summary.json").read_text())["val_loss"]
    assert first["summary"]["val_loss"] == pytest.approx(short_val, abs=1e-5)
    # activation checkpointing inside the stages changes memory, not results
    first, last = ranks[0]["recompute"], ranks[1]["recompute"]
    assert_same_training({"losses": first["losses"], "params": {**first["params"], **last["params"]}},
                         ref_losses, ref_params)
    # gate saturation from both stages: every layer, and the first stage's layers as in one process (same tokens,
    # same state rows); a later stage probes with the activations it received, so only its range is checked
    ref = {(r["step"], r["layer"]): r["saturated"] for r in MetricsReader(tmp_path / "ref").rows("state")}
    got = {(r["step"], r["layer"]): r["saturated"] for r in MetricsReader(out / "1f1b").rows("state")}
    assert got.keys() == ref.keys() and {layer for _, layer in got} == {0, 1, 2, 3}
    assert all(0.0 <= v <= 1.0 for v in got.values())
    for (step, layer), v in got.items():
        if layer in ranks[0]["1f1b"]["stage_blocks"]:
            assert v == pytest.approx(ref[(step, layer)], abs=1e-6), (step, layer)


def test_an_mlstm_in_two_stages_trains_exactly_as_one_process(two_stages, tiny_data, tmp_path):
    _, ranks = two_stages
    ref_losses, ref_params = reference(tiny_data, tmp_path, "ref-mlstm", *MLSTM)
    first, last = ranks[0]["mlstm"], ranks[1]["mlstm"]
    assert any(".cell.qkvo." in name for name in first["params"])  # the stages hold mlstm blocks
    assert_same_training({"losses": first["losses"], "params": {**first["params"], **last["params"]}},
                         ref_losses, ref_params)


def test_a_gdn_in_two_stages_trains_exactly_as_one_process(two_stages, tiny_data, tmp_path):
    _, ranks = two_stages
    ref_losses, ref_params = reference(tiny_data, tmp_path, "ref-gdn", *GDN)
    first, last = ranks[0]["gdn"], ranks[1]["gdn"]
    assert any(".cell.conv_weight" in name for name in first["params"])  # the stages hold gdn blocks
    assert_same_training({"losses": first["losses"], "params": {**first["params"], **last["params"]}},
                         ref_losses, ref_params)


def test_init_from_under_two_stages_equals_one_process(two_stages, tiny_data, tmp_path):
    out, ranks = two_stages
    ref_losses, ref_params = reference(tiny_data, tmp_path, "init", f"train.init_from={out / 'whole'}")
    first, last = ranks[0]["init"], ranks[1]["init"]
    assert_same_training({"losses": first["losses"], "params": {**first["params"], **last["params"]}},
                         ref_losses, ref_params)
    whole = ranks[0]["whole"]["losses"]  # the same first batch: a lower loss from the earlier run's weights
    assert ref_losses[1] < whole[1] - 0.01  # (6 warm-up steps moved it by ~0.017; from scratch it would be equal)


def test_pipelined_resume_equals_the_uninterrupted_run(two_stages):
    _, ranks = two_stages
    resumed, whole = ranks[0]["resume+resumed"]["losses"], ranks[0]["whole"]["losses"]
    assert sorted(resumed) == list(range(1, 7))  # 1-3 before the stop, 4-6 after the resume
    for step in range(1, 7):
        assert resumed[step] == whole[step], f"step {step}"  # same process count: bit-identical
    for r in (0, 1):  # and so are the final parameters of both stages
        final, ref = ranks[r]["resume+resumed"]["params"], ranks[r]["whole"]["params"]
        assert all(torch.equal(final[k], ref[k]) for k in ref)


def test_a_pipelined_checkpoint_is_read_by_rpt_eval_as_a_whole_model(two_stages):
    out, ranks = two_stages
    summary = ranks[0]["1f1b"]["summary"]
    result = eval_run(str(out / "1f1b"), "latest", "cpu", None)
    assert result["loss"] == pytest.approx(summary["val_loss"], abs=1e-5)
    assert result["tokens"] == summary["val_tokens"]


def test_four_uneven_stages_train_exactly_as_one_process(tiny_data, tmp_path):
    # six blocks on four stages (some hold two, some one), attention in blocks 2 and 5 making those dearer
    extra = ["model.n_layers=6", "model.attention_every=3", "model.attention_window=8", "model.attention_heads=2",
             "parallel.microbatches=4"]
    ranks = run_ranks(train_runs, 4, tmp_path / "ranks", str(tiny_data), str(tmp_path),
                      [("pp4", extra + ["parallel.pp=4"], False)], timeout=240)
    blocks = [r["pp4"]["stage_blocks"] for r in ranks]
    assert sorted(b for stage in blocks for b in stage) == list(range(6))
    ref_losses, ref_params = reference(tiny_data, tmp_path, "ref", *extra)
    params = {k: v for r in ranks for k, v in r["pp4"]["params"].items()}
    assert_same_training({"losses": ranks[0]["pp4"]["losses"], "params": params}, ref_losses, ref_params)


def test_dp2_x_pp2_keeps_replicas_identical_and_equals_one_process_on_the_whole_batch(tiny_data, tmp_path):
    # 1F1B (one DDP per stage), and interleaved 1F1B (4 virtual stages of one block, one DDP each)
    interleaved = ["parallel.pp=2", "parallel.schedule=interleaved", "parallel.microbatches=2"]
    runs = [("mesh", ["parallel.pp=2"], False), ("interleaved", interleaved, False),
            # the communication middleware over the dp dimension, on every virtual stage's DDP
            ("bf16", interleaved + ["comm.compression=bf16"], False),
            ("adaptive", interleaved + ["comm.adaptive=true", "comm.adaptive_interval=2", "comm.adaptive_period=3",
                                        "comm.adaptive_keep=0.3"], False)]
    ranks = run_ranks(train_runs, 4, tmp_path / "ranks", str(tiny_data), str(tmp_path), runs, timeout=300)
    for run in ("bf16", "adaptive"):  # lossy or late by design: replicas identical, fewer bytes sent
        for a, b in ((0, 1), (2, 3)):
            pa, pb = ranks[a][run]["params"], ranks[b][run]["params"]
            assert all(torch.equal(pa[k], pb[k]) for k in pa), f"{run}: ranks {a} and {b} diverged"
        sent = [r[run]["summary"]["comm_bytes_per_step"] for r in ranks]
        plain = [r["interleaved"]["summary"]["comm_bytes_per_step"] for r in ranks]
        assert all(0 < x < 0.9 * y for x, y in zip(sent, plain)), (run, sent, plain)
    # two data-parallel replicas of 4 rows read the streams one process reads with 8 rows
    ref_losses, ref_params = reference(tiny_data, tmp_path, "ref", "train.batch_size=8", "parallel.microbatches=4")
    for run in ("mesh", "interleaved"):
        # the mesh is pp x dp, pipeline outermost: ranks 0, 1 hold stage 0 (or 0 and 2); ranks 2, 3 the others
        for a, b in ((0, 1), (2, 3)):
            pa, pb = ranks[a][run]["params"], ranks[b][run]["params"]
            assert pa.keys() == pb.keys()
            assert all(torch.equal(pa[k], pb[k]) for k in pa), f"{run}: ranks {a} and {b} diverged"
        s = ranks[0][run]["summary"]
        assert (s["pp"], s["dp"], s["comm_mode"]) == (2, 2, "allreduce") and s["comm_bytes_per_step"] > 0
        params = {**ranks[0][run]["params"], **ranks[2][run]["params"]}
        assert_same_training({"losses": ranks[0][run]["losses"], "params": params}, ref_losses, ref_params)
    assert ranks[0]["interleaved"]["summary"]["pipeline_schedule"] == "interleaved"
