"""The catalogue of bad input: every user-facing entry point, given something wrong, answers with one clear
message that names the fix (exit code 2, no traceback) and leaves no half-written output behind."""

from __future__ import annotations

import hashlib
import itertools
import json
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TIMEOUT = 300

# Each case is a fresh process running `python -m rpt ARGS`, forked from an interpreter that has imported rpt
# and torch once (importing torch is most of a refused command's time): the child runs the module as
# `python -m` does, with its own stdout, stderr and exit status, and an uncaught exception prints its traceback.
FORK_SERVER = r"""
import json, os, runpy, sys, traceback
import rpt.cli, torch
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        for fd, path in ((1, job["out"]), (2, job["err"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        sys.argv = ["rpt", *job["argv"]]
        code = 0
        try:
            runpy.run_module("rpt", run_name="__main__", alter_sys=True)
        except SystemExit as exc:
            if isinstance(exc.code, int):
                code = exc.code
            elif exc.code is not None:  # sys.exit("message"): printed, status 1, as Python does
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
"""


class Forker:
    """One fork server per thread of the pool below."""

    def __init__(self, folder: Path):
        self.folder, self.local, self.servers, self.numbers = folder, threading.local(), [], itertools.count()

    def __call__(self, *args: str) -> subprocess.CompletedProcess:
        if not hasattr(self.local, "server"):
            self.local.server = subprocess.Popen([sys.executable, "-c", FORK_SERVER], stdin=subprocess.PIPE,
                                                 stdout=subprocess.PIPE, text=True)
            self.servers.append(self.local.server)
        n = next(self.numbers)  # atomic: the two threads never share a case's files
        out, err = self.folder / f"{n}.out", self.folder / f"{n}.err"
        server = self.local.server
        server.stdin.write(json.dumps({"argv": list(args), "out": str(out), "err": str(err)}) + "\n")
        server.stdin.flush()
        code = int(server.stdout.readline())
        return subprocess.CompletedProcess(args, code, out.read_text(), err.read_text())

    def close(self) -> None:
        for server in self.servers:
            server.stdin.close()
            server.wait(timeout=TIMEOUT)


def snapshot(folder: Path) -> dict[str, str] | None:
    """Every file under a folder with its checksum (its logs aside, which may record the refused attempt)."""
    if not folder.exists():
        return None
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.relative_to(folder).parts[0] != "logs"}


def test_every_entry_point_refuses_bad_input_clearly_and_writes_nothing(tmp_path, tiny_data, shakespeare_text):
    (tmp_path / "io").mkdir()
    rpt = Forker(tmp_path / "io")
    try:
        catalogue(rpt, tmp_path, tiny_data, shakespeare_text)
    finally:
        rpt.close()


