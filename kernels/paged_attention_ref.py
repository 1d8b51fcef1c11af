"""Torch reference for paged decode attention and the K/V append.

These are the CPU implementations the decode worker runs and the oracle the Triton kernels
are tested against. They gather only the valid positions of each sequence, so whatever
lives in unused slots or padding blocks (garbage, NaN) can never reach the output.
"""

from __future__ import annotations

import torch


def write_kv_ref(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, slot = block_id * block_size + offset
) -> None:
    """Write each token's K/V into its slot of the paged pool (in place)."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    slots = slot_mapping.to(torch.int64)
    k_flat = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    v_flat = v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    k_flat.index_copy_(0, slots, k.to(k_cache.dtype))
    v_flat.index_copy_(0, slots, v.to(v_cache.dtype))


def paged_decode_attention_ref(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_table: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, tokens already in the cache (new token included)
    sm_scale: float,
) -> torch.Tensor:  # [B, Hq, D]
    """One query token per sequence attending over its whole paged cache.

    Computed in fp32, returned in q's dtype. Sequences of length 0 give zeros.
    """
    batch, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(batch, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    lens = seq_lens.tolist()
    for b in range(batch):
        n = int(lens[b])
        if n <= 0:
            continue
        num_blocks = (n + block_size - 1) // block_size
        ids = block_table[b, :num_blocks].to(torch.int64)
        k = k_cache.index_select(0, ids).reshape(-1, num_kv_heads, head_dim)[:n]  # [n, Hkv, D]
        v = v_cache.index_select(0, ids).reshape(-1, num_kv_heads, head_dim)[:n]
        qb = q[b].float().view(num_kv_heads, group, head_dim)  # [Hkv, G, D]
        scores = torch.einsum("hgd,nhd->hgn", qb, k.float()) * sm_scale  # [Hkv, G, n]
        probs = torch.softmax(scores, dim=-1)
        ob = torch.einsum("hgn,nhd->hgd", probs, v.float())  # [Hkv, G, D]
        out[b] = ob.reshape(num_q_heads, head_dim).to(q.dtype)
    return out
