"""What the benchmark scripts share: timing a function on a device, greedy generation speed, and `rpt train` run
as a user runs it (a fresh process, the run's files read back). Imported by the scripts of the area folders
(each is run as `python benchmarks/AREA/NAME.py` and puts this folder on the path). The emulated cluster's scripts
(benchmarks/comm/) launch `rpt train` their own way: one torchrun per node, each in its network namespace."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int, warmup: int = 1, median: bool = False) -> float:
    """Seconds of one call of `fn` on `device` (its queue drained before and after each): the best of `repeats`
    calls after `warmup` untimed ones, or their median."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        began = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - began)
    return sorted(times)[len(times) // 2] if median else min(times)


@torch.no_grad()
def generation_speed(model, tokens: int = 200, **generate) -> float:
    """Greedy tokens per second of one row after a one-token prompt (the prompt's forward and the first token left
    out), with the CPU's one-row products where the model runs on the CPU; `generate`: more of model.generate's
    arguments (depth, exit, shared)."""
    from rpt import kernels
    from rpt.models.decoder import Decoder

    prompt = torch.zeros(1, dtype=torch.long, device=next(model.parameters()).device)
    stream = Decoder.on(model, kernels.current()).generate(prompt, tokens, temperature=0, **generate)
    next(stream)
    began = time.perf_counter()
    count = sum(1 for _ in stream)
    return count / (time.perf_counter() - began)


def rpt_train(run_dir: Path, sets: dict | list, config: str | None = None, nproc: int | None = None,
              env: dict | None = None, timeout: float | None = None, quiet: bool = True) -> subprocess.CompletedProcess:
    """`rpt train --run-dir RUN_DIR [--config CONFIG] [--nproc N] --set K=V ...` in a fresh process from the
    repository's root; its output captured (`quiet`) or passed through. A failed run stops the benchmark with the
    end of its error."""
    pairs = sets.items() if isinstance(sets, dict) else (kv.split("=", 1) for kv in sets)
    cmd = [sys.executable, "-m", "rpt", "train", "--run-dir", str(run_dir),
           *(["--config", str(config)] if config else []), *(["--nproc", str(nproc)] if nproc else []),
           *(a for k, v in pairs for a in ("--set", f"{k}={v}"))]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=quiet, text=True, timeout=timeout)
    if done.returncode:
        raise SystemExit(f"rpt train failed ({' '.join(cmd[1:])}):\n{(done.stderr or '')[-3000:]}")
    return done


def metrics(run_dir: Path, kind: str | None = None) -> list[dict]:
    """A run's metrics.jsonl records (those of one `kind`: train, eval)."""
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if kind is None or r["kind"] == kind]


def summary(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())


def commit() -> str:
    """The short hash of the checkout the benchmark runs from (a row's identity with its date)."""
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=REPO).stdout.strip()


class Served:
    """`rpt serve RUN_DIR ARGS` as a process of its own on a free loopback port, waited for until /health answers;
    `rss()` reads its resident memory, `stop()` ends it (SIGTERM: its drain; then a kill after `timeout`)."""

    def __init__(self, run_dir: Path, *args: str, timeout: float = 180):
        import socket
        import threading

        import httpx

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "rpt", "serve", str(run_dir), "--port", str(self.port),
                                      *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit("rpt serve stopped:\n" + "".join(self.lines))
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.proc.kill()
        raise SystemExit(f"rpt serve did not answer in {timeout:g} s:\n" + "".join(self.lines))

    def rss(self) -> int:
        import os

        with open(f"/proc/{self.proc.pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def stop(self, timeout: float = 60) -> int | None:
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def run_cases(doc: str, cases: dict, add_arguments=None) -> None:
    """The command line of a script made of cases (`cases`: name -> fn(run, args) -> figures): --run, --cases,
    --seed, --out, and the script's own (`add_arguments(parser)`); each case's figures printed as JSON as it ends,
    all of them written to --out."""
    import argparse

    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--run", type=Path, required=True, help="a finished run directory (the demo's, for the targets)")
    p.add_argument("--cases", default=",".join(cases), help=f"some of {', '.join(cases)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="also write the figures as JSON here")
    if add_arguments:
        add_arguments(p)
    args = p.parse_args()
    results = {"commit": commit(), "run": str(args.run)}
    for name in args.cases.split(","):
        results[name] = cases[name](args.run, args)
        print(json.dumps({name: results[name]}, indent=1), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
