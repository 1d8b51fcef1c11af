"""Prometheus metrics (prefix `kvferry_`) served over HTTP by every process.

The router measures what clients see (TTFT, ITL, TPOT, end-to-end latency), the per-request
breakdown it gets from the workers (queue, prefill, K/V transfer, admission wait), outcomes,
failures by gRPC status, migrations and prefill retries, and its view of each worker at scrape
time (`kvferry_router_worker_*`: health, the load its last stats showed, the cache blocks its
mirror holds, what it has open there). Workers export their pool and queue
state at scrape time (a collector over the engine's stats, so the numbers are never stale) and
the K/V bytes they shipped or received. Names follow vLLM's where one exists
(`kv_cache_usage_perc` is a fraction, as there).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sized
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvferry.cache.stats import PoolStats, TierStats

log = logging.getLogger("kvferry.metrics")

# Seconds: from sub-millisecond ITL on a GPU to multi-second TTFT under load.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5,
                   0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


def _histogram(name: str, doc: str, registry: CollectorRegistry) -> Histogram:
    return Histogram(name, doc, buckets=LATENCY_BUCKETS, registry=registry)


class RouterMetrics:
    """What the router records per request; one instance per router process."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry  # what /metrics serves (its own port, and the HTTP front's)
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


def _spec_decode_metrics(s: PoolStats) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """A decode-side worker's speculative decoding counters."""
    yield CounterMetricFamily("kvferry_spec_decode_draft_tokens",
                              "Draft tokens verified (speculative decoding).",
                              s.spec_draft_tokens)
    yield CounterMetricFamily("kvferry_spec_decode_accepted_tokens",
                              "Draft tokens accepted (speculative decoding).",
                              s.spec_accepted_tokens)
    yield CounterMetricFamily("kvferry_spec_decode_draft_prefill_tokens",
                              "Positions a draft model's catch-ups prefilled on this worker "
                              "(its prompt's, unless a prefill worker shipped them, and "
                              "those of the tokens kept since).",
                              s.spec_draft_prefill_tokens)
    yield GaugeMetricFamily("kvferry_spec_decode_paused_sequences",
                            "Sequences whose drafting is paused: their recent drafts were "
                            "not worth the rows they cost (speculative decoding).",
                            s.spec_paused_sequences)


class WorkerCollector(Collector):
    """Pool and queue gauges plus the worker's counters, read from the engine at scrape."""

    def __init__(self, role: str, stats: Callable[[], PoolStats],
                 kv_bytes: Callable[[], int], pool_bytes: int = 0) -> None:
        self.role = role
        self._stats = stats
        self._kv_bytes = kv_bytes
        self.pool_bytes = pool_bytes  # as allocated (--kv-pool-size, auto or given)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self._stats()
        usage = 1.0 - s.free_blocks / s.total_blocks if s.total_blocks else 0.0
        yield GaugeMetricFamily("kvferry_kv_cache_usage_perc",
                                "Fraction of the K/V pool's blocks in use (0 to 1).", usage)
        yield GaugeMetricFamily("kvferry_kv_cache_total_blocks", "Blocks in the K/V pool.",
                                s.total_blocks)
        yield GaugeMetricFamily("kvferry_kv_cache_pool_bytes",
                                "Bytes of the K/V pool as allocated (--kv-pool-size).",
                                self.pool_bytes)
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
        yield from _spec_decode_metrics(s)
        yield CounterMetricFamily("kvferry_kv_evicted_blocks",
                                  "K/V blocks sequences gave up while running (--kv-eviction).",
                                  s.kv_evicted_blocks)
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
        yield GaugeMetricFamily("kvferry_prefill_seconds_per_token",
                                "Measured forward seconds per prompt token (0: none yet).",
                                s.prefill_s_per_token)
        yield from _tier_metrics(s.tiers)


