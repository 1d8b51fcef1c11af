"""Worker choice policies, pluggable by flag (`--policy`), so benchmarks can compare them.

- headroom (default): decode on the worker with the most K/V headroom after every known and
  in-flight request grows to its maximum (ties: fewest requests in flight); prefill on the
  worker with the fewest pending prompt tokens.
- round_robin: rotate through the workers of each role.
- least_requests: fewest requests this router has open there.

Each returns candidates best first; the router tries them in order.
"""

from __future__ import annotations

import itertools
from typing import Protocol

from kvferry.settings import POLICIES as POLICY_NAMES
from router.workers import Worker


class Policy(Protocol):
    name: str

    def order_decode(self, workers: list[Worker], need_blocks: int) -> list[Worker]: ...

    def order_prefill(self, workers: list[Worker], prompt_tokens: int) -> list[Worker]: ...


class HeadroomPolicy:
    name = "headroom"

    def order_decode(self, workers: list[Worker], need_blocks: int) -> list[Worker]:
        return sorted(workers, key=lambda w: (-w.headroom, w.num_in_flight, w.address))

    def order_prefill(self, workers: list[Worker], prompt_tokens: int) -> list[Worker]:
        return sorted(workers, key=lambda w: (w.pending_tokens, w.num_in_flight, w.address))


class RoundRobinPolicy:
    name = "round_robin"

    def __init__(self) -> None:
        self._decode = itertools.count()
        self._prefill = itertools.count()

    @staticmethod
    def _rotate(workers: list[Worker], start: int) -> list[Worker]:
        ordered = sorted(workers, key=lambda w: w.address)
        k = start % len(ordered)
        return ordered[k:] + ordered[:k]

    def order_decode(self, workers: list[Worker], need_blocks: int) -> list[Worker]:
        return self._rotate(workers, next(self._decode))

    def order_prefill(self, workers: list[Worker], prompt_tokens: int) -> list[Worker]:
        return self._rotate(workers, next(self._prefill))


class LeastRequestsPolicy:
    name = "least_requests"

    def order_decode(self, workers: list[Worker], need_blocks: int) -> list[Worker]:
        return sorted(workers, key=lambda w: (w.num_in_flight, w.address))

    def order_prefill(self, workers: list[Worker], prompt_tokens: int) -> list[Worker]:
        return sorted(workers, key=lambda w: (w.num_in_flight, w.address))


# Keyed by kvferry.settings.POLICIES, the names flags and settings accept.
POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (HeadroomPolicy, RoundRobinPolicy, LeastRequestsPolicy)}


def make_policy(name: str) -> Policy:
    if name not in POLICY_NAMES or name not in POLICIES:
        raise ValueError(f"policy: unknown {name!r}; one of {list(POLICY_NAMES)}")
    return POLICIES[name]()
