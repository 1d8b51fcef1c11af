"""Runs of rows (one sequence's query positions: a speculative step's last token and drafts)
attended together by the torch path and by Triton, each run's K/V read once, against the
per-row reference; and the grouping itself (`kvferry_kernels.query_runs`).

Cases hold sequences of 1 to 7 query positions, runs crossing block boundaries, two
sequences that share their first blocks (forked samples: only the last block differs) and
two neighbours whose lengths are one apart but whose tables differ. Every slot past a
sequence's longest position and the padding block hold NaN, so a read past a row's run
shows."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_quant_paged_attention import make_quant_case

from kvferry_kernels import paged_attention_torch, query_runs
from kvferry_kernels.kv_quant import QuantPages, dequantize_pages
from kvferry_kernels.paged_attention_ref import paged_decode_attention_ref
from kvferry_kernels.paged_attention_torch import paged_decode_attention_torch
from kvferry_kernels.triton_paged_attention import (
    alloc_decode_workspace,
    paged_decode_attention_triton,
    query_run_rows,
    run_capacity,
)

NAN = float("nan")
# (longest length, rows) per sequence; rows 1 + k of a speculative step
SEQUENCES = [(18, 5), (7, 1), (33, 3), (34, 1), (16, 7), (3, 2)]


def _expand(seqs: list[tuple[int, int]], tables: torch.Tensor, num_q_heads: int,
            head_dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of each sequence: its table repeated, lengths up to its longest; q random."""
    rows_table, lens = [], []
    for (longest, rows), table in zip(seqs, tables, strict=True):
        for j in range(rows):
            rows_table.append(table)
            lens.append(longest - rows + 1 + j)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(len(lens), num_q_heads, head_dim, generator=gen)
    return q, torch.stack(rows_table), torch.tensor(lens, dtype=torch.int32)


def _fp32_case(block_size: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
               seed: int):
    """fp32 pages; sequences 2 and 3 share their first two blocks (a fork)."""
    gen = torch.Generator().manual_seed(seed)
    needed = [math.ceil(n / block_size) for n, _ in SEQUENCES]
    num_blocks = sum(needed) + 1  # the last block is the poison
    order = torch.randperm(num_blocks - 1, generator=gen).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    poison = num_blocks - 1
    tables = torch.full((len(SEQUENCES), max(needed) + 1), poison, dtype=torch.int32)
    for i, ((longest, _), used) in enumerate(zip(SEQUENCES, needed, strict=True)):
        tables[i, :used] = torch.tensor(order[:used], dtype=torch.int32)
        order = order[used:]
        if longest % block_size:
            for cache in (k_cache, v_cache):
                cache[int(tables[i, used - 1]), longest % block_size:] = NAN
    shared = min(2, 33 // block_size)  # sequence 3 reads sequence 2's full blocks
    tables[3, :shared] = tables[2, :shared]
    k_cache[poison] = NAN
    v_cache[poison] = NAN
    q, table, lens = _expand(SEQUENCES, tables, num_q_heads, head_dim, seed)
    return q, k_cache, v_cache, table, lens, head_dim**-0.5


def _reference(case) -> torch.Tensor:
    q, k_cache, v_cache, table, lens, scale = case
    if isinstance(k_cache, QuantPages):
        k_cache, v_cache = dequantize_pages(k_cache), dequantize_pages(v_cache)
    return paged_decode_attention_ref(q.float(), k_cache, v_cache, table, lens, scale)


def _grouping(seqs: list[tuple[int, int]], most: int) -> list[int]:
    """What run_rows must give: each sequence's rows cut into pieces of at most `most`."""
    want = []
    for _, rows in seqs:
        for j in range(rows):
            want.append(min(most, rows - j) if j % most == 0 else 0)
    return want


def test_runs_are_found_from_tables_and_lengths() -> None:
    case = _fp32_case(16, 6, 2, 32, seed=1)
    table, lens = case[3], case[4]
    runs = query_runs.query_runs(table, lens)
    assert runs.longest == 7
    assert runs.first.tolist() == [0, 5, 6, 9, 10, 17]
    assert runs.last.tolist() == [4, 5, 8, 9, 16, 18]
    # 33 then 34 in the next row: one apart, tables share blocks but not all: two runs
    assert runs.run[9].item() == runs.run[8].item() + 1
    for most in (1, 2, 3, 5, 16):
        assert query_runs.run_rows(table, lens, most).tolist() == _grouping(SEQUENCES, most)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=8), st.integers(1, 6))
def test_run_rows_cover_every_row_once(rows_per_seq: list[int], most: int) -> None:
    """Any batch: every row is attended by exactly one program, none by more than `most`,
    and a program's rows are one sequence's."""
    seqs = [(10 + 3 * i + r, r) for i, r in enumerate(rows_per_seq)]
    tables = torch.arange(len(seqs) * 4, dtype=torch.int32).view(len(seqs), 4)
    _, table, lens = _expand(seqs, tables, 1, 1, seed=0)
    counts = query_runs.run_rows(table, lens, most).tolist()
    owner = []
    for b, n in enumerate(counts):
        assert 0 <= n <= most
        owner.extend([b] * n)
        assert all(torch.equal(table[b], table[b + j]) for j in range(n))
    assert owner == sorted(owner) and len(owner) == len(counts)
    assert counts == _grouping(seqs, most)


