"""The live planner's process: every interval, scrape the routers, decide
(deploy/planner/live.py) from those that answered, log the decision with its reason, export it
as metrics, and scale (deploy/planner/scalers.py) when it moves."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge

from deploy.planner.live import Decision, Planner
from deploy.planner.observe import Scrape, interval_fault, merge, observation, scraper
from deploy.planner.scalers import RayScaler, Scaler, WorkerActors
from deploy.planner.simulator import Layout

log = logging.getLogger("kvferry.planner")


class PlannerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.workers = Gauge("kvferry_planner_workers", "Workers by role: running now "
                             "(current) and what the planner asks for (target).",
                             ["role", "kind"], registry=registry)
        self.decisions = Counter("kvferry_planner_decisions", "Decisions by what they did.",
                                 ["action"], registry=registry)
        self.rate = Gauge("kvferry_planner_observed_request_rate",
                          "Requests per second the router finished last interval.",
                          registry=registry)
        self.correction = Gauge("kvferry_planner_latency_correction",
                                "Measured / predicted latency, by SLA metric, that the "
                                "planner applies to the profile's predictions.", ["metric"],
                                registry=registry)


def _action(current: Layout, chosen: Layout) -> str:
    if chosen == current:
        return "hold"
    if chosen.num_workers > current.num_workers:
        return "scale_up"
    if chosen.num_workers < current.num_workers:
        return "scale_down"
    return "rebalance"


@dataclass
class PlannerLoop:
    planner: Planner
    scrape: Callable[[], Mapping[str, Scrape]]  # the routers that answered, by URL
    scaler: Scaler
    metrics: PlannerMetrics
    is_dry_run: bool = False  # decide and log, scale nothing
    _last: Mapping[str, Scrape] = field(default_factory=dict)

    def _interval(self) -> tuple[Scrape, Scrape] | None:
        """This interval's scrapes, merged over the routers that answered this time and last
        time with sound counters; None when no router did (logged after the first call)."""
        scrapes = self.scrape()
        before, self._last = self._last, dict(scrapes)
        pairs = []
        for url, after in scrapes.items():
            if url not in before:  # its first answer (new, or back): a baseline
                continue
            if (fault := interval_fault(before[url], after)) is not None:
                log.warning("planner: router %s left out this interval: %s", url, fault)
                continue
            pairs.append((before[url], after))
        if not pairs:
            if before:
                log.warning("planner: no router gave this interval's counters; no decision")
            return None
        return merge([b for b, _ in pairs]), merge([a for _, a in pairs])

    def run_once(self) -> Decision | None:
        """One interval: None (no decision) on the first call, which only takes the first
        scrapes, and whenever no router answered twice in a row with sound counters."""
        interval = self._interval()
        if interval is None:
            return None
        obs = observation(*interval, [(t.name, t.percentile) for t in self.planner.sla.targets])
        current = Layout(*self.scaler.current())
        decision = self.planner.decide(obs, current)
        action = _action(current, decision.layout)
        self.metrics.rate.set(obs.rate)
        for metric, ratio in self.planner.correction.items():
            self.metrics.correction.labels(metric).set(ratio)
        self.metrics.decisions.labels(action).inc()
        for role, now, target in (("prefill", current.num_prefill, decision.num_prefill),
                                  ("decode", current.num_decode, decision.num_decode)):
            self.metrics.workers.labels(role, "current").set(now)
            self.metrics.workers.labels(role, "target").set(target)
        log.info("planner: %s %s -> %s: %s%s", action, current, decision.layout,
                 decision.reason, " (dry run)" if self.is_dry_run else "")
        if action != "hold" and not self.is_dry_run:
            self.scaler.scale(decision.num_prefill, decision.num_decode)
        return decision


def run_ray_planner(planner: Planner, deployment: WorkerActors, interval_s: float,
                    stop: threading.Event, metrics: PlannerMetrics | None = None,
                    on_decision: Callable[[Decision], None] | None = None) -> None:
    """The live planner in the driver of a Ray deployment (`kvferry serve --planner-sla`):
    every `interval_s` until `stop` is set, scrape its router and scale its actors
    (`on_decision` sees each decision once carried out). A failed interval (a scrape refused
    while the router is busy) is logged and the next one tried."""
    if metrics is None:
        from prometheus_client import REGISTRY

        metrics = PlannerMetrics(REGISTRY)
    url = f"http://{deployment.metrics_address}/metrics"
    loop = PlannerLoop(planner, scraper(lambda: [url], time.monotonic), RayScaler(deployment),
                       metrics)
    while not stop.is_set():
        try:
            decision = loop.run_once()
        except Exception as exc:  # noqa: BLE001 - said, and tried again next interval
            log.warning("planner: %s: %s", type(exc).__name__, exc)
        else:
            if decision is not None and on_decision is not None:
                on_decision(decision)
        stop.wait(interval_s)
