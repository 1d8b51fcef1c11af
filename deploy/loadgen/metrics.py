"""Per-request records and the run's metrics, defined exactly as vLLM's `bench serve`.

- TTFT: send to the first chunk carrying tokens.
- E2EL (latency): send to the last chunk carrying tokens.
- TPOT: (latency - TTFT) / (output_tokens - 1), over requests with more than one token.
- ITL: every gap between consecutive token-bearing chunks, pooled over all requests (a chunk
  may carry several tokens; the gap is still one ITL, as in vLLM).
- Statistics: numpy mean, median, std (population) and percentiles (linear), reported in ms;
  an empty list counts as [0], as vLLM's `values or 0` does.
- Throughputs and goodput divide by the run's duration; only completed requests count.
  Goodput counts completed requests meeting every SLO given (a one-token request's TPOT is 0).
- Prefix cache (from each request's usage, completed requests only): hit rate =
  sum(cached_prompt_tokens) / sum(prompt_tokens); K/V bytes shipped (and not shipped, the
  decode side's cache hits) per request are means over requests.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

OK = "OK"
ABANDONED = "ABANDONED"  # a conversation's turn never sent: an earlier turn failed
METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")
SLO_NAMES = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class RequestRecord:
    """What the client saw of one request. Times in seconds; start_s from the run's start."""

    prompt_len: int
    output_len: int  # tokens received
    start_s: float
    ttft_s: float = 0.0
    itls_s: tuple[float, ...] = ()
    latency_s: float = 0.0
    status: str = OK  # OK or the gRPC status code's name
    error: str = ""
    tag: str = ""  # the request's tag (BenchRequest.tag)
    cached_prompt_tokens: int = 0  # usage: prompt tokens the prefill worker had cached
    kv_bytes_shipped: int = 0  # usage: K/V bytes pushed to decode workers for it
    kv_bytes_not_shipped: int = 0  # usage: K/V bytes the decode worker already held
    cache_reported: bool = False  # the server reported those three (else unknown, not 0)
    template_tokens: int = 0  # prompt tokens the server added (a chat template), not in
    # prompt_len: the --input-len a chat request asked for stays what it reports

    @property
    def is_success(self) -> bool:
        return self.status == OK

    @property
    def tpot_s(self) -> float:
        """vLLM's TPOT; 0 for a request of one token or none."""
        if self.output_len <= 1:
            return 0.0
        return (self.latency_s - self.ttft_s) / (self.output_len - 1)


