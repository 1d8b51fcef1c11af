"""Paged decode attention over quantized K/V pages (int8, fp8 e4m3).

Each implementation (Triton, the batched torch path, the per-sequence reference) must equal
the reference attending over the dequantized pages (`kv_quant.dequantize_pages`, then the
full-precision `paged_decode_attention_ref`). K and V live in `split_pages` views of one uint8
pool [layers, 2, num_blocks, page_bytes], so every read goes through strided views. What
must never be read is poisoned: the padding block and stale slots of partly filled pages hold
NaN scales and NaN (fp8) / 127 (int8) values, and Triton's output and split workspace start
as NaN.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import pytest
import torch

from kvferry_kernels.kv_quant import QuantPages, dequantize_pages, page_bytes, quantize, split_pages
from kvferry_kernels.paged_attention_ref import paged_decode_attention_ref
from kvferry_kernels.paged_attention_torch import paged_decode_attention_torch
from kvferry_kernels.triton_paged_attention import (
    alloc_decode_workspace,
    paged_decode_attention_triton,
)

NAN = float("nan")
KV_DTYPES = ["int8", "fp8_e4m3"]


class QuantCase(NamedTuple):
    q: torch.Tensor  # [B, Hq, D]
    k_pages: QuantPages  # views into pool[1, 0]
    v_pages: QuantPages  # views into pool[1, 1]
    block_table: torch.Tensor  # [B, max_blocks] int32; padding entries name block 0
    seq_lens: torch.Tensor  # [B] int32
    sm_scale: float


def _fill(pages: QuantPages, x: torch.Tensor, kv_dtype: str) -> None:
    """Store x [N, P, Hkv, D] quantized into every slot of the pages (through the views)."""
    values, scales = quantize(x, kv_dtype)
    pages.data.view(torch.uint8).copy_(values.view(torch.uint8))
    pages.scale.copy_(scales)


def _poison(pages: QuantPages, block: int, start: int) -> None:
    pages.data.view(torch.uint8)[block, start:] = 0x7F  # NaN in e4m3, 127 in int8
    pages.scale[block, start:] = NAN


def make_quant_case(
    seq_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    kv_dtype: str,
    device: torch.device,
    *,
    seed: int,
    q_dtype: torch.dtype = torch.float32,
) -> QuantCase:
    gen = torch.Generator().manual_seed(seed)
    needed = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(needed) + 1  # block 0 is the poison
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    nbytes = page_bytes(block_size, num_kv_heads, head_dim, kv_dtype)
    pool = torch.randint(0, 256, (2, 2, num_blocks, nbytes), generator=gen, dtype=torch.uint8)
    pool = pool.to(device)  # [layers, K/V, num_blocks, page_bytes]
    k_pages, v_pages = (
        split_pages(pool[1, kv], block_size, num_kv_heads, head_dim, kv_dtype) for kv in (0, 1)
    )
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=gen)  # [N, P, Hkv, D]
    k[..., 1] *= 30.0  # an outlier channel, as real keys have
    _fill(k_pages, k.to(device), kv_dtype)
    _fill(v_pages, torch.randn(shape, generator=gen).to(device), kv_dtype)
    block_table = torch.zeros(len(seq_lens), max(needed) + 1, dtype=torch.int32)
    for b, (n, used) in enumerate(zip(seq_lens, needed, strict=True)):
        table, ids = ids[:used], ids[used:]
        block_table[b, :used] = torch.tensor(table, dtype=torch.int32)
        if n % block_size:
            for pages in (k_pages, v_pages):
                _poison(pages, table[-1], n % block_size)
    for pages in (k_pages, v_pages):
        _poison(pages, 0, 0)
    q = torch.randn(len(seq_lens), num_q_heads, head_dim, generator=gen)  # [B, Hq, D]
    return QuantCase(
        q.to(device, q_dtype),
        k_pages,
        v_pages,
        block_table.to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        1.0 / math.sqrt(head_dim),
    )


def dequantized_reference(case: QuantCase) -> torch.Tensor:  # [B, Hq, D] fp32
    """Dequantize whole pages, then attend at full precision."""
    q, k_pages, v_pages, block_table, seq_lens, sm_scale = case
    return paged_decode_attention_ref(
        q.float(), dequantize_pages(k_pages), dequantize_pages(v_pages), block_table, seq_lens,
        sm_scale,
    )


def run_triton(
    case: QuantCase, num_splits: int, *, one_launch: bool | None = None
) -> torch.Tensor:
    """With NaN-filled output and workspace partials, so unwritten entries cannot pass."""
    batch, num_q_heads, head_dim = case.q.shape
    num_kv_heads = case.k_pages.shape[2]
    out = torch.full_like(case.q, NAN)
    ws = alloc_decode_workspace(
        batch, num_q_heads, num_kv_heads, head_dim, num_splits, case.q.device
    )
    for t in (ws.partial_out, ws.partial_max, ws.partial_sum):
        t.fill_(NAN)
    result = paged_decode_attention_triton(
        *case, num_splits=num_splits, workspace=ws, out=out, one_launch=one_launch
    )
    assert result is out
    return out


# (seq_lens, Hq, Hkv, head_dim, block_size, num_splits): ragged, lengths 1, P-1, P, P+1, ...
CASES = {
    "g4-d64-p16-s3": ([1, 15, 16, 17, 130], 8, 2, 64, 16, 3),
    "g4-d128-p32-s4": ([31, 33, 100], 8, 2, 128, 32, 4),
    "mha-d80-p32-s1": ([70, 0], 2, 2, 80, 32, 1),
}


@pytest.mark.triton
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("params", CASES.values(), ids=CASES.keys())
def test_triton_matches_dequantized_reference(
    params: tuple, kv_dtype: str, device: torch.device
) -> None:
    lens, hq, hkv, d, p, splits = params
    case = make_quant_case(lens, hq, hkv, d, p, kv_dtype, device, seed=d + p)
    out = run_triton(case, splits)
    assert not out.isnan().any()
    torch.testing.assert_close(out, dequantized_reference(case), atol=1e-5, rtol=1e-5)


@pytest.mark.triton
@pytest.mark.parametrize(
    ("kv_dtype", "q_dtype", "splits"),
    [("int8", torch.float16, 1), ("fp8_e4m3", torch.bfloat16, 3)],
    ids=["int8-fp16-s1", "fp8-bf16-s3"],
)
def test_triton_half_precision_queries(
    kv_dtype: str, q_dtype: torch.dtype, splits: int, device: torch.device
) -> None:
    """The values go into the dot in q's dtype (exactly) and V is dequantized to it."""
    case = make_quant_case(
        [130, 5, 40], 8, 2, 64, 16, kv_dtype, device, seed=3, q_dtype=q_dtype
    )
    out = run_triton(case, splits)
    assert out.dtype == q_dtype
    # The reference sees the same rounded q; the rest is V's rounding to q's dtype.
    torch.testing.assert_close(out.float(), dequantized_reference(case), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("params", CASES.values(), ids=CASES.keys())
def test_torch_and_ref_match_dequantized_reference(
    params: tuple, kv_dtype: str
) -> None:
    lens, hq, hkv, d, p, _ = params
    case = make_quant_case(lens, hq, hkv, d, p, kv_dtype, torch.device("cpu"), seed=d + p)
    want = dequantized_reference(case)
    got_torch = paged_decode_attention_torch(*case)
    got_ref = paged_decode_attention_ref(*case)
    assert not got_torch.isnan().any()
    torch.testing.assert_close(got_torch, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_ref, want, atol=0.0, rtol=0.0)  # the same computation
    if 0 in lens:
        assert (got_torch[lens.index(0)] == 0).all()


@pytest.mark.triton
def test_rejects_mixed_caches(device: torch.device) -> None:
    case = make_quant_case([20], 4, 2, 64, 16, "int8", device, seed=1)
    full = dequantize_pages(case.v_pages)  # [N, P, Hkv, D] float32
    with pytest.raises(ValueError, match="QuantPages"):
        paged_decode_attention_triton(case.q, case.k_pages, full, *case[3:])
    fp8 = make_quant_case([20], 4, 2, 64, 16, "fp8_e4m3", device, seed=1)
    with pytest.raises(ValueError, match="QuantPages"):
        paged_decode_attention_triton(case.q, case.k_pages, fp8.v_pages, *case[3:])
