"""A worker's prefix cache across its tiers: the device pool's index, then host memory.

`acquire` replaces "match, then allocate" in both engines: it takes the leading blocks the
pool holds, then the run after them that a lower tier holds, allocates the rest, and copies
that run into the first new blocks before returning, so every block it reports cached is in
the pool and final. `register` indexes final blocks in the pool and, write-through, copies
the newly indexed ones to the host tier: each stays referenced until its copy has read it, so
no block is reused or rewritten under a copy, and evicting it from the pool later costs
nothing.

Index state lives on the event loop; bytes move on two tier threads (`kvferry-tier-read` for
promotions, `kvferry-tier-write` for write-through), so a write never queues ahead of a
promotion and the forward-pass executors never wait on a copy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

from kvferry.cache.allocator import IntegrityReport
from kvferry.cache.block_queue import BlockQueue
from kvferry.cache.pool import KvPool
from kvferry.cache.prefix import EventsSince, Tier
from kvferry.cache.stats import TierStats
from kvferry.cache.tiers import host as host_tier
from kvferry.cache.tiers.config import TierSettings, host_cache_bytes
from kvferry.cache.tiers.host import HostTier, Slot, block_nbytes

log = logging.getLogger("kvferry.tiers")

# Write-through copies queued on the write thread before new ones are dropped (and counted):
# a burst of registrations must not hold pool blocks hostage behind a slow copy.
MAX_QUEUED_WRITES = 64


class TierHit(NamedTuple):
    block_ids: list[int]  # the blocks asked for; the first `num_cached` hold cached K/V
    num_cached: int  # leading blocks in place: device hits, then promoted ones
    num_promoted: int  # of those, copied in from the host tier
    promotion_s: float  # time the promotion took (0: none)


class TieredCache:
    """The pool's prefix index plus the host tier (None: the plain prefix cache). Event
    loop only; `on_release` is called whenever blocks return to the pool (the engine's
    `BlockQueue.grant`)."""

    def __init__(self, pool: KvPool, host: HostTier | None = None) -> None:
        self.pool = pool
        self.allocator = pool.allocator
        self.host = host
        self.on_release: Callable[[], None] = lambda: None
        self._reader = self._writer = None
        if host is not None:
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="kvferry-tier-read")
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvferry-tier-write")
        self._num_queued_writes = 0
        self.num_hit_tokens = 0  # promoted from the host tier
        self.num_promotions = 0
        self.promotion_s = 0.0
        self.bytes_in = self.bytes_out = 0  # into the host tier, out of it into the pool

    @property
    def prefix_caching(self) -> bool:
        return self.allocator.prefix_caching

    async def acquire(self, keys: Sequence[bytes], num_query_tokens: int, blocks: BlockQueue,
                      num_blocks: int, deferrable: bool = False) -> TierHit:
        """`num_blocks` blocks whose leading ones hold the longest cached run of `keys`
        (at most `num_blocks - 1` keys), each referenced for the caller. Waits for blocks in
        `blocks`' queue; cancelled, it gives back everything it took."""
        device = self.allocator.match(list(keys), num_query_tokens)
        rest = list(keys[len(device):])
        slots: list[int] = []
        if self.host is not None:
            self.host.touch(keys[:len(device)])
            slots = self.host.pin(rest[:self.host.leading(rest)])
        try:
            fresh = await blocks.alloc(num_blocks - len(device), deferrable)
        except BaseException:
            self._give_back(device, slots)
            raise
        ids = device + fresh
        if not slots:
            return TierHit(ids, len(device), 0, 0.0)
        assert self.host is not None and self._reader is not None
        targets = fresh[:len(slots)]
        started = time.perf_counter()
        copy = asyncio.wrap_future(self._reader.submit(
            host_tier.copy_in, self.host, slots, self.pool, targets))
        try:
            await asyncio.shield(copy)
        except asyncio.CancelledError:
            # The copy still writes into `targets`: give them back once it is done.
            copy.add_done_callback(lambda _: self._give_back(ids, slots))
            raise
        except BaseException:
            self._give_back(ids, slots)
            raise
        self.host.unpin(slots)
        promotion_s = time.perf_counter() - started
        self.allocator.register(rest[:len(slots)], targets)
        self.num_hit_tokens += len(slots) * self.pool.block_size
        self.num_promotions += 1
        self.promotion_s += promotion_s
        self.bytes_out += len(slots) * host_tier.block_nbytes(self.pool)
        return TierHit(ids, len(device) + len(slots), len(slots), promotion_s)

    def _give_back(self, block_ids: list[int], slots: list[int]) -> None:
        self.allocator.free(block_ids)
        if self.host is not None:
            self.host.unpin(slots)
        self.on_release()

    def register(self, keys: Sequence[bytes], block_ids: Sequence[int]) -> None:
        """Index final blocks in the pool; write the newly indexed ones through to the host
        tier."""
        stored = self.allocator.register(list(keys), list(block_ids))
        if self.host is None or not stored or self._writer is None:
            return
        if self._num_queued_writes >= MAX_QUEUED_WRITES:
            self.host.num_dropped_writes += len(stored)
            return
        taken = self.host.reserve([key for key, _ in stored])
        if not taken:
            return
        block_of = dict(stored)
        ids = [block_of[slot.key] for slot in taken]
        self.allocator.incref(ids)
        self._num_queued_writes += 1
        future = self._writer.submit(host_tier.copy_out, self.pool, ids, self.host,
                                     [slot.slot for slot in taken])
        loop = asyncio.get_running_loop()

        def done(copied: Future[None]) -> None:
            if not loop.is_closed():  # else the worker is gone, and its pool with it
                loop.call_soon_threadsafe(self._written, copied, taken, ids)

        future.add_done_callback(done)

    def _written(self, done: Future[None], taken: list[Slot], block_ids: list[int]) -> None:
        self._num_queued_writes -= 1
        error = done.exception()
        if error is not None:
            log.error("host tier: a write-through copy failed: %r", error)
        assert self.host is not None
        self.host.commit(taken, is_ok=error is None)
        if error is None:
            self.bytes_in += len(taken) * host_tier.block_nbytes(self.pool)
        self.allocator.free(block_ids)
        self.on_release()

    def events_since(self, after: int) -> EventsSince:
        keys = {Tier.DEVICE: self.allocator.cached_keys()}
        if self.host is not None:
            keys[Tier.HOST] = self.host.keys()
        return self.allocator.events.since(after, keys)

    def check_integrity(self) -> IntegrityReport:
        report = self.allocator.check_integrity()
        if report.ok and self.host is not None:
            return self.host.check_integrity()
        return report

    @property
    def is_idle(self) -> bool:
        """No copy in flight (tests wait for this before counting free blocks)."""
        return self.host is None or (self._num_queued_writes == 0 and self.host.is_idle)

    def stats(self) -> tuple[TierStats, ...]:
        if self.host is None:
            return ()
        return (TierStats(
            tier=Tier.HOST, capacity_blocks=self.host.num_slots,
            used_blocks=len(self.host.keys()), hit_tokens=self.num_hit_tokens,
            bytes_in=self.bytes_in, bytes_out=self.bytes_out,
            evictions=self.host.num_evictions, dropped_writes=self.host.num_dropped_writes,
            num_promotions=self.num_promotions, promotion_s=self.promotion_s),)

    def close(self) -> None:
        for executor in (self._reader, self._writer):
            if executor is not None:
                executor.shutdown(wait=True)


def build_tiered_cache(pool: KvPool, settings: TierSettings) -> TieredCache:
    """The prefix cache over `pool` and the tiers `settings` asks for."""
    host = None
    if settings.host_cache_size is not None:
        num_slots = host_cache_bytes(settings.host_cache_size) // block_nbytes(pool)
        host = HostTier(pool, num_slots, pool.allocator.events)
        if num_slots < pool.num_blocks:
            log.warning("kv_host_cache_size holds %d blocks, fewer than the pool's %d: the "
                        "host tier adds little under it", num_slots, pool.num_blocks)
        log.info("host K/V tier: %d blocks (%d bytes), %s", num_slots,
                 num_slots * block_nbytes(pool), settings.host_write_policy)
    return TieredCache(pool, host)
