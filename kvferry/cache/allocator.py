"""The block allocator: free list, refcounts and the prefix-cache index of one K/V pool.

The allocator owns the free list and refcounts; callers own their block tables and must give
every block back exactly once, whatever way the request ends. Full blocks whose contents are
final are indexed by their prefix key (`kvferry.cache.prefix`); `events` logs what the index
stores and evicts, for the router's mirror and for the tiers below the pool
(`kvferry.cache.tiers`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from kvferry.cache.prefix import CacheEvents, EventsSince, Tier
from kvferry.errors import ResourceExhausted


class IntegrityReport(NamedTuple):
    ok: bool
    error: str


class BlockAllocator:
    """Free list + refcounts over `num_blocks` blocks, and the prefix-cache index.

    With `prefix_caching`, full blocks whose contents are final are indexed by their key
    (`kvferry.cache.prefix`). An indexed block no request holds stays indexed, with refcount
    0, on a least-recently-released list: it counts as free (`num_free`) and is evicted, its
    key dropped, only when an allocation finds no truly free block. alloc, free and match
    are O(1) per block."""

    def __init__(self, num_blocks: int, block_size: int = 1, prefix_caching: bool = False
                 ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        # Popped from the end: low ids are handed out first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refcount: list[int] = [0] * num_blocks
        self._key_of: dict[int, bytes] = {}  # indexed block -> its key
        self._block_of: dict[bytes, int] = {}  # key -> the block holding it
        self._evictable: OrderedDict[int, None] = OrderedDict()  # indexed, refcount 0; LRU first
        self.events = CacheEvents()
        self.num_query_tokens = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.num_hit_tokens = 0  # of those, found (vLLM's prefix_cache_hits)

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: truly free, or cached with no request on them."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_truly_free(self) -> int:
        """Blocks neither a request nor the prefix cache holds: taking them evicts nothing."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks only the prefix cache holds (reclaimable)."""
        return len(self._evictable)

    def alloc(self, n: int) -> list[int]:
        """Take `n` blocks, each with refcount 1, evicting cached ones (least recently
        released first) once no truly free block is left. All or nothing."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free:
            raise ResourceExhausted(
                f"need {n} K/V blocks, {self.num_free} of {self.num_blocks} free"
            )
        ids: list[int] = []
        removed: list[bytes] = []
        for _ in range(n):
            if self._free:
                block_id = self._free.pop()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                key = self._key_of.pop(block_id)
                del self._block_of[key]
                removed.append(key)
            self._refcount[block_id] = 1
            ids.append(block_id)
        self.events.add([], removed)
        return ids

    def refcount(self, block_id: int) -> int:
        """References to the block: one per table holding it and one per copy of it under
        way (`retain`). An indexed block nobody holds has none and waits for eviction."""
        return self._refcount[block_id]

    def is_private(self, block_id: int) -> bool:
        """Held by one table and not indexed: its holder may write it in place."""
        return self._refcount[block_id] == 1 and block_id not in self._key_of

    def incref(self, ids: list[int]) -> None:
        """Share blocks: each must already be in use."""
        for block_id in ids:
            if self._refcount[block_id] <= 0:
                raise ValueError(f"block {block_id} is free; cannot share it")
            self._refcount[block_id] += 1

    def coldest(self, n: int) -> list[tuple[bytes, int]]:
        """Up to `n` (key, block) pairs of the cached blocks no request holds, the next to be
        evicted first."""
        found = []
        for block_id in self._evictable:
            if len(found) >= n:
                break
            found.append((self._key_of[block_id], block_id))
        return found

    def retain(self, ids: list[int]) -> None:
        """One more reference to each indexed block, held by a request or only cached (a
        copy of it is about to read it: it must not be evicted meanwhile)."""
        for block_id in ids:
            if block_id not in self._key_of:
                raise ValueError(f"block {block_id} is not indexed; cannot retain it")
            if self._refcount[block_id] == 0:
                del self._evictable[block_id]
            self._refcount[block_id] += 1

    def free(self, ids: list[int], is_cold: bool = False) -> None:
        """Drop one reference to each block. One reaching 0 goes back to the free list, or,
        when indexed, to the cache's eviction order (a sequence's last blocks are released
        first, so they are evicted before the prefix they extend); with `is_cold`, to the
        front of that order (a block `retain`ed only to copy it keeps its place)."""
        for block_id in reversed(ids):
            count = self._refcount[block_id]
            if count <= 0:
                raise ValueError(f"block {block_id} freed twice")
            self._refcount[block_id] = count - 1
            if count == 1:
                if block_id in self._key_of:
                    self._evictable[block_id] = None
                    if is_cold:
                        self._evictable.move_to_end(block_id, last=False)
                else:
                    self._free.append(block_id)

    def match(self, keys: list[bytes], num_query_tokens: int) -> list[int]:
        """The blocks holding the longest cached prefix of `keys`, each with one more
        reference (the caller frees them like its own). `num_query_tokens`: the prompt
        length this lookup is for, counted in the hit-rate statistics."""
        if not self.prefix_caching:
            return []
        hits: list[int] = []
        for key in keys:
            block_id = self._block_of.get(key)
            if block_id is None:
                break
            hits.append(block_id)
        for block_id in hits:
            if self._refcount[block_id] == 0:
                del self._evictable[block_id]
            self._refcount[block_id] += 1
        self.num_query_tokens += num_query_tokens
        self.num_hit_tokens += len(hits) * self.block_size
        return hits

    def register(self, keys: list[bytes], ids: list[int]) -> list[tuple[bytes, int]]:
        """Index blocks whose contents are final (full blocks, written); returns the (key,
        block) pairs newly indexed. A block already indexed, or a key another block holds, is
        left as it is. The caller never writes an indexed block again."""
        if not self.prefix_caching:
            return []
        stored: list[tuple[bytes, int]] = []
        for key, block_id in zip(keys, ids):
            if self._refcount[block_id] <= 0:
                raise ValueError(f"block {block_id} is free; cannot index it")
            if block_id in self._key_of or key in self._block_of:
                continue
            self._key_of[block_id] = key
            self._block_of[key] = block_id
            stored.append((key, block_id))
        self.events.add([key for key, _ in stored], [])
        return stored

    def cached_keys(self) -> list[bytes]:
        return list(self._block_of)

    def events_since(self, after: int) -> EventsSince:
        return self.events.since(after, {Tier.DEVICE: self._block_of})

    def check_integrity(self) -> IntegrityReport:
        """free + cached + used == total, refcounts >= 0, no block both free and used or free
        twice; the index is one-to-one, and a cached block no request holds is on the
        eviction list and nowhere else."""
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            return IntegrityReport(False, "a block is on the free list twice")
        for block_id, count in enumerate(self._refcount):
            if count < 0:
                return IntegrityReport(False, f"block {block_id} has refcount {count}")
            idle = block_id in free_set or block_id in self._evictable
            if (count == 0) != idle:
                state = "free" if idle else "not free"
                return IntegrityReport(False, f"block {block_id} is {state} with refcount {count}")
            if block_id in free_set and block_id in self._key_of:
                return IntegrityReport(False, f"block {block_id} is free and indexed")
        if any(block_id not in self._key_of for block_id in self._evictable):
            return IntegrityReport(False, "a block awaits eviction but is not indexed")
        if len(self._key_of) != len(self._block_of) or any(
                self._block_of.get(key) != block_id for block_id, key in self._key_of.items()):
            return IntegrityReport(False, "the prefix index is not one-to-one")
        used = sum(1 for count in self._refcount if count > 0)
        if used + len(self._free) + len(self._evictable) != self.num_blocks:
            return IntegrityReport(False, f"free {len(self._free)} + cached "
                                   f"{len(self._evictable)} + used {used} != total")
        return IntegrityReport(True, "")
