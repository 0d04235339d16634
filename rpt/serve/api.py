"""The HTTP face of `rpt serve` (Starlette): the OpenAI completions API where it applies, /v1/models, /health and
/metrics. Each request is checked whole before anything runs; every refusal is an OpenAI-shaped error
({"error": {"message", "type", "param", "code"}}) with its HTTP status. The routes know the scheduler only
(submit, cancel); the engine's thread tells each stream's text through an asyncio queue of the request's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rpt.data.text import not_utf8_at, shown
from rpt.errors import RptError
from rpt.models.loop_exit import Exit
from rpt.serve.engine import Sampling, Stream
from rpt.serve.metrics import CONTENT_TYPE, ServeMetrics
from rpt.serve.scheduler import Busy, Draining, Scheduler

log = logging.getLogger("rpt.serve")
MAX_TOKENS = 10_000_000  # one stream's most new tokens: its memory does not grow, only its time
MAX_STOP = 4  # stop strings a request may give (as OpenAI's API)
MAX_N = 128  # choices per prompt
# the completions API's fields rpt takes; each extra (top_k, depth, exit, ignore_eos) is rpt's own
FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
          "user", "logprobs", "echo", "suffix", "best_of", "presence_penalty", "frequency_penalty", "logit_bias",
          "top_k", "depth", "exit", "ignore_eos"}


class BadRequest(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=self.headers)


class Outbox:
    """Events from the engine's thread to the event loop, without waking the loop for each: the first event after a
    quiet spell starts a task that hands out what has been posted every tick until a tick finds nothing. (A
    wake-up per token cost the engine's thread a system call, and the loop a turn, for every token of every
    stream: the engine ran 15% slower beside it.) The tick is TICK, longer under load (TICK per PER_TICK events
    the last tick handed out, at most LONGEST): a response then writes one chunk per stream per tick, carrying
    the stream's tokens of a few steps, as vLLM's stream interval, so that the HTTP side's and the client's work
    per token, on the cores the engine runs on, shrinks as the batch grows (benchmarks/results/serve.md)."""

    TICK, PER_TICK, LONGEST = 0.002, 4, 0.032

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.pending, self.lock = loop, [], threading.Lock()
        self.ticking = self.hurrying = False
        self.task: asyncio.Task | None = None

    def post(self, queue: asyncio.Queue, item, now: bool = False) -> None:
        """Hand `item` to `queue` at the next tick, or at once with `now` (a stream's last event: waiting for the
        tick would only delay the end of its response, by up to LONGEST)."""
        with self.lock:
            self.pending.append((queue, item))
            start, hurry = not self.ticking, now and not self.hurrying
            self.ticking, self.hurrying = True, self.hurrying or now
        if start:
            self.loop.call_soon_threadsafe(self._start)
        elif hurry:
            self.loop.call_soon_threadsafe(self._hand_out)

    def _start(self) -> None:
        self.task = self.loop.create_task(self._tick())  # (held: the loop keeps only a weak reference to a task)

    def _hand_out(self, last: bool = False) -> int:
        """Put what has been posted into its queues; how many. `last`: the tick's task ends if there was nothing."""
        with self.lock:
            pending, self.pending, self.hurrying = self.pending, [], False
            if last and not pending:
                self.ticking = False
        for queue, item in pending:
            queue.put_nowait(item)
        return len(pending)

    async def _tick(self) -> None:
        while handed := self._hand_out(last=True):
            await asyncio.sleep(min(self.LONGEST, self.TICK * max(1.0, handed / self.PER_TICK)))


@dataclass
class Service:
    """What the routes serve: the model's name, its tokenizer, the scheduler and the limits."""
    name: str
    tokenizer: object
    eot_id: int
    scheduler: Scheduler
    metrics: ServeMetrics
    max_prompt_bytes: int
    token: str | None = None
    loop_depth: int | None = None  # a looped model's most iterations per token (None: no loop)
    check_exit: object = None  # Exit -> None, refusing a rule the model cannot take
    created: int = field(default_factory=lambda: int(time.time()))
    outbox: Outbox | None = None  # made on the first request, in the server's event loop


