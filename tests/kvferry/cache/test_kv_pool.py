from __future__ import annotations

import pytest
import torch

from kvferry.cache.allocator import BlockAllocator
from kvferry.cache.budget import blocks_for_tokens
from kvferry.cache.pool import KvPool
from kvferry.errors import ResourceExhausted


def test_alloc_free_roundtrip_keeps_integrity() -> None:
    alloc = BlockAllocator(8)
    a = alloc.alloc(3)
    b = alloc.alloc(5)
    assert len(set(a) | set(b)) == 8 and alloc.num_free == 0
    assert alloc.check_integrity().ok
    alloc.free(a)
    assert alloc.num_free == 3 and alloc.check_integrity().ok
    alloc.free(b)
    assert alloc.num_free == 8 and alloc.check_integrity().ok


def test_alloc_is_all_or_nothing() -> None:
    alloc = BlockAllocator(4)
    alloc.alloc(3)
    with pytest.raises(ResourceExhausted):
        alloc.alloc(2)
    assert alloc.num_free == 1


def test_double_free_is_refused() -> None:
    alloc = BlockAllocator(4)
    ids = alloc.alloc(2)
    alloc.free(ids)
    with pytest.raises(ValueError, match="freed twice"):
        alloc.free(ids[:1])
    assert alloc.check_integrity().ok


def test_refcounts_share_blocks() -> None:
    alloc = BlockAllocator(4)
    ids = alloc.alloc(2)
    alloc.incref(ids)
    alloc.free(ids)
    assert alloc.num_free == 2  # still referenced once
    alloc.free(ids)
    assert alloc.num_free == 4 and alloc.check_integrity().ok


def test_integrity_detects_corruption() -> None:
    alloc = BlockAllocator(4)
    alloc.alloc(1)
    alloc._free.append(alloc._free[0])  # a block on the free list twice
    report = alloc.check_integrity()
    assert not report.ok and "twice" in report.error


def test_slots_follow_block_table() -> None:
    pool = KvPool(num_layers=1, num_kv_heads=1, head_dim=2, block_size=4, num_blocks=8,
                  dtype=torch.float32)
    slots = pool.slots([5, 2], 2, 7)
    assert slots.tolist() == [22, 23, 8, 9, 10]
    assert blocks_for_tokens(0, 4) == 0 and blocks_for_tokens(4, 4) == 1
    assert blocks_for_tokens(5, 4) == 2
