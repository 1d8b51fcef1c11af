"""Quantized K/V pools: pages are bytes holding values then their scales, the
layout names the K/V dtype, sizes count the scales, transports move both, and the finite
check covers the scales (and fp8's NaN)."""

from __future__ import annotations

import pytest
import torch

from kvferry import settings
from kvferry.cache.layout import KvLayout, KvShape
from kvferry.cache.pool import KvPool
from kvferry.transfer import wire
from kvferry_kernels import kv_quant

LAYERS, HEADS, DIM, BLOCK, BLOCKS = 2, 3, 64, 16, 6
QUANTIZED = ["int8", "fp8_e4m3"]


def _pool(kv_cache_dtype: str, num_blocks: int = BLOCKS) -> KvPool:
    return KvPool(LAYERS, HEADS, DIM, BLOCK, num_blocks, torch.float32,
                  kv_cache_dtype=kv_cache_dtype)


def _fill(pool: KvPool, block_ids: list[int], seed: int) -> torch.Tensor:
    """Quantize random K/V into `block_ids` of every layer; returns what they read back as,
    [layers, 2, blocks, block_size, heads, D]."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(LAYERS, 2, len(block_ids), BLOCK, HEADS, DIM, generator=g) * 4
    for layer in range(LAYERS):
        for kv, pages in enumerate((pool.k_cache(layer), pool.v_cache(layer))):
            q, scale = kv_quant.quantize(values[layer, kv], pool.kv_cache_dtype)
            pages.data[block_ids] = q
            pages.scale[block_ids] = scale
    return kv_quant.fake_quantize(values, pool.kv_cache_dtype)


def test_the_flag_names_match_the_kernels() -> None:
    assert settings.KV_CACHE_DTYPES == kv_quant.KV_CACHE_DTYPES


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_pages_are_values_then_scales_in_the_pool_bytes(kv_dtype: str) -> None:
    pool = _pool(kv_dtype)
    assert pool.cache.dtype == torch.uint8
    assert pool.page_nbytes == BLOCK * HEADS * DIM + BLOCK * HEADS * 4
    pages = pool.k_cache(1)
    assert pages.data.shape == (BLOCKS, BLOCK, HEADS, DIM)
    assert pages.scale.shape == (BLOCKS, BLOCK, HEADS)
    pages.scale[4, 2, 1] = 2.5  # a write through the view lands in the pool's bytes
    raw = pool.cache[1, 0, 4, BLOCK * HEADS * DIM:].view(torch.float32)
    assert raw[2 * HEADS + 1] == 2.5
    assert pool.cache[1, 1].count_nonzero() == 0  # V pages untouched
    expected = _fill(pool, [0, 3], seed=1)
    dense = pool.dense(pool.cache.index_select(2, torch.tensor([0, 3])))
    assert dense.dtype == torch.float32
    assert torch.equal(dense, expected)


def test_layout_names_the_kv_dtype_and_refuses_a_peer_with_another() -> None:
    full = KvLayout.of_pool(_pool("auto"), "fp")
    int8 = KvLayout.of_pool(_pool("int8"), "fp")
    fp8 = KvLayout.of_pool(_pool("fp8_e4m3"), "fp")
    assert (full.dtype, int8.dtype, fp8.dtype) == ("float32", "int8", "fp8_e4m3")
    assert "layout.dtype" in (int8.mismatch(full) or "")
    assert "layout.dtype" in (int8.mismatch(fp8) or "")
    assert int8.mismatch(KvLayout.of_pool(_pool("int8"), "fp")) is None


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_sizes_count_the_scales(kv_dtype: str) -> None:
    pool = _pool(kv_dtype)
    layout = KvLayout.of_pool(pool, "fp")
    assert layout.shape.bytes_per_block(BLOCK) == pool.cache.nbytes // pool.num_blocks
    assert layout.bytes_per_layer_block == 2 * pool.page_nbytes
    # SmolLM2-135M: 30 layers, 3 K/V heads of 64: 46,080 B per token in fp32
    fp32 = KvShape(30, 3, 64, "float32").bytes_per_token
    quantized = KvShape(30, 3, 64, kv_dtype).bytes_per_token
    assert (fp32, quantized) == (46_080, 2 * 30 * 3 * (64 + 4))
    assert 3.7 < fp32 / quantized < 3.8  # a pool of the same bytes holds ~3.76x the tokens


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_wire_ships_values_and_scales_as_stored(kv_dtype: str) -> None:
    sender, receiver = _pool(kv_dtype), _pool(kv_dtype, num_blocks=BLOCKS + 2)
    expected = _fill(sender, [1, 4, 2], seed=2)
    layout = KvLayout.of_pool(sender, "fp")
    tokens = 3 * BLOCK - 5
    table_out, table_in = [1, 4, 2], [7, 0, 5]
    for span in wire.plan_chunks(layout, tokens, 1 << 12):
        data = wire.pack_array(sender, table_out, span)
        assert len(data) == wire.span_bytes(layout, span)
        assert wire.is_finite(data, receiver)
        wire.unpack_into(receiver, table_in, span, data)
    got = receiver.cache.index_select(2, torch.tensor(table_in))
    assert torch.equal(got, sender.cache.index_select(2, torch.tensor(table_out)))
    assert torch.equal(receiver.dense(got), expected)


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_the_finite_check_reads_the_scales_and_fp8_nan(kv_dtype: str) -> None:
    pool = _pool(kv_dtype)
    _fill(pool, list(range(BLOCKS)), seed=3)
    assert pool.pages_finite(pool.cache)
    pages = pool.v_cache(1)
    for bad in (float("nan"), float("inf")):
        saved = pages.scale[5, 15, 2].item()
        pages.scale[5, 15, 2] = bad
        assert not pool.pages_finite(pool.cache)
        data = pool.cache[1:2, :, 5:6].contiguous().view(torch.uint8).numpy()
        assert not wire.is_finite(data, pool)
        pages.scale[5, 15, 2] = saved
    assert pool.pages_finite(pool.cache)
    if kv_dtype == "fp8_e4m3":
        pages.data.view(torch.uint8)[2, 3, 0, 7] = 0xFF  # e4m3fn's NaN
        assert not pool.pages_finite(pool.cache)


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_finite_scale_past_the_dequantized_range_is_refused(kv_dtype: str,
                                                              dtype: torch.dtype) -> None:
    """A scale codes would dequantize past the pool's dtype with is corrupt: refused like inf;
    one at the bound passes."""
    pool = KvPool(LAYERS, HEADS, DIM, BLOCK, BLOCKS, dtype, kv_cache_dtype=kv_dtype)
    _fill(pool, list(range(BLOCKS)), seed=4)
    bound = kv_quant.max_scale(kv_dtype, dtype)
    assert bound == torch.finfo(dtype).max / {"int8": 127, "fp8_e4m3": 448}[kv_dtype]
    pages = pool.k_cache(0)
    pages.data[1, 2, 0, 0] = {"int8": 127, "fp8_e4m3": 448}[kv_dtype]  # the largest code
    for scale, is_ok in ((bound * 0.999, True), (-bound * 0.999, True), (bound * 1.01, False),
                         (-bound * 1.01, False), (1e37, False)):
        pages.scale[1, 2, 0] = scale
        assert pool.pages_finite(pool.cache) is is_ok, scale
        data = pool.cache[0:1, :, 1:2].contiguous().view(torch.uint8).numpy()
        assert wire.is_finite(data, pool) is is_ok, scale
        read_back = pool.dense(pool.cache[0, 0, 1:2])  # [1, block_size, heads, D] in dtype
        assert bool(torch.isfinite(read_back).all()) is is_ok, scale


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_quantize_refuses_inf_and_nan(kv_dtype: str) -> None:
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = torch.randn(3, HEADS, DIM)
        x[1, 2, 5] = bad
        with pytest.raises(ValueError, match="1 of 9 K/V vectors hold inf or NaN"):
            kv_quant.quantize(x, kv_dtype)
    values, scale = kv_quant.quantize(torch.zeros(2, DIM), kv_dtype)  # all zero: scale 1
    assert torch.equal(scale, torch.ones(2)) and not values.float().any()


def test_chunk_spans_sizes_hold_for_quantized_pages() -> None:
    pool = _pool("int8")
    layout = KvLayout.of_pool(pool, "fp")
    spans = wire.plan_chunks(layout, 5 * BLOCK, 1 << 14)
    assert sum(wire.span_bytes(layout, s) for s in spans) == LAYERS * 5 * 2 * pool.page_nbytes
