"""The live planner's decisions: from what the router saw over the last interval (arrival
rate and the mix of prompt and output lengths), the prefill and decode counts that meet the
SLA with the fewest workers, by simulating the candidates on the profile
(deploy/planner/simulator.py), then moved towards with hysteresis and bounds.

- Hysteresis: a new target must come out the same `patience` intervals in a row before
  anything moves; scaling down also needs the smaller layout to meet the SLA at `headroom`
  times the observed rate, so a load just under a boundary does not flap.
- Bounds: each role within [min, max], the total within max_workers; at most `max_step`
  workers added or removed per role per interval.
- No target meets the SLA: of the largest layouts within the bounds, the one that comes
  closest: whose simulated requests meet it most often, then whose worst percentile is the
  smallest multiple of its target.
- Correction: a profile measured elsewhere (workers with cores of their own, where the
  deployment shares them; another transport) predicts latencies the deployment does not
  see. Each interval the current layout is simulated on the observed workload, and the
  ratio of what the router measured to what the simulation predicts, per SLA metric, is
  kept (an average weighted by `correction_weight`, within [1/4, 10]); a candidate's
  predicted latencies are multiplied by it before they are held to the SLA, as Dynamo's SLA
  planner corrects its interpolated TTFT and ITL.

Every decision carries its reason, for the log line and the metrics the planner exports.
Whoever acts on it (deploy/planner/scalers.py) drains a worker before it leaves.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from deploy.planner.profile import CostModel
from deploy.planner.search import Sla
from deploy.planner.simulator import Layout, SimRequest, simulate

SIM_REQUESTS = 120  # requests simulated per candidate and interval
CORRECTION_BOUNDS = (0.25, 10.0)  # observed / predicted latency, clamped to this


@dataclass(frozen=True)
class Bounds:
    min_prefill: int = 1
    max_prefill: int = 8
    min_decode: int = 1
    max_decode: int = 8
    max_workers: int = 8
    max_step: int = 1  # workers added or removed per role per interval

    def __post_init__(self) -> None:
        if not 1 <= self.min_prefill <= self.max_prefill:
            raise ValueError("bounds: need 1 <= min_prefill <= max_prefill")
        if not 1 <= self.min_decode <= self.max_decode:
            raise ValueError("bounds: need 1 <= min_decode <= max_decode")
        if self.max_workers < self.min_prefill + self.min_decode or self.max_step < 1:
            raise ValueError("bounds: max_workers below the minimums, or max_step < 1")

    def layouts(self) -> list[Layout]:
        return [Layout(p, d) for p in range(self.min_prefill, self.max_prefill + 1)
                for d in range(self.min_decode, self.max_decode + 1)
                if p + d <= self.max_workers]


@dataclass(frozen=True)
class Observation:
    """One interval at the router: how many requests arrived, and a sample of their
    (prompt tokens, output tokens)."""

    duration_s: float
    num_requests: int
    lengths: tuple[tuple[int, int], ...]
    # what the router measured, per SLA metric ("ttft", "itl") at the SLA's percentile, ms
    latencies_ms: tuple[tuple[str, float], ...] = ()

    @property
    def rate(self) -> float:
        return self.num_requests / self.duration_s if self.duration_s > 0 else 0.0


@dataclass(frozen=True)
class Decision:
    num_prefill: int
    num_decode: int
    target: Layout  # what the simulator would run now
    reason: str

    @property
    def layout(self) -> Layout:
        return Layout(self.num_prefill, self.num_decode)


def workload(obs: Observation, num_requests: int = SIM_REQUESTS, seed: int = 0
             ) -> list[SimRequest]:
    """Poisson arrivals at the observed rate, lengths drawn from the observed sample."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num_requests):
        t += rng.expovariate(obs.rate)
        prompt, output = rng.choice(obs.lengths)
        out.append(SimRequest(t, prompt, output))
    return out


def _step(current: int, target: int, max_step: int) -> int:
    return current + max(-max_step, min(max_step, target - current))


