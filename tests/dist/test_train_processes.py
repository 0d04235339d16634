"""Real processes: `rpt train --nproc 2` (gloo, CPU) and an exact resume after a killed run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest


TIMEOUT = 300


def rpt_train(run_dir: Path, data: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "rpt", "train", "--run-dir", str(run_dir), "--set", f"data.path={data}",
            "--set", "model.d_model=32", "--set", "train.batch_size=4", "--set", "train.seq_len=16",
            "--set", "train.warmup_steps=2", "--set", "train.eval_interval=0", "--set", "monitor.log_interval=1",
            "--set", "model.dropout=0.1", *extra]
    return subprocess.run(args, capture_output=True, text=True, timeout=TIMEOUT,
                          env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"})


def losses_by_step(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "train":
            out[record["step"]] = record["loss"]
    return out


TWO_PROCESSES = ("--nproc", "2", "--set", "checkpoint.interval=3", "--set", "train.max_steps=10")


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory, tiny_data) -> Path:
    """One uninterrupted `--nproc 2` run, the reference of the tests below that interrupt the same run."""
    run = tmp_path_factory.mktemp("two") / "full"
    proc = rpt_train(run, tiny_data, *TWO_PROCESSES)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def test_two_process_data_parallel_keeps_replicas_identical(two_process_run):
    summary = json.loads((two_process_run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["tokens"] == 10 * 2 * 4 * 16
    assert summary["comm_bytes_per_step"] == 4 * summary["params"]
    digests = [re.search(r"parameter digest (\w+)", (two_process_run / "logs" / f"rank{r}.log").read_text()).group(1)
               for r in (0, 1)]
    assert digests[0] == digests[1]  # bit-identical replicas after 10 all-reduced steps (dropout differs per rank)
    losses = losses_by_step(two_process_run)
    assert losses[10] < losses[1]


def test_resume_after_a_killed_run_equals_the_uninterrupted_run(tmp_path, tiny_data):
    common = ("--set", "train.max_steps=10", "--set", "checkpoint.interval=3")
    full = rpt_train(tmp_path / "full", tiny_data, *common)
    assert full.returncode == 0, full.stderr[-3000:]
    killed = rpt_train(tmp_path / "cut", tiny_data, *common, env={"RPT_FAULT": "kill@7"})
    assert killed.returncode == -9  # SIGKILL at the start of step 8, after the checkpoint of step 6
    assert not (tmp_path / "cut" / "summary.json").exists()
    # what was written before the kill is all there: the store's rows and the log's records of steps 1-7
    from rpt.monitor.store import MetricsReader
    assert [r["step"] for r in MetricsReader(tmp_path / "cut").rows("train")] == list(range(1, 8))
    assert '"step": 7' in (tmp_path / "cut" / "logs" / "rank0.log").read_text()
    resumed = rpt_train(tmp_path / "cut", tiny_data, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr + resumed.stdout
    a, b = losses_by_step(tmp_path / "full"), losses_by_step(tmp_path / "cut")
    assert [b[s] for s in range(7, 11)] == [a[s] for s in range(7, 11)]  # exactly, not approximately
    sa, sb = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("full", "cut"))
    assert sa["val_loss"] == sb["val_loss"] and sa["steps"] == sb["steps"] == 10



def test_topology_command_measures_every_link_and_predicts_each_mode(tmp_path, tiny_data):
    out = tmp_path / "topo.json"
    proc = subprocess.run([sys.executable, "-m", "rpt", "topology", "--nproc", "2", "--message-mb", "1",
                           "--set", f"data.path={tiny_data}", "--set", "model.d_model=32", "--out", str(out)],
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "latency" in proc.stdout and "chosen by comm.mode = auto" in proc.stdout
    report = json.loads(out.read_text())
    assert [link["pair"] for link in report["links"]] == [[0, 1]]
    assert report["links"][0]["bandwidth_Bps"] > 1e6 and 0 < report["links"][0]["latency_s"] < 0.1
    assert report["links"][0]["kind"] == "intra" and report["chosen"] in report["timed_seconds"]
    assert set(report["timed_seconds"]) == set(report["predicted_seconds"]) == {"allreduce", "ps", "ps-sharded"}
    assert report["gradient_bytes"] > 0 and report["gradient_bytes"] % 4 == 0


def test_resume_with_a_partitioned_optimiser_equals_the_uninterrupted_run(tmp_path, tiny_data):
    """ps-sharded: each rank saves and loads only its share of the AdamW state (DCP), and comes back exact."""
    common = ("--nproc", "2", "--set", "comm.mode=ps-sharded", "--set", "checkpoint.interval=3",
              "--set", "train.max_steps=9")
    full = rpt_train(tmp_path / "full", tiny_data, *common)
    assert full.returncode == 0, full.stderr[-3000:]
    # killed after the checkpoint of step 6; the restarted group loads each rank's share (one launch, not two)
    cut = rpt_train(tmp_path / "cut", tiny_data, *common, "--max-restarts", "1", env={"RPT_FAULT": "kill@8:rank=1"})
    assert cut.returncode == 0, cut.stderr[-3000:]
    assert re.search(r"resumed from \S*step_00000006 at step 6", (tmp_path / "cut" / "logs" / "rank0.log").read_text())

    def final_digests(run: Path) -> set[str]:
        return {re.findall(r"parameter digest (\w+)", (run / "logs" / f"rank{r}.log").read_text())[-1] for r in (0, 1)}
    assert final_digests(tmp_path / "full") == final_digests(tmp_path / "cut")
    assert len(final_digests(tmp_path / "full")) == 1


def test_a_killed_worker_restarts_the_group_which_resumes_and_ends_as_the_uninterrupted_run(tmp_path, tiny_data,
                                                                                            two_process_run):
    common = TWO_PROCESSES
    cut = rpt_train(tmp_path / "cut", tiny_data, *common, "--max-restarts", "1", env={"RPT_FAULT": "kill@5:rank=1"})
    assert cut.returncode == 0, cut.stderr[-3000:]
    assert "resumed from" in (tmp_path / "cut" / "logs" / "rank0.log").read_text()
    # the killed rank's log kept what it wrote before the SIGKILL (its record of step 5's predecessor, step 4,
    # appears twice: before the kill and again after the resume from step 3), and the store every step
    from rpt.monitor.store import MetricsReader
    assert (tmp_path / "cut" / "logs" / "rank1.log").read_text().count('"kind": "train", "step": 4,') == 2
    assert [r["step"] for r in MetricsReader(tmp_path / "cut").rows("train")] == list(range(1, 11))

    def digests(run: Path) -> set[str]:
        return {re.findall(r"parameter digest (\w+)", (run / "logs" / f"rank{r}.log").read_text())[-1] for r in (0, 1)}
    assert digests(tmp_path / "cut") == digests(two_process_run) and len(digests(two_process_run)) == 1

    # killed in the middle of the save of step 6 (its shards written, not its manifest): the restarted group
    # ignores that half checkpoint, resumes from step 3 and still ends as the uninterrupted run
    mid = rpt_train(tmp_path / "mid", tiny_data, *common, "--max-restarts", "1", env={"RPT_FAULT": "killsave@6:rank=1"})
    assert mid.returncode == 0, mid.stderr[-3000:]
    assert "resumed from" in (log := (tmp_path / "mid" / "logs" / "rank0.log").read_text())
    assert re.search(r"resumed from \S*step_00000003 at step 3", log)
    assert digests(tmp_path / "mid") == digests(two_process_run)


@pytest.mark.parametrize("comm", [
    ("comm.compression=powersgd", "comm.powersgd_rank=1", "comm.bucket_mb=0.02"),  # buckets of a few tensors each
    ("comm.compression=topk", "comm.topk_fraction=0.05", "comm.bucket_mb=0.02"),
    ("comm.adaptive=true", "comm.adaptive_interval=2", "comm.adaptive_period=3", "comm.adaptive_pin=[]"),
    ("comm.mode=diloco", "comm.diloco_steps=4", "comm.compression=int8"),  # the checkpoint of step 6: mid-phase
], ids=["powersgd", "topk", "adaptive", "diloco"])
def test_a_killed_run_with_stateful_gradient_sync_resumes_exactly(tmp_path, tiny_data, comm):
    """PowerSGD's error feedback and warm-started factors, top-k's error buffers, the adaptive schedule's
    accumulated gradients and DiLoCo's replicas, inner optimisers and outer momentum differ per rank and carry from
    step to step: each rank checkpoints its own, and the run killed after the checkpoint of step 6 ends
    bit-identical to the uninterrupted one."""
    common = ("--nproc", "2", "--set", "checkpoint.interval=3", "--set", "train.max_steps=10",
              *[arg for kv in comm for arg in ("--set", kv)])
    full = rpt_train(tmp_path / "full", tiny_data, *common)
    assert full.returncode == 0, full.stderr[-3000:]
    assert "find_unused_parameters" not in full.stderr  # DDP's buckets are settled, not frozen by that flag
    cut = rpt_train(tmp_path / "cut", tiny_data, *common, "--max-restarts", "1", env={"RPT_FAULT": "kill@8:rank=1"})
    assert cut.returncode == 0, cut.stderr[-3000:]
    assert re.search(r"resumed from \S*step_00000006 at step 6", (tmp_path / "cut" / "logs" / "rank0.log").read_text())
    assert losses_by_step(tmp_path / "cut") == losses_by_step(tmp_path / "full")

    def digests(run: Path) -> set[str]:
        return {re.findall(r"parameter digest (\w+)", (run / "logs" / f"rank{r}.log").read_text())[-1] for r in (0, 1)}
    assert digests(tmp_path / "cut") == digests(tmp_path / "full") and len(digests(tmp_path / "full")) == 1


def test_a_corrupted_newest_checkpoint_is_skipped_with_a_warning_and_the_previous_resumed(tmp_path, tiny_data):
    common = ("--nproc", "2", "--set", "checkpoint.interval=3", "--set", "checkpoint.keep_last=2")
    # once the checkpoint of step 6 is complete, rank 1 flips one byte of its shard: same size, wrong checksum
    first = rpt_train(tmp_path / "r", tiny_data, *common, "--set", "train.max_steps=6",
                      env={"RPT_FAULT": "corrupt@6:rank=1"})
    assert first.returncode == 0, first.stderr[-3000:]
    again = rpt_train(tmp_path / "r", tiny_data, *common, "--set", "train.max_steps=9", "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    log = (tmp_path / "r" / "logs" / "rank0.log").read_text()
    assert "skipping damaged checkpoint" in log and "step_00000006" in log and "does not match its checksum" in log
    assert re.search(r"resumed from \S*step_00000003 at step 3", log)
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["steps"] == 9
    # the terminal names it and why; DCP's warning that it overwrites the folder stays in the log
    terminal = again.stdout + again.stderr
    assert re.search(r"skipping the damaged checkpoint \S*step_00000006: \S+ does not match its checksum", terminal)
    assert "Detected an existing checkpoint" not in terminal


def test_a_rank_that_computes_slowly_is_flagged_as_the_straggler(tmp_path, tiny_data):
    """Rank 1 sleeps 50 ms in every forward: the store names it, by its own compute time, in every interval, and
    never rank 0, although rank 0 is the one that waits longest inside the all-reduce."""
    from rpt.monitor.store import MetricsReader

    proc = rpt_train(tmp_path / "r", tiny_data, "--nproc", "2", "--set", "train.max_steps=12",
                     "--set", "monitor.log_interval=3", env={"RPT_FAULT": "slow@1-99:rank=1:seconds=0.05"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    reader = MetricsReader(tmp_path / "r")
    flagged = reader.rows("stragglers")
    assert [r["step"] for r in flagged] == [3, 6, 9, 12] and {r["rank"] for r in flagged} == {1}
    assert all(r["ratio"] > 1.2 for r in flagged)
    ranks = reader.rows("ranks")
    for step in (3, 6, 9, 12):
        fast, slow = (next(r for r in ranks if r["step"] == step and r["rank"] == k) for k in (0, 1))
        assert slow["forward_s"] > fast["forward_s"] + 0.025  # 0.05 s of sleep, less the sharing of 2 cores
        assert fast["exposed_comm_s"] > slow["exposed_comm_s"]  # the fast rank waits for the slow one
    comm = reader.rows("comm")  # the heat map's cells: bytes and seconds per bucket per logged step
    assert {r["step"] for r in comm} == {3, 6, 9, 12} and all(r["bytes"] > 0 and r["seconds"] > 0 for r in comm)


def test_profiled_steps_give_every_rank_a_trace_and_a_timeline_summary(tmp_path, tiny_data):
    from rpt.monitor.store import MetricsReader

    proc = rpt_train(tmp_path / "r", tiny_data, "--nproc", "2", "--set", "train.max_steps=6", "--profile", "2:4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        trace = json.loads((tmp_path / "r" / "traces" / f"rank{rank}.json").read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert {"rpt_step#2", "rpt_step#3", "rpt_step#4"} <= names and "rpt_step#5" not in names
        assert "gloo:all_reduce" in names
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    stored = MetricsReader(tmp_path / "r").rows("profile")
    assert [r["rank"] for r in stored] == [0, 1]
    for p, row in zip(summary["profile_by_rank"], stored):
        assert p["steps"] == 3 and p["compute_s"] > 0 and p["comm_s"] > 0 and p["wall_s"] == row["wall_s"]
        assert p["compute_s"] + p["comm_s"] - p["overlap_s"] + p["idle_s"] == pytest.approx(p["wall_s"], rel=1e-6)


def test_a_stalled_rank_stops_the_job_with_a_message_naming_it_and_the_operation(tmp_path, tiny_data):
    """Rank 1 hangs in its forward of step 4. Without the watchdog the job would wait out the 10-minute
    collective timeout and gloo's error would name neither rank nor operation."""
    began = time.monotonic()
    proc = rpt_train(tmp_path / "r", tiny_data, "--nproc", "2", "--set", "train.max_steps=20",
                     "--set", "train.stall_timeout=3", env={"RPT_FAULT": "stall@4:rank=1:seconds=120"})
    assert proc.returncode != 0
    assert time.monotonic() - began < 90
    logs = {r: (tmp_path / "r" / "logs" / f"rank{r}.log").read_text() for r in (0, 1)}
    assert "stall: rank 1 made no progress" in logs[0]
    assert "last at step 4 in forward" in logs[0] and "rank 0 waits at step 4 in backward" in logs[0]
    assert "stalled" in proc.stderr and "names the rank" in proc.stderr


def test_persistent_non_finite_gradients_stop_every_rank_and_keep_the_last_good_checkpoint(tmp_path, tiny_data):
    proc = rpt_train(tmp_path / "r", tiny_data, "--nproc", "2", "--set", "train.max_steps=30",
                     "--set", "train.max_bad_steps=3", "--set", "checkpoint.interval=2", env={"RPT_FAULT": "nan@4-99"})
    assert proc.returncode == 2 and "non-finite gradients" in proc.stderr and "Traceback" not in proc.stderr
    kept = sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir())
    assert kept[-1] == "step_00000004"  # steps 5, 6 and 7 were skipped; the last good checkpoint is step 4's
    assert (tmp_path / "r" / "checkpoints" / kept[-1] / "manifest.json").exists()


def test_what_auto_chose_is_said_on_the_terminal(tmp_path, tiny_data):
    proc = rpt_train(tmp_path / "r", tiny_data, "--nproc", "2", "--set", "comm.mode=auto", "--set", "train.max_steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    said = re.search(r"comm.mode = auto chose (\S+) with compression (\S+) \(each mode's traffic timed", proc.stdout)
    assert said and said.groups() == (summary["comm_mode"], summary["compression"]), proc.stdout[-2000:]
