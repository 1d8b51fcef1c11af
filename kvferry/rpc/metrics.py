"""Prometheus metrics (prefix `kvferry_`) served over HTTP by every process.

The router measures what clients see (TTFT, ITL, TPOT, end-to-end latency), the per-request
breakdown it gets from the workers (queue, prefill, K/V transfer, admission wait), outcomes,
failures by gRPC status, migrations and prefill retries. Workers export their pool and queue
state at scrape time (a collector over the engine's stats, so the numbers are never stale) and
the K/V bytes they shipped or received. Names follow vLLM's where one exists
(`kv_cache_usage_perc` is a fraction, as there).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvferry.cache.stats import PoolStats

log = logging.getLogger("kvferry.metrics")

# Seconds: from sub-millisecond ITL on a GPU to multi-second TTFT under load.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5,
                   0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


def _histogram(name: str, doc: str, registry: CollectorRegistry) -> Histogram:
    return Histogram(name, doc, buckets=LATENCY_BUCKETS, registry=registry)


class RouterMetrics:
    """What the router records per request; one instance per router process."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.ttft = _histogram("kvferry_time_to_first_token_seconds",
                               "Generate call to its first token, at the router.", r)
        self.itl = _histogram("kvferry_inter_token_latency_seconds",
                              "Gap between consecutive token chunks of a stream.", r)
        self.tpot = _histogram("kvferry_time_per_output_token_seconds",
                               "(latency - TTFT) / (output tokens - 1), per request.", r)
        self.e2e = _histogram("kvferry_e2e_request_latency_seconds",
                              "Generate call to its final message.", r)
        self.queue = _histogram("kvferry_request_queue_time_seconds",
                                "Waiting before the prefill forward began.", r)
        self.prefill = _histogram("kvferry_request_prefill_time_seconds",
                                  "Prefill forward until the first token was sampled.", r)
        self.kv_transfer = _histogram("kvferry_kv_transfer_time_seconds",
                                      "K/V push from its first chunk to the decode ack.", r)
        self.admission_wait = _histogram("kvferry_admission_wait_seconds",
                                         "Waiting for decode K/V headroom.", r)
        self.finished = Counter("kvferry_requests_finished_total",
                                "Requests that completed, by finish reason.", ["reason"],
                                registry=r)
        self.failures = Counter("kvferry_request_failures_total",
                                "Requests that ended with an error, by gRPC status.", ["code"],
                                registry=r)
        self.migrations = Counter("kvferry_migrations_total",
                                  "Decode legs re-prefilled on another worker mid-stream.",
                                  registry=r)
        self.prefill_retries = Counter(
            "kvferry_prefill_retries_total",
            "Prefills sent again because their prefill worker became unavailable under them "
            "(before the first token, mid push, or with its done still on the way).", registry=r)
        self.prompt_tokens = Counter("kvferry_prompt_tokens_total", "Prompt tokens served.",
                                     registry=r)
        self.generation_tokens = Counter("kvferry_generation_tokens_total",
                                         "Tokens generated and streamed.", registry=r)


class WorkerCollector(Collector):
    """Pool and queue gauges plus the worker's counters, read from the engine at scrape."""

    def __init__(self, role: str, stats: Callable[[], PoolStats],
                 kv_bytes: Callable[[], int]) -> None:
        self.role = role
        self._stats = stats
        self._kv_bytes = kv_bytes

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self._stats()
        usage = 1.0 - s.free_blocks / s.total_blocks if s.total_blocks else 0.0
        yield GaugeMetricFamily("kvferry_kv_cache_usage_perc",
                                "Fraction of the K/V pool's blocks in use (0 to 1).", usage)
        yield GaugeMetricFamily("kvferry_kv_cache_total_blocks", "Blocks in the K/V pool.",
                                s.total_blocks)
        yield GaugeMetricFamily("kvferry_num_requests_running",
                                "Requests being prefilled or decoded.", s.num_running)
        yield GaugeMetricFamily("kvferry_num_requests_waiting",
                                "Requests admitted but waiting (K/V blocks, prefill queue).",
                                s.num_waiting)
        yield GaugeMetricFamily("kvferry_num_pending_prefill_tokens",
                                "Prompt tokens queued for prefill.", s.num_pending_prefill_tokens)
        yield CounterMetricFamily("kvferry_num_preemptions",
                                  "Running requests preempted (K/V swapped out).",
                                  s.num_preemptions)
        yield CounterMetricFamily("kvferry_decode_steps", "Decode steps run.", s.num_decode_steps)
        yield CounterMetricFamily("kvferry_kv_corrupt_pushes",
                                  "K/V pushes refused by the receiver as corrupted in flight.",
                                  s.num_corrupt_pushes)
        yield CounterMetricFamily("kvferry_prefix_cache_queries",
                                  "Prompt tokens looked up in the prefix cache.",
                                  s.prefix_cache_queries)
        yield CounterMetricFamily("kvferry_prefix_cache_hits",
                                  "Prompt tokens found in the prefix cache (not computed, or "
                                  "not received).", s.prefix_cache_hits)
        yield GaugeMetricFamily("kvferry_prefix_cache_blocks",
                                "Blocks only the prefix cache holds (reclaimable).",
                                s.cached_blocks)
        if self.role == "prefill":
            yield GaugeMetricFamily("kvferry_kv_parked_requests",
                                    "Deferred prefills whose K/V waits here to be shipped.",
                                    s.num_parked)
            yield CounterMetricFamily("kvferry_kv_parked_evictions",
                                      "Parked K/V freed for a prefill with a decode "
                                      "reservation (prefilled again later).", s.num_evictions)
        direction = "sent" if self.role == "prefill" else "received"
        yield CounterMetricFamily(f"kvferry_kv_bytes_{direction}",
                                  f"K/V page bytes {direction} over the transport.",
                                  self._kv_bytes())


def serve(port: int, host: str, registry: CollectorRegistry) -> int:
    """Serve /metrics on a daemon thread; returns the bound port (port 0: any free one)."""
    server, _ = start_http_server(port, addr=host, registry=registry)
    bound = server.server_port
    log.info("Prometheus metrics on http://%s:%d/metrics", host, bound)
    return bound