@dataclass(frozen=True)
class Slo:
    """Service-level objectives for goodput, in ms; None: not constrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @property
    def is_set(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms))

    def is_met(self, record: RequestRecord) -> bool:
        pairs = ((self.ttft_ms, record.ttft_s), (self.tpot_ms, record.tpot_s),
                 (self.e2el_ms, record.latency_s))
        return all(slo is None or slo / 1000 >= value for slo, value in pairs)

    @staticmethod
    def parse(pairs: Sequence[str]) -> Slo:
        """From "name:ms" pairs such as ["ttft:500", "tpot:50"] (names: ttft, tpot, e2el)."""
        values: dict[str, float] = {}
        for pair in pairs:
            name, sep, text = pair.partition(":")
            if not sep or name not in SLO_NAMES:
                raise ValueError(f"goodput: expected NAME:MS with NAME in {SLO_NAMES}, "
                                 f"got {pair!r}")
            value = float(text)
            if not value >= 0:
                raise ValueError(f"goodput: {name} must be >= 0 ms, got {text}")
            values[f"{name}_ms"] = value
        return Slo(**values)


@dataclass(frozen=True)
class Stats:
    """Summary of one metric, in ms."""

    mean_ms: float
    median_ms: float
    std_ms: float
    percentiles_ms: tuple[tuple[float, float], ...]  # (percentile, value)

    @staticmethod
    def of(values_s: Sequence[float], percentiles: Sequence[float]) -> Stats:
        data = list(values_s) or [0.0]
        return Stats(
            mean_ms=float(np.mean(data)) * 1000, median_ms=float(np.median(data)) * 1000,
            std_ms=float(np.std(data)) * 1000,
            percentiles_ms=tuple((float(p), float(np.percentile(data, p)) * 1000)
                                 for p in percentiles),
        )

    def percentile_ms(self, p: float) -> float:
        return next(v for q, v in self.percentiles_ms if q == p)


@dataclass(frozen=True)
class BenchmarkMetrics:
    """The run's aggregates (vLLM's BenchmarkMetrics, plus failures by status code)."""

    duration_s: float
    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float | None  # None when no SLO was given
    output_throughput: float
    total_token_throughput: float
    total_cached_prompt_tokens: int
    prefix_cache_hit_rate: float  # cached / prompt tokens; 0 when no prompt token completed
    mean_kv_bytes_shipped: float
    mean_kv_bytes_not_shipped: float
    cache_reported: bool  # some request's usage reported the cache figures: else unknown
    ttft: Stats
    tpot: Stats
    itl: Stats
    e2el: Stats
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    failures_by_status: dict[str, int] = field(default_factory=dict)
    total_template_tokens: int = 0  # chat template tokens servers added (not in total_input)

    def stats(self, name: str) -> Stats:
        return {"ttft": self.ttft, "tpot": self.tpot, "itl": self.itl, "e2el": self.e2el}[name]


def _mean(values: Sequence[int]) -> float:
    return float(np.mean(values)) if values else 0.0


def _token_times(record: RequestRecord) -> list[float]:
    times = [record.start_s + record.ttft_s]
    for gap in record.itls_s:
        times.append(times[-1] + gap)
    return times


def _peaks(done: Sequence[RequestRecord]) -> tuple[float, int]:
    """vLLM's peak output tokens in a one-second bucket, and peak concurrent requests."""
    if not done:
        return 0.0, 0
    first = min(r.start_s for r in done)
    last = max(r.start_s + r.latency_s for r in done)
    buckets = np.zeros(int(np.ceil(last - first)) + 1)
    for record in done:
        for t in _token_times(record):
            second = int(t - first)
            if 0 <= second < len(buckets):
                buckets[second] += 1
    # Half-open [start, end): at a tie, an end comes before a start.
    events = sorted([(r.start_s, 1) for r in done] + [(r.start_s + r.latency_s, -1)
                                                     for r in done])
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return float(buckets.max()), peak


def calculate_metrics(records: Sequence[RequestRecord], duration_s: float, slo: Slo = Slo(),
                      percentiles: Sequence[float] = (90, 95, 99)) -> BenchmarkMetrics:
    """Aggregate per-request records over a run that lasted duration_s."""
    if not duration_s > 0 or math.isinf(duration_s):
        raise ValueError(f"duration_s must be positive and finite, got {duration_s}")
    done = [r for r in records if r.is_success]
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(r.output_len for r in done)
    good = sum(1 for r in done if slo.is_met(r))
    total_cached = sum(r.cached_prompt_tokens for r in done)  # of every prompt token
    total_template = sum(r.template_tokens for r in done)
    max_tokens_per_s, max_concurrent = _peaks(done)
    return BenchmarkMetrics(
        duration_s=duration_s, completed=len(done), failed=len(records) - len(done),
        total_input=total_input, total_output=total_output,
        request_throughput=len(done) / duration_s,
        request_goodput=good / duration_s if slo.is_set else None,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        total_cached_prompt_tokens=total_cached,
        prefix_cache_hit_rate=(total_cached / (total_input + total_template)
                               if total_input + total_template else 0.0),
        mean_kv_bytes_shipped=_mean([r.kv_bytes_shipped for r in done]),
        mean_kv_bytes_not_shipped=_mean([r.kv_bytes_not_shipped for r in done]),
        cache_reported=any(r.cache_reported for r in done),
        ttft=Stats.of([r.ttft_s for r in done], percentiles),
        tpot=Stats.of([r.tpot_s for r in done if r.output_len > 1], percentiles),
        itl=Stats.of([gap for r in done for gap in r.itls_s], percentiles),
        e2el=Stats.of([r.latency_s for r in done], percentiles),
        max_output_tokens_per_s=max_tokens_per_s, max_concurrent_requests=max_concurrent,
        failures_by_status=dict(Counter(r.status for r in records if not r.is_success)),
        total_template_tokens=total_template,
    )
