"""The K/V append into quantized pages (int8, fp8 e4m3).

Both appends (Triton, in the kernel; `write_kv_ref`, through `kv_quant.quantize`) must store
exactly `kv_quant.quantize`'s values and scales (computed on CPU), ties included: the inputs
carry exact round-half ties for int8 (x.5 with scale 1) and for e4m3 (midpoints, normal and
subnormal), which must go to even as torch rounds them. The expected pool is built byte by
byte from the page layout (values, then scales), so the test also checks where the bytes
land and that every other byte of the uint8 pool [layers, 2, num_blocks, page_bytes] stays
as it was.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvferry_kernels.kv_quant import (
    dequantize_pages,
    fake_quantize,
    page_bytes,
    quantize,
    split_pages,
    storage_dtype,
)
from kvferry_kernels.paged_attention_ref import paged_decode_attention_ref, write_kv_ref
from kvferry_kernels.paged_attention_torch import paged_decode_attention_torch
from kvferry_kernels.triton_kv_append import write_kv_triton

KV_DTYPES = ["int8", "fp8_e4m3"]
WRITERS: dict[str, Callable[..., None]] = {"triton": write_kv_triton, "ref": write_kv_ref}


def _tokens(num_tokens: int, num_kv_heads: int, head_dim: int, kv_dtype: str,
            gen: torch.Generator) -> torch.Tensor:  # [T, Hkv, D] float32
    """Random vectors with an outlier channel, plus rows whose scale is exactly 1 and whose
    entries are exact rounding ties, an all-zero row and signed zeros."""
    x = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    x[:, :, 2] *= 25.0
    if kv_dtype == "int8":
        ties = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -125.5, 3.25, 0.0])
        qmax = 127.0
    else:  # e4m3 midpoints: 17 (16|18), 19 (18|20), 232 (224|240), subnormal 2^-10, 3 * 2^-10
        ties = torch.tensor([17.0, 19.0, -232.0, 2**-10, -3 * 2**-10, 5 * 2**-10, 300.0, -0.0])
        qmax = 448.0
    row = torch.zeros(head_dim)
    row[: len(ties)] = ties
    row[-1] = qmax  # amax / qmax == 1: the tie values reach the rounding unscaled
    x[0, 0] = row
    x[-1, -1] = 0.0  # all zero: scale 1
    x[-1, 0, :4] = torch.tensor([-0.0, 0.0, -0.0, 1e-30])
    return x


def _expected_pool(pool: torch.Tensor, layer: int, x: torch.Tensor, slots: torch.Tensor,
                   kv: int, block_size: int, kv_dtype: str) -> None:
    """Write quantize(x) (on CPU) into pool[layer, kv] byte by byte from the page layout."""
    values, scales = quantize(x.float().cpu(), kv_dtype)
    num_kv_heads, head_dim = x.shape[1:]
    value_bytes = num_kv_heads * head_dim * storage_dtype(kv_dtype).itemsize  # per slot
    scales_at = block_size * value_bytes
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        page = pool[layer, kv, block]
        first = offset * value_bytes
        page[first:first + value_bytes] = values[t].reshape(-1).view(torch.uint8)
        first = scales_at + offset * num_kv_heads * 4
        page[first:first + num_kv_heads * 4] = scales[t].reshape(-1).view(torch.uint8)


@pytest.mark.triton
@pytest.mark.parametrize("writer", WRITERS.keys())
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize(
    ("src_dtype", "block_size", "num_kv_heads", "head_dim"),
    [(torch.float32, 16, 2, 64), (torch.bfloat16, 32, 3, 80), (torch.float16, 16, 8, 128)],
    ids=["fp32-p16-h2-d64", "bf16-p32-h3-d80", "fp16-p16-h8-d128"],
)
def test_append_stores_quantize_bytes_in_the_right_slots(
    src_dtype: torch.dtype,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    kv_dtype: str,
    writer: str,
    device: torch.device,
) -> None:
    num_tokens, num_blocks = 11, 4
    gen = torch.Generator().manual_seed(block_size * head_dim)
    k = _tokens(num_tokens, num_kv_heads, head_dim, kv_dtype, gen).to(src_dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(src_dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    if writer == "triton":
        slots[3] = -1  # a padding token: writes nothing
    nbytes = page_bytes(block_size, num_kv_heads, head_dim, kv_dtype)
    pool = torch.randint(0, 256, (2, 2, num_blocks, nbytes), generator=gen, dtype=torch.uint8)
    expected = pool.clone()  # [layers, K/V, num_blocks, page_bytes]
    _expected_pool(expected, 1, k, slots, 0, block_size, kv_dtype)
    _expected_pool(expected, 1, v, slots, 1, block_size, kv_dtype)
    pool = pool.to(device)
    k_pages, v_pages = (
        split_pages(pool[1, kv], block_size, num_kv_heads, head_dim, kv_dtype) for kv in (0, 1)
    )
    WRITERS[writer](k.to(device), v.to(device), k_pages, v_pages, slots.to(device))
    pool = pool.cpu()
    diff = (pool != expected).nonzero()
    assert diff.numel() == 0, f"{len(diff)} bytes differ, first at {diff[:4].tolist()}"
    # And so the stored slots read back as fake_quantize(x).
    kept = slots >= 0
    blocks, offsets = slots[kept] // block_size, slots[kept] % block_size
    k_back = dequantize_pages(split_pages(pool[1, 0], block_size, num_kv_heads, head_dim,
                                          kv_dtype))[blocks, offsets]  # [T', Hkv, D]
    assert torch.equal(k_back, fake_quantize(k.float(), kv_dtype)[kept])


@pytest.mark.triton
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_triton_quantize_matches_torch_over_the_range(
    kv_dtype: str, device: torch.device
) -> None:
    """Entries spread over 2^-14..2^8 within each vector (so fp8 values from subnormal to
    448, and int8 values of every size), through the kernel's own rounding, bit for bit."""
    gen = torch.Generator().manual_seed(5)
    exponents = torch.randint(-14, 9, (64, 1, 128), generator=gen).float()
    x = torch.randn(64, 1, 128, generator=gen) * torch.exp2(exponents)  # [T, 1, D]
    nbytes = page_bytes(64, 1, 128, kv_dtype)
    pool = torch.zeros(1, 2, 1, nbytes, dtype=torch.uint8)
    expected = pool.clone()
    slots = torch.arange(64)
    _expected_pool(expected, 0, x, slots, 0, 64, kv_dtype)
    _expected_pool(expected, 0, x, slots, 1, 64, kv_dtype)
    pool = pool.to(device)
    pages = [split_pages(pool[0, kv], 64, 1, 128, kv_dtype) for kv in (0, 1)]
    write_kv_triton(x.to(device), x.to(device), *pages, slots.to(device))
    assert torch.equal(pool.cpu(), expected)


