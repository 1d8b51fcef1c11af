"""Building a worker's tiered prefix cache from its settings (`WorkerSettings.tiers`)."""

from __future__ import annotations

import logging
from pathlib import Path

from kvferry.cache.pool import KvPool
from kvferry.cache.tiers import codec
from kvferry.cache.tiers.disk import DiskTier
from kvferry.cache.tiers.host import HostTier, block_nbytes
from kvferry.cache.tiers.tiered import TieredCache
from kvferry.faults import Faults
from kvferry.settings.tiers import (
    TierSettings,
    disk_cache_bytes,
    host_cache_bytes,
    redacted_url,
    store_password,
)

log = logging.getLogger("kvferry.tiers")


def build_tiered_cache(pool: KvPool, settings: TierSettings) -> TieredCache:
    """The prefix cache over `pool` and the tiers `settings` asks for."""
    host = disk = None
    if settings.host_cache_size is not None:
        num_slots = host_cache_bytes(settings.host_cache_size) // block_nbytes(pool)
        host = HostTier(pool, num_slots, pool.allocator.events)
        if num_slots < pool.num_blocks:
            log.warning("kv_host_cache_size holds %d blocks, fewer than the pool's %d: the "
                        "host tier adds little under it", num_slots, pool.num_blocks)
        log.info("host K/V tier: %d blocks (%d bytes), %s", num_slots,
                 num_slots * block_nbytes(pool), settings.host_write_policy)
    if settings.disk_cache_dir is not None:
        faults = Faults.from_env()
        disk = DiskTier(Path(settings.disk_cache_dir), disk_cache_bytes(settings),
                        codec.layout_hash(pool), block_nbytes(pool), pool.allocator.events,
                        faults.disk_full_after_bytes, faults.tier_write_delay_s)
        log.info("disk K/V tier %s: %d blocks of %d bytes", disk.dir, disk.capacity_blocks,
                 disk.file_nbytes)
    store = None
    if settings.store_url is not None:
        from kvferry.cache.tiers.store import StoreTier

        store = StoreTier(settings.store_url, codec.layout_hash(pool), block_nbytes(pool),
                          pool.allocator.events, password=store_password(settings),
                          deadline_s=settings.store_deadline_s)
        log.info("store K/V tier at %s", redacted_url(settings.store_url))
    return TieredCache(pool, host, disk, store, settings.host_write_policy)
