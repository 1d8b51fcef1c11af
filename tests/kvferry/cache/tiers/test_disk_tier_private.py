"""The disk tier keeps K/V private and serves nothing it did not check: a directory another
user owns or others may write is refused by name (settings, the tier, the CLI in one line
with exit status 2); every directory it makes is 0700 and every file 0600 whatever the umask;
a file with a valid header and CRCs but non-finite values, or a quantized page whose scale
is out of bounds, is dropped and counted, never copied into the pool."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvferry.cache.block_queue import BlockQueue
from kvferry.cache.pool import KvPool
from kvferry.cache.prefix import block_keys, cache_seed
from kvferry.cache.tiers import codec
from kvferry.cache.tiers.disk import DiskTier
from kvferry.cache.tiers.host import HostTier, block_nbytes
from kvferry.cache.tiers.tiered import TieredCache
from kvferry.settings.tiers import TierSettings
from kvferry_kernels import kv_quant
from tests.waiting import until

BLOCK = 4
SEED = cache_seed("fingerprint", "float32")
REPO = Path(__file__).resolve().parents[4]


def _pool(num_blocks: int = 6, kv_cache_dtype: str = "auto") -> KvPool:
    return KvPool(2, 2, 8, BLOCK, num_blocks, torch.float32, prefix_caching=True,
                  kv_cache_dtype=kv_cache_dtype)


def _disk(root: Path, pool: KvPool, num_blocks: int = 16) -> DiskTier:
    nbytes = block_nbytes(pool)
    return DiskTier(root, num_blocks * (codec.HEADER_BYTES + nbytes), codec.layout_hash(pool),
                    nbytes, pool.allocator.events)


def _tiered(root: Path, pool: KvPool, host_slots: int = 3) -> tuple[TieredCache, BlockQueue]:
    cache = TieredCache(pool, HostTier(pool, host_slots, pool.allocator.events),
                        _disk(root, pool))
    blocks = BlockQueue(pool.allocator, max_waiting=8)
    cache.on_release = blocks.grant
    return cache, blocks


def _fill(pool: KvPool, ids: list[int], seed: int) -> None:
    """What a forward pass writes: finite values, and on a quantized pool the pages
    `quantize` makes of them."""
    gen = torch.Generator().manual_seed(seed)
    for block_id in ids:
        if pool.is_quantized:
            for layer in range(pool.num_layers):
                for kv in (pool.k_cache(layer), pool.v_cache(layer)):
                    values, scales = kv_quant.quantize(
                        torch.randn(kv.data[block_id].shape, generator=gen), pool.kv_cache_dtype)
                    kv.data[block_id].copy_(values)
                    kv.scale[block_id].copy_(scales)
        else:
            pool.cache[:, :, block_id] = torch.randn(pool.cache[:, :, block_id].shape,
                                                     generator=gen)


async def _compute(cache: TieredCache, blocks: BlockQueue, pool: KvPool, keys: list[bytes],
                   seed: int) -> None:
    hit = await cache.acquire(keys, len(keys) * BLOCK + 1, blocks, len(keys) + 1)
    _fill(pool, hit.block_ids[hit.num_cached:len(keys)], seed)
    cache.register(keys, hit.block_ids[:len(keys)])
    await until(lambda: cache.is_idle, "write-through done")
    pool.allocator.free(hit.block_ids)


async def _on_disk_only(cache: TieredCache, blocks: BlockQueue, pool: KvPool,
                        keys: list[bytes], seed: int) -> None:
    """`keys`' blocks computed and written through, then pushed out of pool and host."""
    await _compute(cache, blocks, pool, keys, seed)
    for i, key in enumerate(block_keys(list(range(seed * 1000, seed * 1000 + 6 * BLOCK)),
                                       BLOCK, SEED)):
        await _compute(cache, blocks, pool, [key], seed + i + 1)
    assert cache.host is not None and cache.host.leading(keys) == 0


def _forge(path: Path, key: bytes, layout: bytes, payload: bytes) -> None:
    """Replace a block file with `payload` under a header and CRCs recomputed to match: what
    anyone who can write the file can do, with nothing secret."""
    path.write_bytes(codec.header(layout, key, memoryview(payload)) + payload)
    os.chmod(path, 0o600)


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_a_directory_others_can_write_is_refused_by_name(tmp_path: Path, mode: int) -> None:
    root = tmp_path / "kv"
    root.mkdir()
    os.chmod(root, mode)
    with pytest.raises(ValueError, match=f"^kv_disk_cache_dir: refusing {root} .*writable"):
        TierSettings(host_cache_size="1MiB", disk_cache_dir=str(root))
    with pytest.raises(ValueError, match=f"^kv_disk_cache_dir: refusing {root} "):
        _disk(root, _pool())
    assert list(root.iterdir()) == []  # nothing written into it


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory away")
def test_a_directory_another_user_owns_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    root.mkdir(mode=0o700)
    os.chown(root, 65534, 65534)
    with pytest.raises(ValueError, match="kv_disk_cache_dir: refusing .*owned by uid 65534"):
        _disk(root, _pool())
    mine = tmp_path / "mine"
    _disk(mine, _pool()).close()
    layout_dir = next(mine.iterdir())
    os.chown(layout_dir, 65534, 65534)  # a subdirectory someone else made: refused too
    with pytest.raises(ValueError, match="kv_disk_cache_dir: refusing .*65534"):
        _disk(mine, _pool())


