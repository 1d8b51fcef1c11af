"""`kvferry plan --sla`: the layout (prefill and decode workers, or colocated ones, and the
local-prefill threshold) that serves a workload within its latency targets at the most
requests per second per worker, found by simulating each candidate (DistServe's placement
search, on kvferry's simulator).

A layout's goodput is the highest rate at which the simulated run meets the SLA: the TTFT
and ITL percentiles it names at or under their targets. Found by bisection on the rate; the
arrivals keep their shape (a trace's, or seeded Poisson ones) and are scaled in time.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from deploy.loadgen.metrics import RequestRecord
from deploy.planner.profile import CostModel
from deploy.planner.simulator import Layout, SimRequest, simulate

SLA_NAMES = ("ttft", "itl")
BISECTIONS = 10  # rate steps: the goodput to within 0.1% of the bracket


@dataclass(frozen=True)
class Target:
    """One latency target: this percentile of the metric at or under `ms`."""

    name: str  # "ttft" or "itl"
    percentile: float
    ms: float


@dataclass(frozen=True)
class Sla:
    targets: tuple[Target, ...]

    @staticmethod
    def parse(text: str) -> Sla:
        """From "ttft-p90=500,itl-p90=50"; ValueError naming the part that is wrong."""
        targets = []
        for part in text.split(","):
            match = re.fullmatch(r"(\w+)-p(\d+(?:\.\d+)?)=(\d+(?:\.\d+)?)", part.strip())
            if match is None or match[1] not in SLA_NAMES:
                raise ValueError(f"sla: expected NAME-pNN=MS with NAME in {SLA_NAMES}, got "
                                 f"{part!r}")
            percentile, ms = float(match[2]), float(match[3])
            if not 0 < percentile <= 100 or not ms > 0:
                raise ValueError(f"sla: {part!r}: the percentile must be in (0, 100] and the "
                                 "target > 0 ms")
            targets.append(Target(match[1], percentile, ms))
        if len({t.name for t in targets}) != len(targets):
            raise ValueError(f"sla: one target per metric, got {text!r}")
        return Sla(tuple(targets))

    def __str__(self) -> str:
        return ",".join(f"{t.name}-p{t.percentile:g}={t.ms:g}" for t in self.targets)

    def is_met(self, records: Sequence[RequestRecord]) -> bool:
        return all(value <= target.ms for target, value in self.values(records))

    def values(self, records: Sequence[RequestRecord]) -> list[tuple[Target, float]]:
        """Each target's percentile over the run, in ms (inf when a request failed)."""
        if any(not r.is_success for r in records):
            return [(t, math.inf) for t in self.targets]
        samples = {"ttft": [r.ttft_s for r in records],
                   "itl": [g for r in records for g in r.itls_s] or [0.0]}
        return [(t, float(np.percentile(samples[t.name], t.percentile)) * 1000)
                for t in self.targets]

    def attainment(self, records: Sequence[RequestRecord]) -> float:
        """The fraction of requests meeting every target themselves (their TTFT; their own
        ITL percentile)."""
        def meets(r: RequestRecord) -> bool:
            for t in self.targets:
                value = (r.ttft_s if t.name == "ttft"
                         else float(np.percentile(r.itls_s, t.percentile)) if r.itls_s else 0.0)
                if not r.is_success or value * 1000 > t.ms:
                    return False
            return True
        return sum(map(meets, records)) / len(records) if records else 0.0


@dataclass(frozen=True)
class Outcome:
    """A layout's goodput and what the simulator predicts at a rate."""

    layout: Layout
    goodput: float  # requests/s at which the SLA is met (0: not even at the lowest rate)
    rate: float  # the rate the predictions below are for
    values: tuple[tuple[Target, float], ...]
    percentiles_ms: dict[str, float]  # ttft and itl p50, p90
    attainment: float

    @property
    def goodput_per_worker(self) -> float:
        return self.goodput / self.layout.num_workers


def layouts(max_workers: int, thresholds: Sequence[int] = (0,)) -> list[Layout]:
    """Every colocated count, and every prefill + decode split (each local-prefill threshold),
    of at most `max_workers` workers."""
    if max_workers < 1:
        raise ValueError(f"max_workers: must be >= 1, got {max_workers}")
    found = [Layout(0, n, is_colocated=True) for n in range(1, max_workers + 1)]
    for total in range(2, max_workers + 1):
        for prefill in range(1, total):
            found += [Layout(prefill, total - prefill, local_prefill_threshold=t)
                      for t in thresholds]
    return found


