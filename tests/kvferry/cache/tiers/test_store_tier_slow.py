"""A slow or broken store never stalls a worker: against a real Valkey behind a proxy that
delays every command by hundreds of milliseconds, or answers `:0` to everything, requests
that need the store go on without it past the deadline, requests with nothing to look up make
no store call at all, none fails, the store is disabled (slow calls in a row, or garbage) and
enabled again once it answers in time. And what a worker knows of the store stays bounded: an
LRU that reports the keys it drops, so the router's mirrors and snapshots stay bounded too."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bench.store_proxy import StoreProxy
from deploy.store_server import StoreServer
from kvferry.cache.block_queue import BlockQueue
from kvferry.cache.pool import KvPool
from kvferry.cache.prefix import CacheEvents, Tier, TierTokens, block_keys, cache_seed
from kvferry.cache.stats import TierState
from kvferry.cache.tiers import codec, store
from kvferry.cache.tiers.host import HostTier, block_nbytes
from kvferry.cache.tiers.store import StoreTier
from kvferry.cache.tiers.tiered import TieredCache
from router.workers.cache_mirror import CacheMirror, StoreMirror
from tests.waiting import until

BLOCK = 4
SEED = cache_seed("fingerprint", "float32")
DELAY_S = 0.6  # the slow store's delay per command (under the client's 1 s socket timeout)
DEADLINE_S = 0.05


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreServer]:
    started = StoreServer(tmp_path_factory.mktemp("store"), 64 << 20).start()
    yield started
    started.stop()


@pytest.fixture
def fast_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store, "PROBE_S", (0.05, 0.1))


def _worker(url: str, namespace: str, host_slots: int = 16, num_blocks: int = 32,
            max_known_keys: int = store.MAX_KNOWN_KEYS, head_dim: int = 8
            ) -> tuple[TieredCache, BlockQueue, KvPool]:
    pool = KvPool(2, 2, head_dim, BLOCK, num_blocks, torch.float32, prefix_caching=True)
    tier = StoreTier(url, codec.layout_hash(pool), block_nbytes(pool), pool.allocator.events,
                     namespace, deadline_s=DEADLINE_S, max_known_keys=max_known_keys)
    tier.probe_s = 0.05
    cache = TieredCache(pool, HostTier(pool, host_slots, pool.allocator.events), None, tier)
    blocks = BlockQueue(pool.allocator, max_waiting=16)
    cache.on_release = blocks.grant
    return cache, blocks, pool


async def _compute(cache: TieredCache, blocks: BlockQueue, pool: KvPool, keys: list[bytes],
                   seed: int) -> float:
    """What a prefill does: take blocks (the time that took is returned), write K/V,
    register, release."""
    started = time.perf_counter()
    hit = await cache.acquire(keys, len(keys) * BLOCK + 1, blocks, len(keys) + 1)
    took = time.perf_counter() - started
    gen = torch.Generator().manual_seed(seed)
    for block_id in hit.block_ids[hit.num_cached:len(keys)]:
        pool.cache[:, :, block_id] = torch.randn(pool.cache[:, :, block_id].shape,
                                                 generator=gen)
    cache.register(keys, hit.block_ids[:len(keys)])
    await until(lambda: cache.is_idle, "write-through done", deadline_s=30)
    pool.allocator.free(hit.block_ids)
    return took


async def _acquire(cache: TieredCache, blocks: BlockQueue, pool: KvPool, keys: list[bytes]
                   ) -> float:
    """A lookup (blocks taken, then given back): how long it took."""
    started = time.perf_counter()
    hit = await cache.acquire(keys, len(keys) * BLOCK + 1, blocks, len(keys) + 1)
    took = time.perf_counter() - started
    pool.allocator.free(hit.block_ids)
    return took


def _keys(start: int, n: int = 3) -> list[bytes]:
    return block_keys(list(range(start, start + n * BLOCK)), BLOCK, SEED)


def test_a_slow_store_costs_a_request_at_most_its_deadline_and_is_disabled(
        server: StoreServer, fast_probe: None) -> None:
    proxy = StoreProxy(server.socket)
    writer, w_blocks, w_pool = _worker(proxy.url, "slow")
    reader, r_blocks, r_pool = _worker(proxy.url, "slow")
    stored = _keys(0)
    assert reader.store is not None

    async def run() -> None:
        await _compute(writer, w_blocks, w_pool, stored, seed=1)  # in the store, fast
        proxy.delay_s = DELAY_S
        # Six requests that miss everywhere and one with no key at all, at once: none waits
        # for the store's answer, and the one with no key makes no call.
        started = time.perf_counter()
        calls = reader.store.num_calls
        took = await asyncio.gather(*[_acquire(reader, r_blocks, r_pool, _keys(100 * i))
                                      for i in range(1, 7)],
                                    _acquire(reader, r_blocks, r_pool, []))
        assert time.perf_counter() - started < DELAY_S  # the store answered none of them
        assert max(took) < DELAY_S / 2, took
        assert reader.store.num_calls - calls == 6
        assert reader.store.state is TierState.DISABLED  # slow calls in a row
        assert reader.stats()[1].state is TierState.DISABLED
        # Disabled: a lookup is not even tried (nothing waits on the store).
        calls = reader.store.num_calls
        hit = await reader.acquire(stored, 3 * BLOCK + 1, r_blocks, 4)
        assert hit.num_cached == 0 and reader.store.num_calls == calls
        r_pool.allocator.free(hit.block_ids)
        proxy.delay_s = 0.0
        await until(lambda: reader.store.is_enabled, "the probe to enable the store again",
                    deadline_s=30)
        back = await reader.acquire(stored, 3 * BLOCK + 1, r_blocks, 4)
        assert (back.num_cached, back.by_tier) == (3, TierTokens(store=3 * BLOCK))
        r_pool.allocator.free(back.block_ids)
        assert reader.check_integrity().ok and r_pool.allocator.num_free == r_pool.num_blocks

    try:
        asyncio.run(run())
    finally:
        writer.close()
        reader.close()
        proxy.close()


def test_a_request_the_pool_and_host_cover_makes_no_store_call(
        server: StoreServer) -> None:
    proxy = StoreProxy(server.socket, delay_s=DELAY_S)
    cache, blocks, pool = _worker(proxy.url, "covered")
    keys = _keys(7000)
    assert cache.store is not None

    async def run() -> None:
        proxy.delay_s = 0.0
        await _compute(cache, blocks, pool, keys, seed=5)
        proxy.delay_s = DELAY_S
        calls, chunks = cache.store.num_calls, proxy.num_chunks
        started = time.perf_counter()
        hit = await cache.acquire(keys, 3 * BLOCK + 1, blocks, 4)  # all 3 in the pool
        assert hit.num_cached == 3 and time.perf_counter() - started < DELAY_S / 2
        pool.allocator.free(hit.block_ids)
        assert (cache.store.num_calls, proxy.num_chunks) == (calls, chunks)

    try:
        asyncio.run(run())
    finally:
        cache.close()
        proxy.close()


def test_a_store_answering_garbage_is_disabled_and_nothing_fails(
        server: StoreServer, fast_probe: None) -> None:
    proxy = StoreProxy(server.socket, is_garbage=True)
    cache, blocks, pool = _worker(proxy.url, "garbage")
    assert cache.store is not None

    async def run() -> None:
        for i in range(4):  # lookups and write-through both meet `:0`
            took = await _compute(cache, blocks, pool, _keys(1000 + 100 * i), seed=i)
            assert took < DELAY_S / 2
        assert cache.store.state is TierState.DISABLED
        await asyncio.sleep(0.3)
        assert not cache.store.is_enabled  # `:0` to PING is no answer: still disabled
        proxy.is_garbage = False
        await until(lambda: cache.store.is_enabled, "the store enabled once it answers",
                    deadline_s=30)
        keys = _keys(5000)
        await _compute(cache, blocks, pool, keys, seed=9)
        other, o_blocks, o_pool = _worker(server.url, "garbage")
        hit = await other.acquire(keys, 3 * BLOCK + 1, o_blocks, 4)
        assert hit.by_tier == TierTokens(store=3 * BLOCK)  # written once it came back
        o_pool.allocator.free(hit.block_ids)
        other.close()
        assert cache.check_integrity().ok and pool.allocator.num_free == pool.num_blocks

    try:
        asyncio.run(run())
    finally:
        cache.close()
        proxy.close()


def test_a_non_finite_value_with_valid_crcs_is_dropped_deleted_and_counted(
        server: StoreServer) -> None:
    import redis

    cache, blocks, pool = _worker(server.url, "forged")
    keys = _keys(3000)
    assert cache.store is not None
    client = redis.Redis.from_url(server.url)
    slot = torch.randn(2, 2, BLOCK, 2, 8)
    slot[0, 1, 2, 0, 3] = float("inf")
    payload = codec.as_bytes(slot)
    for key in keys:  # planted by anyone who can write the store: no secret needed
        client.set(cache.store.name(key), codec.header(cache.store.layout, key, payload)
                   + bytes(payload))

    async def run() -> None:
        hit = await cache.acquire(keys, 3 * BLOCK + 1, blocks, 4)
        assert hit.num_cached == 0 and keys[0] not in pool.allocator._block_of
        pool.allocator.free(hit.block_ids)
        await until(lambda: not client.exists(cache.store.name(keys[0])),
                    "the forged value deleted")
        assert cache.stats()[1].corrupt_blocks == 1
        assert cache.store.is_enabled  # one bad value is not a bad store

    try:
        asyncio.run(run())
    finally:
        cache.close()


def test_known_keys_are_an_lru_that_reports_what_it_drops() -> None:
    """Unit level, many keys: the worker's `known`, its reported capacity, its GetStats
    snapshot and the router's mirrors of it stay within the cap."""
    events = CacheEvents()
    tier = StoreTier("redis://127.0.0.1:1/0", b"l" * 8, 64, events, max_known_keys=100)
    mirror, shared = CacheMirror(), StoreMirror(max_keys=300)
    keys = [i.to_bytes(16, "big") for i in range(5000)]
    for start in range(0, len(keys), 50):
        tier.stored(keys[start:start + 50])
        tier.stored(keys[:1])  # seen again: kept as the most recent
        since = events.since(mirror.event_seq, {Tier.STORE: tier.keys()})
        mirror.apply(since)
        shared.apply(since)
        assert len(tier.known) <= 100 and tier.capacity_blocks <= 100
        assert len(mirror.keys) <= 100 and len(shared.keys) <= 100
    assert list(tier.known) == [*keys[-99:], keys[0]]
    snapshot = events.since(0, {Tier.STORE: tier.keys()})
    assert snapshot.is_snapshot and sum(len(e.stored) for e in snapshot.events) == 100
    tier.close()


