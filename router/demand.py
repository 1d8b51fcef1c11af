"""A decode worker's recent demand, for the `prefix` policy (router/policy.py): the blocks of
the requests the router sent it, each decayed by exp(-age / DEMAND_TAU_S). Chats come back to
the worker holding their history, so this is the load a worker's cache draws; it decides
where a new conversation starts."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from kvferry.settings import DEMAND_TAU_S


@dataclass(slots=True)
class RecentDemand:
    blocks: float = 0.0  # as of monotonic time `at`
    at: float = 0.0

    def value(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        return self.blocks * math.exp(-max(0.0, now - self.at) / DEMAND_TAU_S)

    def add(self, blocks: int) -> None:
        """A request needing `blocks` was sent now."""
        now = time.monotonic()
        self.blocks, self.at = self.value(now) + blocks, now