def at_rate(requests: Sequence[SimRequest], rate: float) -> list[SimRequest]:
    """`requests` (arrivals for a rate of 1 request/s) scaled to `rate`."""
    return [replace(r, arrival_s=r.arrival_s / rate) for r in requests]


def _predict(cost: CostModel, layout: Layout, requests: Sequence[SimRequest], sla: Sla,
             rate: float, goodput: float) -> Outcome:
    records = simulate(cost, layout, at_rate(requests, rate))
    ok = [r for r in records if r.is_success] or list(records)
    pct = {f"{name}_p{p}_ms": float(np.percentile(
        [r.ttft_s for r in ok] if name == "ttft" else
        [g for r in ok for g in r.itls_s] or [0.0], p)) * 1000
        for name in SLA_NAMES for p in (50, 90)}
    return Outcome(layout, goodput, rate, tuple(sla.values(records)), pct,
                   sla.attainment(records))


def goodput(cost: CostModel, layout: Layout, requests: Sequence[SimRequest], sla: Sla,
            lowest: float, highest: float) -> float:
    """The highest rate in [lowest, highest] meeting the SLA (0: not even `lowest`)."""
    def met(rate: float) -> bool:
        return sla.is_met(simulate(cost, layout, at_rate(requests, rate)))

    if not met(lowest):
        return 0.0
    if met(highest):
        return highest
    lo, hi = lowest, highest
    for _ in range(BISECTIONS):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if met(mid) else (lo, mid)
    return lo


def search(cost: CostModel, requests: Sequence[SimRequest], sla: Sla, candidates:
           Sequence[Layout], rate: float | None = None) -> list[Outcome]:
    """Every candidate's goodput and its predictions at `rate` (None: at its goodput),
    best first: with a rate, the fewest workers meeting the SLA there, then the most goodput
    per worker; without, the most goodput per worker, then the fewest workers."""
    outcomes = []
    for layout in candidates:
        most = capacity(cost, layout, requests)
        found = goodput(cost, layout, requests, sla, most * 1e-3, most * 1.5)
        outcomes.append(_predict(cost, layout, requests, sla, rate or found or most * 1e-3,
                                 found))

    def order(o: Outcome) -> tuple:
        if rate is not None:
            return (o.goodput < rate, o.layout.num_workers, -o.goodput_per_worker)
        return (-o.goodput_per_worker, o.layout.num_workers)

    return sorted(outcomes, key=order)


def capacity(cost: CostModel, layout: Layout, requests: Sequence[SimRequest],
             batch: int = 16) -> float:
    """Requests/s the layout could serve at most, from the mean work of a request: its
    prompt's forward on a prefill worker, its tokens' share of steps of `batch` sequences on
    a decode worker (a colocated worker does both), and the router's CPU, on the cores it
    shares with the prefill (or colocated) workers where it has none of its own."""
    if layout.is_colocated:
        cost = cost.colocated()
    profile = cost.profile
    prompt = float(np.mean([r.prompt_len for r in requests]))
    output = float(np.mean([r.output_len for r in requests]))
    prefill = float(np.mean([cost.prefill_s(r.prompt_len, r.prompt_len ** 2)
                             for r in requests]))
    step = cost.decode_s(batch, round(batch * (prompt + output / 2)))
    steps = max(output - 1, 0.0) * step / batch
    router = profile.router_s_per_request + output * profile.relay_s_per_token
    # (a colocated worker's own points hold the router's turns on its cores already)
    shares = 0 < profile.num_cores <= 2 * layout.num_workers and not cost.is_colocated
    beside_router = router if shares else 0.0
    if layout.is_colocated:  # prefilled where it decodes: no K/V to receive
        bound = layout.num_decode / (prefill + steps + beside_router)
    else:
        decode = steps + cost.receive_s(round(prompt))
        bound = min(layout.num_prefill / (prefill + beside_router),
                    layout.num_decode / decode if decode else math.inf)
    return bound if shares or router == 0 else min(bound, 1 / router)
