"""The one K/V layout: dtype table, byte arithmetic and the peers' handshake agree."""

from __future__ import annotations

import pytest
import torch

from kvferry.cache.layout import (
    DTYPES,
    QUANTIZED_KV_DTYPES,
    KvLayout,
    KvShape,
    dtype_name,
    torch_dtype,
)
from kvferry.cache.pool import KvPool


def test_dtype_sizes_match_torch() -> None:
    for name, entry in DTYPES.items():
        if entry.torch_dtype is not None:
            assert entry.torch_dtype.itemsize == entry.size_bytes
            assert dtype_name(torch_dtype(name)) == name


def test_plan_only_dtypes_have_no_pool() -> None:
    assert KvShape(1, 1, 1, "fp8").bytes_per_token == 2
    with pytest.raises(ValueError, match="dtype"):
        torch_dtype("fp8")


def test_layout_sizes_match_the_pool_tensor() -> None:
    pool = KvPool(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=5,
                  dtype=torch.bfloat16)
    layout = KvLayout.of_pool(pool, "fp")
    assert layout == KvLayout(3, 2, 8, 4, "bfloat16", "fp")
    layer_block = pool.cache[0, :, 0]  # [2, block_size, kv_heads, head_dim]
    assert layout.bytes_per_layer_block == layer_block.numel() * layer_block.element_size()
    assert layout.shape.bytes_per_block(4) == pool.cache.nbytes // pool.num_blocks


def test_unvalidated_peer_layout_still_names_its_mismatch() -> None:
    mine = KvLayout(2, 2, 8, 16, "float32", "abc")
    theirs = KvLayout(2, 2, 8, 16, "float64", "abc")  # a peer's message: not validated
    assert "layout.dtype" in (mine.mismatch(theirs) or "")


def test_the_dtype_flag_offers_exactly_the_pool_dtypes() -> None:
    from kvferry import settings

    pool_dtypes = {name for name, entry in DTYPES.items() if entry.torch_dtype is not None}
    assert set(settings.DTYPES) - {"auto"} == pool_dtypes - set(QUANTIZED_KV_DTYPES)
    assert set(settings.KV_CACHE_DTYPES) - {"auto"} == set(QUANTIZED_KV_DTYPES)
