"""Batched torch implementation of paged decode attention for the CPU decode path.

Same contract as `paged_attention_ref.paged_decode_attention_ref` (the oracle), but one set of
tensor ops for the whole ragged batch instead of a Python loop per sequence: it gathers every
sequence's blocks into a padded [B, max_len] view, masks scores past each length with -inf
and lets `scaled_dot_product_attention` (fused, GQA-aware) do the rest.

Why no zeroing of the gathered padding: a masked position gets probability exactly 0, so any
finite garbage there contributes exactly 0. Only non-finite garbage (inf, NaN) can leak, and
it can only turn a row into NaN, never into a wrong finite value. So rows that come out NaN are
recomputed with K and V zeroed past their length; all others are already exact.

Quantized caches (`kv_quant.QuantPages`) are gathered the same way, values and scales, and
dequantized to fp32 before attending: the same numbers the reference attends over.

Attention mass (`paged_attention_ref.check_mass`) is computed beside the fused attention, not
instead of it: the scores are formed once more with explicit matmuls and a masked softmax, so
the output is the same bits with or without it. The mask there is a fill, not a bias, so
non-finite K past a length cannot reach the mass either.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvferry_kernels.kv_quant import QuantPages, dequantize
from kvferry_kernels.paged_attention_ref import check_mass
from kvferry_kernels.query_runs import QueryRuns, query_runs


def _gather(cache: torch.Tensor, ids: torch.Tensor, batch: int, num_blocks: int,
            max_len: int) -> torch.Tensor:  # [B, L, Hkv, D] float32
    block_size, num_kv_heads, head_dim = cache.shape[1:]
    shape = (batch, num_blocks * block_size, num_kv_heads, head_dim)
    if cache.is_contiguous():
        # Blocks as flat rows: index_select then copies memcpy-fast, several times faster
        # than advanced indexing or a 4-d index_select on CPU.
        rows = cache.view(cache.shape[0], -1).index_select(0, ids)
    else:
        rows = cache.index_select(0, ids)
    return rows.view(shape)[:, :max_len].float()


def _gather_rows(pages: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # [len(ids), ...]
    """Blocks `ids` of pages whose block dim is strided but whose rest is contiguous (a
    `split_pages` view): copied as flat rows, like the contiguous case of `_gather`."""
    return pages.flatten(1).index_select(0, ids).view(len(ids), *pages.shape[1:])


def _gather_quant(pages: QuantPages, ids: torch.Tensor, batch: int, num_blocks: int,
                  max_len: int) -> torch.Tensor:  # [B, L, Hkv, D] float32
    block_size, num_kv_heads, head_dim = pages.data.shape[1:]
    data = pages.data
    raw = data.view(torch.uint8) if data.dtype == torch.float8_e4m3fn else data  # fp8 as bytes
    values = _gather_rows(raw, ids).view(data.dtype)  # [B * nb, P, Hkv, D]
    scales = _gather_rows(pages.scale, ids)  # [B * nb, P, Hkv]
    length = num_blocks * block_size
    values = values.view(batch, length, num_kv_heads, head_dim)[:, :max_len]
    return dequantize(values, scales.view(batch, length, num_kv_heads)[:, :max_len])


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, invalid: torch.Tensor,
            sm_scale: float) -> torch.Tensor:  # [B, Hq, D] float32
    """q [B, Hq, D]; k, v [B, Hkv, L, D]; invalid [B, L] marks positions to ignore."""
    bias = torch.zeros(invalid.shape, device=q.device)  # [B, L]
    bias.masked_fill_(invalid, float("-inf"))
    out = F.scaled_dot_product_attention(
        q.float()[:, :, None, :],  # [B, Hq, 1, D]
        k, v, attn_mask=bias[:, None, None, :], scale=sm_scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[:, :, 0, :]


def summed_probs(q: torch.Tensor, k: torch.Tensor, invalid: torch.Tensor,
                 sm_scale: float) -> torch.Tensor:  # [U, R, L] float32
    """q [U, R, Hq, D] (R query positions of U sequences), k [U, Hkv, L, D] float32,
    invalid [U, R, L]: each query's softmax probabilities over its valid positions, summed
    over its query heads; exactly 0 where invalid (so in a row with no valid position)."""
    num_runs, rows, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    qg = q.view(num_runs, rows, num_kv_heads, group, head_dim).transpose(1, 2)  # [U, Hkv, R, G, D]
    qg = qg.reshape(num_runs, num_kv_heads, rows * group, head_dim)
    scores = torch.matmul(qg, k.transpose(-1, -2)) * sm_scale  # [U, Hkv, R * G, L]
    scores = scores.view(num_runs, num_kv_heads, rows, group, -1)  # [U, Hkv, R, G, L]
    scores.masked_fill_(invalid[:, None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).sum(dim=(1, 3))  # [U, R, L]; NaN: no valid position
    return probs.masked_fill_(invalid, 0.0)


def _add_mass(mass: torch.Tensor, probs: torch.Tensor, invalid: torch.Tensor) -> None:
    """mass[b, p] += probs[b, p] at every valid p (probs, invalid [B, L], L <= M); nothing
    else of mass is written (not even with 0: a -0.0 or NaN there stays as it is)."""
    window = mass[:, :probs.shape[1]]  # a view: the indexed add writes through it
    valid = ~invalid
    window[valid] += probs[valid]


def dense_decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k: torch.Tensor,  # [B, Hkv, L, D]: each sequence's K from position 0
    v: torch.Tensor,  # [B, Hkv, L, D]
    seq_lens: torch.Tensor,  # [B]: positions [0, len) count; anything after is ignored
    sm_scale: float,
) -> torch.Tensor:  # [B, Hq, D]
    """Decode attention over K/V already laid out densely (decode_worker.kv_stage). What
    lies past a sequence's length must be finite (stale K/V or zeros): it gets probability
    exactly 0.

    Plain batched matmuls, each query head group against its KV head: with one query token
    per sequence this reads K and V once at close to memory speed, where the CPU flash
    kernel of scaled_dot_product_attention takes ~1.3-2x longer (tests/kvferry_kernels and
    docs/performance.md)."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, length = k.shape[1], k.shape[2]
    invalid = torch.arange(length, device=q.device)[None, :] >= seq_lens[:, None].to(q.device)
    qg = q.float().view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    scores = torch.matmul(qg, k.float().transpose(-1, -2)) * sm_scale  # [B, Hkv, G, L]
    scores.masked_fill_(invalid[:, None, None, :], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v.float())  # [B, Hkv, G, D]
    return out.view(batch, num_q_heads, head_dim).to(q.dtype)


