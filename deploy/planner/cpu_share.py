"""CPU time in the simulator: the router (with the load generator beside it) as one FIFO
server of CPU work, and the workers' forwards, sharing cores where deploy/placement.py puts
them together.

With more than two cores per worker the router has cores of its own: everything runs at full
speed and only the router's own queue delays a token. With fewer, the router runs on the
prefill workers' cores (the colocated workers', without prefill workers): while every one of
them is computing, the router and the first of them split one core in half (the kernel's
fair share of two runnable threads); while one of them is idle the router runs there at full
speed. So a busy router slows the prefill behind it, and a busy prefill delays the tokens the
router relays, as measured on two cores.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Sequence

EPSILON_S = 1e-9  # work left below this is done (floating-point remainders of late times)


class SharedCores:
    """Processor sharing between the router's FIFO of CPU jobs and the workers' forwards.
    `schedule(when, callback)` is the simulation's event queue; `now()` its clock."""

    def __init__(self, schedule: Callable[[float, Callable[[], None]], None],
                 now: Callable[[], float], shared_with: Sequence[Hashable]) -> None:
        self._schedule_at = schedule
        self._now = now
        self.shared_with = list(shared_with)  # empty: the router has cores of its own
        self.jobs: deque[list] = deque()  # [work_s left, callback]
        self.forwards: dict[Hashable, list] = {}  # worker -> [work_s left, callback]
        self._last = 0.0
        self._version = 0
        self.router_busy_s = 0.0  # CPU the router spent, for reports and tests

    def _rates(self) -> tuple[float, dict[Hashable, float]]:
        rates = dict.fromkeys(self.forwards, 1.0)
        router = 1.0
        if self.jobs and self.shared_with and all(w in self.forwards for w in self.shared_with):
            router = 0.5
            rates[self.shared_with[0]] = 0.5
        return router, rates

    def _advance(self) -> None:
        now = self._now()
        elapsed = now - self._last
        if elapsed > 0:
            router, rates = self._rates()
            if self.jobs:
                self.jobs[0][0] -= router * elapsed
                self.router_busy_s += router * elapsed
            for worker, entry in self.forwards.items():
                entry[0] -= rates[worker] * elapsed
        self._last = now

    def _reschedule(self) -> None:
        self._version += 1
        version = self._version
        router, rates = self._rates()
        waits = [max(entry[0], 0.0) / rates[w] for w, entry in self.forwards.items()]
        if self.jobs:
            waits.append(max(self.jobs[0][0], 0.0) / router)
        if waits:
            self._schedule_at(self._now() + min(waits), lambda: self._fire(version))

    def _fire(self, version: int) -> None:
        if version != self._version:  # superseded by a later change
            return
        self._advance()
        done = []
        while self.jobs and self.jobs[0][0] <= EPSILON_S:
            done.append(self.jobs.popleft()[1])
        for worker, (left, callback) in list(self.forwards.items()):
            if left <= EPSILON_S:
                del self.forwards[worker]
                done.append(callback)
        self._reschedule()
        for callback in done:
            callback()

    def submit(self, work_s: float, callback: Callable[[], None]) -> None:
        """Router CPU work, done in order; `callback` when it is."""
        self._advance()
        self.jobs.append([work_s, callback])
        self._reschedule()

    def run_forward(self, worker: Hashable, work_s: float,
                    callback: Callable[[], None]) -> None:
        """A worker's forward (it runs one at a time); `callback` when it is done."""
        self._advance()
        self.forwards[worker] = [work_s, callback]
        self._reschedule()
