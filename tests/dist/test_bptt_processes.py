"""Exact BPTT in recomputed chunks (train.bptt_chunk) on real gloo processes: data parallelism with accumulation and
FSDP2 train as one process with the plain backward over the whole window (the chunks run inside the one forward
that DDP and FSDP see)."""

from __future__ import annotations

from ranks import run_ranks
from pipeline_workers import train_runs
from test_pipeline import assert_same_training, reference

CHUNK = ["train.bptt_chunk=4", "model.attention_every=2", "model.attention_window=8"]  # windows of 16 tokens


def test_data_parallel_and_fsdp_with_chunks_train_as_one_process_without(tiny_data, tmp_path):
    runs = [("ddp", [*CHUNK, "train.grad_accum=2"], False), ("fsdp", [*CHUNK, "parallel.fsdp=2"], False)]
    ranks = run_ranks(train_runs, 2, tmp_path / "ranks", str(tiny_data), str(tmp_path), runs, timeout=240)
    ref_losses, ref_params = reference(tiny_data, tmp_path, "ref", "train.batch_size=8", *CHUNK[1:])
    for run, _, _ in runs:
        for r in ranks:
            assert_same_training({"losses": ranks[0][run]["losses"], "params": r[run]["params"]}, ref_losses,
                                 ref_params)
