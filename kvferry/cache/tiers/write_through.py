"""Write-through: blocks the pool indexes are copied to the host tier on a thread of their
own, then from the host tier to disk (on that thread) and to the store (on the store's write
thread, so a slow store holds up no host or disk copy). A pool block stays referenced until
its copy has read it (so it is never reused or rewritten under the copy), a host slot stays
pinned until its disk or store write has read it, and each tier's index takes a block only
once its copy is complete.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from kvferry.cache.pool import KvPool
from kvferry.cache.prefix import Tier
from kvferry.cache.tiers import host as host_tier
from kvferry.cache.tiers.disk import DiskTier
from kvferry.cache.tiers.host import HostTier, Slot, block_nbytes
from kvferry.cache.tiers.store import StoreTier

log = logging.getLogger("kvferry.tiers")
T = TypeVar("T")

# Write-through jobs queued on the write thread before new ones are dropped (and counted):
# a burst of registrations must not hold pool blocks hostage behind slow copies.
MAX_QUEUED_WRITES = 64


@dataclass(slots=True)
class TierCounts:
    """One tier's traffic since start (TierStats' counters)."""

    hit_tokens: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    num_promotions: int = 0
    promotion_s: float = 0.0

    def add(self, num_blocks: int, block_size: int, block_nbytes: int,
            promotion_s: float) -> None:
        """A promotion read `num_blocks` blocks out of the tier."""
        if num_blocks:
            self.hit_tokens += num_blocks * block_size
            self.bytes_out += num_blocks * block_nbytes
            self.num_promotions += 1
            self.promotion_s += promotion_s


class WriteThrough:
    """The write thread and what is queued on it. Event loop only, but for the copies."""

    def __init__(self, pool: KvPool, host: HostTier, disk: DiskTier | None,
                 store: StoreTier | None, counts: dict[Tier, TierCounts],
                 on_release: Callable[[], None]) -> None:
        self.pool = pool
        self.allocator = pool.allocator
        self.host = host
        self.disk = disk
        self.store = store
        self._counts = counts
        self._on_release = on_release
        self._block_nbytes = block_nbytes(pool)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvferry-tier-write")
        self._num_queued = 0

    @property
    def is_idle(self) -> bool:
        return self._num_queued == 0

    def close(self) -> None:
        self._writer.shutdown(wait=True)

    def copy_ahead(self) -> None:
        """Write-back: while fewer than a quarter of the pool's blocks are truly free, copy
        the next quarter in line for eviction to the host tier, so that evicting them loses
        nothing; allocations never wait for it (a block evicted first is lost)."""
        low = max(self.pool.num_blocks // 4, 1)
        if self.allocator.num_truly_free < low:
            cold = [(key, block) for key, block in self.allocator.coldest(low)
                    if key not in self.host]
            if cold:
                self.write(cold, is_cold=True)

    def write(self, stored: list[tuple[bytes, int]], is_cold: bool = False) -> None:
        """Copy indexed pool blocks ((key, block) pairs) to the host tier, then to disk and
        the store; each block is referenced until its copy has read it. `is_cold`: blocks
        only the cache holds (write-back), which go back to the front of the eviction order
        once copied."""
        if self._num_queued >= MAX_QUEUED_WRITES:
            self.host.num_dropped_writes += len(stored)
            return
        taken = self.host.reserve([key for key, _ in stored])
        if not taken:
            return
        block_of = dict(stored)
        ids = [block_of[slot.key] for slot in taken]
        self.allocator.retain(ids)
        self._num_queued += 1
        _then(self._writer.submit(host_tier.copy_out, self.pool, ids, self.host,
                                  [slot.slot for slot in taken]),
              lambda done: self._copied_out(done, taken, ids, is_cold))

    def _copied_out(self, done: Future[None], taken: list[Slot], block_ids: list[int],
                    is_cold: bool) -> None:
        self._num_queued -= 1
        error = done.exception()
        if error is not None:
            log.error("host K/V tier: a write-through copy failed: %r", error)
        self.host.commit(taken, is_ok=error is None)
        self.allocator.free(block_ids, is_cold)
        self._on_release()
        if error is not None:
            return
        self._counts[Tier.HOST].bytes_in += len(taken) * self._block_nbytes
        if self.disk is not None:
            keys, evicted = self.disk.reserve([slot.key for slot in taken])
            if keys or evicted:
                slot_of = {slot.key: slot.slot for slot in taken}
                slots = self.host.pin(keys)  # committed above: read them while pinned
                assert [slot_of[key] for key in keys] == slots
                self._num_queued += 1
                _then(self._writer.submit(self.disk.write, keys,
                                          [self.host.data[s] for s in slots], evicted),
                      lambda done: self._written_to_disk(done, keys, slots))
        if self.store is not None and self.store.is_enabled:
            keys = [slot.key for slot in taken]
            slots = self.host.pin(keys)
            queued = self.store.queue_write(keys, [self.host.data[s] for s in slots])
            if queued is None:  # the store's write queue is full: dropped, counted
                self.host.unpin(slots)
                return
            self._num_queued += 1
            _then(queued, lambda done: self._written_to_store(done, slots))

    def _written_to_disk(self, done: Future[tuple[int, OSError | None]], keys: list[bytes],
                         slots: list[int]) -> None:
        self._num_queued -= 1
        assert self.disk is not None
        self.host.unpin(slots)
        num_written, error = (0, done.exception()) if done.exception() else done.result()
        self.disk.commit(keys, num_written, error)
        self._counts[Tier.DISK].bytes_in += num_written * self._block_nbytes


    def _written_to_store(self, done: Future[tuple[list[bytes], int]], slots: list[int]
                          ) -> None:
        self._num_queued -= 1
        assert self.store is not None
        self.host.unpin(slots)
        num_new = self.store.written(done)  # a failure disables the store (then probed)
        self._counts[Tier.STORE].bytes_in += num_new * self._block_nbytes


def _then(future: Future[T], callback: Callable[[Future[T]], None]) -> None:
    """`callback(future)` on this event loop once the thread's job is done."""
    loop = asyncio.get_running_loop()

    def done(finished: Future[T]) -> None:
        if not loop.is_closed():  # else the worker is gone, and its pool with it
            loop.call_soon_threadsafe(callback, finished)

    future.add_done_callback(done)