@pytest.mark.parametrize(("block_size", "hq", "hkv"), [(16, 6, 2), (4, 8, 1), (16, 4, 4)])
def test_torch_path_reads_each_run_once(monkeypatch: pytest.MonkeyPatch, block_size: int,
                                        hq: int, hkv: int) -> None:
    """With finite values past every length (as stale slots hold), each run's K and V are
    gathered once; the result is the per-row reference's."""
    q, k_cache, v_cache, *rest = _fp32_case(block_size, hq, hkv, 32, seed=block_size + hq)
    case = (q, torch.nan_to_num(k_cache), torch.nan_to_num(v_cache), *rest)
    gathered = []
    gather = paged_attention_torch._gather

    def counting(cache, ids, batch, num_blocks, max_len):
        gathered.append(batch)
        return gather(cache, ids, batch, num_blocks, max_len)

    monkeypatch.setattr(paged_attention_torch, "_gather", counting)
    got = paged_decode_attention_torch(*case)
    assert gathered == [len(SEQUENCES)] * 2  # K, then V: one row per run
    assert not got.isnan().any()
    torch.testing.assert_close(got, _reference(case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("block_size", "hq", "hkv"), [(16, 6, 2), (4, 8, 1)])
def test_torch_path_runs_with_nan_past_their_lengths(block_size: int, hq: int,
                                                     hkv: int) -> None:
    """NaN past a run (its last block's unused slots, the padding block) reaches no row."""
    case = _fp32_case(block_size, hq, hkv, 32, seed=block_size + hq)
    got = paged_decode_attention_torch(*case)
    assert not got.isnan().any()
    torch.testing.assert_close(got, _reference(case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_torch_path_runs_over_quantized_pages(kv_dtype: str) -> None:
    base = make_quant_case([n for n, _ in SEQUENCES], 6, 2, 32, 16, kv_dtype,
                           torch.device("cpu"), seed=7)
    q, table, lens = _expand(SEQUENCES, base.block_table, 6, 32, seed=7)
    case = (q, base.k_pages, base.v_pages, table, lens, base.sm_scale)
    got = paged_decode_attention_torch(*case)
    assert not got.isnan().any()
    torch.testing.assert_close(got, _reference(case), atol=1e-5, rtol=1e-5)


def _triton(case, num_splits: int, one_launch: bool, with_runs: bool) -> torch.Tensor:
    """Output and workspace NaN-filled, so an entry no program wrote cannot pass."""
    q, k_cache = case[0], case[1]
    batch, hq, d = q.shape
    hkv = k_cache.shape[2]
    ws = alloc_decode_workspace(batch, hq, hkv, d, num_splits, q.device)
    for t in (ws.partial_out, ws.partial_max, ws.partial_sum):
        t.fill_(NAN)
    out = torch.full_like(q, NAN)
    runs = query_run_rows(case[3], case[4], hq, hkv) if with_runs else None
    paged_decode_attention_triton(*case, num_splits=num_splits, workspace=ws, out=out,
                                  one_launch=one_launch, run_rows=runs)
    assert (ws.counters == 0).all()
    return out


@pytest.mark.triton
@pytest.mark.parametrize(("hq", "hkv"), [(6, 2), (8, 1), (4, 4)], ids=["g3", "g8", "mha"])
@pytest.mark.parametrize(("splits", "one_launch"), [(1, True), (3, True), (3, False)],
                         ids=["s1", "s3-one-launch", "s3-stage2"])
def test_triton_runs_match_reference(hq: int, hkv: int, splits: int, one_launch: bool,
                                     device: torch.device) -> None:
    """G = 3 puts 5 rows in a program, G = 8 two (a 7-row run takes four programs), MHA 16."""
    assert run_capacity(hq // hkv) == {3: 5, 8: 2, 1: 16}[hq // hkv]
    case = tuple(x.to(device) if isinstance(x, torch.Tensor) else x
                 for x in _fp32_case(16, hq, hkv, 32, seed=hq + splits))
    together = _triton(case, splits, one_launch, with_runs=True)
    alone = _triton(case, splits, one_launch, with_runs=False)
    assert not together.isnan().any()
    want = _reference(case)
    torch.testing.assert_close(together, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(together, alone, atol=1e-6, rtol=1e-5)


@pytest.mark.triton
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_triton_runs_over_quantized_pages(kv_dtype: str, device: torch.device) -> None:
    base = make_quant_case([n for n, _ in SEQUENCES], 6, 2, 32, 16, kv_dtype, device, seed=5)
    q, table, lens = _expand(SEQUENCES, base.block_table.cpu(), 6, 32, seed=5)
    case = (q.to(device), base.k_pages, base.v_pages, table.to(device), lens.to(device),
            base.sm_scale)
    got = _triton(case, 2, True, with_runs=True)
    assert not got.isnan().any()
    torch.testing.assert_close(got, _reference(case), atol=1e-5, rtol=1e-5)


@pytest.mark.triton
def test_triton_refuses_malformed_run_rows(device: torch.device) -> None:
    case = tuple(x.to(device) if isinstance(x, torch.Tensor) else x
                 for x in _fp32_case(16, 6, 2, 32, seed=3))
    with pytest.raises(ValueError, match="run_rows"):
        paged_decode_attention_triton(*case, run_rows=case[4].long())
