"""Torch reference for paged decode attention and the K/V append.

These are the CPU implementations the decode worker runs and the oracle the Triton kernels
are tested against. They gather only the valid positions of each sequence, so whatever
lives in unused slots or padding blocks (garbage, NaN) can never reach the output.

A cache is either a full-precision tensor [num_blocks, block_size, Hkv, D] or
`kv_quant.QuantPages` (int8 / fp8 values with a float32 scale per token and K/V head, views
into the pool's bytes): the append quantizes with `kv_quant.quantize`, attention reads the
valid positions back with `kv_quant.dequantize` and attends in fp32.

Attention mass (H2O's heavy hitters): every decode attention implementation takes an optional
`mass` [B, M] float32 buffer (M >= max(seq_lens); callers pass the block table's capacity) and
adds to mass[b, p], for each p < seq_lens[b], position p's softmax probability summed over
all query heads. It adds and never overwrites (one buffer collects every layer's mass);
entries at and past a row's length are left as they are. `check_mass` states the buffer's
contract once for all of them.
"""

from __future__ import annotations

import torch

from kvferry_kernels.kv_quant import QuantPages, dequantize, kv_dtype_of, quantize


def _storage_bytes(data: torch.Tensor) -> torch.Tensor:
    """fp8 values as raw bytes (same shape and strides): indexing and copies of float8
    tensors are not implemented on every device, bytes always are."""
    return data.view(torch.uint8) if data.dtype == torch.float8_e4m3fn else data


def write_quant_ref(
    x: torch.Tensor,  # [T, Hkv, D]
    pages: QuantPages,  # data [num_blocks, block_size, Hkv, D], scale [num_blocks, block_size, Hkv]
    slots: torch.Tensor,  # [T] int64
) -> None:
    """Quantize each token's vectors and store values and scales in their slots, in place
    through the views (so into the pool bytes they view)."""
    block_size = pages.data.shape[1]
    values, scales = quantize(x, kv_dtype_of(pages))  # [T, Hkv, D], [T, Hkv]
    blocks, offsets = slots // block_size, slots % block_size
    # Indexed assignment writes through strided views; `.view(N * bs, ...)` would not.
    _storage_bytes(pages.data)[blocks, offsets] = _storage_bytes(values)
    pages.scale[blocks, offsets] = scales


def write_kv_ref(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor | QuantPages,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor | QuantPages,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, slot = block_id * block_size + offset
) -> None:
    """Write each token's K/V into its slot of the paged pool (in place); quantized caches
    get `kv_quant.quantize`'s values and scales."""
    slots = slot_mapping.to(torch.int64)
    if isinstance(k_cache, QuantPages) and isinstance(v_cache, QuantPages):
        write_quant_ref(k, k_cache, slots)
        write_quant_ref(v, v_cache, slots)
        return
    if isinstance(k_cache, QuantPages) or isinstance(v_cache, QuantPages):
        raise ValueError("k_cache and v_cache must both be QuantPages or both tensors")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    k_flat = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    v_flat = v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    k_flat.index_copy_(0, slots, k.to(k_cache.dtype))
    v_flat.index_copy_(0, slots, v.to(v_cache.dtype))


def check_mass(mass: torch.Tensor, q: torch.Tensor, seq_lens: torch.Tensor,
               capacity: int) -> None:
    """Raise ValueError unless `mass` is a contiguous float32 [B, M] on q's device with
    M >= max(seq_lens). `capacity` bounds every length (a block table's entries x block
    size): the lengths are read back to the host only when M is under it."""
    batch = q.shape[0]
    if (mass.dtype != torch.float32 or mass.dim() != 2 or mass.shape[0] != batch
            or mass.device != q.device or not mass.is_contiguous()):
        raise ValueError(f"mass must be a contiguous float32 [{batch}, >= max(seq_lens)] "
                         f"on {q.device}; got {mass.dtype} {tuple(mass.shape)} on "
                         f"{mass.device}")
    if batch and mass.shape[1] < capacity and int(seq_lens.max()) > mass.shape[1]:
        raise ValueError(f"mass has {mass.shape[1]} positions per row, fewer than the "
                         f"longest sequence ({int(seq_lens.max())})")


def _valid_positions(cache: torch.Tensor | QuantPages, ids: torch.Tensor,
                     n: int) -> torch.Tensor:  # [n, Hkv, D] float32
    """The first n positions of the blocks `ids`, in fp32 (dequantized if quantized)."""
    num_kv_heads, head_dim = cache.shape[2], cache.shape[3]
    if isinstance(cache, QuantPages):
        values = _storage_bytes(cache.data).index_select(0, ids)  # [nb, P, Hkv, D]
        values = values.view(cache.data.dtype).reshape(-1, num_kv_heads, head_dim)[:n]
        scales = cache.scale.index_select(0, ids).reshape(-1, num_kv_heads)[:n]  # [n, Hkv]
        return dequantize(values, scales)
    return cache.index_select(0, ids).reshape(-1, num_kv_heads, head_dim)[:n].float()


def paged_decode_attention_ref(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor | QuantPages,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor | QuantPages,  # [num_blocks, block_size, Hkv, D]
    block_table: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, tokens already in the cache (new token included)
    sm_scale: float,
    *,
    mass: torch.Tensor | None = None,  # [B, >= max(seq_lens)] float32, added to
) -> torch.Tensor:  # [B, Hq, D]
    """One query token per sequence attending over its whole paged cache.

    Computed in fp32, returned in q's dtype. Sequences of length 0 give zeros. With `mass`,
    each row's probabilities, summed over its query heads, are added to mass[b, :len].
    """
    batch, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if mass is not None:
        check_mass(mass, q, seq_lens, block_table.shape[1] * block_size)
    group = num_q_heads // num_kv_heads
    out = torch.zeros(batch, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    lens = seq_lens.tolist()
    for b in range(batch):
        n = int(lens[b])
        if n <= 0:
            continue
        num_blocks = (n + block_size - 1) // block_size
        ids = block_table[b, :num_blocks].to(torch.int64)
        k = _valid_positions(k_cache, ids, n)  # [n, Hkv, D]
        v = _valid_positions(v_cache, ids, n)
        qb = q[b].float().view(num_kv_heads, group, head_dim)  # [Hkv, G, D]
        scores = torch.einsum("hgd,nhd->hgn", qb, k) * sm_scale  # [Hkv, G, n]
        probs = torch.softmax(scores, dim=-1)
        if mass is not None:
            mass[b, :n] += probs.sum(dim=(0, 1))
        ob = torch.einsum("hgn,nhd->hgd", probs, v)  # [Hkv, G, D]
        out[b] = ob.reshape(num_q_heads, head_dim).to(q.dtype)
    return out
