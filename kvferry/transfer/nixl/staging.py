"""Whole pages for a tensor-parallel worker's NIXL transfers (docs/tensor-parallel.md).

A split worker's pool on rank 0 holds only its own K/V heads, so NIXL can neither read whole
pages from it nor write whole pages into it. Such a worker registers a staging pool with
NIXL instead: whole pages (every K/V head, as the wire carries them) in host memory, as many
blocks as its own pool. A push copies each layer group from the ranks into staging blocks
(`KvPool.read_pages`, through the group) before it announces the group, and the decode
worker reads the group from there. A pull reads into staging blocks, checks them there, and
writes them into the ranks (`write_pages`). Blocks in flight never outnumber the pool's,
so staging as many blocks as the pool never runs short for a pull. A push stages the
request's whole block table; two pushes sharing prefix-cached blocks could stage more
blocks than the pool holds, and such a push fails RESOURCE_EXHAUSTED and is retried by the
router.
"""

from __future__ import annotations

import torch

from kvferry.cache.pool import KvPool
from kvferry.transfer.wire import ChunkSpan


def staging_for(pool: KvPool) -> KvPool | None:
    """The staging pool a NIXL end needs for `pool` (None: `pool` holds whole pages)."""
    if pool.tensor_parallel_size == 1:
        return None
    return KvPool(pool.num_layers, pool.whole_kv_heads, pool.head_dim, pool.block_size,
                  pool.num_blocks, pool.dtype, "cpu", prefix_caching=False,
                  kv_cache_dtype=pool.kv_cache_dtype)


def stage(pool: KvPool, ids: list[int], staging: KvPool, staged: list[int],
          span: ChunkSpan) -> None:
    """A span's pages (blocks `ids` of `pool`, every rank's heads) into `staged` blocks."""
    layers = slice(span.layer_start, span.layer_end)
    staging.write_pages(staged, pool.read_pages(ids, layers), layers)


def unstage(staging: KvPool, staged: list[int], pool: KvPool, ids: list[int],
            span: ChunkSpan) -> None:
    """A span's pages from `staged` blocks into blocks `ids` of `pool` (each rank its own
    heads)."""
    layers = slice(span.layer_start, span.layer_end)
    pool.write_pages(ids, staging.read_pages(staged, layers), layers)


def zero(pool: KvPool, ids: list[int], span: ChunkSpan) -> None:
    """Zero a span's pages in blocks `ids` of a pool that holds whole pages."""
    index = torch.tensor(ids, dtype=torch.int64, device=pool.cache.device)
    pool.cache[span.layer_start: span.layer_end, :, index] = 0