@dataclass
class Completion:
    """One checked request: its prompts' token ids, choices per prompt, the streams' settings."""
    prompts: list[list[int]]  # each begins with the end of text (a document starts with it), as rpt generate's
    n: int
    stream: bool
    include_usage: bool
    continuous_usage: bool  # stream_options.continuous_usage_stats (as vLLM's): usage in every chunk
    settings: list[Sampling]  # one per choice of a prompt (the seeds differ by choice)

    @property
    def prompt_tokens(self) -> int:
        """The prompts' own tokens (the leading end of text left out), each prompt once whatever its choices, as
        OpenAI and vLLM count them."""
        return sum(len(ids) - 1 for ids in self.prompts)


def build_app(service: Service) -> Starlette:
    async def completions(request: Request) -> Response:
        try:
            body = await read_body(request, service.max_prompt_bytes)
            job = parse(body, service)
            return await run(request, job, service)
        except BadRequest as exc:
            service.metrics.requests.labels(outcome=outcome_of(exc)).inc()
            return exc.response()
        except Exception:  # a bug of rpt's: the client gets OpenAI's error shape, the log the traceback
            service.metrics.requests.labels(outcome="error").inc()
            log.exception("a completion request failed inside the server")
            return BadRequest(500, "the server failed on this request (its log holds the traceback)", "server_error",
                              code="internal_error").response()

    def model_card() -> dict:
        return {"id": service.name, "object": "model", "created": service.created, "owned_by": "rpt"}

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def model(request: Request) -> Response:
        name = request.path_params["name"]
        if name != service.name:
            return BadRequest(404, f"the model {name!r} does not exist: this server serves {service.name!r}",
                              param="model", code="model_not_found").response()
        return JSONResponse(model_card())

    async def chat(request: Request) -> Response:
        return BadRequest(404, f"{service.name!r} is a base model (no chat template): rpt serve answers "
                          "POST /v1/completions only; send the conversation as a prompt there",
                          code="unknown_url").response()

    async def health(request: Request) -> Response:
        sched = service.scheduler
        if sched.failure is not None:
            return JSONResponse({"status": "failed", "error": repr(sched.failure)}, status_code=503)
        if sched.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok", "active": sched.engine.active, "queued": sched.queued})

    async def metrics(request: Request) -> Response:
        return Response(service.metrics.text(), media_type=CONTENT_TYPE)

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                            Route("/v1/chat/completions", chat, methods=["POST"]),
                            Route("/v1/models", models, methods=["GET"]),
                            Route("/v1/models/{name:path}", model, methods=["GET"]),
                            Route("/health", health, methods=["GET"]),
                            Route("/metrics", metrics, methods=["GET"])],
                    exception_handlers={HTTPException: http_error, Exception: server_error})
    app.add_middleware(BearerToken, token=service.token, metrics=service.metrics)
    return app


async def http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own refusals (no such route, a method the route does not take) in OpenAI's error shape."""
    if exc.status_code == 404:
        message = f"there is no route {request.url.path}: rpt serve answers POST /v1/completions, GET /v1/models, " \
                  "GET /health and GET /metrics"
    elif exc.status_code == 405:
        message = f"{request.method} is not taken by {request.url.path}"
    else:
        message = exc.detail
    return BadRequest(exc.status_code, message, code={404: "unknown_url", 405: "method_not_allowed"}.get(
        exc.status_code), headers=dict(exc.headers or {})).response()


async def server_error(request: Request, exc: Exception) -> Response:
    """What a route failed with, outside the completions route's own accounting: OpenAI's error shape."""
    return BadRequest(500, "the server failed on this request (its log holds the traceback)", "server_error",
                      code="internal_error").response()


