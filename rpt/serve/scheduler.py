"""Admission and the engine's thread: a bounded queue in front of `max_streams` running streams.

A request's streams are admitted whole or refused whole: while fewer than `max_streams + max_queue` streams are
held they are taken (the engine runs `max_streams` of them, the rest wait in order), else `submit` raises `Busy`
(the API answers 429). One thread runs
the engine's steps (`run`); it sleeps while there is nothing to do. A drain stops admitting (`Draining`: 503), lets the
running streams finish, and at its deadline ends the rest with finish_reason "abort".
"""

from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import nullcontext

from rpt.serve.engine import Engine, Stream


class Busy(Exception):
    """Every slot is taken and the queue is full."""


class Draining(Exception):
    """The server is shutting down: it admits nothing more."""


class Scheduler:
    def __init__(self, engine: Engine, max_streams: int, max_queue: int, metrics=None, products=None):
        """`metrics`: rpt/serve/metrics.py's ServeMetrics (None: none kept); `products()`: a context the engine's
        thread runs inside (the CPU's one-row products, rpt/kernels/cpu/products.py)."""
        self.engine, self.max_streams, self.max_queue = engine, max_streams, max_queue
        self.metrics, self.products = metrics, products
        self.queue: deque[Stream] = deque()
        self.held = 0  # streams admitted and not ended: queued or in the engine
        self.wake = threading.Condition()
        self.draining = False
        self.deadline: float | None = None  # when a drain cuts what is still running
        self.failure: BaseException | None = None  # what stopped the engine's thread, if anything did

    def submit(self, streams: list[Stream]) -> None:
        """Admit these streams (one request's) or refuse them all."""
        with self.wake:
            if self.draining:
                raise Draining()
            if self.held + len(streams) > self.max_streams + self.max_queue:
                raise Busy()
            for stream in streams:
                stream.on_event = self._counted(stream.on_event)
            self.held += len(streams)
            self.queue.extend(streams)
            self._gauges()
            self.wake.notify()

    def _counted(self, on_event):
        """`on_event`, and the stream's slot given back when it ends."""
        def counted(stream: Stream, text: str, finish: str | None) -> None:
            if finish is not None:
                with self.wake:
                    self.held -= 1
            on_event(stream, text, finish)
        return counted

    def cancel(self, stream: Stream) -> None:
        """The client is gone: the stream leaves the queue or the batch (at the engine's next step)."""
        with self.wake:
            if stream in self.queue:
                self.queue.remove(stream)
                stream.finish_reason = "cancelled"
                stream.on_event(stream, "", "cancelled")
            else:
                stream.cancelled = True
            self.wake.notify()

    def drain(self, grace: float) -> None:
        """Admit nothing more; what runs may finish within `grace` seconds, then it is cut ("abort")."""
        with self.wake:
            self.draining, self.deadline = True, time.monotonic() + grace
            for s in self.queue:  # never started: ended at once
                s.finish_reason = "abort"
                s.on_event(s, "", "abort")
            self.queue.clear()
            self.wake.notify()

    @property
    def queued(self) -> int:
        return len(self.queue)

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.streams(self.engine.active, len(self.queue), self.engine.state_bytes(self.engine.active))

    def run(self) -> None:
        """The engine's loop, on the calling thread, until a drain has ended every stream. The
        server runs it on its main thread: torch's CPU kernels run slower on another thread of a process whose main
        thread started them (benchmarks/results/serve.md)."""
        try:
            with (self.products or nullcontext)():
                while True:
                    with self.wake:
                        while not self.queue and self.engine.active == 0:
                            if self.draining:
                                return
                            self.wake.wait(timeout=0.1)  # (signal handlers run between waits)
                        while self.queue and self.engine.active < self.max_streams:
                            self.engine.add(self.queue.popleft())
                        if self.deadline is not None and time.monotonic() >= self.deadline:
                            self.engine.abort_all()
                            continue
                    self.engine.step()
                    self._gauges()
        except BaseException as exc:  # the engine broke: every stream ends, and /health says so
            self.failure = exc
            with self.wake:
                for s in self.queue:
                    s.on_event(s, "", "abort")
                self.queue.clear()
            try:
                self.engine.abort_all()
            finally:
                raise