def test_known_stays_bounded_against_a_small_store(tmp_path: Path) -> None:
    """Many distinct blocks (16 KiB) written against a store of 3 MiB: it evicts, `known` and
    the reported capacity stay at the cap, and the router's mirror of the worker too."""
    small = StoreServer(tmp_path / "small", 3 << 20).start()
    cache, blocks, pool = _worker(small.url, "small", max_known_keys=40, head_dim=256)
    mirror = CacheMirror()

    async def run() -> None:
        for i in range(120):
            await _compute(cache, blocks, pool, _keys(10_000 + 100 * i, 2), seed=i)
            mirror.apply(cache.events_since(mirror.event_seq))
            (_, store_stats) = cache.stats()
            assert store_stats.capacity_blocks <= 40 and store_stats.used_blocks <= 40
            assert sum(1 for mask in mirror.keys.values() if mask & (1 << Tier.STORE)) <= 40

    try:
        asyncio.run(run())
        assert cache.store is not None and len(cache.store.known) == 40
        assert small.process is not None
        import redis

        info = redis.Redis.from_url(small.url).info("stats")
        assert info["evicted_keys"] > 0  # the store did evict, and told no one
    finally:
        cache.close()
        small.stop()


def test_the_routers_store_mirror_drops_its_least_recently_reported_keys() -> None:
    shared = StoreMirror(max_keys=50)
    events = CacheEvents()
    keys = [i.to_bytes(16, "big") for i in range(1000)]
    for start in range(0, len(keys), 10):
        events.add(keys[start:start + 10], [], Tier.STORE)
        events.add(keys[:1], [], Tier.STORE)  # reported again: kept
    shared.apply(events.since(1, {}))
    assert len(shared.keys) == 50 and list(shared.keys)[-1] == keys[0]


def test_the_deadline_flag_is_checked_and_passed_on() -> None:
    import argparse

    from deploy.tier_args import tier_args, tier_argv, tier_settings
    from kvferry.settings.tiers import TierSettings

    with pytest.raises(ValueError, match="^kv_store_deadline_ms: "):
        TierSettings(host_cache_size="1MiB", store_url="unix:///s", store_deadline_s=0)
    parser = argparse.ArgumentParser()
    tier_args(parser, is_deployment=True)
    args = parser.parse_args(["--kv-host-cache-size", "1MiB", "--kv-store-size", "64MiB",
                              "--kv-store-deadline-ms", "20"])
    assert tier_settings(args).store_deadline_s == pytest.approx(0.02)
    argv = tier_argv(args, store_url="unix:///s")
    assert argv[argv.index("--kv-store-deadline-ms") + 1] == "20"
    assert "--kv-store-deadline-ms" not in tier_argv(parser.parse_args([]))
