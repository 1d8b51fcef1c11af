"""kvferry/transfer/nixl/staging.py: a split worker's whole-page staging for NIXL. Its shape
(every K/V head, the pool's blocks, host memory), and a span's pages staged and unstaged
between blocks without touching other layers or blocks. Through NIXL and the ranks:
tests/e2e/test_tensor_parallel_nixl.py."""

from __future__ import annotations

import torch

from kvferry.cache.pool import KvPool
from kvferry.transfer.nixl import staging
from kvferry.transfer.wire import ChunkSpan


class _RankPool(KvPool):
    """Stands for rank 0's pool of a worker split 2 ways (1 of 2 K/V heads here)."""

    tensor_parallel_size = 2
    whole_kv_heads = 2


def _pool(heads: int = 2) -> KvPool:
    pool = KvPool(3, heads, 4, 4, 8, torch.float32)
    pool.cache.copy_(torch.randn_like(pool.cache))
    return pool


def test_only_a_split_pool_gets_staging_of_whole_pages() -> None:
    assert staging.staging_for(_pool()) is None
    stage = staging.staging_for(_RankPool(3, 1, 4, 4, 8, torch.float32))
    assert stage is not None
    assert (stage.num_kv_heads, stage.num_blocks, stage.cache.device.type) == (2, 8, "cpu")
    assert stage.tensor_parallel_size == 1 and not stage.allocator.prefix_caching


def test_a_span_staged_and_unstaged_moves_only_its_pages() -> None:
    pool, stage, back = _pool(), KvPool(3, 2, 4, 4, 8, torch.float32), _pool()
    before = back.cache.clone()
    span = ChunkSpan(1, 3, 0, 2)  # layers 1-2, two blocks
    staging.stage(pool, [5, 2], stage, [0, 7], span)
    torch.testing.assert_close(stage.cache[1:3, :, [0, 7]], pool.cache[1:3, :, [5, 2]],
                               rtol=0, atol=0)
    assert stage.cache[0].abs().sum() == 0 and stage.cache[:, :, 1:7].abs().sum() == 0
    staging.unstage(stage, [0, 7], back, [3, 4], span)
    torch.testing.assert_close(back.cache[1:3, :, [3, 4]], pool.cache[1:3, :, [5, 2]],
                               rtol=0, atol=0)
    untouched = torch.ones(back.num_blocks, dtype=torch.bool)
    untouched[[3, 4]] = False
    assert torch.equal(back.cache[:, :, untouched], before[:, :, untouched])
    assert torch.equal(back.cache[0], before[0])  # layer 0 not in the span
    staging.zero(stage, [0, 7], ChunkSpan(2, 3, 0, 2))
    assert stage.cache[2].abs().sum() == 0 and stage.cache[1, :, [0, 7]].abs().sum() > 0