class BearerToken:
    """With --token, every route but /health needs `Authorization: Bearer TOKEN` (the scheme in any case, as HTTP's
    schemes are; a plain ASGI middleware, so that streamed answers pass through untouched)."""

    def __init__(self, app, token: str | None, metrics: ServeMetrics):
        self.app, self.token, self.metrics = app, token, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.token and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1").strip()
            scheme, _, credential = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(credential.strip().encode(), self.token.encode()):
                self.metrics.requests.labels(outcome="unauthorized").inc()
                message = "the bearer token is wrong: send the server's --token" if scheme.lower() == "bearer" else \
                    "a bearer token is needed: send the header Authorization: Bearer TOKEN"
                answer = BadRequest(401, message, "authentication_error", code="invalid_api_key").response()
                return await answer(scope, receive, send)
        return await self.app(scope, receive, send)


def outcome_of(exc: BadRequest) -> str:
    return {429: "busy", 503: "draining", 413: "too_large", 401: "unauthorized"}.get(exc.status, "bad_request")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) past `limit` bytes whether or not it says its length first."""
    too_large = BadRequest(413, f"the request body is over --max-prompt-bytes ({limit:,} bytes)",
                           code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def parse(body: bytes, service: Service) -> Completion:
    try:
        req = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(400, f"the body is not valid JSON: {exc}") from None
    if not isinstance(req, dict):
        raise BadRequest(400, "the body must be a JSON object")
    unknown = sorted(set(req) - FIELDS)
    if unknown:
        raise BadRequest(400, f"unknown field {unknown[0]!r}: this server takes {', '.join(sorted(FIELDS))}",
                         param=unknown[0])
    if req.get("model") not in (None, service.name):
        raise BadRequest(404, f"the model {req['model']!r} does not exist: this server serves {service.name!r}",
                         param="model", code="model_not_found")
    for name, allowed in (("logprobs", (None,)), ("echo", (None, False)), ("suffix", (None, "")),
                          ("best_of", (None, 1)), ("presence_penalty", (None, 0)), ("frequency_penalty", (None, 0)),
                          ("logit_bias", (None, {}))):
        if req.get(name, None) not in allowed:
            raise BadRequest(400, f"{name} is not supported by rpt serve", param=name)
    prompts = req.get("prompt")
    prompts = [prompts] if isinstance(prompts, str) else prompts
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise BadRequest(400, "prompt must be a string or a non-empty list of strings", param="prompt")
    if any(p == "" for p in prompts):
        raise BadRequest(400, "a prompt is empty: give at least one character", param="prompt")
    utf8(prompts, "prompt")
    n = integer(req, "n", 1, 1, MAX_N)
    sched = service.scheduler
    if len(prompts) * n > sched.max_streams + sched.max_queue:
        raise BadRequest(400, f"{len(prompts)} prompts x n = {n} streams can never be admitted: this server runs "
                         f"{sched.max_streams} streams and queues {sched.max_queue}", param="n")
    stop = req.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest(400, f"stop must be a non-empty string or a list of at most {MAX_STOP} non-empty strings "
                         f"(got {stop!r})", param="stop")
    utf8(stop, "stop")
    seed = req.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2 ** 63):
        raise BadRequest(400, "seed must be an integer from 0 to 2**63 - 1", param="seed")
    depth, exit_rule = looped(req, service)
    top_k = req.get("top_k")
    top_k = 0 if top_k in (None, -1) else integer(req, "top_k", 0, 0, 1 << 30, "0 or -1 for no limit, or ")
    base = Sampling(max_tokens=integer(req, "max_tokens", 16, 1, MAX_TOKENS),
                    temperature=number(req, "temperature", 1.0, 0.0, 2.0),
                    top_p=number(req, "top_p", 1.0, 0.0, 1.0, low_open=True), top_k=max(top_k, 0),
                    stop=tuple(stop), depth=depth, exit=exit_rule, ignore_eos=boolean(req, "ignore_eos", False))
    settings = [dataclasses.replace(base, seed=None if seed is None else (seed + j) % 2 ** 63)
                for j in range(n)]  # choice j of a seeded request: seed + j, so that the choices differ
    stream = boolean(req, "stream", False)
    options = req.get("stream_options")
    if options is not None and not stream:
        raise BadRequest(400, "stream_options applies to a streamed answer: give it with \"stream\": true",
                         param="stream_options")
    options = options or {}
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise BadRequest(400, "stream_options takes include_usage and continuous_usage_stats only",
                         param="stream_options")
    for name in options:
        boolean(options, name, False, f"stream_options.{name}")
    encode = service.tokenizer.encode
    ids = [[service.eot_id] + encode(p, add_special_tokens=False).ids for p in prompts]  # a document starts with EOT
    return Completion(ids, n, stream, bool(options.get("include_usage")),
                      bool(options.get("continuous_usage_stats")), settings)


def utf8(texts: list[str], name: str) -> None:
    """Refuse a string UTF-8 cannot write (a lone surrogate, e.g. "\\ud83d" without its pair): the tokenizer
    would fail on it."""
    for text in texts:
        at = not_utf8_at(text)
        if at is not None:
            raise BadRequest(400, f"{name} is not valid Unicode text: character {at + 1} is {shown(text[at])}; "
                             "send UTF-8 text (a surrogate pair's two halves together)", param=name)


def integer(req: dict, name: str, default: int, low: int, high: int, also: str = "") -> int:
    value = req.get(name, default)
    value = default if value is None else value
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise BadRequest(400, f"{name} must be an integer: {also}from {low} to {high:,} (got {value!r})", param=name)
    return value


def number(req: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = req.get(name, default)
    value = default if value is None else value
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (
            (low < value if low_open else low <= value) and value <= high):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise BadRequest(400, f"{name} must be a number in {interval} (got {value!r})", param=name)
    return float(value)


def boolean(req: dict, name: str, default: bool, param: str | None = None) -> bool:
    value = req.get(name, default)
    if not isinstance(value, bool):
        raise BadRequest(400, f"{param or name} must be true or false (got {value!r})", param=param or name)
    return value


def looped(req: dict, service: Service) -> tuple[int | None, Exit | None]:
    """A looped model's `depth` and `exit` (rpt's extra fields); refused for a model without a loop."""
    depth, rule = req.get("depth"), req.get("exit")
    if (depth is not None or rule is not None) and service.loop_depth is None:
        raise BadRequest(400, "depth and exit apply to a looped model (model.loop_core > 0); this one has no loop",
                         param="depth" if depth is not None else "exit")
    if depth is not None:
        depth = integer(req, "depth", 0, 1, service.loop_depth)
    if rule is not None:
        if not isinstance(rule, str):
            raise BadRequest(400, 'exit must be a string "CRITERION:THRESHOLD", e.g. "kl:5e-4"', param="exit")
        try:
            rule = Exit.parse(rule, name="exit")
            service.check_exit(rule)
        except RptError as exc:
            raise BadRequest(400, f"{exc.message}: {exc.fix}" if exc.fix else exc.message, param="exit") from None
    return depth, rule


async def run(request: Request, job: Completion, service: Service) -> Response:
    """Submit the request's streams; answer as they produce (stream) or once all have ended."""
    if service.outbox is None:
        service.outbox = Outbox(asyncio.get_running_loop())
    outbox, events = service.outbox, asyncio.Queue()
    arrived, metrics = time.perf_counter(), service.metrics
    seen: dict[int, tuple[int, float | None]] = {}  # stream id -> (its tokens counted, its last token's time)

    def on_event(stream: Stream, text: str, finish: str | None) -> None:  # on the engine's thread
        count, last = seen.get(stream.id, (0, None))
        for _ in range(len(stream.tokens) - count):
            last = metrics.token(arrived, last)
        seen[stream.id] = (len(stream.tokens), last)
        if finish is not None:
            metrics.finished.labels(reason=finish).inc()
        outbox.post(events, (stream, text, finish, len(stream.tokens)), now=finish is not None)

    streams = [Stream(ids, settings, on_event) for ids in job.prompts for settings in job.settings]
    try:
        service.scheduler.submit(streams)
    except Busy:
        raise BadRequest(429, "every stream slot is taken and the queue is full: retry shortly", "rate_limit_error",
                         code="server_busy", headers={"Retry-After": "1"}) from None
    except Draining:
        raise BadRequest(503, "the server is shutting down and admits no new request", "service_unavailable",
                         code="shutting_down") from None
    metrics.requests.labels(outcome="ok").inc()
    metrics.prompt_tokens.inc(job.prompt_tokens)
    answer = Answer(job, streams, events, service.scheduler, service.name)
    if job.stream:
        return StreamingResponse(answer.events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return await answer.whole(request)


class Answer:
    """One request's answer as its streams produce: server-sent events, or one JSON body once all have ended. A
    client that goes away cancels its streams that are still running."""

    def __init__(self, job: Completion, streams: list[Stream], events: asyncio.Queue, scheduler: Scheduler,
                 model: str):
        self.job, self.streams, self.queue, self.scheduler = job, streams, events, scheduler
        self.index = {s.id: i for i, s in enumerate(streams)}  # prompt p's choice j: p * n + j, as OpenAI's
        self.head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                     "model": model}
        self.chunk_head = json.dumps(self.head)[:-1] + ', "choices": [{"text": '  # each event's chunk begins so
        self.sent = {s.id: 0 for s in streams}  # each stream's tokens as of its last event handed out

    def usage(self) -> dict:
        completion = sum(self.sent.values())
        prompt = self.job.prompt_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def cancel_open(self) -> None:
        for s in self.streams:
            if s.finish_reason is None:
                self.scheduler.cancel(s)

    def chunk(self, stream: Stream, text: str, finish: str | None, tokens: int) -> str:
        self.sent[stream.id] = tokens
        usage = f', "usage": {json.dumps(self.usage())}' if self.job.continuous_usage else ""
        return (f'data: {self.chunk_head}{json.dumps(text)}, "index": {self.index[stream.id]}, "logprobs": null, '
                f'"finish_reason": {json.dumps(finish)}}}]{usage}}}\n\n')

    async def events(self):
        """The server-sent events: at each turn, one chunk per stream with the text of all its events waiting (its
        last event's finish reason and token count), the turn's chunks written together; the last turn's write
        carries the usage and the end as well."""
        open_ = len(self.streams)
        try:
            while open_:
                got = [await self.queue.get()]
                while not self.queue.empty():
                    got.append(self.queue.get_nowait())
                open_ -= sum(event[2] is not None for event in got)
                merged: dict[int, list] = {}  # a stream's events of this turn, as one: its texts joined
                for stream, text, finish, tokens in got:
                    held = merged.setdefault(stream.id, [stream, "", None, 0])
                    held[1], held[2], held[3] = held[1] + text, finish, tokens
                parts = []
                for event in merged.values():
                    if event[1] or event[2]:
                        parts.append(self.chunk(*event))
                    else:  # tokens with no whole character yet: counted, not sent
                        self.sent[event[0].id] = event[3]
                if not open_:  # the last chunks, the usage and the end in one write
                    if self.job.include_usage:
                        parts.append(f"data: {json.dumps({**self.head, 'choices': [], 'usage': self.usage()})}\n\n")
                    parts.append("data: [DONE]\n\n")
                out = "".join(parts)
                if out:
                    yield out
        finally:  # the client went away (or the server stopped): its streams leave the batch
            self.cancel_open()

    async def whole(self, request: Request) -> Response:
        texts = {s.id: [] for s in self.streams}

        async def collect():
            open_ = len(self.streams)
            while open_:
                stream, text, finish, tokens = await self.queue.get()
                self.sent[stream.id] = tokens
                texts[stream.id].append(text)
                open_ -= finish is not None

        gone, done = asyncio.ensure_future(disconnected(request)), asyncio.ensure_future(collect())
        try:
            await asyncio.wait({gone, done}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not done.done():  # the client went away: nobody reads these streams any more
                done.cancel()
                self.cancel_open()
        if not done.done() or done.cancelled():
            return Response(status_code=499)
        choices = sorted(({"text": "".join(texts[s.id]), "index": self.index[s.id], "logprobs": None,
                           "finish_reason": s.finish_reason} for s in self.streams), key=lambda c: c["index"])
        return JSONResponse({**self.head, "choices": choices, "usage": self.usage()})


async def disconnected(request: Request) -> None:
    """Returns once the client has closed its connection (the body was read whole before)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
