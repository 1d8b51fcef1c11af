"""What the live planner sees: the router's Prometheus metrics (kvferry/rpc/metrics.py),
scraped once per interval, the difference between two scrapes giving the interval's
requests, their mean prompt and output tokens, and the TTFT and ITL percentiles it served."""

from __future__ import annotations

import math
import socket
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from deploy.planner.live import Observation

HISTOGRAMS = {"ttft": "kvferry_time_to_first_token_seconds",
              "itl": "kvferry_inter_token_latency_seconds"}


@dataclass(frozen=True)
class Scrape:
    """The counters and histogram buckets of one scrape, and when it was taken."""

    at_s: float
    finished: float
    prompt_tokens: float
    generation_tokens: float
    buckets: dict[str, tuple[tuple[float, float], ...]]  # name -> (le, cumulative count)


def parse(text: str, at_s: float) -> Scrape:
    """The router's /metrics text (prometheus_client's exposition format)."""
    totals = {"kvferry_requests_finished": 0.0, "kvferry_prompt_tokens": 0.0,
              "kvferry_generation_tokens": 0.0}
    buckets: dict[str, list[tuple[float, float]]] = {name: [] for name in HISTOGRAMS}
    wanted = {metric: name for name, metric in HISTOGRAMS.items()}
    for family in text_string_to_metric_families(text):
        if family.name in totals:
            totals[family.name] = sum(s.value for s in family.samples
                                      if s.name.endswith("_total"))
        elif family.name in wanted:
            buckets[wanted[family.name]] = sorted(
                (float(s.labels["le"]), s.value) for s in family.samples
                if s.name.endswith("_bucket"))
    return Scrape(at_s, totals["kvferry_requests_finished"], totals["kvferry_prompt_tokens"],
                  totals["kvferry_generation_tokens"],
                  {name: tuple(b) for name, b in buckets.items()})


def percentile_ms(before: Scrape, after: Scrape, name: str, p: float) -> float | None:
    """The p-th percentile of a histogram over the interval, interpolated within the bucket
    it falls in as Prometheus' histogram_quantile does (None: nothing observed; past the
    last finite bucket: that bucket's bound)."""
    old = dict(before.buckets.get(name, ()))
    counts = [(le, count - old.get(le, 0.0)) for le, count in after.buckets.get(name, ())]
    if not counts or counts[-1][1] <= 0:
        return None
    rank = counts[-1][1] * p / 100
    below_le, below = 0.0, 0.0
    for le, count in counts:
        if count >= rank:
            if not math.isfinite(le):
                return below_le * 1000
            share = (rank - below) / (count - below) if count > below else 1.0
            return (below_le + (le - below_le) * share) * 1000
        below_le, below = le, count
    return below_le * 1000


def observation(before: Scrape, after: Scrape, percentiles: Sequence[tuple[str, float]] = ()
                ) -> Observation:
    """The interval between two scrapes, as the planner reads it (nothing, when a router
    restarted and its counters went back to zero); `percentiles`: (metric, p) to measure,
    the SLA's."""
    finished = after.finished - before.finished
    if finished <= 0 or after.prompt_tokens < before.prompt_tokens:
        return Observation(after.at_s - before.at_s, 0, ())
    prompt = (after.prompt_tokens - before.prompt_tokens) / finished
    output = (after.generation_tokens - before.generation_tokens) / finished
    seen = ((name, percentile_ms(before, after, name, p)) for name, p in percentiles)
    return Observation(after.at_s - before.at_s, round(finished),
                       ((max(round(prompt), 1), max(round(output), 1)),),
                       tuple((name, ms) for name, ms in seen if ms is not None))


def merge(scrapes: Sequence[Scrape]) -> Scrape:
    """Several routers' scrapes as one: counters and bucket counts summed."""
    buckets: dict[str, dict[float, float]] = {}
    for scrape in scrapes:
        for name, pairs in scrape.buckets.items():
            into = buckets.setdefault(name, {})
            for le, count in pairs:
                into[le] = into.get(le, 0.0) + count
    return Scrape(max(s.at_s for s in scrapes), sum(s.finished for s in scrapes),
                  sum(s.prompt_tokens for s in scrapes),
                  sum(s.generation_tokens for s in scrapes),
                  {name: tuple(sorted(b.items())) for name, b in buckets.items()})


def dns_urls(host_port: str) -> Callable[[], list[str]]:
    """Every address HOST resolves to (a headless Service: each router pod), each time."""
    host, _, port = host_port.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"router_metrics_dns: expected HOST:PORT, got {host_port!r}")

    def urls() -> list[str]:
        found = sorted({info[4][0] for info in socket.getaddrinfo(host, int(port),
                                                                  type=socket.SOCK_STREAM)})
        return [f"http://{f'[{a}]' if ':' in a else a}:{port}/metrics" for a in found]

    return urls


def scraper(urls: Callable[[], Sequence[str]], clock: Callable[[], float],
            timeout_s: float = 10.0) -> Callable[[], Scrape]:
    """Scrapes every router (`urls()`, the --metrics-port /metrics of each) each call."""
    def scrape() -> Scrape:
        scrapes = []
        for url in urls():
            with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310
                scrapes.append(parse(response.read().decode(), clock()))
        if not scrapes:
            raise OSError("no router to scrape")
        return merge(scrapes)

    return scrape
