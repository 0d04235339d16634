"""Benchmark: `rpt serve`'s memory and its behaviour under load (issue 61's targets), against what the server said
of itself at start (its /metrics: rpt_fixed_bytes, rpt_state_bytes_per_stream, rpt_work_bytes_per_stream).

    .venv/bin/python benchmarks/serve/load.py --run runs/demo [--cases memory,load,drain]

- memory: the server's resident memory (its /proc) while 1, 32 and 128 streams run (prompts of 256 tokens, 128
  new), against fixed + prefill + streams x (state + work); and one stream of 10,000 tokens: flat after the first hundred.
- load: 256 clients at once against --max-streams 64 and --max-queue 64: each request completes or gets 429 with
  Retry-After within a second, none hangs, memory within what was said; a request after the load is served.
- drain: the same load, SIGTERM in its middle: the process exits 0 within --grace, and every admitted stream ends
  with a finish_reason.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness.py
from harness import Served, run_cases  # noqa: E402
from throughput import prompt_texts, together  # noqa: E402


def said(served: Served) -> dict:
    import httpx

    text = httpx.get(f"{served.url}/metrics").text
    figures = {}
    for name in ("rpt_fixed_bytes", "rpt_state_bytes_per_stream", "rpt_work_bytes_per_stream", "rpt_prefill_bytes"):
        figures[name] = float(next(line.split()[1] for line in text.splitlines() if line.startswith(name + " ")))
    return figures


class Sampler:
    """The server's resident memory every 20 ms while a block runs: its peak, and every sample."""

    def __init__(self, served: Served):
        self.served, self.samples, self.running = served, [], False

    def __enter__(self):
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self):
        while self.running:
            self.samples.append((time.perf_counter(), self.served.rss()))
            time.sleep(0.02)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()

    @property
    def peak(self) -> int:
        return max(r for _, r in self.samples)


def memory(run: Path, args) -> dict:
    served = Served(run, "--max-streams", "128", "--max-queue", "0")
    out = {}
    try:
        s = said(served)
        per = s["rpt_state_bytes_per_stream"] + s["rpt_work_bytes_per_stream"]
        texts = prompt_texts(run, [256] * 128, args.seed)
        for n in (1, 32, 128):
            with Sampler(served) as sampler:
                asyncio.run(together(served.url, texts[:n], [128] * n))
            stated = s["rpt_fixed_bytes"] + s["rpt_prefill_bytes"] + n * per
            out[f"streams_{n}"] = {"peak_rss_mib": sampler.peak / 2 ** 20, "stated_mib": stated / 2 ** 20,
                                   "over_stated_mib": (sampler.peak - stated) / 2 ** 20}
        with Sampler(served) as sampler:
            began = time.perf_counter()
            long = asyncio.run(together(served.url, texts[:1], [10_000]))
        times = [t for t, _ in sampler.samples]
        per_token = (times[-1] - began) / max(1, long["tokens"])
        after_100 = [r for t, r in sampler.samples if t - began > 100 * per_token + long["ttft_median_ms"] / 1000]
        out["stream_10000"] = {"tokens": long["tokens"], "rss_at_100_mib": after_100[0] / 2 ** 20,
                               "rss_max_after_mib": max(after_100) / 2 ** 20,
                               "growth_after_100_mib": (max(after_100) - after_100[0]) / 2 ** 20}
        out["said"] = {k: v / 2 ** 20 for k, v in s.items()}
    finally:
        served.stop()
    return out


async def crowd(url: str, texts: list[str], max_tokens: int, timeout: float) -> list[dict]:
    """Every text as one request at once; each request's outcome (status, seconds, finish_reason, Retry-After)."""
    import httpx

    async def ask(client, text):
        began = time.perf_counter()
        try:
            r = await client.post(f"{url}/v1/completions", json={"prompt": text, "max_tokens": max_tokens,
                                                                  "ignore_eos": True, "temperature": 0.8})
        except httpx.HTTPError as exc:
            return {"status": type(exc).__name__, "seconds": time.perf_counter() - began}
        body = r.json()
        return {"status": r.status_code, "seconds": time.perf_counter() - began,
                "reason": body["choices"][0]["finish_reason"] if r.status_code == 200 else None,
                "retry_after": r.headers.get("retry-after")}

    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=len(texts) + 8)) as client:
        return await asyncio.gather(*(ask(client, t) for t in texts))


def summarise(outcomes: list[dict]) -> dict:
    by_status = {}
    for o in outcomes:
        by_status[str(o["status"])] = by_status.get(str(o["status"]), 0) + 1
    refused = [o for o in outcomes if o["status"] == 429]
    return {"by_status": by_status, "refused_slowest_s": max((o["seconds"] for o in refused), default=None),
            "refused_without_retry_after": sum(o["retry_after"] is None for o in refused),
            "served_reasons": sorted({o["reason"] for o in outcomes if o["status"] == 200}),
            "slowest_s": max(o["seconds"] for o in outcomes)}


def load(run: Path, args) -> dict:
    served = Served(run, "--max-streams", "64", "--max-queue", "64")
    try:
        s = said(served)
        texts = prompt_texts(run, [64] * args.clients, args.seed)
        with Sampler(served) as sampler:
            outcomes = asyncio.run(crowd(served.url, texts, 32, timeout=300))
        stated = s["rpt_fixed_bytes"] + s["rpt_prefill_bytes"] + 64 * (s["rpt_state_bytes_per_stream"]
                                                                       + s["rpt_work_bytes_per_stream"])
        after = asyncio.run(crowd(served.url, texts[:1], 8, timeout=60))[0]
    finally:
        served.stop()
    return {**summarise(outcomes), "peak_rss_mib": sampler.peak / 2 ** 20, "stated_mib": stated / 2 ** 20,
            "after_the_load": after["status"]}


def drain(run: Path, args) -> dict:
    grace = 5.0
    served = Served(run, "--max-streams", "64", "--max-queue", "64", "--grace", str(grace))
    texts = prompt_texts(run, [64] * args.clients, args.seed)
    timer = threading.Timer(2.0, lambda: served.proc.send_signal(signal.SIGTERM))
    began = time.perf_counter()
    timer.start()
    outcomes = asyncio.run(crowd(served.url, texts, 400, timeout=120))
    try:
        code = served.proc.wait(timeout=grace + 30)
    except Exception:  # noqa: BLE001  (reported as a hang)
        code = "hung"
    exited = time.perf_counter() - began - 2.0
    admitted = [o for o in outcomes if o["status"] == 200]
    return {**summarise(outcomes), "exit_code": code, "exited_after_signal_s": exited, "grace_s": grace,
            "admitted_without_reason": sum(o["reason"] is None for o in admitted)}


CASES = {"memory": memory, "load": load, "drain": drain}


def main() -> None:
    run_cases(__doc__, CASES, lambda p: p.add_argument("--clients", type=int, default=256))


if __name__ == "__main__":
    sys.exit(main())
