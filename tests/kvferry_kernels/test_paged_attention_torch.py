"""The batched torch decode attention (CPU path) against the per-sequence reference."""

from __future__ import annotations

import pytest
import torch

from kvferry_kernels.paged_attention_ref import paged_decode_attention_ref
from kvferry_kernels.paged_attention_torch import paged_decode_attention_torch


@pytest.mark.parametrize("block_size,hq,hkv", [(1, 4, 4), (16, 8, 2), (16, 5, 1), (64, 8, 1)])
def test_matches_reference_with_poisoned_padding(block_size: int, hq: int, hkv: int) -> None:
    gen = torch.Generator().manual_seed(block_size + hq)
    head_dim, num_blocks = 32, 64
    lens = [1, block_size - 1 or 1, block_size + 1, 3 * block_size + 5, 0]
    k_cache = torch.randn(num_blocks, block_size, hkv, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, hkv, head_dim, generator=gen)
    poison = num_blocks - 1
    k_cache[poison] = float("nan")
    v_cache[poison] = float("nan")
    width = max((n + block_size - 1) // block_size for n in lens)
    order = torch.randperm(num_blocks - 1, generator=gen).tolist()
    table = torch.full((len(lens), width), poison, dtype=torch.int32)
    for b, n in enumerate(lens):
        used = (n + block_size - 1) // block_size
        table[b, :used] = torch.tensor(order[:used], dtype=torch.int32)
        order = order[used:]
    # Unused slots of partly filled blocks hold NaN too.
    for b, n in enumerate(lens):
        if n % block_size:
            last = int(table[b, n // block_size])
            k_cache[last, n % block_size:] = float("nan")
            v_cache[last, n % block_size:] = float("nan")
    q = torch.randn(len(lens), hq, head_dim, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    got = paged_decode_attention_torch(q, k_cache, v_cache, table, seq_lens, head_dim**-0.5)
    want = paged_decode_attention_ref(q, k_cache, v_cache, table, seq_lens, head_dim**-0.5)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (got[-1] == 0).all()  # length 0 gives zeros
