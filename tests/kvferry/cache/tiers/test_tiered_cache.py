"""The host tier under a pool, and `TieredCache` over both: write-through copies, promotion
back into the pool bit for bit, LRU with pinned slots, cancellation, the event log, and a
state machine checking both indexes after every step."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvferry.cache.block_queue import BlockQueue
from kvferry.cache.pool import KvPool
from kvferry.cache.prefix import Tier, TierTokens, block_keys, cache_seed
from kvferry.cache.tiers.host import HostTier, block_nbytes
from kvferry.cache.tiers.tiered import TieredCache
from tests.waiting import until

BLOCK = 4
SEED = cache_seed("fingerprint", "float32")


def _pool(num_blocks: int = 8, kv_cache_dtype: str = "auto", device: str = "cpu") -> KvPool:
    return KvPool(2, 2, 8, BLOCK, num_blocks, torch.float32, torch.device(device),
                  prefix_caching=True, kv_cache_dtype=kv_cache_dtype)


def _tiered(pool: KvPool, num_slots: int, write_policy: str = "write_through"
            ) -> tuple[TieredCache, BlockQueue]:
    cache = TieredCache(pool, HostTier(pool, num_slots, pool.allocator.events),
                        write_policy=write_policy)
    blocks = BlockQueue(pool.allocator, max_waiting=8)
    cache.on_release = blocks.grant
    return cache, blocks


def _fill(pool: KvPool, block_ids: list[int], seed: int) -> dict[int, torch.Tensor]:
    """Distinct contents in each block (as a forward pass would write them)."""
    gen = torch.Generator().manual_seed(seed)
    written = {}
    for block_id in block_ids:
        page = pool.cache[:, :, block_id]
        if page.dtype == torch.uint8:
            page.copy_(torch.randint(0, 256, page.shape, generator=gen, dtype=torch.uint8))
        else:
            page.copy_(torch.randn(page.shape, generator=gen))
        written[block_id] = page.clone()
    return written


async def _written(cache: TieredCache) -> None:
    await until(lambda: cache.is_idle, "the write-through copies to finish")


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                     reason="needs CUDA"))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_block_evicted_from_the_pool_comes_back_from_host_bit_for_bit(
        kv_cache_dtype: str, device: str) -> None:
    """On CUDA the host region is pinned and the copies run on the tier's own stream."""
    pool = _pool(8, kv_cache_dtype, device)
    cache, blocks = _tiered(pool, 16)
    assert cache.host is not None
    assert cache.host.data.is_pinned() == (device == "cuda")
    assert (cache.host.stream is not None) == (device == "cuda")
    keys = block_keys(list(range(3 * BLOCK)), BLOCK, SEED)

    async def run() -> None:
        first = await cache.acquire(keys, 3 * BLOCK + 1, blocks, 4)
        assert first.num_cached == 0
        contents = _fill(pool, first.block_ids[:3], seed=1)
        cache.register(keys, first.block_ids[:3])
        await _written(cache)
        pool.allocator.free(first.block_ids)
        assert cache.host is not None and cache.host.leading(keys) == 3
        flush = pool.allocator.alloc(8)  # the pool evicts every cached block
        assert pool.allocator.num_cached == 0
        _fill(pool, flush, seed=2)
        pool.allocator.free(flush)
        again = await cache.acquire(keys, 3 * BLOCK + 1, blocks, 4)
        assert again.num_cached == 3 and again.num_promoted == 3
        assert again.by_tier == TierTokens(host=3 * BLOCK)
        for key, block_id, block in zip(keys, again.block_ids, contents.values()):
            assert torch.equal(pool.cache[:, :, block_id].view(torch.uint8),
                               block.view(torch.uint8)), key
            assert pool.allocator._block_of[key] == block_id  # indexed in the pool again
        pool.allocator.free(again.block_ids)
        host, = cache.stats()
        assert (host.tier, host.hit_tokens, host.used_blocks) == (Tier.HOST, 3 * BLOCK, 3)
        assert host.bytes_in == host.bytes_out == 3 * block_nbytes(pool)
        assert cache.check_integrity().ok and pool.allocator.num_free == 8

    asyncio.run(run())


