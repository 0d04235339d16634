"""The run's metrics database: RUN_DIR/metrics.sqlite, written by rank 0, read live by the dashboard.

SQLite in WAL mode: readers never block the writer and always see whole transactions, and each
log interval is one committed transaction, so a killed job loses nothing it had written (a test
kills a writer with SIGKILL and reads every row back). Python's sqlite3 is enough; no server.

Tables (all keyed by step):
    train      rank 0's record per log line: loss (mean over ranks), grad norm, lr, tokens/s, ...
    ranks      every rank's row per log line: phase seconds per step, compute, memory, bytes, stage
    evals      validation loss, perplexity, bits per byte
    depths     a looped model's validation by depth (bits per byte), and its state's change at each iteration
    positions  validation by position in the documents (bits per byte and tokens of each bin, by its first position)
    comm       bytes and seconds (launch to completion, mean over the interval's steps) per bucket per step
    state      RMS of the recurrent state per layer, and the share of its gate outputs that are saturated
    stragglers ranks whose own compute exceeds their peers' (see metrics.stragglers)
    profile    per rank, over the steps of `--profile`: wall, compute, communication, overlap, idle seconds
    meta       key/value: config, world size, layers, ...
"""

from __future__ import annotations

import json
import math
import sqlite3
from pathlib import Path

from rpt.monitor.metrics import FIELDS

SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS train (step INTEGER PRIMARY KEY, time REAL, tokens INTEGER, loss REAL, grad_norm REAL,
    lr REAL, tokens_per_s REAL, skipped_steps INTEGER);
CREATE TABLE IF NOT EXISTS ranks (step INTEGER, rank INTEGER, {", ".join(f"{f} REAL" for f in FIELDS if f != "step")},
    PRIMARY KEY (step, rank));
CREATE TABLE IF NOT EXISTS evals (step INTEGER, time REAL, final INTEGER, loss REAL, ppl REAL, bpb REAL);
CREATE TABLE IF NOT EXISTS depths (step INTEGER, final INTEGER, depth INTEGER, bpb REAL, state_change REAL,
    PRIMARY KEY (step, final, depth));
CREATE TABLE IF NOT EXISTS positions (step INTEGER, final INTEGER, first INTEGER, bpb REAL, tokens INTEGER,
    PRIMARY KEY (step, final, first));
CREATE TABLE IF NOT EXISTS comm (step INTEGER, bucket INTEGER, bytes REAL, seconds REAL, PRIMARY KEY (step, bucket));
CREATE TABLE IF NOT EXISTS state (step INTEGER, layer INTEGER, rms REAL, saturated REAL, PRIMARY KEY (step, layer));
CREATE TABLE IF NOT EXISTS stragglers (step INTEGER, rank INTEGER, compute_s REAL, reference_s REAL, ratio REAL);
CREATE TABLE IF NOT EXISTS profile (step INTEGER, rank INTEGER, steps INTEGER, wall_s REAL, compute_s REAL,
    comm_s REAL, overlap_s REAL, idle_s REAL, PRIMARY KEY (step, rank));
"""
FILENAME = "metrics.sqlite"
TABLES = ("train", "ranks", "evals", "depths", "positions", "comm", "state", "stragglers", "profile")  # readable


def _clean(v):
    return None if isinstance(v, float) and not math.isfinite(v) else v


class MetricsWriter:
    def __init__(self, run_dir: Path):
        self.db = sqlite3.connect(Path(run_dir) / FILENAME, timeout=30, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")  # durable against a killed process; WAL commits are atomic
        self.db.executescript(SCHEMA)

    def set_meta(self, **values) -> None:
        with self.db:
            self.db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)",
                                [(k, json.dumps(v)) for k, v in values.items()])

    def write_interval(self, train: dict, ranks: list[dict], state: dict[int, tuple[float, float]], comm: dict[int, float],
                       stragglers: list[dict], comm_seconds: dict[int, float] | None = None) -> None:
        step = int(train["step"])
        self.db.execute("BEGIN")
        try:
            self.db.execute("INSERT OR REPLACE INTO train VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                            (step, train["time"], train["tokens"], _clean(train["loss"]), _clean(train["grad_norm"]),
                             train["lr"], train["tokens_per_s"], train["skipped_steps"]))
            cols = ["step", "rank", *[f for f in FIELDS if f != "step"]]
            self.db.executemany(f"INSERT OR REPLACE INTO ranks ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})",
                                [(step, r["rank"], *[_clean(r.get(f)) for f in FIELDS if f != "step"]) for r in ranks])
            self.db.executemany("INSERT OR REPLACE INTO state VALUES (?, ?, ?, ?)",
                                [(step, layer, _clean(rms), _clean(sat)) for layer, (rms, sat) in state.items()])
            seconds = comm_seconds or {}
            self.db.executemany("INSERT OR REPLACE INTO comm VALUES (?, ?, ?, ?)",
                                [(step, int(b), float(v), _clean(seconds.get(b))) for b, v in comm.items()])
            self.db.executemany("INSERT INTO stragglers VALUES (?, ?, ?, ?, ?)",
                                [(step, s["rank"], s["compute_s"], s["reference_s"], s["ratio"]) for s in stragglers])
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise

    def write_profile(self, step: int, by_rank: list[dict]) -> None:
        with self.db:
            self.db.executemany("INSERT OR REPLACE INTO profile VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                                [(step, r, p["steps"], p["wall_s"], p["compute_s"], p["comm_s"], p["overlap_s"],
                                  p["idle_s"]) for r, p in enumerate(by_rank)])

    def write_eval(self, record: dict) -> None:
        with self.db:
            self.db.execute("INSERT INTO evals VALUES (?, ?, ?, ?, ?, ?)",
                            (record["step"], record["time"], int(record["final"]), _clean(record["loss"]),
                             _clean(record["ppl"]), _clean(record["bpb"])))
            change = (record.get("loop") or {}).get("state_change", [])
            for depth, r in record.get("by_depth", {}).items():  # the state's change at iteration `depth`
                self.db.execute("INSERT OR REPLACE INTO depths VALUES (?, ?, ?, ?, ?)",
                                (record["step"], int(record["final"]), int(depth), _clean(r["bpb"]),
                                 _clean(change[int(depth) - 1]) if int(depth) <= len(change) else None))
            for b in record.get("by_position", []):  # bins of positions in the documents, by their first
                self.db.execute("INSERT OR REPLACE INTO positions VALUES (?, ?, ?, ?, ?)",
                                (record["step"], int(record["final"]), b["from"], _clean(b["bpb"]), b["tokens"]))

    def close(self) -> None:
        self.db.close()


class MetricsReader:
    """Read-only access for the dashboard and tests (opened with mode=ro: the reader cannot write)."""

    def __init__(self, run_dir: Path):
        path = Path(run_dir) / FILENAME
        self.db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30, check_same_thread=False)
        self.db.row_factory = sqlite3.Row

    def rows(self, table: str, after: int = -1) -> list[dict]:
        if table not in TABLES:
            raise ValueError(f"unknown table {table}")
        try:
            cur = self.db.execute(f"SELECT * FROM {table} WHERE step > ? ORDER BY step", (after,))
        except sqlite3.OperationalError as e:  # a run written before the table existed
            if "no such table" in str(e):
                return []
            raise
        return [dict(r) for r in cur.fetchall()]

    def meta(self) -> dict:
        return {r["key"]: json.loads(r["value"]) for r in self.db.execute("SELECT key, value FROM meta")}

    def close(self) -> None:
        self.db.close()
