"""Cores: core lists as taskset writes them, and core lending: two CPU workers placed on
cores of their own (`serve` puts a prefill and a decode worker on separate cores,
deploy/placement.py) run torch threads on each other's cores while the other has no forward
to run.

Disaggregation keeps a prefill burst off the decode worker's cores, but on a small machine it
also leaves half of it idle most of the time: a closed loop of short requests decodes on one
core while the prefill core waits for the next wave, then prefills the wave while the decode
core waits for it. A worker with lending on marks, in a file both map, until when it is busy
(`begin` at a forward's start: busy until further notice; `end`: busy for HOLD_S more, so the
gap between two decode steps does not look idle). At each forward's start and between its
layers it reads its partner's mark: idle, it runs its own threads plus one per lent core;
busy, its own only. Contention lasts at most one layer after the partner starts (a decode
layer is a couple of milliseconds; a prefill layer of a long wave some tens).

The extra threads are the step thread's OpenMP team's: created once (`_spawn_lent_threads`)
while the step thread runs on the lent cores, so they inherit those cores and stay there
(pinned again explicitly), while the step thread and its own threads stay on the worker's
own cores. Only the thread that first calls `begin` (the worker's step thread) adjusts;
forwards on other threads leave the threads as they are.

The spec a worker gets (`--core-lending`, set by `serve --lend-cores auto`, parsed by
kvferry/settings/cpus.py): FILE:SLOT:PARTNER:CPUS, the shared file, this worker's slot, its
partner's, and the partner's cores (e.g. 0-1,3).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvferry.settings.cpus import parse_spec

log = logging.getLogger("kvferry.cores")

SLOT_BYTES = 8  # one float64 per worker: monotonic time until which it is busy
HOLD_S = 0.02  # busy this long after a forward ends (a decode step's gap is ~1-5 ms)
_BUSY = float("inf")


def create_file(path: Path, num_slots: int) -> None:
    """The shared file of `num_slots` workers, every one idle."""
    path.write_bytes(bytes(SLOT_BYTES * num_slots))


class CoreLending:
    """This worker's side of one lending pair (see the module docstring)."""

    def __init__(self, path: Path, slot: int, partner: int, partner_cores: set[int],
                 own_threads: int, clock: Callable[[], float] = time.monotonic) -> None:
        if own_threads < 1:
            raise ValueError(f"core_lending: needs a thread count of its own (--torch-threads), "
                             f"got {own_threads}")
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 0)
        slots = memoryview(self._map).cast("d")
        if max(slot, partner) >= len(slots):
            raise ValueError(f"core_lending: {path} holds {len(slots)} slots, not slot "
                             f"{max(slot, partner)}")
        self._slots, self.slot, self.partner = slots, slot, partner
        self.partner_cores = set(partner_cores)
        self.own_threads = own_threads
        self.lent_threads = len(self.partner_cores)
        self._clock = clock
        import torch

        self._set_threads = torch.set_num_threads
        self._owner: int | None = None  # the step thread's id, once it began a forward
        self.threads = own_threads  # what the step thread runs now
        self.num_forwards = 0
        self.num_lent_forwards = 0  # forwards that began with the partner's cores

    @classmethod
    def from_spec(cls, spec: str, own_threads: int) -> CoreLending:
        path, slot, partner, cores = parse_spec(spec)
        return cls(path, slot, partner, cores, own_threads)

    def partner_is_idle(self) -> bool:
        return self._slots[self.partner] < self._clock()

    def begin(self) -> None:
        """A forward starts on this thread: busy until `end`; threads for it."""
        self._slots[self.slot] = _BUSY
        if self._owner is None:
            self._owner = threading.get_ident()
            self._spawn_lent_threads()
        if threading.get_ident() != self._owner:
            return
        self.num_forwards += 1
        self.adjust()
        if self.threads > self.own_threads:
            if not self.num_lent_forwards:
                log.info("core lending: first forward with the partner's cores too (%d "
                         "threads)", self.threads)
            self.num_lent_forwards += 1

    def adjust(self) -> None:
        """Between layers: the partner's cores too while it is idle, else our own only."""
        if threading.get_ident() != self._owner:
            return
        want = self.own_threads + (self.lent_threads if self.partner_is_idle() else 0)
        if want != self.threads:
            self._set_threads(want)
            self.threads = want

    def end(self) -> None:
        """The forward ended: busy for HOLD_S more (the next step follows within it)."""
        self._slots[self.slot] = self._clock() + HOLD_S

    def close(self) -> None:
        self._slots[self.slot] = 0.0
        self._slots.release()
        self._map.close()

    def _spawn_lent_threads(self) -> None:
        """Grow this thread's OpenMP team by one thread per lent core, those threads on the
        lent cores (the rest of the team stays on ours), then back to our own threads."""
        own_cores = os.sched_getaffinity(0)
        self._set_threads(self.own_threads)
        _touch_team()  # our own team members exist (on our cores) before the lent ones
        before = _team_threads()
        os.sched_setaffinity(0, self.partner_cores)  # what threads started now inherit
        try:
            self._set_threads(self.own_threads + self.lent_threads)
            _touch_team()
        finally:
            os.sched_setaffinity(0, own_cores)
            self._set_threads(self.own_threads)
        for tid in _team_threads() - before:
            os.sched_setaffinity(tid, self.partner_cores)
        log.info("core lending: %d thread(s) of our own, %d more on cores %s while the "
                 "partner (slot %d) is idle", self.own_threads, self.lent_threads,
                 sorted(self.partner_cores), self.partner)


def _touch_team() -> None:
    """One parallel region with every thread torch may use now (the grain is 32K elements)."""
    import torch

    torch.ones(1 << 22).add_(1)


def _team_threads() -> set[int]:
    """This process's threads named as the calling one (OpenMP's team inherits its name)."""
    me = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text()
    out = set()
    for task in os.listdir("/proc/self/task"):
        try:
            if Path(f"/proc/self/task/{task}/comm").read_text() == me:
                out.add(int(task))
        except OSError:  # ended meanwhile
            continue
    return out