def catalogue(rpt, tmp_path, tiny_data, shakespeare_text) -> None:
    small = ["--set", "model.d_model=32", "--set", "train.batch_size=4", "--set", "train.seq_len=16"]
    data = ["--set", f"data.path={tiny_data}"]
    # a finished run, to resume and evaluate wrongly
    run = tmp_path / "run"
    done = rpt("train", "--run-dir", str(run), *data, *small, "--set", "train.max_steps=3")
    assert done.returncode == 0, done.stderr[-2000:]
    # data prepared with another tokenizer
    text = tmp_path / "other.txt"
    text.write_text(shakespeare_text[:200_000])
    other = tmp_path / "other-data"
    assert rpt("prepare", "--input", str(text), "--out", str(other), "--vocab-size", "280").returncode == 0
    # data whose token file holds an id beyond its vocabulary (same size, so it passes the size check)
    import shutil

    import numpy as np
    damaged = tmp_path / "damaged-data"
    shutil.copytree(tiny_data, damaged)
    train_bin = next(damaged.glob("train.*"))
    ids = np.memmap(train_bin, dtype=json.loads((damaged / "meta.json").read_text())["dtype"], mode="r+")
    ids[100] = 5000
    ids.flush()
    del ids
    # inputs that are wrong in themselves
    (tmp_path / "bad.toml").write_text("[train\nmax_steps = 3\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "afile").write_text("not a folder")
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = str(busy.getsockname()[1])
    new = tmp_path / "new"
    jsonl = tmp_path / "records.jsonl"
    jsonl.write_text("".join(json.dumps({"body": shakespeare_text[i * 500:(i + 1) * 500], "id": i}) + "\n"
                             for i in range(20)))
    notjson = tmp_path / "notjson.jsonl"
    notjson.write_text("this is not json\n" * 20)

    cases = [  # (what, argv, text the message must hold, folders that must stay as they were)
        ("malformed TOML", ["train", "--config", str(tmp_path / "bad.toml"), "--run-dir", str(new)], "bad.toml", [new]),
        ("unknown key", ["train", "--run-dir", str(new), *data, "--set", "train.max_stepz=3"],
         "did you mean 'train.max_steps'", [new]),
        ("mistyped value", ["train", "--run-dir", str(new), *data, "--set", "train.max_steps=many"], "train.max_steps",
         [new]),
        ("missing data", ["train", "--run-dir", str(new), "--set", f"data.path={tmp_path / 'nowhere'}"],
         "not a prepared dataset", [new]),
        ("empty data", ["prepare", "--input", str(tmp_path / "empty"), "--out", str(tmp_path / "prep")],
         "no input files", [tmp_path / "prep"]),
        ("tokenizer of other data", ["eval", str(run), "--data", str(other)], "another tokenizer", [run]),
        ("token ids beyond the model's vocabulary", ["train", "--run-dir", str(new), *data, *small,
         "--set", "model.vocab_size=100"], "smaller than the data's vocabulary", [new]),
        ("token ids beyond the data's vocabulary", ["train", "--run-dir", str(new), "--set", f"data.path={damaged}",
         *small], "token id 5000", [new]),
        ("checkpoint of another shape", ["train", "--run-dir", str(run), "--resume", *data, *small,
         "--set", "model.d_model=48", "--set", "train.max_steps=6"], "blocks.0.cell", [run]),
        ("unwritable run directory", ["train", "--run-dir", str(tmp_path / "afile"), *data], "is a file", []),
        ("pipeline deeper than the blocks", ["train", "--run-dir", str(new), *data, "--set", "parallel.pp=5"],
         "larger than model.n_layers", [new]),
        ("world size not divisible by pp", ["train", "--run-dir", str(new), *data, *small, "--nproc", "3",
         "--set", "parallel.pp=2"], "world size 3 is not divisible by parallel.pp = 2", [new]),
        ("bad profile range", ["train", "--run-dir", str(new), *data, "--profile", "ten:12"], "START:END", [new]),
        ("dashboard port in use", ["monitor", str(run), "--port", port], f"cannot listen on 127.0.0.1:{port}", [run]),
        ("dashboard of a folder that is no run", ["monitor", str(tmp_path / "empty")], "not a run directory", []),
        ("resume of a folder that holds no run", ["train", "--resume", "--run-dir", str(new)], "holds no run", [new]),
        ("resume of a run whose budget is spent", ["train", "--resume", "--run-dir", str(run)],
         "already spent its budget", [run]),
        ("FSDP with a parameter server", ["train", "--run-dir", str(new), *data, *small, "--nproc", "2",
         "--set", "parallel.fsdp=2", "--set", "comm.mode=ps-sharded"], "FSDP reduce-scatters the gradients", [new]),
        ("FSDP with fp16", ["train", "--run-dir", str(new), *data, *small, "--set", "parallel.fsdp=2",
         "--set", "train.precision=fp16"], "use precision bf16", [new]),
        ("mistyped checkpoint", ["eval", str(run), "--checkpoint", "bestt"], "no complete checkpoint 'bestt'", [run]),
        ("checkpoint folder that does not exist", ["generate", str(run), "--checkpoint", "no/such/folder"],
         "step_00000003", [run]),
        ("mistyped cell, rpt config", ["config", "--set", "model.cell=lstmm"], "did you mean 'lstm'", []),
        ("mistyped gate, rpt config", ["config", "--set", "model.cell=modlstm", "--set", "model.gate=expp"],
         "did you mean 'exp'", []),
        ("a gate nobody registered", ["config", "--set", "model.cell=modlstm", "--set", "model.gate=softsign01"],
         "model.imports", []),
        ("data.path at a text file", ["train", "--run-dir", str(new), "--set", f"data.path={text}"],
         f"rpt prepare --input {text} --out data/other", [new]),
        ("jsonl without the text field", ["prepare", "--input", str(jsonl), "--out", str(tmp_path / "prep")],
         "--text-field body", [tmp_path / "prep"]),
        ("jsonl lines that are not JSON", ["prepare", "--input", str(notjson), "--out", str(tmp_path / "prep")],
         "not JSON objects", [tmp_path / "prep"]),
        ("plan for an impossible layout", ["plan", "--world-size", "6", *data, "--set", "model.n_layers=4",
         "--set", "parallel.pp=4"], "not divisible", []),
    ]
    def check(case) -> str | None:
        what, argv, expected, folders = case
        before = {folder: snapshot(folder) for folder in folders}  # a new run's folder: None, and must stay absent
        proc = rpt(*argv)
        problems = []
        if proc.returncode != 2:
            problems.append(f"exit code {proc.returncode}")
        if expected not in proc.stderr:
            problems.append(f"no '{expected}' in the message")
        if "fix:" not in proc.stderr or "Traceback" in proc.stderr:
            problems.append("not one message with its fix")
        for folder in folders:
            if snapshot(folder) != before[folder]:
                problems.append(f"{folder.name} was written to")
        return f"{what}: {', '.join(problems)}\n    {proc.stderr.strip()[-600:]}" if problems else None

    with ThreadPoolExecutor(max_workers=2) as pool:
        failures = [f for f in pool.map(check, cases) if f]
    busy.close()
    assert not failures, "\n".join(failures)
