"""Triton paged decode attention against the fp32 torch reference.

Every case poisons what the kernel must not read or must overwrite: padding entries of the
block table point at a NaN block, stale slots of partly filled pages are NaN, and the output
and split workspace start as NaN. The parametrization covers GQA ratios, head dims, block
sizes and split counts by combination, not as a cross product (the interpreter is slow).
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import pytest
import torch

from kvferry_kernels.dispatch import get_attention_backend
from kvferry_kernels.paged_attention_ref import paged_decode_attention_ref
from kvferry_kernels.triton_paged_attention import (
    DecodeWorkspace,
    alloc_decode_workspace,
    paged_decode_attention_triton,
)

pytestmark = pytest.mark.triton

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
NAN = float("nan")


class PagedCase(NamedTuple):
    q: torch.Tensor  # [B, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, P, Hkv, D]
    v_cache: torch.Tensor  # [num_blocks, P, Hkv, D]
    block_table: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    sm_scale: float


def _block_tables(
    seq_lens: list[int], block_size: int, *, gen: torch.Generator, shared_pages: int
) -> tuple[list[list[int]], int]:
    """Shuffled page ids per sequence; later sequences reuse the first `shared_pages` full
    pages of sequence 0 (a shared prefix). Returns the tables and the pool size."""
    needed = [math.ceil(n / block_size) for n in seq_lens]
    full0 = seq_lens[0] // block_size
    reuse = [0] + [min(shared_pages, full0, n // block_size) for n in seq_lens[1:]]
    num_own = sum(n - r for n, r in zip(needed, reuse, strict=True))
    ids = (torch.randperm(num_own, generator=gen) + 1).tolist()  # block 0 is the poison
    tables: list[list[int]] = []
    for n, r in zip(needed, reuse, strict=True):
        own, ids = ids[: n - r], ids[n - r :]
        tables.append((tables[0][:r] if r else []) + own)
    return tables, num_own


def make_case(
    seq_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    *,
    seed: int = 0,
    shared_pages: int = 0,
) -> PagedCase:
    gen = torch.Generator().manual_seed(seed)
    tables, num_used = _block_tables(seq_lens, block_size, gen=gen, shared_pages=shared_pages)
    # Block 0 is all NaN and every padding entry points at it. Block 0 is also what a masked
    # block-table load falls back to, so an unmasked K/V load would read NaN too.
    poison = 0
    shape = (num_used + 1, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen)  # [num_blocks, P, Hkv, D]
    v_cache = torch.randn(shape, generator=gen)
    k_cache[poison] = NAN
    v_cache[poison] = NAN
    use_count = torch.zeros(num_used + 1, dtype=torch.int64)
    for table in tables:
        use_count[table] += 1
    for n, table in zip(seq_lens, tables, strict=True):
        if n % block_size and use_count[table[-1]] == 1:  # stale tail of an unshared page
            k_cache[table[-1], n % block_size :] = NAN
            v_cache[table[-1], n % block_size :] = NAN
    max_blocks = max(len(t) for t in tables) + 1  # at least one padding column everywhere
    block_table = torch.full((len(seq_lens), max_blocks), poison, dtype=torch.int32)
    for b, table in enumerate(tables):
        block_table[b, : len(table)] = torch.tensor(table, dtype=torch.int32)
    q = torch.randn(len(seq_lens), num_q_heads, head_dim, generator=gen)  # [B, Hq, D]
    return PagedCase(
        q.to(device, dtype),
        k_cache.to(device, dtype),
        v_cache.to(device, dtype),
        block_table.to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        1.0 / math.sqrt(head_dim),
    )


def poisoned_workspace(
    batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int, splits: int,
    device: torch.device,
) -> DecodeWorkspace:
    """A workspace whose partials are NaN (the counters must start at zero)."""
    ws = alloc_decode_workspace(batch, num_q_heads, num_kv_heads, head_dim, splits, device)
    for t in (ws.partial_out, ws.partial_max, ws.partial_sum):
        t.fill_(NAN)
    return ws


def run_triton(
    case: PagedCase, num_splits: int | None, *, one_launch: bool | None = None
) -> torch.Tensor:
    """Run with NaN-filled output and workspace, so unwritten entries cannot pass."""
    batch, num_q_heads, head_dim = case.q.shape
    out = torch.full_like(case.q, NAN)
    splits = num_splits if num_splits is not None else 2
    ws = poisoned_workspace(
        batch, num_q_heads, case.k_cache.shape[2], head_dim, splits, case.q.device
    )
    return paged_decode_attention_triton(
        *case,
        num_splits=num_splits,
        workspace=ws if num_splits is not None else None,
        out=out,
        one_launch=one_launch,
    )


def reference(case: PagedCase) -> torch.Tensor:  # [B, Hq, D] fp32
    q, k, v, bt, lens, scale = case
    return paged_decode_attention_ref(q.float(), k.float(), v.float(), bt, lens, scale)


# (seq_lens, Hq, Hkv, head_dim, block_size, num_splits): lengths 1, P-1, P, P+1, 3P+5, ~130
FP32_CASES = {
    "b1-mha-d64-p16-s1": ([130], 4, 4, 64, 16, 1),
    "b3-g2-d128-p16-s3": ([1, 15, 16], 4, 2, 128, 16, 3),
    "b3-g4-d80-p16-s3": ([17, 53, 130], 8, 2, 80, 16, 3),
    "b3-g5-d64-p1-s3": ([0, 2, 8], 10, 2, 64, 1, 3),
    "b1-g5-d128-p1-s1": ([130], 5, 1, 128, 1, 1),
    "b3-g8-d128-p64-s3": ([63, 64, 65], 16, 2, 128, 64, 3),
    "b1-g8-d80-p64-s1": ([197], 8, 1, 80, 64, 1),
    "b3-mqa16-d128-p128-s8": ([3, 129, 127], 16, 1, 128, 128, 8),
    "b1-g2-d64-p32-s5-one-token": ([1], 4, 2, 64, 32, 5),
    "b2-mqa32-d64-p16-s3": ([130, 5], 32, 1, 64, 16, 3),  # group of 32 rows: BLOCK_G > 16
    "b3-llama-g4-d128-p16-s4": ([1000, 1, 300], 32, 8, 128, 16, 4),
}


@pytest.mark.parametrize("params", FP32_CASES.values(), ids=FP32_CASES.keys())
def test_fp32_matches_reference(params: tuple, device: torch.device) -> None:
    lens, hq, hkv, d, p, splits = params
    case = make_case(lens, hq, hkv, d, p, device, seed=len(lens) * 1000 + d + p)
    out = run_triton(case, splits)
    assert not out.isnan().any()
    torch.testing.assert_close(out, reference(case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 2, 4, 8, 16, 32, 64, 128])
def test_every_power_of_two_block_size(block_size: int, device: torch.device) -> None:
    case = make_case([block_size + 1, 3 * block_size + 5], 4, 2, 64, block_size, device)
    out = run_triton(case, 2)
    torch.testing.assert_close(out, reference(case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("lens", "hq", "hkv", "d", "p", "splits"),
    [([17, 130, 1], 8, 2, 128, 16, 3), ([65, 197], 5, 1, 80, 64, 1)],
    ids=["g4-d128-p16-s3", "g5-d80-p64-s1"],
)
def test_fp16_matches_reference(
    lens: list[int], hq: int, hkv: int, d: int, p: int, splits: int, device: torch.device
) -> None:
    case = make_case(lens, hq, hkv, d, p, device, torch.float16, seed=7)
    out = run_triton(case, splits)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), reference(case), atol=2e-3, rtol=1e-2)


@pytest.mark.skipif(not INTERPRET, reason="the bf16 upcast path exists only in the interpreter")
def test_bf16_is_upcast_in_interpreter(device: torch.device) -> None:
    case = make_case([40, 130], 8, 2, 128, 16, device, torch.bfloat16, seed=3)
    out = run_triton(case, 3)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference(case), atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(
    INTERPRET or not torch.cuda.is_available(),
    reason="native bf16 needs CUDA and TRITON_INTERPRET=0",
)
@pytest.mark.parametrize("splits", [1, 4])
def test_native_bf16_matches_reference(splits: int, device: torch.device) -> None:
    case = make_case([1, 300, 1000, 4097], 32, 8, 128, 16, device, torch.bfloat16, seed=11)
    out = run_triton(case, splits)
    torch.testing.assert_close(out.float(), reference(case), atol=1e-2, rtol=2e-2)


def test_split_count_does_not_change_result(device: torch.device) -> None:
    case = make_case([130, 77, 1], 8, 2, 128, 16, device, seed=5)
    one = run_triton(case, 1)
    for splits in (3, 4):
        torch.testing.assert_close(run_triton(case, splits), one, atol=1e-5, rtol=1e-5)


def test_block_size_does_not_change_result(device: torch.device) -> None:
    """The same logical K/V laid out in 1-token and 16-token pages gives the same output."""
    lens, hkv, d = [130, 33], 2, 64
    coarse = make_case(lens, 8, hkv, d, 16, device, seed=9)
    fine_k, fine_v = [], []
    for b, n in enumerate(lens):
        pages = coarse.block_table[b, : math.ceil(n / 16)].long()
        fine_k.append(coarse.k_cache[pages].reshape(-1, hkv, d)[:n])  # [n, Hkv, D]
        fine_v.append(coarse.v_cache[pages].reshape(-1, hkv, d)[:n])
    k_tokens, v_tokens = torch.cat(fine_k), torch.cat(fine_v)  # [sum(n), Hkv, D]
    perm = torch.randperm(k_tokens.shape[0], generator=torch.Generator().manual_seed(1))
    perm += 1  # block 0: poison
    k_cache = torch.full((len(perm) + 1, 1, hkv, d), NAN, device=device)  # [N, 1, Hkv, D]
    v_cache = torch.full_like(k_cache, NAN)
    k_cache[perm.to(device), 0] = k_tokens
    v_cache[perm.to(device), 0] = v_tokens
    block_table = torch.zeros((len(lens), max(lens) + 1), dtype=torch.int32)
    start = 0
    for b, n in enumerate(lens):
        block_table[b, :n] = perm[start : start + n].to(torch.int32)
        start += n
    fine = PagedCase(
        coarse.q, k_cache, v_cache, block_table.to(device), coarse.seq_lens, coarse.sm_scale
    )
    for splits in (1, 3):
        torch.testing.assert_close(
            run_triton(fine, splits), run_triton(coarse, splits), atol=1e-6, rtol=1e-6
        )
    torch.testing.assert_close(run_triton(fine, 1), reference(coarse), atol=1e-5, rtol=1e-5)


def test_shared_prefix_pages(device: torch.device) -> None:
    case = make_case([130, 100, 40, 129], 8, 2, 64, 16, device, seed=13, shared_pages=6)
    assert torch.equal(case.block_table[1, :2], case.block_table[0, :2])  # really shared
    torch.testing.assert_close(run_triton(case, 3), reference(case), atol=1e-5, rtol=1e-5)


def test_strided_q_and_cache_views(device: torch.device) -> None:
    base = make_case([130, 17, 64], 8, 2, 80, 16, device, seed=17)
    b, hq, d = base.q.shape
    q = torch.randn(b, d, 2 * hq, device=device).transpose(1, 2)[:, ::2]  # [B, Hq, D] strided
    q.copy_(base.q)
    kv = torch.stack([base.k_cache, base.v_cache], dim=1)  # [N, 2, P, Hkv, D]
    case = base._replace(q=q, k_cache=kv[:, 0], v_cache=kv[:, 1])
    assert not q.is_contiguous() and not case.k_cache.is_contiguous()
    for splits in (1, 3):
        torch.testing.assert_close(run_triton(case, splits), reference(base), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("splits", [1, 3])
def test_empty_sequences_give_zeros(splits: int, device: torch.device) -> None:
    case = make_case([5, 20], 4, 2, 64, 16, device, seed=19)
    case = case._replace(seq_lens=torch.zeros_like(case.seq_lens))
    assert torch.equal(run_triton(case, splits), torch.zeros_like(case.q))


def test_default_splits_and_reused_workspace(device: torch.device) -> None:
    """One workspace serves steps of different lengths (fixed grid, as in a CUDA graph)."""
    case = make_case([130, 45], 8, 2, 64, 16, device, seed=23)
    torch.testing.assert_close(run_triton(case, None), reference(case), atol=1e-5, rtol=1e-5)
    ws = poisoned_workspace(2, 8, 2, 64, 4, device)
    for lens in ([130, 45], [3, 40], [0, 16]):
        step = case._replace(seq_lens=torch.tensor(lens, dtype=torch.int32, device=device))
        out = paged_decode_attention_triton(*step, workspace=ws)  # splits from the workspace
        torch.testing.assert_close(out, reference(step), atol=1e-5, rtol=1e-5)


def test_rejects_bad_shapes(device: torch.device) -> None:
    case = make_case([10], 6, 4, 64, 16, device)  # 6 query heads over 4 KV heads
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_attention_triton(*case)
    good = make_case([10], 8, 4, 64, 16, device)
    ws = alloc_decode_workspace(1, 8, 4, 64, 2, device)
    with pytest.raises(ValueError, match="workspace"):
        paged_decode_attention_triton(*good, num_splits=3, workspace=ws)


def test_dispatch_backends_agree(device: torch.device) -> None:
    case = make_case([40, 130], 8, 2, 64, 16, device, seed=29)
    torch_backend, triton_backend = get_attention_backend("torch"), get_attention_backend("triton")
    assert (torch_backend.name, triton_backend.name) == ("torch", "triton")
    torch.testing.assert_close(
        triton_backend.decode_attention(*case),
        torch_backend.decode_attention(*case),
        atol=1e-5,
        rtol=1e-5,
    )


def test_dispatch_rejects_unknown_backend() -> None:
    with pytest.raises(ValueError, match="flashinfer"):
        get_attention_backend("flashinfer")
