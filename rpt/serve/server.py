"""`rpt serve RUN_DIR`: the run's model behind the OpenAI-compatible API, on uvicorn. This is where serving is put
together (the engine on the main thread, the metrics, the app on uvicorn's thread) and where it ends: SIGTERM or
Ctrl-C drains (nothing new admitted, the running streams finish within --grace seconds less half a second, or end
with finish_reason "abort"), then the process exits 0 within --grace; a second signal cuts at once.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import threading
import time
from pathlib import Path

import uvicorn

from rpt.errors import RptError
from rpt.net import open_warning
from rpt.models.decoder import Decoder
from rpt.serve.api import Service, build_app
from rpt.serve.config import ServeConfig
from rpt.serve.engine import Engine, Sampling, Stream
from rpt.serve.metrics import ServeMetrics
from rpt.serve.scheduler import Scheduler

SHUTDOWN = 0.5  # seconds of --grace kept for the shutdown itself, so that the process is gone within --grace
HTTP_ALLOWANCE = 32 << 20  # the HTTP side's connections and held requests: 256 clients at once took up to 14 MiB
SAMPLING_WORK = 24  # bytes per vocabulary entry a decoding row may hold at once: logits, sorted copy, order, sums


class Drain:
    """SIGTERM and Ctrl-C: the first drains (nothing new admitted, `grace` seconds for what runs), a second cuts at
    once. Installed on the main thread, where the engine runs; uvicorn runs on a thread of its own and installs
    none of its own (so it never re-raises the signal: the process exits 0)."""

    def __init__(self, scheduler: Scheduler, grace: float):
        self.scheduler, self.grace = scheduler, grace
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self)

    def __call__(self, sig, frame) -> None:
        if self.scheduler.draining:
            self.scheduler.drain(0.0)
            return
        cut = max(0.0, self.grace - SHUTDOWN)
        print(f"draining: no new requests; running streams have {cut:g} s to finish", file=sys.stderr, flush=True)
        self.scheduler.drain(cut)


def resident_bytes() -> int:
    """This process's resident memory (Linux's /proc; 0 where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def memory_plan(engine: Engine, max_streams: int, model_cfg) -> dict:
    """What the server says of its memory at start: one stream's state, its working memory while it decodes (its
    logits and their sampling, freed between steps), the limit's total, the fixed part resident now (the weights,
    the runtime, the warmed-up kernels) with an allowance for the HTTP side's connections and held requests, and a
    prefill's working memory (a step's prompt tokens through the
    sequence form: their inputs, one layer's projections and outputs at a time, generously)."""
    state = engine.state_bytes(1)
    work = SAMPLING_WORK * model_cfg.vocab_size
    hidden = model_cfg.d_hidden or 2 * model_cfg.d_model
    prefill = engine.prefill_tokens * 4 * (model_cfg.d_model + 8 * hidden)
    return {"state_per_stream": state, "work_per_stream": work, "max_streams": max_streams,
            "limit_bytes": max_streams * (state + work), "fixed_bytes": resident_bytes() + HTTP_ALLOWANCE,
            "prefill_bytes": prefill}


def warm_up(engine: Engine, eot: int, max_streams: int) -> None:
    """Streams of two tokens through the engine at every batch size the products distinguish (`batch_shapes`), and
    the decoder's products at each (Decoder.warm: a two-level head's that only uncertain rows run too): a first
    request pays no build or first-call cost, and the packings and what oneDNN keeps per shape are made now, so
    that the fixed part measured after this holds them."""
    for rows in batch_shapes(max_streams):
        for _ in range(rows):
            engine.add(Stream([eot, eot], Sampling(max_tokens=2, temperature=0), lambda *_: None))
        while engine.active:
            engine.step()
        engine.decoder.warm(rows)


def batch_shapes(max_streams: int) -> list[int]:
    """Decode batches of every size the packed products distinguish (RowProducts: one row or two, then powers of
    two), up to `max_streams` rows."""
    from rpt.kernels.cpu.products import RowProducts

    sizes, n = [1], 2
    while n < 2 * max_streams and n <= RowProducts.MANY_ROWS:
        sizes.append(min(n, max_streams))
        n *= 2
    return sorted(set(sizes))