def _attend_runs(q: torch.Tensor, k_cache: torch.Tensor | QuantPages,
                 v_cache: torch.Tensor | QuantPages, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, sm_scale: float, runs: QueryRuns,
                 mass: torch.Tensor | None = None) -> torch.Tensor:
    """Each run's K/V gathered (and dequantized) once, up to its longest row, and all its
    rows attended over it as the query positions of one sequence, each masked past its
    own length: [B, Hq, D] float32, NaN in a row that met non-finite K/V past its length.
    With `mass`, each row's head-summed probabilities are added to its row of it."""
    num_runs, rows = runs.first.shape[0], runs.longest
    num_q_heads, head_dim = q.shape[1:]
    block_size = k_cache.shape[1]
    run_lens = seq_lens[runs.last]  # [U] each run's longest length
    max_len = int(run_lens.max())
    num_blocks = (max_len + block_size - 1) // block_size
    ids = block_table[runs.first, :num_blocks].reshape(-1).to(torch.int64)  # [U * nb]
    gather_k = _gather_quant if isinstance(k_cache, QuantPages) else _gather
    gather_v = _gather_quant if isinstance(v_cache, QuantPages) else _gather
    k = gather_k(k_cache, ids, num_runs, num_blocks, max_len).transpose(1, 2)  # [U, Hkv, L, D]
    v = gather_v(v_cache, ids, num_runs, num_blocks, max_len).transpose(1, 2)
    queries = q.new_zeros(num_runs, rows, num_q_heads, head_dim, dtype=torch.float32)
    queries[runs.run, runs.offset] = q.float()
    lens = torch.ones(num_runs, rows, dtype=seq_lens.dtype, device=q.device)  # padding: 1
    lens[runs.run, runs.offset] = seq_lens.to(q.device)
    invalid = torch.arange(max_len, device=q.device) >= lens[:, :, None]  # [U, R, L]
    bias = torch.zeros(num_runs, rows, max_len, device=q.device)
    bias.masked_fill_(invalid, float("-inf"))
    out = F.scaled_dot_product_attention(
        queries.transpose(1, 2), k, v, attn_mask=bias[:, None], scale=sm_scale,
        enable_gqa=num_q_heads != k.shape[1])  # [U, Hq, R, D]
    if mass is not None:
        probs = summed_probs(queries, k, invalid, sm_scale)[runs.run, runs.offset]  # [B, L]
        _add_mass(mass, probs, invalid[runs.run, runs.offset])
    return out.transpose(1, 2)[runs.run, runs.offset]


