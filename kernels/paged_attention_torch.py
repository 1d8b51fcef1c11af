"""Batched torch implementation of paged decode attention for the CPU decode path.

Same contract as `paged_attention_ref.paged_decode_attention_ref` (the oracle), but one set of
tensor ops for the whole ragged batch instead of a Python loop per sequence: it gathers every
sequence's blocks into a padded [B, max_len] view, masks positions past each length (scores to
-inf, values to 0, so garbage or NaN in unused slots never reaches the output) and computes
softmax in fp32.
"""

from __future__ import annotations

import torch


def paged_decode_attention_torch(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_table: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    sm_scale: float,
) -> torch.Tensor:  # [B, Hq, D]
    batch, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    max_len = int(seq_lens.max().item()) if batch else 0
    if max_len <= 0:
        return torch.zeros_like(q)
    num_blocks = (max_len + block_size - 1) // block_size
    ids = block_table[:, :num_blocks].to(torch.int64)  # [B, nb]
    k = k_cache[ids].reshape(batch, num_blocks * block_size, num_kv_heads, head_dim)[:, :max_len]
    v = v_cache[ids].reshape(batch, num_blocks * block_size, num_kv_heads, head_dim)[:, :max_len]
    valid = torch.arange(max_len, device=q.device)[None, :] < seq_lens[:, None].to(q.device)
    v = torch.where(valid[:, :, None, None], v.float(), 0.0)  # [B, L, Hkv, D]
    k = torch.where(valid[:, :, None, None], k.float(), 0.0)
    qg = q.float().view(batch, num_kv_heads, group, head_dim)  # [B, Hkv, G, D]
    scores = torch.einsum("bhgd,blhd->bhgl", qg, k) * sm_scale  # [B, Hkv, G, L]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # rows with length 0
    out = torch.einsum("bhgl,blhd->bhgd", probs, v)  # [B, Hkv, G, D]
    return out.reshape(batch, num_q_heads, head_dim).to(q.dtype)
