"""The figures /metrics serves, in Prometheus' text format (prometheus-client, one registry per server): requests by
outcome, active and queued streams, the states' bytes, tokens generated, time to first token and time per output
token."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST


CONTENT_TYPE = CONTENT_TYPE_LATEST
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServeMetrics:
    def __init__(self, bytes_per_stream: int, work_per_stream: int = 0, fixed_bytes: int = 0, prefill_bytes: int = 0):
        """What the server said at start: one stream's state, its working memory while it decodes, the fixed part."""
        self.registry = r = CollectorRegistry()
        self.requests = Counter("rpt_requests", "completion requests by outcome (ok, bad_request, busy, draining, "
                                "too_large, unauthorized, error)", ["outcome"], registry=r)
        self.finished = Counter("rpt_streams_finished", "streams by finish_reason", ["reason"], registry=r)
        self.active = Gauge("rpt_streams_active", "streams being generated (prefill and decode)", registry=r)
        self.queued = Gauge("rpt_streams_queued", "streams waiting for a slot", registry=r)
        self.state_bytes = Gauge("rpt_state_bytes", "the active streams' recurrent states (streams x bytes per "
                                 "stream)", registry=r)
        Gauge("rpt_state_bytes_per_stream", "one stream's recurrent state", registry=r).set(bytes_per_stream)
        Gauge("rpt_work_bytes_per_stream", "the most a decoding stream holds beside its state (its logits and their "
              "sampling), freed between steps", registry=r).set(work_per_stream)
        Gauge("rpt_fixed_bytes", "the resident memory the server started with (weights, runtime) and an allowance "
              "for its connections and held requests",
              registry=r).set(fixed_bytes)
        Gauge("rpt_prefill_bytes", "the most a step's prefill holds (its prompt tokens through the sequence form)",
              registry=r).set(prefill_bytes)
        self.tokens = Counter("rpt_generated_tokens", "tokens generated", registry=r)
        self.prompt_tokens = Counter("rpt_prompt_tokens", "prompt tokens read", registry=r)
        self.ttft = Histogram("rpt_time_to_first_token_seconds", "from a request's arrival to its stream's first "
                              "token", buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("rpt_time_per_output_token_seconds", "between two tokens of a stream",
                              buckets=LATENCY_BUCKETS, registry=r)

    def streams(self, active: int, queued: int, state_bytes: int) -> None:
        self.active.set(active)
        self.queued.set(queued)
        self.state_bytes.set(state_bytes)

    def token(self, arrived: float, last: float | None) -> float:
        """A stream's token now (`arrived`: its request's arrival; `last`: its previous token's time, None for its
        first); returns now."""
        now = time.perf_counter()
        self.tokens.inc()
        if last is None:
            self.ttft.observe(now - arrived)
        else:
            self.tpot.observe(now - last)
        return now

    def text(self) -> bytes:
        return generate_latest(self.registry)
