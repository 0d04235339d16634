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

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rpt.errors import RptError
from rpt.models.loop_exit import Exit
from rpt.serve.engine import Sampling, Stream
from rpt.serve.metrics import CONTENT_TYPE, ServeMetrics
from rpt.serve.protocol import (Choice, CompletionRequest, CompletionResponse, ErrorDetail, ErrorResponse,
                                ModelCard, ModelList, StreamOptions, Usage, refusal)
from rpt.serve.scheduler import Busy, Draining, Scheduler

log = logging.getLogger("rpt.serve")


class BadRequest(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers or {}

    def response(self) -> Response:
        body = ErrorResponse(error=ErrorDetail(message=self.message, type=self.kind, param=self.param, code=self.code))
        return Response(body.model_dump_json(), status_code=self.status, headers=self.headers,
                        media_type="application/json")


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

    def model_card() -> ModelCard:
        return ModelCard(id=service.name, created=service.created)

    async def models(request: Request) -> Response:
        return Response(ModelList(data=[model_card()]).model_dump_json(), media_type="application/json")

    async def model(request: Request) -> Response:
        name = request.path_params["name"]
        if name != service.name:
            return BadRequest(404, f"the model {name!r} does not exist: this server serves {service.name!r}",
                              param="model", code="model_not_found").response()
        return Response(model_card().model_dump_json(), media_type="application/json")

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
    """The request checked whole (protocol.py's rules, then what needs this server), as the engine's streams'
    settings and the prompts' token ids."""
    try:
        raw = json.loads(body)  # (Python's parser: a lone surrogate reaches the prompt's rule, which names it)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(400, f"the body is not valid JSON: {exc}") from None
    try:
        req = CompletionRequest.model_validate(raw)
    except ValidationError as exc:
        message, param = refusal(exc)
        raise BadRequest(400, message, param=param) from None
    if req.model not in (None, service.name):
        raise BadRequest(404, f"the model {req.model!r} does not exist: this server serves {service.name!r}",
                         param="model", code="model_not_found")
    n, sched = req.n, service.scheduler
    if len(req.prompts) * n > sched.max_streams + sched.max_queue:
        raise BadRequest(400, f"{len(req.prompts)} prompts x n = {n} streams can never be admitted: this server "
                         f"runs {sched.max_streams} streams and queues {sched.max_queue}", param="n")
    if req.stream_options is not None and not req.stream:
        raise BadRequest(400, "stream_options applies to a streamed answer: give it with \"stream\": true",
                         param="stream_options")
    depth, exit_rule = looped(req, service)
    base = Sampling(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                    top_k=max(req.top_k, 0), stop=req.stops, depth=depth, exit=exit_rule, ignore_eos=req.ignore_eos)
    settings = [dataclasses.replace(base, seed=None if req.seed is None else (req.seed + j) % 2 ** 63)
                for j in range(n)]  # choice j of a seeded request: seed + j, so that the choices differ
    options = req.stream_options or StreamOptions()
    encode = service.tokenizer.encode
    ids = [[service.eot_id] + encode(p, add_special_tokens=False).ids  # a document starts with EOT
           for p in req.prompts]
    return Completion(ids, n, req.stream, options.include_usage, options.continuous_usage_stats, settings)


def looped(req: CompletionRequest, service: Service) -> tuple[int | None, Exit | None]:
    """A looped model's `depth` and `exit` (rpt's extra fields); refused for a model without a loop."""
    if (req.depth is not None or req.exit is not None) and service.loop_depth is None:
        raise BadRequest(400, "depth and exit apply to a looped model (model.loop_core > 0); this one has no loop",
                         param="depth" if req.depth is not None else "exit")
    if req.depth is not None and req.depth > service.loop_depth:
        raise BadRequest(400, f"depth must be an integer from 1 to {service.loop_depth} (got {req.depth})",
                         param="depth")
    rule = req.exit
    if rule is not None:
        try:
            rule = Exit.parse(rule, name="exit")
            service.check_exit(rule)
        except RptError as exc:
            raise BadRequest(400, f"{exc.message}: {exc.fix}" if exc.fix else exc.message, param="exit") from None
    return req.depth, rule


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
        self.id, self.created, self.model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), model
        self.sent = {s.id: 0 for s in streams}  # each stream's tokens as of its last event handed out

    def usage(self) -> Usage:
        completion = sum(self.sent.values())
        prompt = self.job.prompt_tokens
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def body(self, choices: list[Choice], usage: Usage | None) -> str:
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                  usage=usage).dumped()

    def cancel_open(self) -> None:
        for s in self.streams:
            if s.finish_reason is None:
                self.scheduler.cancel(s)

    def chunk(self, stream: Stream, text: str, finish: str | None, tokens: int) -> str:
        self.sent[stream.id] = tokens
        choice = Choice(text=text, index=self.index[stream.id], finish_reason=finish)
        return f"data: {self.body([choice], self.usage() if self.job.continuous_usage else None)}\n\n"

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
                        parts.append(f"data: {self.body([], self.usage())}\n\n")
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
        choices = sorted((Choice(text="".join(texts[s.id]), index=self.index[s.id], finish_reason=s.finish_reason)
                          for s in self.streams), key=lambda c: c.index)
        return Response(self.body(choices, self.usage()), media_type="application/json")


async def disconnected(request: Request) -> None:
    """Returns once the client has closed its connection (the body was read whole before)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
