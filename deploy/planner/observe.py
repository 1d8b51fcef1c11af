"""What the live planner sees: the routers' Prometheus metrics (kvferry/rpc/metrics.py),
scraped once per interval, the difference between two scrapes giving the interval's
requests, their mean prompt and output tokens, and the TTFT and ITL percentiles it served.

The routers are scraped one by one and read as far as they can be trusted: one that does not
answer, answers an error or more than `MAX_BODY_BYTES`, or sends text that does not parse is
left out of that interval (and logged); so is one whose counters are not finite numbers or went
down (a restart) between its two scrapes. The planner plans from the rest.
"""

from __future__ import annotations

import http.client
import logging
import math
import socket
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from deploy.planner.live import Observation

HISTOGRAMS = {"ttft": "kvferry_time_to_first_token_seconds",
              "itl": "kvferry_inter_token_latency_seconds"}
MAX_BODY_BYTES = 4 << 20  # a router's /metrics is some KiB; past this it is no answer

log = logging.getLogger("kvferry.planner")


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
    if not finished > 0 or not after.prompt_tokens >= before.prompt_tokens:  # NaN: nothing
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


def interval_fault(before: Scrape, after: Scrape) -> str | None:
    """Why one router's two scrapes are no interval to plan from (None: they are one): a
    value that is not a finite non-negative number, no time between them, or a counter or
    bucket that went down (the router restarted, or the text is not a router's)."""
    values = [v for s in (before, after) for v in (s.finished, s.prompt_tokens,
                                                  s.generation_tokens)]
    values += [v for s in (before, after) for pairs in s.buckets.values() for le, count in pairs
               for v in (count, 0.0 if math.isinf(le) else le)]
    if not all(math.isfinite(v) and v >= 0 for v in values):
        return "a value is not a finite non-negative number"
    if not after.at_s > before.at_s:
        return "no time passed between its scrapes"
    if (after.finished < before.finished or after.prompt_tokens < before.prompt_tokens
            or after.generation_tokens < before.generation_tokens):
        return "a counter went down (the router restarted?)"
    for name, pairs in after.buckets.items():
        old = dict(before.buckets.get(name, ()))
        deltas = [count - old.get(le, 0.0) for le, count in pairs]
        if any(d < 0 for d in deltas) or any(b < a for a, b in zip(deltas, deltas[1:])):
            return f"histogram {name} went down or is not cumulative"
    return None


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


def fetch(url: str, timeout_s: float, max_bytes: int) -> bytes:
    """The body at `url`; ValueError past `max_bytes` (read no further)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310
        body = response.read(max_bytes + 1)
    if len(body) > max_bytes:
        raise ValueError(f"answered more than {max_bytes} bytes")
    return body


def scraper(urls: Callable[[], Sequence[str]], clock: Callable[[], float],
            timeout_s: float = 10.0, max_body_bytes: int = MAX_BODY_BYTES,
            fetch: Callable[[str, float, int], bytes] = fetch
            ) -> Callable[[], Mapping[str, Scrape]]:
    """Scrapes every router (`urls()`, the --metrics-port /metrics of each) each call: the
    scrapes of those that answered, by URL. One that does not (unreachable, an error, a body
    past `max_body_bytes` or not a metrics text) is logged and left out."""
    def scrape() -> dict[str, Scrape]:
        try:
            found = list(urls())
        except OSError as exc:  # the DNS name of the routers, for a moment
            log.warning("planner: cannot list the routers: %s: %s", type(exc).__name__, exc)
            return {}
        scrapes = {}
        for url in found:
            try:
                scrapes[url] = parse(fetch(url, timeout_s, max_body_bytes).decode(), clock())
            except (OSError, ValueError, KeyError, http.client.HTTPException) as exc:
                log.warning("planner: router %s left out this interval: %s: %s", url,
                            type(exc).__name__, exc)
        return scrapes

    return scrape
