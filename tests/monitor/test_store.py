"""The metrics store: what a run writes, read back; and a writer killed mid-run loses nothing it committed."""

from __future__ import annotations

import json
import shutil
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from rpt.monitor.metrics import stragglers
from rpt.monitor.store import FILENAME, MetricsReader
from rpt.train.trainer import Trainer


def test_a_run_writes_every_logged_step_rank_eval_and_layer(make_cfg, tmp_path, solo):
    cfg = make_cfg("train.max_steps=6", "monitor.log_interval=2", "train.eval_interval=3", "model.n_layers=3")
    Trainer(cfg, tmp_path / "r", solo, show_progress=False).run()
    reader = MetricsReader(tmp_path / "r")
    jsonl = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    train = reader.rows("train")
    assert [r["step"] for r in train] == [2, 4, 6]
    assert [r["loss"] for r in train] == [r["loss"] for r in jsonl if r["kind"] == "train"]
    ranks = reader.rows("ranks")
    assert [(r["step"], r["rank"]) for r in ranks] == [(2, 0), (4, 0), (6, 0)]
    for r in ranks:
        assert r["forward_s"] > 0 and r["backward_s"] > 0 and r["optimizer_s"] > 0 and r["memory_bytes"] > 1e6
        assert r["compute_s"] == pytest.approx(r["forward_s"] + r["backward_s"] + r["optimizer_s"])
        assert r["step_s"] >= r["forward_s"] + r["backward_s"]
    assert ranks[1]["eval_s"] > 0  # the evaluation at step 3 falls in the interval that ends at step 4
    assert [(r["step"], r["final"]) for r in reader.rows("evals")] == [(3, 0), (6, 0), (6, 1)]
    layers = reader.rows("state")
    assert sorted({r["layer"] for r in layers}) == [0, 1, 2] and all(r["rms"] > 0 for r in layers)
    assert all(0.0 <= r["saturated"] <= 1.0 for r in layers)
    meta = reader.meta()
    assert meta["world_size"] == 1 and meta["n_layers"] == 3 and meta["summary"]["steps"] == 6


WRITER = """
import sys, time
from rpt.monitor.store import MetricsWriter
w = MetricsWriter(sys.argv[1])
for step in range(1, 100000):
    rows = [{"rank": r, "forward_s": 0.1 * r, "compute_s": 0.1} for r in range(4)]
    w.write_interval({"step": step, "time": time.time(), "tokens": step * 100, "loss": 1.0 / step, "grad_norm": 1.0,
                      "lr": 1e-3, "tokens_per_s": 1e4, "skipped_steps": 0}, rows, {0: (1.0, 0.1), 1: (2.0, 0.2)},
                     {0: 10.0}, [])
    print(step, flush=True)
"""


def test_a_writer_killed_mid_run_loses_nothing_it_committed(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        last = 0
        deadline = time.monotonic() + 60
        while last < 300 and time.monotonic() < deadline:
            last = int(proc.stdout.readline())
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert last >= 300
    db = sqlite3.connect(tmp_path / FILENAME)
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    db.close()
    reader = MetricsReader(tmp_path)
    steps = [r["step"] for r in reader.rows("train")]
    assert steps[:last] == list(range(1, last + 1))  # every interval it reported done is there, whole
    ranks = reader.rows("ranks")
    assert len(ranks) == 4 * len(steps)  # and no half-written interval


def test_stragglers_are_judged_against_peers_of_the_same_stage():
    rows = [{"rank": 0, "stage": 0, "compute_s": 1.0}, {"rank": 1, "stage": 0, "compute_s": 1.5},
            {"rank": 2, "stage": 1, "compute_s": 3.0}, {"rank": 3, "stage": 1, "compute_s": 3.1}]
    assert [s["rank"] for s in stragglers(rows)] == [1]  # stage 1 is slower by design, not a straggler
    assert stragglers([{"rank": 0, "stage": 0, "compute_s": 1.0}]) == []


def test_a_finished_run_leaves_one_self_contained_database_file(make_cfg, tmp_path, solo):
    Trainer(make_cfg("train.max_steps=4", "monitor.log_interval=1"), tmp_path / "r", solo, show_progress=False).run()
    assert not (tmp_path / "r" / "metrics.sqlite-wal").exists()  # folded in when the writer closed
    (tmp_path / "copy").mkdir()
    shutil.copy(tmp_path / "r" / "metrics.sqlite", tmp_path / "copy")  # the file alone, as users copy it
    assert [r["step"] for r in MetricsReader(tmp_path / "copy").rows("train")] == [1, 2, 3, 4]
