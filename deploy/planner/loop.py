"""The live planner's process: every interval, scrape the router, decide
(deploy/planner/live.py), log the decision with its reason, export it as metrics, and scale
(deploy/planner/scalers.py) when it moves."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

from deploy.planner.live import Decision, Planner
from deploy.planner.observe import Scrape, observation, scraper
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
    scrape: Callable[[], Scrape]
    scaler: Scaler
    metrics: PlannerMetrics
    is_dry_run: bool = False  # decide and log, scale nothing
    _last: Scrape | None = None

    def run_once(self) -> Decision | None:
        """One interval: None on the first call (it only takes the first scrape)."""
        scrape = self.scrape()
        before, self._last = self._last, scrape
        if before is None:
            return None
        obs = observation(before, scrape, [(t.name, t.percentile)
                                           for t in self.planner.sla.targets])
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
