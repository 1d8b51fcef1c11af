"""Client-visible timings of one public request, recorded into the router's Prometheus
metrics (kvferry/rpc/metrics.py). One clock per request, whichever front served it (the
gRPC Generate stream, router/server.py, or the HTTP API, router/http/front.py), so both
fill the same histograms and counters."""

from __future__ import annotations

import time

from kvferry.rpc.metrics import RouterMetrics
from router.events import DoneEvent


class StreamClock:
    """Records TTFT and ITL as token chunks arrive, the rest once the request ends. A request
    of several samples is timed by the first of them to end; every sample's tokens count."""

    def __init__(self, metrics: RouterMetrics | None) -> None:
        self.metrics = metrics
        self.tokens_only: RouterMetrics | None = None  # after the first DoneEvent
        self.start = time.perf_counter()
        self.last = 0.0  # arrival of the latest chunk; 0 before the first
        self.ttft = 0.0

    def chunk(self, num_tokens: int) -> None:
        if self.metrics is None or num_tokens == 0:
            return
        now = time.perf_counter()
        if self.last:
            self.metrics.itl.observe(now - self.last)
        else:
            self.ttft = now - self.start
            self.metrics.ttft.observe(self.ttft)
        self.last = now

    def done(self, event: DoneEvent) -> None:
        m = self.metrics
        if m is None:  # a later sample of the request: its tokens only
            if self.tokens_only is not None:
                self.tokens_only.generation_tokens.inc(event.completion_tokens)
            return
        latency = time.perf_counter() - self.start
        m.e2e.observe(latency)
        if event.completion_tokens > 1:
            m.tpot.observe((latency - self.ttft) / (event.completion_tokens - 1))
        t = event.timing
        m.queue.observe(t.queue_s)
        m.prefill.observe(t.prefill_s)
        m.kv_transfer.observe(t.kv_transfer_s)
        m.admission_wait.observe(t.admission_wait_s)
        m.migrations.inc(t.num_migrations)
        m.finished.labels(event.reason.name.lower()).inc()
        m.prompt_tokens.inc(event.prompt_tokens)
        m.generation_tokens.inc(event.completion_tokens)
        self.metrics, self.tokens_only = None, m  # recorded once

    def failed(self, code_name: str) -> None:
        """The request ended with an error: `code_name` is its gRPC status's name (the HTTP
        front counts its errors by the status the same failure has on gRPC)."""
        if self.metrics is not None:
            self.metrics.failures.labels(code_name).inc()
            self.metrics = None
