"""CPU time in the simulator: the router and the load generator beside it, each one FIFO
server of CPU work, and the workers' forwards, sharing cores where deploy/placement.py puts
them together.

With more than two cores per worker the router has cores of its own: the workers run at full
speed and a token waits only for the router's and the client's own queues. With fewer, the
router and the client run on the prefill workers' cores (the colocated workers', without
prefill workers). While the threads that want those cores (the busy workers among them, and
the router and the client when they have work) are no more than the cores, each runs at full
speed. Past that the router and the client go first, as the kernel lets a thread that slept
preempt one that computes, and the busy workers share what is left. So a busy router slows
the prefill beside it by the CPU it takes. This fitted the tiny model's colocated runs
better than an equal share for every runnable thread (docs/planning.md).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Sequence

EPSILON_S = 1e-9  # work left below this is done (floating-point remainders of late times)


class SharedCores:
    """Processor sharing between FIFO queues of CPU jobs (`queues`: the router, the client)
    and the workers' forwards. `schedule(when, callback)` is the simulation's event queue;
    `now()` its clock; `shared_with`: the workers on the queues' cores (empty: the queues
    have cores of their own); `cores`: how many cores those workers hold."""

    def __init__(self, schedule: Callable[[float, Callable[[], None]], None],
                 now: Callable[[], float], shared_with: Sequence[Hashable],
                 queues: Sequence[str] = ("router",), cores: int | None = None) -> None:
        self._schedule_at = schedule
        self._now = now
        self.shared_with = list(shared_with)
        self.cores = cores if cores is not None else len(self.shared_with)
        self.jobs: dict[str, deque[list]] = {q: deque() for q in queues}  # [work_s, callback]
        self.forwards: dict[Hashable, list] = {}  # worker -> [work_s left, callback]
        self._last = 0.0
        self._version = 0

    def _rates(self) -> tuple[dict[str, float], dict[Hashable, float]]:
        active = [q for q, jobs in self.jobs.items() if jobs]
        rates = dict.fromkeys(self.forwards, 1.0)
        queue_rate = 1.0
        if self.shared_with:
            busy = [w for w in self.shared_with if w in self.forwards]
            if len(busy) + len(active) > self.cores:
                queue_rate = min(1.0, self.cores / max(len(active), 1))
                left = max(self.cores - queue_rate * len(active), 0.0)
                for worker in busy:
                    rates[worker] = min(1.0, left / len(busy))
        return dict.fromkeys(active, queue_rate), rates

    def _advance(self) -> None:
        now = self._now()
        elapsed = now - self._last
        if elapsed > 0:
            queues, rates = self._rates()
            for queue, rate in queues.items():
                self.jobs[queue][0][0] -= rate * elapsed
            for worker, entry in self.forwards.items():
                entry[0] -= rates[worker] * elapsed
        self._last = now

    def _reschedule(self) -> None:
        self._version += 1
        version = self._version
        queues, rates = self._rates()
        waits = [max(entry[0], 0.0) / rates[w] for w, entry in self.forwards.items()
                 if rates[w] > 0]  # a stalled forward finishes after the queues have run
        waits += [max(self.jobs[q][0][0], 0.0) / rate for q, rate in queues.items()]
        if waits:
            self._schedule_at(self._now() + min(waits), lambda: self._fire(version))

    def _fire(self, version: int) -> None:
        if version != self._version:  # superseded by a later change
            return
        self._advance()
        done = []
        for jobs in self.jobs.values():
            while jobs and jobs[0][0] <= EPSILON_S:
                done.append(jobs.popleft()[1])
        for worker, (left, callback) in list(self.forwards.items()):
            if left <= EPSILON_S:
                del self.forwards[worker]
                done.append(callback)
        self._reschedule()
        for callback in done:
            callback()

    def submit(self, work_s: float, callback: Callable[[], None],
               queue: str = "router") -> None:
        """CPU work for `queue`, done in order; `callback` when it is."""
        self._advance()
        self.jobs[queue].append([work_s, callback])
        self._reschedule()

    def run_forward(self, worker: Hashable, work_s: float,
                    callback: Callable[[], None]) -> None:
        """A worker's forward (it runs one at a time); `callback` when it is done."""
        self._advance()
        self.forwards[worker] = [work_s, callback]
        self._reschedule()
