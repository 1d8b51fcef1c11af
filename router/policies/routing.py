"""Worker choice policies, pluggable by flag (`--policy`), so benchmarks can compare them.

- prefix: headroom's admission, plus the workers' prefix caches (the cost formula below).
- headroom: decode on the worker with the most K/V headroom after every known and in-flight
  request grows to its maximum (ties: fewest requests in flight); prefill on the worker with
  the fewest pending prompt tokens.
- round_robin: rotate through the workers of each role.
- least_requests: fewest requests this router has open there.

Each returns candidates best first; the router tries them in order.

The prefix policy's cost, in K/V blocks, lower is better (Dynamo's KV router scores
`overlap_weight * blocks_to_prefill + active_blocks` the same way; llm-d adds a prefix scorer
to load scorers with weights):

    decode:  prefix_weight * (prompt_blocks - cached_blocks) + load_weight * used_blocks
             + demand_weight * recent_demand_blocks
    prefill: prefill_prefix_weight * (prompt_tokens / block_size - cached_blocks)
             + load_weight * pending_prompt_tokens / block_size

- prompt_blocks: the prompt's leading full blocks a cache may hold (`max_shared_blocks`; the
  block holding the last prompt token is computed everywhere, so it is left out);
  cached_blocks: how many of them lead the worker's cache as the router knows it (reported
  by the worker's cache events, or predicted for requests just sent there:
  `router.workers`). Each cached block is prefill compute saved, and on a decode worker also
  a block not pushed.
- used_blocks: total_blocks - headroom, the blocks that every known and in-flight request
  there may grow to hold; pending_prompt_tokens: prompt tokens queued or sent to prefill there.
- recent_demand_blocks: the blocks of the requests this router sent the worker, each decayed
  by exp(-age / 10 s) (`router.workers.worker.RecentDemand`). Chats come back to the worker
  holding their history, so this is the load a worker's cache draws; it decides where a new
  conversation starts (no worker holds its prefix, so only load separates them), where the
  blocks in use at that instant would leave it to chance.
- Weights: `--prefix-weight` (default 16), `--prefill-prefix-weight` (default 4),
  `--load-weight` (default 1) and `--demand-weight` (default 0.25: a block of history weighs
  64 blocks of recent demand, so a conversation leaves its history only for a worker whose
  recent demand is lower by more than 64 times that history, about 16 such conversations'
  turns). On decode a cached block is a block not pushed, worth 16 blocks of load, measured:
  at 1:1 a conversation's next turn left the worker holding its history whenever the other
  carried one request less, at 4:1 whenever it carried a few long requests less
  (docs/performance.md). On prefill a cached block is compute saved, and a queue
  there delays the first token as much as a recompute, so it weighs less. A
  decode worker whose headroom cannot hold the request at its longest goes after every one
  that can, whatever its cache: the cache saves a prefill, a short pool costs preemptions.
  Its reservation shares the cached blocks, but the worker's projection counts them again
  for this request (and evictable cached blocks it takes are headroom), so the request needs
  its full `need_blocks` of headroom there too. Ties: fewest requests in flight, then
  address.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvferry.settings import (
    DEFAULT_DEMAND_WEIGHT,
    DEFAULT_LOAD_WEIGHT,
    DEFAULT_PREFILL_PREFIX_WEIGHT,
    DEFAULT_PREFIX_WEIGHT,
)
from router.workers.worker import Worker


@dataclass(frozen=True)
class LocalPrefill:
    """Conditional disaggregation (`--local-prefill-threshold`): a prompt with fewer than
    `threshold` tokens left to compute is prefilled on its decode worker itself, with no K/V
    transfer; such a prompt never waits for decode headroom before its prefill. 0: never."""

    threshold: int = 0

    def is_local(self, uncached_tokens: int) -> bool:
        return uncached_tokens < self.threshold


class Policy(Protocol):
    name: str
    uses_keys: bool  # reads the prompt's block keys (the router computes them only then)

    def order_decode(self, workers: list[Worker], need_blocks: int,
                     keys: Sequence[bytes] = ()) -> list[Worker]:
        """Decode candidates, best first, for a request needing `need_blocks` at its
        longest; `keys`: its prompt's block keys (`kvferry.cache.prefix.block_keys`)."""
        ...

    def order_prefill(self, workers: list[Worker], prompt_tokens: int,
                      keys: Sequence[bytes] = ()) -> list[Worker]:
        """Prefill candidates, best first, for a `prompt_tokens`-token prompt."""
        ...