def paged_decode_attention_torch(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor | QuantPages,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor | QuantPages,  # [num_blocks, block_size, Hkv, D]
    block_table: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    sm_scale: float,
    *,
    mass: torch.Tensor | None = None,  # [B, >= max(seq_lens)] float32, added to
) -> torch.Tensor:  # [B, Hq, D]
    """Several query positions of one sequence in consecutive rows (`query_runs`) read its
    K/V once for all of them; any other row reads its own. With `mass`, each row's
    probabilities summed over its query heads are added to mass[b, :seq_lens[b]]
    (`paged_attention_ref.check_mass`); the output is the same bits either way."""
    if mass is not None:
        check_mass(mass, q, seq_lens, block_table.shape[1] * k_cache.shape[1])
    if q.shape[0] > 1 and int(seq_lens.min()) > 0:
        runs = query_runs(block_table, seq_lens)
        if runs.longest > 1:
            out = _attend_runs(q, k_cache, v_cache, block_table, seq_lens, sm_scale, runs,
                               mass)
            bad = out.isnan().flatten(1).any(dim=1)
            if bad.any():  # non-finite K/V past a row's length: that row alone, zeroed there
                rows = bad.nonzero().flatten()
                out[rows] = _attend_rows(q[rows], k_cache, v_cache, block_table[rows],
                                         seq_lens[rows], sm_scale).float()
            return out.to(q.dtype)
    return _attend_rows(q, k_cache, v_cache, block_table, seq_lens, sm_scale, mass)


def _attend_rows(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor | QuantPages,
    v_cache: torch.Tensor | QuantPages,
    block_table: torch.Tensor,  # [B, max_blocks]
    seq_lens: torch.Tensor,  # [B]
    sm_scale: float,
    mass: torch.Tensor | None = None,  # [B, M] float32, added to
) -> torch.Tensor:  # [B, Hq, D]
    """Each row over its own gathered K/V (and its probabilities added to `mass`)."""
    batch = q.shape[0]
    block_size = k_cache.shape[1]
    max_len = int(seq_lens.max().item()) if batch else 0
    if max_len <= 0:
        return torch.zeros_like(q)
    num_blocks = (max_len + block_size - 1) // block_size
    ids = block_table[:, :num_blocks].reshape(-1).to(torch.int64)  # [B * nb]
    gather_k = _gather_quant if isinstance(k_cache, QuantPages) else _gather
    gather_v = _gather_quant if isinstance(v_cache, QuantPages) else _gather
    k = gather_k(k_cache, ids, batch, num_blocks, max_len)  # [B, L, Hkv, D] float32
    v = gather_v(v_cache, ids, batch, num_blocks, max_len)
    invalid = torch.arange(max_len, device=q.device)[None, :] >= seq_lens[:, None].to(q.device)
    out = _attend(q, k.transpose(1, 2), v.transpose(1, 2), invalid, sm_scale)
    if mass is not None:
        probs = summed_probs(q.float()[:, None], k.transpose(1, 2), invalid[:, None], sm_scale)
        _add_mass(mass, probs[:, 0], invalid)
    bad = out.isnan().flatten(1).any(dim=1)  # [B]
    if bad.any():
        rows = bad.nonzero().flatten()
        kb, vb, inv = k[rows], v[rows], invalid[rows]  # copies: pool memory stays untouched
        kb.masked_fill_(inv[:, :, None, None], 0.0)
        vb.masked_fill_(inv[:, :, None, None], 0.0)
        out[rows] = torch.nan_to_num(
            _attend(q[rows], kb.transpose(1, 2), vb.transpose(1, 2), inv, sm_scale), nan=0.0)
    return out.to(q.dtype)