@dataclass
class Planner:
    """Call `decide` once per interval with what the router saw and what runs now."""

    cost: CostModel
    sla: Sla
    bounds: Bounds = field(default_factory=Bounds)
    patience: int = 2  # intervals a new target must hold before anything moves
    headroom: float = 1.2  # a smaller layout must meet the SLA at this times the rate
    correction_weight: float = 0.5  # of each interval's observed/predicted ratio; 0: none
    correction: dict[str, float] = field(default_factory=dict)  # metric -> ratio
    _pending: Layout | None = None
    _streak: int = 0

    def _corrected_sla(self) -> Sla:
        """The SLA as the simulation must meet it: each target divided by its correction."""
        return Sla(tuple(replace(t, ms=t.ms / self.correction.get(t.name, 1.0))
                         for t in self.sla.targets))

    def _meets(self, layout: Layout, requests: Sequence[SimRequest], scale: float) -> bool:
        scaled = [SimRequest(r.arrival_s / scale, r.prompt_len, r.output_len)
                  for r in requests]
        return self._corrected_sla().is_met(simulate(self.cost, layout, scaled))

    def correct(self, obs: Observation, current: Layout, requests: Sequence[SimRequest]
                ) -> None:
        """Fold this interval's observed / predicted latency of the current layout into the
        correction."""
        if not self.correction_weight or not obs.latencies_ms:
            return
        predicted = {t.name: ms for t, ms in self.sla.values(simulate(self.cost, current,
                                                                      requests))}
        low, high = CORRECTION_BOUNDS
        for name, seen in obs.latencies_ms:
            guess = predicted.get(name, math.inf)
            if not (math.isfinite(seen) and math.isfinite(guess) and guess > 0 and seen > 0):
                continue
            ratio = min(high, max(low, seen / guess))
            old = self.correction.get(name)
            self.correction[name] = (ratio if old is None else
                                     old + self.correction_weight * (ratio - old))

    def target(self, obs: Observation, current: Layout) -> tuple[Layout, str]:
        """The fewest workers meeting the SLA at the observed rate (a smaller layout than
        `current` only with headroom), else the largest meeting it for the most requests,
        and why."""
        if obs.num_requests == 0 or not obs.lengths:
            return current, "no requests this interval: nothing to plan from"
        requests = workload(obs)
        self.correct(obs, current, requests)
        candidates = sorted(self.bounds.layouts(), key=lambda x: (x.num_workers,
                                                                  abs(x.num_prefill
                                                                      - current.num_prefill)))
        for layout in candidates:
            smaller = layout.num_workers < current.num_workers
            if self._meets(layout, requests, self.headroom if smaller else 1.0):
                return layout, (f"{layout} is the smallest layout meeting {self.sla} at "
                                f"{obs.rate:.2f} requests/s{self._said()}")
        largest = max(x.num_workers for x in candidates)
        scored = [(*self._closeness(x, requests), -abs(x.num_prefill - current.num_prefill), x)
                  for x in candidates if x.num_workers == largest]
        attained, _, _, best = max(scored, key=lambda s: s[:3])
        return best, (f"no layout within the bounds meets {self.sla} at {obs.rate:.2f} "
                      f"requests/s{self._said()}: of the largest, {best} comes closest "
                      f"({attained:.0%} of requests within it)")

    def _closeness(self, layout: Layout, requests: Sequence[SimRequest]
                   ) -> tuple[float, float]:
        """How near a layout comes to the SLA: the fraction of simulated requests meeting it,
        then (where that ties, as at none) the worst ratio of a percentile to its target,
        negated: higher is closer."""
        sla = self._corrected_sla()
        records = simulate(self.cost, layout, requests)
        worst = max(ms / t.ms for t, ms in sla.values(records))
        return sla.attainment(records), -worst

    def _said(self) -> str:
        if not self.correction:
            return ""
        return " (latencies corrected x" + ", x".join(
            f"{ratio:.2f} {name}" for name, ratio in sorted(self.correction.items())) + ")"

    def decide(self, obs: Observation, current: Layout) -> Decision:
        target, reason = self.target(obs, current)
        if target != self._pending:
            self._pending, self._streak = target, 0
        self._streak += 1
        if target == current or self._streak < self.patience:
            held = "" if target == current else (f"; waiting {self.patience - self._streak} "
                                                 "more interval(s) before moving")
            return Decision(current.num_prefill, current.num_decode, target, reason + held)
        step = self.bounds.max_step
        return Decision(_step(current.num_prefill, target.num_prefill, step),
                        _step(current.num_decode, target.num_decode, step), target, reason)