# name, kind, help, TierStats field: one sample per tier, labelled {tier}
_TIER_METRICS = (
    ("kvferry_external_prefix_cache_hits", CounterMetricFamily,
     "Prompt tokens found in a tier below the pool and promoted into it (vLLM's "
     "external_prefix_cache_hits).", "hit_tokens"),
    ("kvferry_kv_tier_blocks", GaugeMetricFamily, "Blocks the tier holds.", "used_blocks"),
    ("kvferry_kv_tier_capacity_blocks", GaugeMetricFamily, "Blocks the tier can hold.",
     "capacity_blocks"),
    ("kvferry_kv_tier_bytes_in", CounterMetricFamily, "Bytes written into the tier.",
     "bytes_in"),
    ("kvferry_kv_tier_bytes_out", CounterMetricFamily,
     "Bytes read out of the tier into the pool.", "bytes_out"),
    ("kvferry_kv_tier_evictions", CounterMetricFamily,
     "Blocks the tier dropped to make room.", "evictions"),
    ("kvferry_kv_tier_dropped_writes", CounterMetricFamily,
     "Blocks the tier did not take (slots pinned, write queue full).", "dropped_writes"),
    ("kvferry_kv_tier_corrupt_blocks", CounterMetricFamily,
     "Blocks that failed their check on read and were dropped.", "corrupt_blocks"),
    ("kvferry_kv_tier_promotions", CounterMetricFamily,
     "Lookups that promoted blocks from the tier.", "num_promotions"),
    ("kvferry_kv_tier_promotion_seconds", CounterMetricFamily,
     "Seconds promotions from the tier took, summed.", "promotion_s"),
    ("kvferry_kv_tier_state", GaugeMetricFamily,
     "0: enabled, 1: read-only (full), 2: disabled (failing).", "state"),
)


def _tier_metrics(tiers: tuple[TierStats, ...]
                  ) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    if not tiers:
        return
    for name, kind, doc, field in _TIER_METRICS:
        family = kind(name, doc, labels=["tier"])
        for stats in tiers:
            family.add_metric([stats.tier.name.lower()], getattr(stats, field))
        yield family


class ReportedKeys(Protocol):
    @property
    def keys(self) -> Sized: ...  # the block keys the worker's cache events reported


class RouterWorkerView(Protocol):
    """What the router believes about one worker (`router.workers.worker.Worker` is one), read at
    scrape time from the metrics thread: plain fields only, nothing iterated."""

    @property
    def address(self) -> str: ...
    @property
    def role(self) -> str: ...
    @property
    def is_healthy(self) -> bool: ...
    @property
    def num_running(self) -> int: ...  # from its last stats snapshot
    @property
    def num_in_flight(self) -> int: ...  # requests the router has open there
    @property
    def total_blocks(self) -> int: ...
    @property
    def projected_blocks(self) -> int: ...
    @property
    def num_stats_refreshes(self) -> int: ...
    @property
    def cache(self) -> ReportedKeys: ...


# The router's per-worker gauges: name, help, and how to read it off a `RouterWorkerView`.
_ROUTER_WORKER_GAUGES: tuple[tuple[str, str, Callable[[RouterWorkerView], float]], ...] = (
    ("kvferry_router_worker_healthy", "1 while the router routes to the worker (serving, its "
     "stats answered, its layout compatible), else 0.", lambda w: int(w.is_healthy)),
    ("kvferry_router_worker_num_running", "Requests running on the worker, as its last stats "
     "snapshot applied said.", lambda w: w.num_running),
    ("kvferry_router_worker_num_in_flight", "Requests this router has open on the worker now "
     "(on a prefill worker, until their prefill ends).", lambda w: w.num_in_flight),
    ("kvferry_router_worker_total_blocks", "Blocks in the worker's K/V pool, as its last stats "
     "snapshot said.", lambda w: w.total_blocks),
    ("kvferry_router_worker_projected_blocks", "Blocks the worker's live requests may grow to, "
     "as its last stats snapshot said.", lambda w: w.projected_blocks),
    ("kvferry_router_worker_cached_blocks", "Prefix-cache blocks the worker's cache events "
     "reported, in the router's mirror (its predictions not counted).",
     lambda w: len(w.cache.keys)),
)


class RouterWorkersCollector(Collector):
    """The router's view of its workers, one sample per worker labelled by its address and
    role: what routing decides on, so a test (or an operator) can wait until the router sees
    what a worker did, instead of waiting for a few stats refreshes."""

    def __init__(self, workers: Callable[[], Iterable[RouterWorkerView]]) -> None:
        self._workers = workers

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        labels = ["worker", "role"]
        workers = list(self._workers())  # a copy: the event loop may add or drop one
        for name, doc, read in _ROUTER_WORKER_GAUGES:
            gauge = GaugeMetricFamily(name, doc, labels=labels)
            for w in workers:
                gauge.add_metric([w.address, w.role], read(w))
            yield gauge
        refreshes = CounterMetricFamily("kvferry_router_worker_stats_refreshes",
                                        "Stats snapshots from the worker the router applied.",
                                        labels=labels)
        for w in workers:
            refreshes.add_metric([w.address, w.role], w.num_stats_refreshes)
        yield refreshes


def serve(port: int, host: str, registry: CollectorRegistry) -> int:
    """Serve /metrics on a daemon thread; returns the bound port (port 0: any free one)."""
    server, _ = start_http_server(port, addr=host, registry=registry)
    bound = server.server_port
    log.info("Prometheus metrics on http://%s:%d/metrics", host, bound)
    return bound
