"""The router's mirror of one worker's prefix-cache index, for the `prefix` policy.

A `CacheMirror` is owned by its `router.workers.worker.Worker`; it holds the block keys the worker
reported (from its cache events), the cursor of the last event applied, and the keys the
router predicts the worker holds. Every GetStats sends the cursor and gets the events after
it (keys stored, keys evicted), or a snapshot of every key when the worker no longer has them
all (it restarted, or the router fell behind); a worker that was unhealthy is forgotten
(`forget`), so it is asked for a snapshot. Between refreshes the router also predicts: a
request's prompt keys count as cached on the worker it was sent to for `PREDICTED_KEY_TTL_S`
(Dynamo's approximate mode, SGLang's router tree), so a burst of requests sharing a prefix
lands on one worker before any event reports it; the worker's events confirm them (stored)
or retract them (evicted), and unconfirmed ones lapse.

Each key carries the set of tiers the worker holds it in (device pool, host memory, disk,
shared store: `kvferry.cache.prefix.Tier`), as a bitmask; a key leaves the mirror when no tier
holds it. `num_cached_blocks` counts a key in any tier (the `prefix` policy is tier-agnostic,
as Dynamo's merged view); `leading_tiers` says which tier is the fastest for each.

The store tier is shared: a block one worker wrote there is a store hit on every worker of
the deployment whose store tier is enabled. A `StoreMirror` (one per router, `WorkerSet`)
keeps the store keys any worker reported, until a worker reports one gone (evicted, corrupt,
or the store unreachable from it); `leading_tiers` credits those keys as store hits to a
worker that never saw them. A worker's snapshot does not clear it (the store outlives the
worker that wrote a block). A key the store evicted without anyone noticing is credited too
long, at the cost of one mispriced choice: the worker routed there recomputes the block and
writes it to the store again.

Both stay bounded however long the store runs: a worker remembers at most
`kvferry.cache.tiers.store.MAX_KNOWN_KEYS` store keys and reports the ones it forgets as
removed, so a worker's mirror holds no more store keys than the worker does (its GetStats
snapshot neither), and `StoreMirror` drops its least recently reported keys past
`MAX_STORE_KEYS`. A key forgotten that way is credited to no one until a worker reports it
again: under-crediting costs a recompute at worst, never a wrong answer. Store keys stay
reported per worker rather than once per deployment: each worker's events already carry them,
and a key one worker forgets may still be fresh on another.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvferry.cache.prefix import EventsSince, Tier

# How long a key predicted on a worker (a request sent there) counts as cached without the
# worker's events confirming it: a long prefill and push, plus a few stats refreshes.
PREDICTED_KEY_TTL_S = 10.0
# Store keys the router remembers, least recently reported dropped first: four workers' caps
# (`MAX_KNOWN_KEYS`), some 30 MiB at most; a 48 GB store of 2.3 MiB blocks (Qwen3-4B, 16
# tokens) holds ~21k.
MAX_STORE_KEYS = 1 << 18


@dataclass(slots=True)
class StoreMirror:
    """The blocks the deployment's shared store holds, as any worker reported them."""

    keys: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    max_keys: int = MAX_STORE_KEYS

    def apply(self, since: EventsSince) -> None:
        for event in since.events:
            if event.tier is not Tier.STORE:
                continue
            for key in event.removed:
                self.keys.pop(key, None)
            for key in event.stored:
                self.keys[key] = None
                self.keys.move_to_end(key)
        while len(self.keys) > self.max_keys:
            self.keys.popitem(last=False)


@dataclass(slots=True)
class CacheMirror:
    """One worker's prefix-cache index as the router knows it."""

    # Reported by the worker's events: key -> bitmask of the tiers holding it (1 << Tier).
    keys: dict[bytes, int] = field(default_factory=dict)
    # Sequence number of the last event applied (0: none, the next answer is a snapshot).
    event_seq: int = 0
    predicted: dict[bytes, float] = field(default_factory=dict)  # key -> monotonic expiry

    def predict(self, keys: Sequence[bytes]) -> None:
        """A request with these prompt block keys was sent to the worker."""
        if keys:
            expiry = time.monotonic() + PREDICTED_KEY_TTL_S
            self.predicted.update(dict.fromkeys(keys, expiry))

    def num_cached_blocks(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` the worker holds, as far as the router knows (reported,
        or predicted and not lapsed)."""
        now = time.monotonic()
        count = 0
        for key in keys:
            if key not in self.keys and self.predicted.get(key, 0.0) <= now:
                break
            count += 1
        return count

    def leading_tiers(self, keys: Sequence[bytes], store: StoreMirror | None = None
                      ) -> list[Tier]:
        """For each leading key the worker holds, the fastest tier holding it (a predicted
        key counts as on the device; with `store`, the worker's shared store, a key is in
        its store when the shared mirror has it, whatever this worker reported)."""
        now = time.monotonic()
        tiers: list[Tier] = []
        store_bit = 1 << Tier.STORE
        for key in keys:
            mask = self.keys.get(key, 0)
            if self.predicted.get(key, 0.0) > now:
                mask |= 1 << Tier.DEVICE
            if store is not None:
                mask = (mask & ~store_bit) | (store_bit if key in store.keys else 0)
            if not mask:
                break
            tiers.append(Tier((mask & -mask).bit_length() - 1))
        return tiers

    def apply(self, since: EventsSince) -> None:
        """Apply the events of one answer, in order. An answer issued later than the one
        applied last but asked with an older cursor replays events already applied: replaying
        an ordered log from an earlier point ends in the same state, so that is harmless, and
        the cursor never goes back (answers issued earlier are refused by
        `Worker.apply_stats`)."""
        if since.is_snapshot:
            self.keys.clear()
        for event in since.events:
            bit = 1 << event.tier
            for key in event.removed:
                mask = self.keys.pop(key, 0) & ~bit
                if mask:
                    self.keys[key] = mask
                if event.tier is Tier.DEVICE:
                    self.predicted.pop(key, None)
            for key in event.stored:
                self.keys[key] = self.keys.get(key, 0) | bit
                self.predicted.pop(key, None)
        self.event_seq = since.seq
        now = time.monotonic()
        for key in [k for k, expiry in self.predicted.items() if expiry <= now]:
            del self.predicted[key]

    def forget(self) -> None:
        """Drop everything known, so that the next answer is a snapshot."""
        self.keys.clear()
        self.predicted.clear()
        self.event_seq = 0