def test_the_cli_refuses_it_in_one_line_with_status_2(tmp_path: Path) -> None:
    root = tmp_path / "open"
    root.mkdir()
    os.chmod(root, 0o777)
    result = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "prefill-worker", "--model",
         str(tmp_path / "missing"), "--kv-host-cache-size", "1MiB", "--kv-disk-cache-dir",
         str(root)], cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "KVFERRY_HOME": str(tmp_path / "home")})
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and "kv_disk_cache_dir" in lines[0] and str(root) in lines[0]


def test_nothing_it_writes_is_open_to_others_whatever_the_umask(tmp_path: Path) -> None:
    root = tmp_path / "made" / "kv"  # missing parents are made 0700 too
    old = os.umask(0)
    try:
        pool = _pool()
        cache, blocks = _tiered(root, pool)
        keys = block_keys(list(range(3 * BLOCK)), BLOCK, SEED)

        async def run() -> None:
            await _on_disk_only(cache, blocks, pool, keys, seed=1)
            again = await cache.acquire(keys, 3 * BLOCK + 1, blocks, 4)
            assert again.num_cached == 3  # read back from disk
            pool.allocator.free(again.block_ids)

        asyncio.run(run())
        cache.close()
    finally:
        os.umask(old)
    dirs, files = [tmp_path / "made"], []
    for parent, subdirs, names in os.walk(tmp_path / "made"):
        dirs += [Path(parent, d) for d in subdirs]
        files += [Path(parent, n) for n in names]
    assert len(files) > 9  # LOCK and block files
    assert {oct(stat.S_IMODE(d.stat().st_mode)) for d in dirs} == {oct(0o700)}
    assert {oct(stat.S_IMODE(f.stat().st_mode)) for f in files} == {oct(0o600)}


def test_an_older_builds_open_files_and_directories_are_not_served(tmp_path: Path) -> None:
    pool = _pool()
    disk = _disk(tmp_path, pool)
    keys = block_keys(list(range(2 * BLOCK)), BLOCK, SEED)
    slots = [torch.randn((2, 2, BLOCK, 2, 8)) for _ in keys]
    todo, evicted = disk.reserve(keys)
    disk.commit(todo, *disk.write(todo, slots, evicted))
    os.chmod(disk.path(keys[0]), 0o644)  # what the umask made of it before
    os.chmod(disk.path(keys[0]).parent, 0o755)
    disk.close()
    again = _disk(tmp_path, _pool())
    assert again.keys() == [keys[1]] and not disk.path(keys[0]).exists()
    assert stat.S_IMODE(disk.path(keys[1]).parent.stat().st_mode) == 0o700
    link = again.path(keys[0])
    link.parent.mkdir(mode=0o700, exist_ok=True)
    link.symlink_to(again.path(keys[1]))
    with pytest.raises(OSError):  # O_NOFOLLOW: a link is never followed
        again.read_into(keys[0], torch.empty_like(slots[0]))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_forged_block_with_valid_crcs_is_dropped_and_counted(
        tmp_path: Path, kv_cache_dtype: str) -> None:
    """Non-finite values (a dense pool) or a scale past `kv_quant.max_scale` (int8): the
    header and both CRCs hold, the pushed-chunk check does not; the run ends before it and
    the block is left for the caller to compute."""
    pool = _pool(kv_cache_dtype=kv_cache_dtype)
    cache, blocks = _tiered(tmp_path, pool)
    keys = block_keys(list(range(50, 50 + 3 * BLOCK)), BLOCK, SEED)
    layout = codec.layout_hash(pool)

    async def run() -> None:
        await _on_disk_only(cache, blocks, pool, keys, seed=3)
        assert cache.disk is not None
        path = cache.disk.path(keys[1])
        slot = torch.empty(pool.cache.shape[0], 2, *pool.cache.shape[3:],
                           dtype=pool.cache.dtype)
        codec.as_bytes(slot)[:] = path.read_bytes()[codec.HEADER_BYTES:]
        if pool.is_quantized:
            pages = kv_quant.split_pages(slot, BLOCK, 2, 8, kv_cache_dtype)
            pages.scale[0, 1, 2, 1] = 1e38  # finite, but its codes dequantize to inf
        else:
            slot[1, 0, 3, 1, 5] = float("nan")
        _forge(path, keys[1], layout, bytes(codec.as_bytes(slot)))
        assert not pool.pages_finite(slot)
        again = await cache.acquire(keys, 3 * BLOCK + 1, blocks, 4)
        assert again.num_cached == 1  # the first block; the forged one ends the run
        assert keys[1] not in pool.allocator._block_of  # computed afresh by the caller
        assert not path.exists() and cache.disk.leading(keys) == 1
        assert pool.pages_finite(pool.cache[:, :, again.block_ids])  # nothing copied in
        pool.allocator.free(again.block_ids)
        _, disk = cache.stats()
        assert disk.corrupt_blocks == 1
        assert cache.check_integrity().ok and pool.allocator.num_free == pool.num_blocks

    asyncio.run(run())
    cache.close()
