"""The host-memory tier: copies of cached K/V blocks in a region of host memory of its own.

One slot holds one block of every layer's K and V, laid out as the pool holds it
(`[layers, 2, *page]`: dense K/V or quantized pages with their scales), so a copy in or out is
one `index_copy_` of whole blocks. The index lives on the event loop; the bytes move on the
tiered cache's threads. Under a CUDA pool the region is pinned and the copies run on a CUDA
stream of their own, so they overlap the step loop's kernels instead of queueing behind
them. A slot being written is invisible until `commit`; a slot being read (or written) is
pinned, and eviction (least recently used first) skips pinned slots, so no slot is reused
under a running copy.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvferry.cache.allocator import IntegrityReport
from kvferry.cache.pool import KvPool
from kvferry.cache.prefix import CacheEvents, Tier
from kvferry.cache.stats import TierState


class Slot(NamedTuple):
    key: bytes
    slot: int


class HostTier:
    """`num_slots` blocks of host memory below `pool`, logging to the pool's event log."""

    tier = Tier.HOST

    def __init__(self, pool: KvPool, num_slots: int, events: CacheEvents) -> None:
        if num_slots < 1:
            raise ValueError(f"kv_host_cache_size: holds no block (a block is "
                             f"{block_nbytes(pool)} bytes)")
        # whole pages (every K/V head, as a tensor-parallel pool's read_pages gathers them)
        block_shape = (pool.num_layers, 2, *pool.page_shape)
        # [num_slots, layers, 2, *page]: one block of every layer per slot
        is_cuda = pool.cache.is_cuda
        self.data = torch.empty((num_slots, *block_shape), dtype=pool.cache.dtype,
                                pin_memory=is_cuda)
        # The tier threads' copies (None on CPU: a copy there is a memcpy on that thread)
        self.stream = torch.cuda.Stream(pool.cache.device) if is_cuda else None
        self.num_slots = num_slots
        self.events = events
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()  # committed; LRU first
        self._writing: dict[bytes, int] = {}  # reserved by a write not committed yet
        self._pins = [0] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self.num_evictions = 0
        self.num_dropped_writes = 0  # no unpinned slot to take
        self.num_corrupt = 0  # host memory holds no checksum: nothing is found corrupt here
        self.state = TierState.ENABLED  # never disabled: a copy into RAM cannot fail

    @property
    def capacity_blocks(self) -> int:
        return self.num_slots

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def keys(self) -> list[bytes]:
        return list(self._slot_of)

    def __contains__(self, key: bytes) -> bool:
        return key in self._slot_of

    def leading(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, this tier holds (committed)."""
        count = 0
        for key in keys:
            if key not in self._slot_of:
                break
            count += 1
        return count

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark held keys most recently used (the device just served them)."""
        for key in keys:
            if key in self._slot_of:
                self._slot_of.move_to_end(key)

    def pin(self, keys: Sequence[bytes]) -> list[int]:
        """The slots of `keys` (all held), pinned until `unpin`, and marked recently used."""
        slots = [self._slot_of[key] for key in keys]
        self.touch(keys)
        for slot in slots:
            self._pins[slot] += 1
        return slots

    def unpin(self, slots: Sequence[int]) -> None:
        for slot in slots:
            if self._pins[slot] <= 0:
                raise ValueError(f"host slot {slot} unpinned twice")
            self._pins[slot] -= 1

    def reserve(self, keys: Sequence[bytes]) -> list[Slot]:
        """Pinned slots to write the keys this tier lacks into (held keys are only marked
        used). A slot comes from the free list or from evicting the least recently used
        unpinned block; with neither, the rest is dropped and counted."""
        taken: list[Slot] = []
        removed: list[bytes] = []
        for key in keys:
            if key in self._slot_of:
                self._slot_of.move_to_end(key)
                continue
            if key in self._writing:
                continue
            slot = self._take(removed)
            if slot is None:
                self.num_dropped_writes += 1
                continue
            self._pins[slot] += 1
            self._writing[key] = slot
            taken.append(Slot(key, slot))
        self.events.add([], removed, Tier.HOST)
        return taken

    def _take(self, removed: list[bytes]) -> int | None:
        if self._free:
            return self._free.pop()
        for key, slot in self._slot_of.items():
            if self._pins[slot] == 0:
                del self._slot_of[key]
                removed.append(key)
                self.num_evictions += 1
                return slot
        return None

    def commit(self, written: Sequence[Slot], is_ok: bool) -> None:
        """Writes into `written` (from `reserve`) ended: visible when `is_ok`, else freed."""
        stored: list[bytes] = []
        for key, slot in written:
            del self._writing[key]
            self._pins[slot] -= 1
            if is_ok:
                self._slot_of[key] = slot
                stored.append(key)
            else:
                self._free.append(slot)
        self.events.add(stored, [], Tier.HOST)

    def check_integrity(self) -> IntegrityReport:
        """Every slot is free, committed or being written, exactly once; no pin is left on
        a slot when `is_idle`."""
        held = list(self._slot_of.values()) + list(self._writing.values()) + self._free
        if sorted(held) != list(range(self.num_slots)):
            return IntegrityReport(False, f"host slots: {len(held)} accounted for, "
                                   f"{len(set(held))} distinct, of {self.num_slots}")
        if any(count < 0 for count in self._pins):
            return IntegrityReport(False, "a host slot has a negative pin count")
        return IntegrityReport(True, "")

    @property
    def is_idle(self) -> bool:
        return not self._writing and not any(self._pins)


def block_nbytes(pool: KvPool) -> int:
    """Bytes of one block of every layer's K and V, every K/V head's (a slot)."""
    return 2 * pool.num_layers * math.prod(pool.page_shape) * pool.cache.element_size()


def copy_out(pool: KvPool, block_ids: Sequence[int], host: HostTier,
             slots: Sequence[int]) -> None:
    """Pool blocks -> host slots (a tier thread; the blocks are final and referenced). A
    tensor-parallel pool's blocks are read whole through its group (`read_pages`)."""
    if pool.tensor_parallel_size > 1:
        pages = pool.read_pages(list(block_ids)).movedim(2, 0).to(host.data.device)
        host.data.index_copy_(0, torch.tensor(slots, dtype=torch.int64), pages)
        return
    if host.stream is None:
        ids = torch.tensor(block_ids, dtype=torch.int64)
        # [layers, 2, n, *page] -> [n, layers, 2, *page]
        pages = pool.cache.index_select(2, ids).movedim(2, 0)
        host.data.index_copy_(0, torch.tensor(slots, dtype=torch.int64), pages)
        return
    # The blocks' last writes are queued on the step loop's stream: the copy waits for them.
    host.stream.wait_stream(torch.cuda.default_stream(pool.cache.device))
    with torch.cuda.stream(host.stream):
        ids = torch.tensor(block_ids, dtype=torch.int64, device=pool.cache.device)
        pages = pool.cache.index_select(2, ids).movedim(2, 0)
        for i, slot in enumerate(slots):  # into pinned memory: asynchronous DMA
            host.data[slot].copy_(pages[i], non_blocking=True)
    host.stream.synchronize()  # the slot is complete before the index commits it


def copy_in(host: HostTier, slots: Sequence[int], pool: KvPool,
            block_ids: Sequence[int]) -> None:
    """Host slots -> pool blocks no request reads yet (a tier thread; the slots are pinned).
    A tensor-parallel pool's ranks each keep their heads (`write_pages`, through its group)."""
    if pool.tensor_parallel_size > 1:
        pages = host.data.index_select(0, torch.tensor(slots, dtype=torch.int64))
        pool.write_pages(list(block_ids), pages.movedim(0, 2))
        return
    if host.stream is None:
        pages = host.data.index_select(0, torch.tensor(slots, dtype=torch.int64))
        pool.cache.index_copy_(2, torch.tensor(block_ids, dtype=torch.int64),
                               pages.movedim(0, 2))
        return
    # Writes still queued into the fresh blocks (their last owner's) land first.
    host.stream.wait_stream(torch.cuda.default_stream(pool.cache.device))
    with torch.cuda.stream(host.stream):
        ids = torch.tensor(block_ids, dtype=torch.int64, device=pool.cache.device)
        pages = torch.stack([host.data[slot].to(pool.cache.device, non_blocking=True)
                             for slot in slots])
        pool.cache.index_copy_(2, ids, pages.movedim(0, 2))
    # Done before the caller hands the blocks on: the step loop's stream then reads them.
    host.stream.synchronize()
