"""The C decode attention over dense K/V rows (kernels/kvferry_kernels/cpu_attention.py) against
the torch ops it replaces (`dense_decode_attention`, itself checked against the per-sequence
oracle):
every head size path (32, 64 and 128 in registers, any other in a plain loop), grouped
queries, rows of every length from 1 to the row width, positions past a row's length
poisoned with NaN (the kernel must never read them), and the stage's strided layer slice. The
paged entry reads the pool's pages in place: the same bits as the dense entry over the same
K/V, against the torch paged path, and it refuses tables it would read outside of."""

from __future__ import annotations

import logging
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch

from kvferry_kernels import artifact_cache, cpu_attention
from kvferry_kernels.paged_attention_torch import (
    dense_decode_attention,
    paged_decode_attention_torch,
)
from kvferry_kernels.query_runs import query_runs


@pytest.fixture(scope="module")
def kernel() -> cpu_attention.CpuAttention:
    loaded = cpu_attention.load(None)
    assert loaded is not None, "the test machine has a C compiler: the kernel must build"
    return loaded


@pytest.mark.parametrize("head_dim", [32, 64, 128, 48, 8])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_matches_the_torch_path_over_each_rows_length(kernel: cpu_attention.CpuAttention,
                                                      head_dim: int, group: int) -> None:
    gen = torch.Generator().manual_seed(head_dim * 10 + group)
    layers, rows, kv_heads, width = 2, 6, 2, 70
    # The stage's layout: [layers, rows, kv_heads, width, D]; a layer slice is strided.
    k = torch.randn(layers, rows, kv_heads, width, head_dim, generator=gen)
    v = torch.randn(layers, rows, kv_heads, width, head_dim, generator=gen)
    lens = torch.tensor([1, 2, 17, 16, 70, 33], dtype=torch.int32)
    q = torch.randn(rows, kv_heads * group, head_dim, generator=gen)
    want = dense_decode_attention(q, k[1], v[1], lens, head_dim**-0.5)
    for row, n in enumerate(lens.tolist()):  # never read: past each row's length
        k[1, row, :, n:] = float("nan")
        v[1, row, :, n:] = float("nan")
    got = kernel(q, k[1], v[1], lens, head_dim**-0.5)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(got[0], v[1, 0, :, 0].repeat_interleave(group, 0))  # 1 position


def test_large_scores_neither_overflow_nor_underflow(kernel: cpu_attention.CpuAttention
                                                     ) -> None:
    """Scores hundreds apart: softmax subtracts the max, exp of anything below -87 is 0."""
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(3, 1, 50, 64, generator=gen)
    v = torch.randn(3, 1, 50, 64, generator=gen)
    q = 40 * torch.randn(3, 4, 64, generator=gen)
    lens = torch.tensor([50, 20, 7], dtype=torch.int32)
    got = kernel(q, k, v, lens, 1.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, dense_decode_attention(q, k, v, lens, 1.0),
                               atol=2e-5, rtol=2e-5)