@pytest.mark.triton
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_pool_bytes_round_trip_through_split_pages(kv_dtype: str, device: torch.device) -> None:
    """Pages written into a [layers, 2, num_blocks, page_bytes] pool, shipped as bytes to
    other block ids of another pool, read back through split_pages: same K/V, same
    attention."""
    num_layers, num_blocks, block_size, hkv, d = 3, 6, 16, 2, 64
    gen = torch.Generator().manual_seed(7)
    nbytes = page_bytes(block_size, hkv, d, kv_dtype)
    sender = torch.zeros(num_layers, 2, num_blocks, nbytes, dtype=torch.uint8, device=device)
    blocks = [4, 1, 2]  # one sequence of 40 tokens
    slots = torch.cat([torch.arange(b * block_size, (b + 1) * block_size) for b in blocks])[:40]
    kv_per_layer = []
    for layer in range(num_layers):
        k = torch.randn(40, hkv, d, generator=gen)  # [T, Hkv, D]
        v = torch.randn(40, hkv, d, generator=gen)
        kv_per_layer.append((k, v))
        write = write_kv_triton if layer % 2 else write_kv_ref
        pages = [split_pages(sender[layer, kv], block_size, hkv, d, kv_dtype) for kv in (0, 1)]
        write(k.to(device), v.to(device), *pages, slots.to(device))

    wire = sender[:, :, blocks].cpu().numpy().tobytes()  # what a transport sends
    received_blocks = [0, 5, 3]
    receiver = torch.full((num_layers, 2, num_blocks, nbytes), 0xFF, dtype=torch.uint8)
    receiver[:, :, received_blocks] = torch.frombuffer(bytearray(wire), dtype=torch.uint8).view(
        num_layers, 2, len(blocks), nbytes)

    table = torch.tensor([received_blocks + [1]], dtype=torch.int32)  # padding: poison (0xFF)
    sent_table = torch.tensor([blocks + [0]], dtype=torch.int32)
    q = torch.randn(1, 4, d, generator=gen)  # [B, Hq, D]
    lens = torch.tensor([40], dtype=torch.int32)
    for layer, (k, v) in enumerate(kv_per_layer):
        k_pages, v_pages = (
            split_pages(receiver[layer, kv], block_size, hkv, d, kv_dtype) for kv in (0, 1)
        )
        got_k = dequantize_pages(k_pages)[received_blocks].reshape(-1, hkv, d)[:40]
        got_v = dequantize_pages(v_pages)[received_blocks].reshape(-1, hkv, d)[:40]
        assert torch.equal(got_k, fake_quantize(k, kv_dtype))
        assert torch.equal(got_v, fake_quantize(v, kv_dtype))
        sent = [split_pages(sender[layer, kv].cpu(), block_size, hkv, d, kv_dtype)
                for kv in (0, 1)]
        torch.testing.assert_close(
            paged_decode_attention_torch(q, k_pages, v_pages, table, lens, d**-0.5),
            paged_decode_attention_ref(q, *sent, sent_table, lens, d**-0.5),
            atol=1e-5, rtol=1e-5,
        )


@pytest.mark.triton
def test_rejects_mixed_caches(device: torch.device) -> None:
    nbytes = page_bytes(16, 2, 64, "int8")
    pool = torch.zeros(2, 2, nbytes, dtype=torch.uint8, device=device)
    pages = split_pages(pool[0], 16, 2, 64, "int8")
    full = torch.zeros(2, 16, 2, 64, device=device)
    k = torch.zeros(1, 2, 64, device=device)
    slots = torch.zeros(1, dtype=torch.int64, device=device)
    for write in WRITERS.values():
        with pytest.raises(ValueError, match="QuantPages"):
            write(k, k, pages, full, slots)
    assert not pool.any()
