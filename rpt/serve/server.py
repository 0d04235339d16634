"""`rpt serve RUN_DIR`: the run's model behind the OpenAI-compatible API, on uvicorn. This is where serving is put
together (the engine, the scheduler and its thread, the metrics, the app) and where it ends: SIGTERM or Ctrl-C
drains (nothing new admitted, the running streams finish within --grace seconds or end with finish_reason
"abort"), then the process exits 0; a second signal cuts at once.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from pathlib import Path

import uvicorn

from rpt.errors import RptError
from rpt.serve.api import Service, build_app
from rpt.serve.engine import Engine, Sampling, Stream
from rpt.serve.metrics import ServeMetrics
from rpt.serve.scheduler import Scheduler

SAMPLING_WORK = 24  # bytes per vocabulary entry a decoding row may hold at once: logits, sorted copy, order, sums


class DrainingServer(uvicorn.Server):
    """uvicorn's server, with a drain before it stops: its own signal handling ends the process with status 0."""

    def __init__(self, config: uvicorn.Config, scheduler: Scheduler, grace: float):
        super().__init__(config)
        self.scheduler, self.grace = scheduler, grace

    def handle_exit(self, sig, frame) -> None:
        if self.scheduler.draining:  # a second signal: stop now
            self.scheduler.drain(0.0)
            self.should_exit = self.force_exit = True
            return
        print(f"draining: no new requests; running streams have {self.grace:g} s to finish", file=sys.stderr,
              flush=True)
        self.scheduler.drain(self.grace)
        threading.Thread(target=self._exit_when_drained, daemon=True).start()

    def _exit_when_drained(self) -> None:
        deadline = time.monotonic() + self.grace + 5.0
        while not self.scheduler.idle() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.1)  # the streams' last events reach their responses
        self.should_exit = True


def resident_bytes() -> int:
    """This process's resident memory (Linux's /proc; 0 where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def memory_plan(engine: Engine, max_streams: int, vocab: int) -> dict:
    """What the server says of its memory at start: one stream's state, its working memory while it decodes (its
    logits and their sampling, freed between steps), the limit's total, and the fixed part resident now (the
    weights, the runtime, the warmed-up kernels)."""
    state = engine.state_bytes(1)
    work = SAMPLING_WORK * vocab
    return {"state_per_stream": state, "work_per_stream": work, "max_streams": max_streams,
            "limit_bytes": max_streams * (state + work), "fixed_bytes": resident_bytes()}


def mib(n: float) -> str:
    return f"{n / 2 ** 20:,.1f} MiB" if n >= 2 ** 20 else f"{n / 1024:,.1f} KiB"


def serve(run_dir: str, checkpoint: str, host: str, port: int, max_streams: int, max_queue: int,
          max_prompt_bytes: int, token: str | None, device: str | None, grace: float, prefill_chunk: int) -> None:
    from rpt import kernels
    from rpt.data.tokenizer import eot_id, token_bytes
    from rpt.kernels.cpu.products import RowProducts, row_products
    from rpt.train.run_dir import load_run

    for name, value in (("--max-streams", max_streams), ("--max-prompt-bytes", max_prompt_bytes),
                        ("--prefill-chunk", prefill_chunk)):
        if value < 1:
            raise RptError(f"{name} {value} must be 1 or more", f"e.g. {name} 64")
    if max_queue < 0 or grace < 0:
        raise RptError("--max-queue and --grace must be 0 or more", "e.g. --max-queue 64 --grace 30")
    cfg, model, tokenizer, path, _ = load_run(run_dir, checkpoint, device)
    eot = eot_id(tokenizer)
    engine = Engine(model, eot, cfg.data.reset_at_documents, token_bytes(tokenizer), prefill_chunk)
    ops = kernels.current().loops() if engine.device.type == "cpu" else None
    one_row = RowProducts(ops) if ops is not None else None  # a lone stream's products, as `rpt generate` runs them
    products = (lambda: row_products(model, one_row)) if one_row is not None else contextlib.nullcontext
    with products():  # a first request pays no build or first-call cost
        warm = Stream([eot, eot], Sampling(max_tokens=2, temperature=0), lambda *_: None)
        engine.add(warm)
        while engine.active:
            engine.step()
    plan = memory_plan(engine, max_streams, cfg.model.vocab_size)
    metrics = ServeMetrics(plan["state_per_stream"], plan["work_per_stream"], plan["fixed_bytes"])
    scheduler = Scheduler(engine, max_streams, max_queue, metrics, products)
    m = cfg.model
    service = Service(Path(run_dir).resolve().name, tokenizer, eot, scheduler, metrics, max_prompt_bytes, token,
                      loop_depth=m.loop_cap if m.loop_core else None, check_exit=lambda rule: rule.check(m))
    app = build_app(service)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=grace + 5,
                            lifespan="off")
    server = DrainingServer(config, scheduler, grace)
    print(f"serving {service.name} ({path}) as model {service.name!r}: {m.cell} {m.n_layers} x {m.d_model}, "
          f"{sum(p.numel() for p in model.parameters()):,} parameters, on {engine.device}", flush=True)
    print(f"memory: one stream's state {mib(plan['state_per_stream'])}, and up to {mib(plan['work_per_stream'])} "
          f"of logits while it decodes; --max-streams {max_streams} hold {mib(plan['limit_bytes'])}; fixed "
          f"{mib(plan['fixed_bytes'])} (weights, runtime: resident now); --max-queue {max_queue} more wait, "
          "whole prompts held", flush=True)
    print("no context limit: a stream's memory is its state, the same at any length", flush=True)
    print(f"listening on http://{host}:{port}/v1" + (" (bearer token required)" if token else ""), flush=True)
    scheduler.start()
    try:
        server.run()
    finally:
        scheduler.close()