def _runs_case(head_dim: int, group: int, block_size: int, seed: int):
    """Sequences of 5, 1 and 3 query positions (a speculative step's rows: one table, lengths
    one apart, every position up to the longest written, NaN past it), in shuffled blocks."""
    gen = torch.Generator().manual_seed(seed)
    kv_heads, num_blocks, width = 2, 40, 6
    order = torch.randperm(num_blocks, generator=gen).tolist()
    cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), float("nan"))
    tables, lens = [], []
    for start, rows in ((block_size - 2, 5), (7, 1), (2 * block_size, 3)):
        table = [-1] * width
        longest = start + rows
        for j in range(-(-longest // block_size)):
            table[j] = block = order.pop()
            used = min(block_size, longest - j * block_size)
            cache[:, block, :used] = torch.randn(2, used, kv_heads, head_dim, generator=gen)
        for r in range(rows):
            tables.append(table)
            lens.append(start + 1 + r)
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=gen)
    return (q, cache[0], cache[1], torch.tensor(tables, dtype=torch.int32),
            torch.tensor(lens, dtype=torch.int32))


@pytest.mark.parametrize("head_dim", [32, 64, 128, 48])
@pytest.mark.parametrize(("group", "block_size"), [(1, 16), (3, 4), (8, 4)])
def test_one_sequence_s_query_positions_read_its_k_v_once_bit_for_bit(
        kernel: cpu_attention.CpuAttention, head_dim: int, group: int, block_size: int) -> None:
    """Consecutive rows of one sequence attended together (each K/V line read once for all)
    give each row the bits it gets alone, and match the torch paged path."""
    q, k_cache, v_cache, tables, lens = _runs_case(head_dim, group, block_size,
                                                   head_dim + group + block_size)
    assert query_runs(tables, lens).longest == 5
    together = kernel.paged(q, k_cache, v_cache, tables, lens, head_dim**-0.5)
    alone = kernel.paged(q, k_cache, v_cache, tables, lens, head_dim**-0.5, max_run=1)
    assert torch.equal(together, alone)
    safe = [torch.nan_to_num(c) for c in (k_cache, v_cache)]
    torch.testing.assert_close(together, paged_decode_attention_torch(
        q, *safe, tables.clamp(min=0), lens, head_dim**-0.5), atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("change, error", [
    (lambda a: {**a, "q": a["q"].double()}, "fp32"),
    (lambda a: {**a, "k": a["k"].transpose(2, 3).contiguous().transpose(2, 3)}, "strided"),
    (lambda a: {**a, "seq_lens": torch.tensor([0, 3])}, r"seq_lens must lie in \[1, 5\]"),
    (lambda a: {**a, "seq_lens": torch.tensor([6, 3])}, r"seq_lens must lie in \[1, 5\]")])
def test_refuses_what_it_cannot_read(kernel: cpu_attention.CpuAttention, change, error
                                     ) -> None:
    args = {"q": torch.randn(2, 2, 32), "k": torch.randn(2, 1, 5, 32),
            "v": torch.randn(2, 1, 5, 32), "seq_lens": torch.tensor([5, 3]), "sm_scale": 0.1}
    with pytest.raises(ValueError, match=error):
        kernel(**change(args))


def _paged_case(head_dim: int, group: int, block_size: int, seed: int
                ) -> tuple[torch.Tensor, ...]:
    """A pool layer's K and V pages (NaN in every slot no sequence holds), shuffled block
    tables padded with -1, lengths from 1 to a whole table, and queries."""
    gen = torch.Generator().manual_seed(seed)
    kv_heads, num_blocks, width = 2, 40, 5  # table entries per sequence
    lens = torch.tensor([1, block_size, block_size + 1, 3 * block_size - 1,
                         width * block_size, 2], dtype=torch.int32)
    # [layers, 2, blocks, block_size, Hkv, D], as KvPool lays it out; layer 1 is attended.
    cache = torch.full((2, 2, num_blocks, block_size, kv_heads, head_dim), float("nan"))
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(lens), width), -1, dtype=torch.int32)
    for row, n in enumerate(lens.tolist()):
        for j in range(-(-n // block_size)):
            block = order.pop()
            tables[row, j] = block
            used = min(block_size, n - j * block_size)
            cache[:, :, block, :used] = torch.randn(2, 2, used, kv_heads, head_dim,
                                                    generator=gen)
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=gen)
    return q, cache[1, 0], cache[1, 1], tables, lens


@pytest.mark.parametrize("head_dim", [32, 64, 128, 48])
@pytest.mark.parametrize(("group", "block_size"), [(1, 16), (3, 16), (8, 4), (3, 7)])
def test_paged_reads_pages_in_place_bit_for_bit_as_dense(
        kernel: cpu_attention.CpuAttention, head_dim: int, group: int, block_size: int) -> None:
    q, k_cache, v_cache, tables, lens = _paged_case(head_dim, group, block_size,
                                                    head_dim + 100 * group + block_size)
    got = kernel.paged(q, k_cache, v_cache, tables, lens, head_dim**-0.5)
    # The same K/V gathered into dense rows (zeros past each length) through the dense entry.
    width = tables.shape[1] * block_size
    rows = [torch.zeros(2, k_cache.shape[2], width, head_dim) for _ in range(len(lens))]
    for row, n in enumerate(lens.tolist()):
        for t in range(n):
            block, slot = int(tables[row, t // block_size]), t % block_size
            rows[row][0, :, t] = k_cache[block, slot]
            rows[row][1, :, t] = v_cache[block, slot]
    dense = torch.stack(rows)
    assert torch.equal(got, kernel(q, dense[:, 0], dense[:, 1], lens, head_dim**-0.5))
    safe = [torch.nan_to_num(c) for c in (k_cache, v_cache)]  # torch gathers whole blocks
    torch.testing.assert_close(got, paged_decode_attention_torch(
        q, *safe, tables.clamp(min=0), lens, head_dim**-0.5), atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("change, error", [
    (lambda a: {**a, "seq_lens": torch.tensor([0, 3])}, "length outside"),
    (lambda a: {**a, "seq_lens": torch.tensor([9, 3])}, "length outside"),  # 3 entries of 4
    (lambda a: {**a, "block_tables": torch.tensor([[0, 9], [2, 3]])}, "outside the pool"),
    (lambda a: {**a, "block_tables": torch.tensor([[0, -1], [2, 3]])}, "outside the pool"),
    (lambda a: {**a, "k_cache": a["k_cache"].double()}, "fp32"),
    (lambda a: {**a, "k_cache": torch.randn(4, 8, 1, 32)[:, ::2],
                "v_cache": torch.randn(4, 8, 1, 32)[:, ::2]}, "each page dense")])
def test_paged_refuses_what_it_would_read_outside_of(kernel: cpu_attention.CpuAttention,
                                                     change, error) -> None:
    args = {"q": torch.randn(2, 2, 32), "k_cache": torch.randn(4, 4, 1, 32),
            "v_cache": torch.randn(4, 4, 1, 32), "block_tables": torch.tensor([[0, 1], [2, 3]]),
            "seq_lens": torch.tensor([8, 3]), "sm_scale": 0.1}
    with pytest.raises(ValueError, match=error):
        kernel.paged(**change(args))


def test_built_once_per_cache_and_none_without_a_compiler(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = cpu_attention.load.__wrapped__(tmp_path / "a")
    assert first is not None
    (entry,) = (tmp_path / "a").iterdir()  # one entry, no scratch directory left
    assert sorted(p.name for p in entry.iterdir()) == [cpu_attention.LIBRARY, "manifest.json"]
    assert first.path == entry / cpu_attention.LIBRARY
    mtime = first.path.stat().st_mtime_ns
    again = cpu_attention.load.__wrapped__(tmp_path / "a")
    assert again is not None and again.path == first.path
    assert first.path.stat().st_mtime_ns == mtime  # loaded, not built again

    monkeypatch.setenv("CC", "/bin/false")  # a compiler that fails
    assert cpu_attention.load.__wrapped__(tmp_path / "b") is None
    assert list((tmp_path / "b").iterdir()) == []  # the failed build's scratch is gone


def _flip_a_middle_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))  # the same size: only the hash can tell


# What a crash, a planted stub or bit rot leaves in a cache entry's file.
CORRUPTIONS = {
    "truncated": lambda path: os.truncate(path, path.stat().st_size // 2),
    "stub": lambda path: path.write_bytes(b"not a library\n"),
    "hash mismatch": _flip_a_middle_byte,
}


@pytest.fixture(scope="module")
def built_entry(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A verified library entry, copied by each test into a cache this process never mapped
    (dlopen of a path already loaded would hand back the old mapping)."""
    loaded = cpu_attention.load.__wrapped__(tmp_path_factory.mktemp("kernels"))
    assert loaded is not None
    return loaded.path.parent


def _works(kernel: cpu_attention.CpuAttention | None) -> bool:
    q, k, v = torch.randn(2, 2, 32), torch.randn(2, 1, 5, 32), torch.randn(2, 1, 5, 32)
    lens = torch.tensor([5, 3], dtype=torch.int32)
    return kernel is not None and torch.allclose(
        kernel(q, k, v, lens, 0.2), dense_decode_attention(q, k, v, lens, 0.2), atol=1e-5)


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_a_bad_library_is_never_loaded_but_rebuilt_with_one_warning(
        built_entry: Path, tmp_path: Path, corruption: str,
        caplog: pytest.LogCaptureFixture) -> None:
    cache = tmp_path / "kernels"
    entry = cache / built_entry.name
    shutil.copytree(built_entry, entry)
    CORRUPTIONS[corruption](entry / cpu_attention.LIBRARY)
    with caplog.at_level(logging.WARNING):
        loaded = cpu_attention.load.__wrapped__(cache)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and str(entry) in warnings[0], warnings
    assert loaded is not None and loaded.path == entry / cpu_attention.LIBRARY
    assert artifact_cache.verify(entry) is None  # a fresh, verified build
    assert _works(loaded)


def test_a_cache_others_may_write_is_refused_with_one_line(
        built_entry: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache = tmp_path / "kernels"
    planted = cache / built_entry.name
    shutil.copytree(built_entry, planted)  # as if planted: valid, but anyone could swap it
    cache.chmod(cache.stat().st_mode | stat.S_IWOTH)
    with caplog.at_level(logging.WARNING):
        loaded = cpu_attention.load.__wrapped__(cache)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and f"refusing {cache} " in warnings[0], warnings
    assert loaded is not None and cache not in loaded.path.parents  # built privately
    assert artifact_cache.verify(loaded.path.parent) is None
    assert stat.S_IMODE(loaded.path.parent.parent.stat().st_mode) == 0o700
    assert _works(loaded)