def test_write_through_holds_the_blocks_until_copied_and_logs_host_events() -> None:
    pool = _pool(4)
    cache, blocks = _tiered(pool, 8)
    keys = block_keys(list(range(2 * BLOCK)), BLOCK, SEED)

    async def run() -> None:
        hit = await cache.acquire(keys, 2 * BLOCK, blocks, 2)
        cache.register(keys, hit.block_ids)
        pool.allocator.free(hit.block_ids)
        # Until the copy read them, the blocks are held: no allocation may take them.
        assert cache.is_idle or pool.allocator.num_free == 2
        await _written(cache)
        assert pool.allocator.num_free == 4
        since = cache.events_since(0)
        assert since.is_snapshot
        assert {(e.tier, tuple(e.stored)) for e in since.events} == {
            (Tier.DEVICE, tuple(keys)), (Tier.HOST, tuple(keys))}
        tiers = [e.tier for e in pool.allocator.events._log]
        assert tiers == [Tier.DEVICE, Tier.HOST]

    asyncio.run(run())


def test_write_back_copies_the_next_blocks_to_evict_once_the_pool_runs_low() -> None:
    """Nothing is copied when blocks are indexed; once fewer than a quarter of the pool's
    blocks are truly free, the next lookup copies the cached blocks next in line for
    eviction, which keep their place in line, and come back from host memory after the pool
    evicts them."""
    pool = _pool(8)
    cache, blocks = _tiered(pool, 16, "write_back")
    keys = block_keys(list(range(2 * BLOCK)), BLOCK, SEED)

    async def run() -> None:
        hit = await cache.acquire(keys, 2 * BLOCK + 1, blocks, 3)
        contents = _fill(pool, hit.block_ids[:2], seed=5)
        cache.register(keys, hit.block_ids[:2])
        pool.allocator.free(hit.block_ids)  # the last block first: k1, then k0, in line
        held = await cache.acquire([], 0, blocks, 6)  # 6 truly free before: no copy
        await _written(cache)
        assert cache.host is not None and cache.host.keys() == []  # not written through
        await cache.acquire([], 0, blocks, 0)  # none truly free now: copy ahead
        await _written(cache)
        assert set(cache.host.keys()) == set(keys)
        assert [k for k, _ in pool.allocator.coldest(2)] == [keys[1], keys[0]]
        pool.allocator.free(held.block_ids)
        pool.allocator.free(pool.allocator.alloc(8))  # evicts both
        again = await cache.acquire(keys, 2 * BLOCK + 1, blocks, 3)
        assert again.num_promoted == 2
        for block_id, block in zip(again.block_ids, contents.values()):
            assert torch.equal(pool.cache[:, :, block_id], block)
        pool.allocator.free(again.block_ids)
        assert cache.check_integrity().ok

    asyncio.run(run())


def test_host_lru_skips_pinned_slots_and_drops_writes_with_none_free() -> None:
    pool = _pool(8)
    host = HostTier(pool, 2, pool.allocator.events)
    a, b, c, d = block_keys(list(range(4 * BLOCK)), BLOCK, SEED)
    host.commit(host.reserve([a, b]), is_ok=True)
    pinned = host.pin([a])  # a is being read: b, the other, is evicted though a is older
    host.commit(host.reserve([c]), is_ok=True)
    assert host.keys() == [a, c] and host.num_evictions == 1
    removed = [e.removed for e in pool.allocator.events._log if e.removed]
    assert removed == [[b]]
    writing = host.reserve([d])  # c is evicted for d; d is invisible until committed
    assert host.keys() == [a] and host.leading([d]) == 0
    assert host.reserve([b]) == [] and host.num_dropped_writes == 1  # a, d pinned
    host.commit(writing, is_ok=False)  # a failed copy leaves nothing visible
    assert host.keys() == [a] and host.check_integrity().ok
    host.unpin(pinned)
    assert host.is_idle


