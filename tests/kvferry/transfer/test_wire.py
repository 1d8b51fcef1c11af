from __future__ import annotations

import numpy as np
import pytest
import torch

from kvferry.cache.layout import KvLayout
from kvferry.cache.pool import KvPool
from kvferry.errors import InvalidArgument
from kvferry.transfer import wire


def _pool(num_blocks: int = 32, dtype: torch.dtype = torch.float32) -> KvPool:
    return KvPool(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4,
                  num_blocks=num_blocks, dtype=dtype)


@pytest.mark.parametrize("num_tokens,target,min_group", [
    (1, 1 << 20, 0), (17, 1 << 20, 0), (17, 700, 0), (9, 300, 0), (17, 1 << 20, 3000),
    (17, 700, 1 << 20)])
def test_plan_covers_every_page_once(num_tokens: int, target: int, min_group: int) -> None:
    pool = _pool()
    layout = KvLayout.of_pool(pool, "fp")
    seen = wire.coverage(layout, num_tokens).astype(int)
    for span in wire.plan_chunks(layout, num_tokens, target, min_group):
        seen[span.layer_start:span.layer_end,
             span.block_start:span.block_start + span.num_blocks] += 1
    assert (seen == 1).all()


@pytest.mark.parametrize("min_group_kib,num_groups", [(0, 4), (8, 4), (16, 2), (1024, 1)])
def test_small_pushes_go_in_fewer_layer_groups(min_group_kib: int, num_groups: int) -> None:
    layout = KvLayout(16, 2, 8, 4, "float32", "fp")  # 2 KiB per layer for 16 tokens
    spans = wire.plan_chunks(layout, 16, 1 << 20, min_group_kib << 10)
    assert len(spans) == num_groups
    assert {s.layer_end - s.layer_start for s in spans} == {16 // num_groups}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_unpack_roundtrip_between_pools(dtype: torch.dtype) -> None:
    src, dst = _pool(dtype=dtype), _pool(dtype=dtype)
    src.cache.copy_(torch.randn(src.cache.shape).to(dtype))
    layout = KvLayout.of_pool(src, "fp")
    src_table, dst_table = [3, 7, 1, 9, 4], [20, 2, 11, 5, 30]
    num_tokens = 18
    for span in wire.plan_chunks(layout, num_tokens, 600):
        data = wire.pack_array(src, src_table, span).tobytes()
        wire.check_span(layout, num_tokens, span, len(data))
        wire.unpack_into(dst, dst_table, span, data)
    assert torch.equal(src.cache[:, :, src_table], dst.cache[:, :, dst_table])
    untouched = [i for i in range(32) if i not in dst_table]
    assert not dst.cache[:, :, untouched].any()


def test_check_span_rejects_out_of_range_and_bad_sizes() -> None:
    layout = KvLayout.of_pool(_pool(), "fp")
    ok = wire.ChunkSpan(0, 1, 0, 2)
    size = layout.bytes_per_layer_block * 2
    wire.check_span(layout, 8, ok, size)
    with pytest.raises(InvalidArgument) as exc:
        wire.check_span(layout, 8, wire.ChunkSpan(0, 4, 0, 2), size * 4)
    assert exc.value.field == "layer_start"
    with pytest.raises(InvalidArgument) as exc:
        wire.check_span(layout, 8, wire.ChunkSpan(0, 1, 1, 2), size)  # past the prompt's blocks
    assert exc.value.field == "block_start"
    with pytest.raises(InvalidArgument) as exc:
        wire.check_span(layout, 8, ok, size - 1)
    assert exc.value.field == "data"


def test_layout_mismatch_names_the_field() -> None:
    a = KvLayout(2, 2, 8, 16, "float32", "abc")
    assert a.mismatch(a) is None
    b = KvLayout(2, 2, 8, 32, "float32", "abc")
    assert "block_size" in (a.mismatch(b) or "")
    c = KvLayout(2, 2, 8, 16, "float32", "xyz")
    assert "model_fingerprint" in (a.mismatch(c) or "")
    assert isinstance(wire.coverage(a, 17), np.ndarray)


def test_chunk_checksum_is_crc32c() -> None:
    """The wire's checksum is CRC-32C (Castagnoli): its standard check value, and the same
    value from bytes and from an array over them."""
    assert wire.crc32(b"123456789") == 0xE3069283
    data = bytes(range(256)) * 7
    assert wire.crc32(np.frombuffer(data, dtype=np.uint8)) == wire.crc32(data) != 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), None])
def test_finite_check_finds_one_bad_value_anywhere(dtype: torch.dtype, bad: float | None) -> None:
    values = torch.randn(4099).to(dtype)
    pool = KvPool(1, 1, 4099, 1, 1, dtype)  # a page is one 4099-value K (or V) vector
    for where in (0, 2048, 4098):
        probe = values.clone()
        if bad is not None:
            probe[where] = bad
        data = probe.view(torch.uint8).numpy().tobytes()
        assert wire.is_finite(data, pool) is (bad is None)
        assert wire.all_finite(probe) is (bad is None)
    assert wire.all_finite(values[:0])
