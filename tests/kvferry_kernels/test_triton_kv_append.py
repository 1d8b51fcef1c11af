"""Triton K/V append against `write_kv_ref`: caches must match bit for bit."""

from __future__ import annotations

import pytest
import torch

from kvferry_kernels.paged_attention_ref import write_kv_ref
from kvferry_kernels.triton_kv_append import write_kv_triton

pytestmark = pytest.mark.triton


def _pool(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return torch.randn(shape, generator=gen).to(device, dtype)  # [N, P, Hkv, D]


@pytest.mark.parametrize(
    ("src_dtype", "cache_dtype", "block_size", "num_kv_heads", "head_dim"),
    [
        (torch.float32, torch.float32, 1, 2, 64),
        (torch.float32, torch.float16, 16, 3, 80),
        (torch.float16, torch.float16, 64, 8, 128),
        (torch.bfloat16, torch.bfloat16, 16, 2, 128),
        (torch.float32, torch.bfloat16, 128, 1, 80),
    ],
)
def test_matches_reference(
    src_dtype: torch.dtype,
    cache_dtype: torch.dtype,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
) -> None:
    num_tokens = 9
    num_blocks = 3 + -(-num_tokens // block_size)  # room to spare, slots shuffled
    gen = torch.Generator().manual_seed(block_size)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(device, src_dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(device, src_dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(device)
    k_ref = _pool(num_blocks, block_size, num_kv_heads, head_dim, cache_dtype, device, 1)
    v_ref = _pool(num_blocks, block_size, num_kv_heads, head_dim, cache_dtype, device, 2)
    k_out, v_out = k_ref.clone(), v_ref.clone()
    write_kv_ref(k, v, k_ref, v_ref, slots)
    write_kv_triton(k, v, k_out, v_out, slots)
    assert torch.equal(k_out, k_ref) and torch.equal(v_out, v_ref)


def test_strided_inputs_and_cache_views(device: torch.device) -> None:
    """K/V as strided slices and caches as the two halves of one [N, 2, P, Hkv, D] pool."""
    num_blocks, block_size, hkv, d, t = 5, 16, 2, 80, 7
    gen = torch.Generator().manual_seed(3)
    kv_src = torch.randn(t, 4 * hkv, d, generator=gen).to(device)
    k, v = kv_src[:, 0::4], kv_src[:, 1::4]  # [T, Hkv, D], not contiguous
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t].to(device)
    pool = torch.randn(num_blocks, 2, block_size, hkv, d, generator=gen).to(device)
    k_ref, v_ref = pool[:, 0].clone(), pool[:, 1].clone()
    write_kv_ref(k, v, k_ref, v_ref, slots)
    write_kv_triton(k, v, pool[:, 0], pool[:, 1], slots)
    assert torch.equal(pool[:, 0], k_ref) and torch.equal(pool[:, 1], v_ref)


def test_negative_slots_are_skipped(device: torch.device) -> None:
    hkv, d = 2, 64
    k = torch.randn(4, hkv, d, device=device)
    v = torch.randn(4, hkv, d, device=device)
    slots = torch.tensor([5, -1, 0, -1], dtype=torch.int32, device=device)
    k_cache = torch.zeros(2, 4, hkv, d, device=device)
    v_cache = torch.zeros_like(k_cache)
    write_kv_triton(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache[1, 1], k[0]) and torch.equal(v_cache[0, 0], v[2])
    k_cache[1, 1] = 0
    k_cache[0, 0] = 0
    assert not k_cache.any()  # nothing else was touched


def test_empty_batch_and_bad_shapes(device: torch.device) -> None:
    k_cache = torch.zeros(2, 4, 2, 64, device=device)
    v_cache = torch.zeros_like(k_cache)
    empty = torch.zeros(0, 2, 64, device=device)
    write_kv_triton(empty, empty, k_cache, v_cache, torch.zeros(0, dtype=torch.int64))
    assert not k_cache.any()
    wrong = torch.zeros(3, 4, 64, device=device)  # 4 heads into a 2-head pool
    with pytest.raises(ValueError, match="k/v must be"):
        write_kv_triton(wrong, wrong, k_cache, v_cache, torch.zeros(3, dtype=torch.int64))
