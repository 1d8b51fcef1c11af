"""The disk tier: the block codec's checks, files written whole or not at all, the index
rebuilt by a restart, LRU within a cap, directories per process, and, under a tiered cache,
a block the pool and host memory both dropped coming back from disk bit for bit, a corrupt
file dropped (never served), a full disk turning the tier read-only."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
from pathlib import Path

import pytest
import torch

from kvferry.cache.block_queue import BlockQueue
from kvferry.cache.pool import KvPool
from kvferry.cache.prefix import Tier, TierTokens, block_keys, cache_seed
from kvferry.cache.stats import TierState
from kvferry.cache.tiers import codec
from kvferry.cache.tiers.disk import DiskTier
from kvferry.cache.tiers.host import HostTier, block_nbytes
from kvferry.cache.tiers.tiered import TieredCache
from tests.waiting import until, until_sync

BLOCK = 4
SEED = cache_seed("fingerprint", "float32")
KEYS = block_keys(list(range(8 * BLOCK)), BLOCK, SEED)


def _pool(num_blocks: int = 8) -> KvPool:
    return KvPool(2, 2, 8, BLOCK, num_blocks, torch.float32, prefix_caching=True)


def _disk(root: Path, pool: KvPool, num_blocks: int = 16, **faults: float) -> DiskTier:
    nbytes = block_nbytes(pool)
    return DiskTier(root, num_blocks * (codec.HEADER_BYTES + nbytes), codec.layout_hash(pool),
                    nbytes, pool.allocator.events, **faults)  # type: ignore[arg-type]


def _slots(pool: KvPool, n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn((2, 2, BLOCK, 2, 8), generator=gen) for _ in range(n)]


def _write(disk: DiskTier, keys: list[bytes], slots: list[torch.Tensor]) -> None:
    todo, evicted = disk.reserve(keys)
    done, error = disk.write(todo, [slots[keys.index(k)] for k in todo], evicted)
    disk.commit(todo, done, error)


def test_the_codec_refuses_every_mismatch() -> None:
    pool = _pool()
    layout = codec.layout_hash(pool)
    payload = codec.as_bytes(_slots(pool, 1, 0)[0])
    head = codec.header(layout, KEYS[0], payload)
    expected = codec.parse_header(head, layout, KEYS[0], payload.nbytes)
    codec.check_payload(payload, expected)
    for reason, args in [("another K/V layout", (head, b"\1" * 8, KEYS[0], payload.nbytes)),
                         ("another block's key", (head, layout, KEYS[1], payload.nbytes)),
                         ("payload of", (head, layout, KEYS[0], payload.nbytes + 4)),
                         ("header checksum", (head[:20] + b"\xff" + head[21:], layout,
                                              KEYS[0], payload.nbytes))]:
        with pytest.raises(codec.BadValue, match=reason):
            codec.parse_header(*args)
    flipped = bytearray(payload)
    flipped[100] ^= 1
    with pytest.raises(codec.BadValue, match="payload checksum"):
        codec.check_payload(memoryview(flipped), expected)
    assert codec.layout_hash(_pool()) == layout
    assert codec.layout_hash(KvPool(2, 2, 8, BLOCK, 8, torch.float32,
                                    kv_cache_dtype="int8")) != layout


def test_blocks_survive_a_restart_and_the_index_is_rebuilt(tmp_path: Path) -> None:
    pool = _pool()
    disk = _disk(tmp_path, pool)
    slots = _slots(pool, 3, 1)
    _write(disk, KEYS[:3], slots)
    (disk.dir / "tmp" / "partial").write_bytes(b"torn")  # a killed writer's leftovers
    stray = disk.path(KEYS[5])
    stray.parent.mkdir(exist_ok=True)
    stray.write_bytes(b"short")  # a file of the wrong size is deleted at the scan
    disk.close()
    again = _disk(tmp_path, _pool())
    assert again.dir == disk.dir  # the lock was released: the same directory
    assert set(again.keys()) == set(KEYS[:3]) and not stray.exists()
    assert not list((again.dir / "tmp").iterdir())
    out = torch.empty_like(slots[1])
    again.read_into(KEYS[1], out)
    assert torch.equal(out, slots[1])
    assert again.check_integrity().ok


def test_each_live_process_takes_a_directory_of_its_own(tmp_path: Path) -> None:
    pool = _pool()
    first, second = _disk(tmp_path, pool), _disk(tmp_path, pool)
    assert first.dir != second.dir and first.dir.parent == second.dir.parent


def test_lru_within_the_cap_skips_blocks_being_read(tmp_path: Path) -> None:
    pool = _pool()
    disk = _disk(tmp_path, pool, num_blocks=3)
    slots = _slots(pool, 5, 2)
    _write(disk, KEYS[:3], slots[:3])
    disk.pin([KEYS[0]])  # being read, and now the most recent
    _write(disk, [KEYS[3]], slots[3:4])
    assert disk.keys() == [KEYS[2], KEYS[0], KEYS[3]] and not disk.path(KEYS[1]).exists()
    removed = [e.removed for e in pool.allocator.events._log if e.removed]
    assert removed == [[KEYS[1]]]
    assert disk.check_integrity().ok


def test_a_disk_full_tier_turns_read_only_and_keeps_serving(tmp_path: Path) -> None:
    pool = _pool()
    disk = _disk(tmp_path, pool, full_after_bytes=2 * (codec.HEADER_BYTES + block_nbytes(pool)))
    slots = _slots(pool, 3, 3)
    _write(disk, KEYS[:3], slots)
    assert disk.state is TierState.READ_ONLY and disk.keys() == KEYS[:2]
    assert disk.num_dropped_writes == 1 and disk.reserve(KEYS[3:4]) == ([], [])
    out = torch.empty_like(slots[0])
    disk.read_into(KEYS[0], out)
    assert torch.equal(out, slots[0])


def _write_slowly(root: str) -> None:
    pool = _pool()
    disk = _disk(Path(root), pool, write_delay_s=60.0)
    todo, evicted = disk.reserve(KEYS[:1])
    disk.write(todo, _slots(pool, 1, 4), evicted)


def test_kill_9_during_a_write_leaves_no_block_visible(tmp_path: Path) -> None:
    child = multiprocessing.get_context("spawn").Process(target=_write_slowly,
                                                         args=(str(tmp_path),))
    child.start()
    until_sync(lambda: list(tmp_path.glob("*/*/tmp/*")), "the child's partial file")
    os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
    child.join()
    disk = _disk(tmp_path, _pool())
    assert disk.keys() == [] and not list(disk.dir.glob("*/*.kvb"))
    assert not list((disk.dir / "tmp").iterdir())  # the partial file was swept


def _tiered(root: Path, pool: KvPool, host_slots: int) -> tuple[TieredCache, BlockQueue]:
    cache = TieredCache(pool, HostTier(pool, host_slots, pool.allocator.events),
                        _disk(root, pool))
    blocks = BlockQueue(pool.allocator, max_waiting=8)
    cache.on_release = blocks.grant
    return cache, blocks


def _fill(pool: KvPool, ids: list[int], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    for block_id in ids:
        pool.cache[:, :, block_id] = torch.randn(pool.cache[:, :, block_id].shape, generator=gen)
    return [pool.cache[:, :, block_id].clone() for block_id in ids]


async def _on_disk_only(cache: TieredCache, pool: KvPool, blocks: BlockQueue,
                        keys: list[bytes], others: list[bytes], seed: int
                        ) -> list[torch.Tensor]:
    """Compute `keys`' blocks (their contents returned), write them through, then push
    `others` through pool and host until only the disk holds them."""
    hit = await cache.acquire(keys, len(keys) * BLOCK + 1, blocks, len(keys) + 1)
    contents = _fill(pool, hit.block_ids[:len(keys)], seed)
    cache.register(keys, hit.block_ids[:len(keys)])
    await until(lambda: cache.is_idle, "write-through done")
    pool.allocator.free(hit.block_ids)
    for key in others:
        hit = await cache.acquire([key], 2 * BLOCK, blocks, 2)
        _fill(pool, hit.block_ids[:1], 9)
        cache.register([key], hit.block_ids[:1])
        await until(lambda: cache.is_idle, "write-through done")
        pool.allocator.free(hit.block_ids)
    return contents


def test_a_block_dropped_by_pool_and_host_comes_back_from_disk(tmp_path: Path) -> None:
    pool = _pool(6)
    cache, blocks = _tiered(tmp_path, pool, host_slots=3)
    keys = KEYS[:3]
    others = block_keys(list(range(500, 500 + 6 * BLOCK)), BLOCK, SEED)

    async def run() -> None:
        contents = await _on_disk_only(cache, pool, blocks, keys, others, seed=1)
        assert cache.host is not None and cache.host.leading(keys) == 0
        assert cache.disk is not None and cache.disk.leading(keys) == 3
        again = await cache.acquire(keys, 3 * BLOCK + 1, blocks, 4)
        assert (again.num_cached, again.num_promoted) == (3, 3)
        assert again.by_tier == TierTokens(disk=3 * BLOCK)
        for block_id, block in zip(again.block_ids, contents):
            assert torch.equal(pool.cache[:, :, block_id], block)
        assert cache.host.leading(keys) == 3  # read through host memory: host hits next
        pool.allocator.free(again.block_ids)
        host, disk = cache.stats()
        assert (disk.tier, disk.hit_tokens, host.hit_tokens) == (Tier.DISK, 3 * BLOCK, 0)
        assert cache.check_integrity().ok and pool.allocator.num_free == 6

    asyncio.run(run())
    cache.close()


def test_a_corrupt_file_is_dropped_never_served(tmp_path: Path) -> None:
    pool = _pool(6)
    cache, blocks = _tiered(tmp_path, pool, host_slots=3)
    keys = KEYS[:3]
    others = block_keys(list(range(700, 700 + 6 * BLOCK)), BLOCK, SEED)

    async def run() -> None:
        contents = await _on_disk_only(cache, pool, blocks, keys, others, seed=2)
        assert cache.disk is not None
        path = cache.disk.path(keys[1])
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x40  # one bit of the second block's payload
        path.write_bytes(bytes(data))
        again = await cache.acquire(keys, 3 * BLOCK + 1, blocks, 4)
        assert again.num_cached == 1  # the first block; the corrupt one ends the run
        assert torch.equal(pool.cache[:, :, again.block_ids[0]], contents[0])
        assert not path.exists() and cache.disk.leading(keys) == 1
        assert keys[1] not in pool.allocator._block_of  # computed afresh by the caller
        pool.allocator.free(again.block_ids)
        _, disk = cache.stats()
        assert disk.corrupt_blocks == 1
        removed = [e.removed for e in pool.allocator.events._log
                   if e.tier is Tier.DISK and e.removed]
        assert [keys[1]] in removed
        assert cache.check_integrity().ok and pool.allocator.num_free == 6

    asyncio.run(run())
    cache.close()


def test_disk_needs_a_host_tier(tmp_path: Path) -> None:
    pool = _pool()
    with pytest.raises(ValueError, match="kv_disk_cache_dir"):
        TieredCache(pool, None, _disk(tmp_path, pool))