def test_a_promotion_cancelled_mid_copy_gives_everything_back() -> None:
    pool = _pool(8)
    cache, blocks = _tiered(pool, 8)
    keys = block_keys(list(range(3 * BLOCK)), BLOCK, SEED)
    assert cache.host is not None
    cache.host.commit(cache.host.reserve(keys), is_ok=True)
    copying = asyncio.Event()
    release = asyncio.Event()

    async def run() -> None:
        loop = asyncio.get_running_loop()
        assert cache._reader is not None
        # Hold the read thread: the promotion's copy queues behind this until released.
        cache._reader.submit(lambda: (loop.call_soon_threadsafe(copying.set),
                                      asyncio.run_coroutine_threadsafe(release.wait(),
                                                                       loop).result()))
        await copying.wait()
        task = asyncio.create_task(cache.acquire(keys, 3 * BLOCK + 1, blocks, 4))
        await until(lambda: pool.allocator.num_free == 4, "the promotion to allocate")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert pool.allocator.num_free == 4  # the copy still runs: its targets are held
        release.set()
        await until(lambda: pool.allocator.num_free == 8, "the cancelled copy's blocks back")
        assert cache.host is not None and cache.host.is_idle
        assert cache.check_integrity().ok and not pool.allocator._block_of

    asyncio.run(run())


class TieredMachine(RuleBasedStateMachine):
    """Requests take prefixes (device hits, promotions, fresh blocks), write them, register,
    release; the pool is small, so it evicts, and the host tier evicts too. After every step
    both indexes are consistent and every indexed block, in either tier, holds the bytes
    written for its key."""

    PREFIXES = [block_keys([p] * 3 * BLOCK, BLOCK, SEED) for p in range(4)]

    def __init__(self) -> None:
        super().__init__()
        self.pool = _pool(5)
        self.cache, self.blocks = _tiered(self.pool, 8)  # 12 keys: the host evicts too
        self.loop = asyncio.new_event_loop()
        self.held: list[list[int]] = []
        self.content: dict[bytes, float] = {}  # key -> the value its block is filled with

    def teardown(self) -> None:
        self.cache.close()
        self.loop.close()

    @rule(prefix=st.integers(0, 3), length=st.integers(1, 3))
    def take(self, prefix: int, length: int) -> None:
        if self.pool.allocator.num_free < length + 1:
            return
        keys = self.PREFIXES[prefix][:length]

        async def take() -> list[int]:
            hit = await self.cache.acquire(keys, length * BLOCK + 1, self.blocks, length + 1)
            event("promoted from host" if hit.num_promoted else "no promotion")
            for key, block_id in zip(keys[hit.num_cached:], hit.block_ids[hit.num_cached:]):
                value = self.content.setdefault(key, float(len(self.content) + 1))
                self.pool.cache[:, :, block_id] = value
            self.cache.register(keys, hit.block_ids[:length])
            await _written(self.cache)
            return hit.block_ids

        self.held.append(self.loop.run_until_complete(take()))

    @precondition(lambda self: self.held)
    @rule(index=st.integers(0, 10))
    def release(self, index: int) -> None:
        self.pool.allocator.free(self.held.pop(index % len(self.held)))

    @invariant()
    def consistent(self) -> None:
        report = self.cache.check_integrity()
        assert report.ok, report.error
        for key, block_id in self.pool.allocator._block_of.items():
            assert bool((self.pool.cache[:, :, block_id] == self.content[key]).all()), key
        host = self.cache.host
        assert host is not None
        for key, slot in host._slot_of.items():
            assert bool((host.data[slot] == self.content[key]).all()), key


class WriteBackMachine(TieredMachine):
    """The same, with blocks copied ahead of eviction instead of written through."""

    def __init__(self) -> None:
        super().__init__()
        self.cache.close()
        self.pool = _pool(8)  # a quarter of it, 2 blocks, copied ahead
        self.cache, self.blocks = _tiered(self.pool, 8, "write_back")


for machine in (TieredMachine, WriteBackMachine):
    machine.TestCase.settings = settings(max_examples=40, stateful_step_count=30,
                                         deadline=None)
test_tiers_state_machine = TieredMachine.TestCase
test_write_back_state_machine = WriteBackMachine.TestCase
