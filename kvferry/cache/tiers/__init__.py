"""Tiers below a worker's K/V pool: host memory, local disk, a shared store.

`tiered.TieredCache` composes the pool's allocator (the device tier) with the tiers a worker
was started with; with none it is the plain prefix cache. Blocks are named by their prefix
key (`kvferry.cache.prefix`), so any tier, on any worker, holds the same bytes for a key.
"""