def check_free(host: str, port: int) -> None:
    """Refuse, with the fix, an address this process cannot listen on (taken, or not this machine's)."""
    import socket

    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise RptError(f"--host {host}: {exc.strerror}", "give an address of this machine, e.g. 127.0.0.1") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a port in TIME_WAIT is free
        try:
            probe.bind(address)
        except OSError as exc:
            raise RptError(f"cannot listen on {host}:{port}: {exc.strerror}",
                           f"choose another --port (e.g. --port {port + 1 if port < 65535 else 8000}, or 0 for any "
                           "free one), or stop what uses it") from None


def mib(n: float) -> str:
    return f"{n / 2 ** 20:,.1f} MiB" if n >= 2 ** 20 else f"{n / 1024:,.1f} KiB"


def serve(run_dir: str, serving: ServeConfig) -> None:
    from rpt import kernels
    from rpt.data.tokenizer import eot_id, token_bytes
    from rpt.kernels.cpu.products import row_products
    from rpt.train.run_dir import load_run

    host, port, max_streams, token = serving.host, serving.port, serving.max_streams, serving.token
    check_free(host, port)  # before the model loads and warms up
    run_cfg, model, tokenizer, path, _ = load_run(run_dir, serving.checkpoint, serving.device)
    eot = eot_id(tokenizer)
    decoder = Decoder.on(model, kernels.current())  # the steps' products on packed weights (as `rpt generate`)
    packed = decoder.products
    engine = Engine(model, eot, run_cfg.data.reset_at_documents, token_bytes(tokenizer), serving.prefill_chunk,
                    serving.prefill_tokens, decoder)
    products = (lambda: row_products(model, packed)) if packed is not None else contextlib.nullcontext
    with products():
        warm_up(engine, eot, max_streams)
    gc.collect()
    gc.freeze()  # what start-up made is never collected: a full collection over it held the GIL 143 ms mid-load
    plan = memory_plan(engine, max_streams, run_cfg.model)
    metrics = ServeMetrics(plan["state_per_stream"], plan["work_per_stream"], plan["fixed_bytes"],
                           plan["prefill_bytes"])
    scheduler = Scheduler(engine, max_streams, serving.max_queue, metrics, products)
    m = run_cfg.model
    service = Service(Path(run_dir).resolve().name, tokenizer, eot, scheduler, metrics, serving.max_prompt_bytes, token,
                      loop_depth=m.loop_cap if m.loop_core else None, check_exit=lambda rule: rule.check(m, name="exit"))
    app = build_app(service)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    http = threading.Thread(target=server.run, name="rpt-http", daemon=True)
    http.start()
    while not server.started:
        if not http.is_alive():
            raise RptError(f"the server could not listen on {host}:{port}", "choose another --port (or --host)")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]  # the port taken (--port 0: a free one)
    print(f"serving {service.name} ({path}) as model {service.name!r}: {m.cell} {m.n_layers} x {m.d_model}, "
          f"{sum(p.numel() for p in model.parameters()):,} parameters, on {engine.device}", flush=True)
    print(f"memory: one stream's state {mib(plan['state_per_stream'])}, and up to {mib(plan['work_per_stream'])} "
          f"of logits while it decodes; --max-streams {max_streams} hold {mib(plan['limit_bytes'])}; fixed "
          f"{mib(plan['fixed_bytes'])} (weights, runtime: resident now; connections: {mib(HTTP_ALLOWANCE)}), and up "
          f"to {mib(plan['prefill_bytes'])} "
          f"while prompts are prefilled; --max-queue {serving.max_queue} more wait, whole prompts held", flush=True)
    print("no context limit: a stream's memory is its state, the same at any length", flush=True)
    print(f"listening on http://{host}:{port}/v1" + (" (bearer token required)" if token else ""), flush=True)
    warning = open_warning(host, token, "the API")
    if warning:
        print(warning, file=sys.stderr, flush=True)
    Drain(scheduler, serving.grace)
    try:
        scheduler.run()  # here, on the main thread, until a drain has ended every stream
        time.sleep(0.1)  # the last events reach their responses
    finally:
        server.should_exit = True
        http.join(timeout=3)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # drained: every response is written; the interpreter's teardown (torch's) would take a second more
