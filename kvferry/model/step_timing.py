"""Timing alternatives of one step against each other, in process (`--compile auto` uses it
to choose a bucket's package)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping

ROUNDS = 5  # rounds of STEPS calls per alternative, the alternatives taking turns
STEPS = 3


def median_ms(steps: Mapping[str, Callable[[], object]], rounds: int = ROUNDS,
              calls: int = STEPS) -> dict[str, float]:
    """Median ms per call of each alternative: each called once untimed (first-call costs),
    then `rounds` rounds in which each in turn is called `calls` times, so that a drift of
    the machine falls on all of them alike."""
    for step in steps.values():
        step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                step()
            times[name].append((time.perf_counter() - t0) * 1e3 / calls)
    return {name: statistics.median(ms) for name, ms in times.items()}
