"""Triton K/V append: scatter each new token's K and V into its slot of the paged pool.

Same contract as `paged_attention_ref.write_kv_ref`, plus one extension: a negative slot
means "padding token, write nothing" (a batch padded to a captured CUDA-graph size).
Caches may be strided views (for example K and V halves of one [N, 2, P, Hkv, D] pool);
page ids are widened to int64 before they meet a stride, so pools past 2^31 elements work.

`TRITON_INTERPRET=1` must be set before this module is imported to run it on CPU tensors.
The interpreter mishandles bf16 arithmetic, so for bf16 the values are converted on the
host there and copied bit for bit as int16.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Read once: triton decides at decoration time whether a kernel is interpreted.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_MAX_TILE_ELEMENTS = 4096  # heads x head_dim per program


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcn,
    stride_kcp,
    stride_kch,
    stride_kcd,
    stride_vcn,
    stride_vcp,
    stride_vch,
    stride_vcd,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    page = slot // PAGE_SIZE
    in_page = slot % PAGE_SIZE

    offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    num_heads_to_store = tl.where(slot >= 0, NUM_KV_HEADS, 0)  # padding token: none
    store_mask = (offs_h[:, None] < num_heads_to_store) & (offs_d[None, :] < HEAD_DIM)

    k = tl.load(
        k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd,
        mask=mask,
        other=0.0,
    )  # [BLOCK_H, BLOCK_D]
    kc = (
        k_cache_ptr
        + page * stride_kcn
        + in_page * stride_kcp
        + offs_h[:, None] * stride_kch
        + offs_d[None, :] * stride_kcd
    )
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=store_mask)

    v = tl.load(
        v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd,
        mask=mask,
        other=0.0,
    )  # [BLOCK_H, BLOCK_D]
    vc = (
        v_cache_ptr
        + page * stride_vcn
        + in_page * stride_vcp
        + offs_h[:, None] * stride_vch
        + offs_d[None, :] * stride_vcd
    )
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=store_mask)


def _check_inputs(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"k_cache/v_cache must be equal [N, P, Hkv, D]; got "
            f"{tuple(k_cache.shape)} {k_cache.dtype} and "
            f"{tuple(v_cache.shape)} {v_cache.dtype}"
        )
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if k.dim() != 3 or k.shape != v.shape or tuple(k.shape[1:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"k/v must be [T, {num_kv_heads}, {head_dim}]; got "
            f"{tuple(k.shape)} and {tuple(v.shape)}"
        )
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"slot_mapping must be int32/int64 [{k.shape[0]}]; got "
            f"{tuple(slot_mapping.shape)} {slot_mapping.dtype}"
        )
    if not _INTERPRET and k_cache.device.type != "cuda":
        raise ValueError(
            "triton write_kv needs CUDA tensors, or TRITON_INTERPRET=1 set "
            "before importing kernels.triton_kv_append"
        )


def write_kv_triton(
    k: torch.Tensor,  # [T, Hkv, D], any strides
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64 (or int32), slot = block_id * block_size + offset
) -> None:
    """Write each token's K/V into its slot of the paged pool (in place, cast to the cache
    dtype). Tokens with a negative slot are skipped."""
    _check_inputs(k, v, k_cache, v_cache, slot_mapping)
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    if _INTERPRET and torch.bfloat16 in (k.dtype, v.dtype, k_cache.dtype):
        k, v = k.to(k_cache.dtype), v.to(k_cache.dtype)
        if k_cache.dtype == torch.bfloat16:
            k, v = k.view(torch.int16), v.view(torch.int16)
            k_cache, v_cache = k_cache.view(torch.int16), v_cache.view(torch.int16)

    _, page_size, num_kv_heads, head_dim = k_cache.shape
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, _MAX_TILE_ELEMENTS // block_d))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _write_kv_kernel[grid](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        *k.stride(),
        *v.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        PAGE_SIZE=page_size,
        num_warps=4,
    )


__all__ = ["write_kv_triton"]
