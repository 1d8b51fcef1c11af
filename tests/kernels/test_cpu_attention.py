"""The C decode attention over dense K/V rows (kernels/cpu_attention.py) against the torch
ops it replaces (`dense_decode_attention`, itself checked against the per-sequence oracle):
every head size path (32, 64 and 128 in registers, any other in a plain loop), grouped
queries, rows of every length from 1 to the row width, positions past a row's length
poisoned with NaN (the kernel must never read them), and the stage's strided layer slice."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels import cpu_attention
from kernels.paged_attention_torch import dense_decode_attention


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
