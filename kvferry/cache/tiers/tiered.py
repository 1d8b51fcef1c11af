"""A worker's prefix cache across its tiers: the device pool's index, host memory, disk.

`acquire` replaces "match, then allocate" in both engines: it takes the leading blocks the
pool holds, then the run after them that the host tier holds, then the run after that the
disk holds (read into host slots, verified, which also makes them host hits next time),
allocates the rest, and copies the host run into the first new blocks before returning: every
block it reports cached is in the pool, final and verified. `register` indexes final blocks
in the pool and, write-through, copies the newly indexed ones to the host tier, then from
there to disk: each pool block stays referenced until its copy has read it, so no block is
reused or rewritten under a copy, and evicting it from the pool later costs nothing.

Index state lives on the event loop; bytes move on two tier threads (`kvferry-tier-read` for
promotions, `kvferry-tier-write` for write-through), so a write never queues ahead of a
promotion and the forward-pass executors never wait on tier I/O. The store's calls run on
threads of its own, within a deadline (`store.py`): a slow store delays no host or disk
promotion, and a request by at most the deadline.

A block read from disk or the store is checked as a pushed chunk is (`KvPool.pages_finite`:
no inf or NaN, and on quantized pools each scale within bounds) before it is copied into the
pool: one that fails is dropped, counted as corrupt, and recomputed, as one failing its CRC.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

from kvferry.cache.allocator import IntegrityReport
from kvferry.cache.block_queue import BlockQueue
from kvferry.cache.pool import KvPool
from kvferry.cache.prefix import EventsSince, Tier, TierTokens
from kvferry.cache.stats import TierStats
from kvferry.cache.tiers import codec
from kvferry.cache.tiers import host as host_tier
from kvferry.cache.tiers.disk import DiskTier
from kvferry.cache.tiers.host import HostTier, Slot, block_nbytes
from kvferry.cache.tiers.store import StoreTier
from kvferry.cache.tiers.write_through import TierCounts, WriteThrough

log = logging.getLogger("kvferry.tiers")
T = TypeVar("T")

class TierHit(NamedTuple):
    block_ids: list[int]  # the blocks asked for; the first `num_cached` hold cached K/V
    num_cached: int  # leading blocks in place: device hits, then promoted ones
    num_promoted: int  # of those, copied in from the host tier (some read from disk first)
    promotion_s: float  # time the promotion took (0: none)
    by_tier: TierTokens = TierTokens()  # the promoted ones' tokens, by the tier they came from


@dataclass(slots=True)
class _Promotion:
    host_slots: list[int]  # pinned host slots of the host run
    staged: list[Slot]  # host slots reserved for the disk and store runs after it, in order
    tiers: list[Tier]  # where each staged block is read from
    is_open: bool = True  # every key staged so far: a lower tier's run may follow
    values: list[bytes] = field(default_factory=list)  # the store run's, fetched


class TieredCache:
    """The pool's prefix index plus a host tier and, below it, a disk tier (each optional;
    disk needs host). Event loop only; `on_release` is called whenever blocks return to the
    pool (the engine's `BlockQueue.grant`)."""

    def __init__(self, pool: KvPool, host: HostTier | None = None,
                 disk: DiskTier | None = None, store: StoreTier | None = None,
                 write_policy: str = "write_through") -> None:
        if (disk is not None or store is not None) and host is None:
            raise ValueError("kv_disk_cache_dir/kv_store_url: need a host tier "
                             "(--kv-host-cache-size): their blocks are read through it")
        self.pool = pool
        self.allocator = pool.allocator
        self.host = host
        self.disk = disk
        self.store = store
        self.is_write_back = write_policy == "write_back"
        self.on_release: Callable[[], None] = lambda: None
        self._counts = {tier: TierCounts() for tier in (Tier.HOST, Tier.DISK, Tier.STORE)}
        self._block_nbytes = block_nbytes(pool)
        self._reader = self._writes = None
        if host is not None:
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="kvferry-tier-read")
            self._writes = WriteThrough(pool, host, disk, store, self._counts,
                                        lambda: self.on_release())

    @property
    def prefix_caching(self) -> bool:
        return self.allocator.prefix_caching

    # ---- lookups --------------------------------------------------------------------------
    async def acquire(self, keys: Sequence[bytes], num_query_tokens: int, blocks: BlockQueue,
                      num_blocks: int, deferrable: bool = False) -> TierHit:
        """`num_blocks` blocks whose leading ones hold the longest cached run of `keys`
        (at most `num_blocks - 1` keys), each referenced for the caller. Waits for blocks in
        `blocks`' queue; cancelled, it gives back everything it took."""
        device = self.allocator.match(list(keys), num_query_tokens)
        if self.is_write_back and self._writes is not None:
            self._writes.copy_ahead()
        rest = list(keys[len(device):])
        plan = self._plan(keys[:len(device)], rest)
        try:
            if plan is not None and self.store is not None and plan.is_open:
                await self._plan_store(plan, rest)
            fresh = await blocks.alloc(num_blocks - len(device), deferrable)
        except BaseException:
            self._end_promotion(plan, 0, None)
            self._give_back(device)
            raise
        ids = device + fresh
        if plan is None or not (plan.host_slots or plan.staged):
            self._end_promotion(plan, 0, None)
            return TierHit(ids, len(device), 0, 0.0)
        started = time.perf_counter()
        assert self._reader is not None
        read = asyncio.wrap_future(self._reader.submit(self._promote, plan, fresh))
        try:
            num_read, error = await asyncio.shield(read)
        except asyncio.CancelledError:
            # The copy still writes into `fresh`: give everything back once it is done.
            read.add_done_callback(lambda done: self._cancelled(done, plan, ids))
            raise
        except BaseException:
            self._end_promotion(plan, 0, None)
            self._give_back(ids)
            raise
        self._end_promotion(plan, num_read, error)
        num_promoted = len(plan.host_slots) + num_read
        self.allocator.register(rest[:num_promoted], fresh[:num_promoted])
        promotion_s = time.perf_counter() - started
        slowest = max(plan.tiers[:num_read], default=Tier.HOST)
        counts = {tier: plan.tiers[:num_read].count(tier) for tier in (Tier.DISK, Tier.STORE)}
        counts[Tier.HOST] = len(plan.host_slots)
        for tier, num in counts.items():
            self._counts[tier].add(num, self.pool.block_size, self._block_nbytes,
                                   promotion_s if tier is slowest else 0.0)
        bs = self.pool.block_size
        by_tier = TierTokens(counts[Tier.HOST] * bs, counts[Tier.DISK] * bs,
                             counts[Tier.STORE] * bs)
        return TierHit(ids, len(device) + num_promoted, num_promoted, promotion_s, by_tier)

    def _plan(self, device_keys: Sequence[bytes], rest: list[bytes]) -> _Promotion | None:
        """Pin the host run after the device run, and stage the disk run after that."""
        if self.host is None:
            return None
        self.host.touch(device_keys)
        num_host = self.host.leading(rest)
        plan = _Promotion(self.host.pin(rest[:num_host]), [], [])
        if self.disk is not None:
            after = rest[num_host:]
            self._stage(plan, after[:self.disk.leading(after)], Tier.DISK)
            self.disk.pin([s.key for s in plan.staged])
        return plan

    def _stage(self, plan: _Promotion, keys: list[bytes], tier: Tier) -> None:
        """Reserve host slots for the run `keys` of `tier`, as far as slots are free."""
        assert self.host is not None
        taken = self.host.reserve(keys)
        run = 0
        while run < len(taken) and taken[run].key == keys[run]:
            run += 1
        self.host.commit(taken[run:], is_ok=False)
        plan.staged.extend(taken[:run])
        plan.tiers.extend([tier] * run)
        plan.is_open = run == len(keys)

    async def _plan_store(self, plan: _Promotion, rest: list[bytes]) -> None:
        """Stage the store's run after the host and disk runs and fetch it (two round trips,
        each within its deadline; no call when no key is left to look up)."""
        assert self.store is not None
        after = rest[len(plan.host_slots) + len(plan.staged):]
        num = await self.store.lookup(after)
        if not num:
            return
        first = len(plan.staged)
        self._stage(plan, after[:num], Tier.STORE)
        values = await self.store.fetch_run([slot.key for slot in plan.staged[first:]])
        kept = first + len(values)
        assert self.host is not None
        self.host.commit(plan.staged[kept:], is_ok=False)  # gone, or not fetched in time
        del plan.staged[kept:], plan.tiers[kept:]
        plan.values = values

    def _promote(self, plan: _Promotion, fresh: list[int]) -> tuple[int, Exception | None]:
        """A tier thread: read the staged runs into their host slots (verified; stops at the
        first that fails), then copy the host slots into the first fresh blocks."""
        assert self.host is not None
        num_read, error = 0, None
        values = iter(plan.values)
        for slot, tier in zip(plan.staged, plan.tiers):
            data = self.host.data[slot.slot]  # [layers, 2, *page]
            try:
                if tier is Tier.DISK:
                    self.disk.read_into(slot.key, data)  # type: ignore[union-attr]
                else:
                    self.store.verify_into(slot.key, next(values), data)  # type: ignore[union-attr]
                if not self.pool.pages_finite(data):
                    raise codec.BadValue("non-finite K/V (inf or NaN, or a quantized page's "
                                         "scale out of bounds)")
            except Exception as exc:  # a bad value, or the disk failing
                error = exc
                break
            num_read += 1
        slots = plan.host_slots + [s.slot for s in plan.staged[:num_read]]
        host_tier.copy_in(self.host, slots, self.pool, fresh[:len(slots)])
        return num_read, error

    def _end_promotion(self, plan: _Promotion | None, num_read: int,
                       error: Exception | None) -> None:
        if plan is None:
            return
        assert self.host is not None
        self.host.unpin(plan.host_slots)
        self.host.commit(plan.staged[:num_read], is_ok=True)  # lower hits are host hits now
        self.host.commit(plan.staged[num_read:], is_ok=False)
        if self.disk is not None:
            self.disk.unpin([s.key for s, t in zip(plan.staged, plan.tiers) if t is Tier.DISK])
        if self.store is not None:
            self.store.stored([s.key for s, t in zip(plan.staged[:num_read],
                                                     plan.tiers[:num_read]) if t is Tier.STORE])
        if error is None:
            return
        key, tier = plan.staged[num_read].key, plan.tiers[num_read]
        if tier is Tier.DISK and self.disk is not None:
            self.disk.drop_bad(key, error)
        elif self.store is not None and not self.store.failed(error):
            self.store.removed(key, error)
            self.store.forget(key)  # delete it there, on the store's write thread

    def _cancelled(self, done: asyncio.Future[tuple[int, Exception | None]],
                   plan: _Promotion, ids: list[int]) -> None:
        num_read, error = (0, None) if done.cancelled() or done.exception() else done.result()
        self._end_promotion(plan, num_read, error)
        self._give_back(ids)

    def _give_back(self, block_ids: list[int]) -> None:
        self.allocator.free(block_ids)
        self.on_release()

    # ---- write-through --------------------------------------------------------------------
    def register(self, keys: Sequence[bytes], block_ids: Sequence[int]) -> None:
        """Index final blocks in the pool; write the newly indexed ones through to the host
        tier, then from there to disk."""
        stored = self.allocator.register(list(keys), list(block_ids))
        if self._writes is not None and stored and not self.is_write_back:
            self._writes.write(stored)

    # ---- state ----------------------------------------------------------------------------
    def events_since(self, after: int) -> EventsSince:
        keys = {Tier.DEVICE: self.allocator.cached_keys()}
        if self.host is not None:
            keys[Tier.HOST] = self.host.keys()
        if self.disk is not None:
            keys[Tier.DISK] = self.disk.keys()
        if self.store is not None:
            keys[Tier.STORE] = self.store.keys()
        return self.allocator.events.since(after, keys)

    def check_integrity(self) -> IntegrityReport:
        for part in (self.allocator, self.host, self.disk):
            if part is not None and not (report := part.check_integrity()).ok:
                return report
        return IntegrityReport(True, "")

    @property
    def is_idle(self) -> bool:
        """No copy in flight (tests wait for this before counting free blocks)."""
        return self._writes is None or (self._writes.is_idle and self.host.is_idle)

    def stats(self) -> tuple[TierStats, ...]:
        tiers = []
        for tier, part in ((Tier.HOST, self.host), (Tier.DISK, self.disk),
                           (Tier.STORE, self.store)):
            if part is None:
                continue
            c = self._counts[tier]
            tiers.append(TierStats(
                tier, part.capacity_blocks, len(part.keys()), c.hit_tokens, c.bytes_in,
                c.bytes_out, part.num_evictions, part.num_dropped_writes, part.num_corrupt,
                c.num_promotions, c.promotion_s, part.state))
        return tuple(tiers)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.shutdown(wait=True)
        if self._writes is not None:
            self._writes.close()
        if self.disk is not None:
            self.disk.close()
        if self.store is not None:
            self.store.close()