class HeadroomPolicy:
    name = "headroom"
    uses_keys = False

    def order_decode(self, workers: list[Worker], need_blocks: int,
                     keys: Sequence[bytes] = ()) -> list[Worker]:
        return sorted(workers, key=lambda w: (-w.headroom, w.num_in_flight, w.address))

    def order_prefill(self, workers: list[Worker], prompt_tokens: int,
                      keys: Sequence[bytes] = ()) -> list[Worker]:
        return sorted(workers, key=lambda w: (w.pending_tokens, w.num_in_flight, w.address))


class PrefixPolicy(HeadroomPolicy):
    """The cost formula of the module docstring. A HeadroomPolicy: admission waits for a
    worker with room the same way (`router.downstream.Downstream._admit`)."""

    name = "prefix"
    uses_keys = True

    def __init__(self, prefix_weight: float = DEFAULT_PREFIX_WEIGHT,
                 load_weight: float = DEFAULT_LOAD_WEIGHT,
                 prefill_prefix_weight: float = DEFAULT_PREFILL_PREFIX_WEIGHT,
                 demand_weight: float = DEFAULT_DEMAND_WEIGHT) -> None:
        self.prefix_weight = prefix_weight
        self.load_weight = load_weight
        self.prefill_prefix_weight = prefill_prefix_weight
        self.demand_weight = demand_weight

    def decode_cost(self, worker: Worker, keys: Sequence[bytes]) -> float:
        uncached = len(keys) - worker.cache.num_cached_blocks(keys)
        used = worker.total_blocks - worker.headroom
        return (self.prefix_weight * uncached + self.load_weight * used
                + self.demand_weight * worker.demand.value())

    def prefill_cost(self, worker: Worker, prompt_tokens: int, keys: Sequence[bytes]) -> float:
        # A healthy worker has reported its layout; a fake one without counts tokens.
        block_size = worker.layout.block_size if worker.layout is not None else 1
        uncached = prompt_tokens / block_size - worker.cache.num_cached_blocks(keys)
        return (self.prefill_prefix_weight * uncached
                + self.load_weight * worker.pending_tokens / block_size)

    def order_decode(self, workers: list[Worker], need_blocks: int,
                     keys: Sequence[bytes] = ()) -> list[Worker]:
        return sorted(workers, key=lambda w: (w.headroom < need_blocks, self.decode_cost(w, keys),
                                              w.num_in_flight, w.address))

    def order_prefill(self, workers: list[Worker], prompt_tokens: int,
                      keys: Sequence[bytes] = ()) -> list[Worker]:
        return sorted(workers, key=lambda w: (self.prefill_cost(w, prompt_tokens, keys),
                                              w.num_in_flight, w.address))


class RoundRobinPolicy:
    name = "round_robin"
    uses_keys = False

    def __init__(self) -> None:
        self._decode = itertools.count()
        self._prefill = itertools.count()

    @staticmethod
    def _rotate(workers: list[Worker], start: int) -> list[Worker]:
        ordered = sorted(workers, key=lambda w: w.address)
        k = start % len(ordered)
        return ordered[k:] + ordered[:k]

    def order_decode(self, workers: list[Worker], need_blocks: int,
                     keys: Sequence[bytes] = ()) -> list[Worker]:
        return self._rotate(workers, next(self._decode))

    def order_prefill(self, workers: list[Worker], prompt_tokens: int,
                      keys: Sequence[bytes] = ()) -> list[Worker]:
        return self._rotate(workers, next(self._prefill))


class LeastRequestsPolicy:
    name = "least_requests"
    uses_keys = False

    def order_decode(self, workers: list[Worker], need_blocks: int,
                     keys: Sequence[bytes] = ()) -> list[Worker]:
        return sorted(workers, key=lambda w: (w.num_in_flight, w.address))

    def order_prefill(self, workers: list[Worker], prompt_tokens: int,
                      keys: Sequence[bytes] = ()) -> list[Worker]:
        return sorted(workers, key=lambda w: (w.num_in_flight, w.address))
