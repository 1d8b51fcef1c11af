"""The live planner's decisions: from what the router saw over the last interval (arrival
rate and the mix of prompt and output lengths), the prefill and decode counts that meet the
SLA with the fewest workers, by simulating the candidates on the profile
(deploy/planner/simulator.py), then moved towards with hysteresis and bounds.

- Hysteresis: a new target must come out the same `patience` intervals in a row before
  anything moves; scaling down also needs the smaller layout to meet the SLA at `headroom`
  times the observed rate, so a load just under a boundary does not flap.
- Bounds: each role within [min, max], the total within max_workers; at most `max_step`
  workers added or removed per role per interval.
- No target meets the SLA: the layout with the most goodput within the bounds.

Every decision carries its reason, for the log line and the metrics the planner exports.
Whoever acts on it (deploy/planner/scalers.py) drains a worker before it leaves.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from deploy.planner.profile import CostModel
from deploy.planner.search import Sla
from deploy.planner.simulator import Layout, SimRequest, simulate

SIM_REQUESTS = 120  # requests simulated per candidate and interval


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
    _pending: Layout | None = None
    _streak: int = 0

    def _meets(self, layout: Layout, requests: Sequence[SimRequest], scale: float) -> bool:
        scaled = [SimRequest(r.arrival_s / scale, r.prompt_len, r.output_len)
                  for r in requests]
        return self.sla.is_met(simulate(self.cost, layout, scaled))

    def target(self, obs: Observation, current: Layout) -> tuple[Layout, str]:
        """The fewest workers meeting the SLA at the observed rate (a smaller layout than
        `current` only with headroom), else the most capable layout, and why."""
        if obs.num_requests == 0 or not obs.lengths:
            return current, "no requests this interval: nothing to plan from"
        requests = workload(obs)
        candidates = sorted(self.bounds.layouts(), key=lambda x: (x.num_workers,
                                                                  abs(x.num_prefill
                                                                      - current.num_prefill)))
        for layout in candidates:
            smaller = layout.num_workers < current.num_workers
            if self._meets(layout, requests, self.headroom if smaller else 1.0):
                return layout, (f"{layout} is the smallest layout meeting {self.sla} at "
                                f"{obs.rate:.2f} requests/s")
        best = max(candidates, key=lambda x: (x.num_workers, -abs(x.num_prefill
                                                                  - current.num_prefill)))
        return best, (f"no layout within the bounds meets {self.sla} at {obs.rate:.2f} "
                      f"requests/s: the largest, {best}")

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
