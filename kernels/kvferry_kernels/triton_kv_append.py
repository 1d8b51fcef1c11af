"""Triton K/V append: scatter each new token's K and V into its slot of the paged pool.

Same contract as `paged_attention_ref.write_kv_ref`, plus one extension: a negative slot
means "padding token, write nothing" (a batch padded to a captured CUDA-graph size).
Caches may be strided views (for example K and V halves of one [N, 2, P, Hkv, D] pool);
page ids are widened to int64 before they meet a stride, so pools past 2^31 elements work.

Quantized caches (`kv_quant.QuantPages`, strided views into the pool's bytes) are quantized
in the kernel with `kv_quant.quantize`'s exact arithmetic, so both paths store the same
bytes: scale = amax / qmax (1 for an all-zero vector; kept within kv_quant's bounds, the
smallest normal float32 and the largest float32 <= float32 max / qmax) and value = x / scale,
both divisions correctly rounded (`div_rn`, as torch on CPU; a plain `/` is approximate on
GPUs), then
- int8: rounded half to even (as torch.round; from floor, not a libdevice call, which the
  interpreter lacks) and clamped to [-127, 127];
- fp8 e4m3: clamped to +-448 and encoded to its bits with integer arithmetic,
  round-to-nearest-even, subnormals included. The interpreter's own fp32 -> fp8 cast rounds
  ties away from zero and drops the carry into the exponent (126.3 becomes 64), so the cast
  is not used anywhere; on a GPU the encoding costs a few integer ops per stored byte.

`TRITON_INTERPRET=1` must be set before this module is imported to run it on CPU tensors.
The interpreter mishandles bf16 arithmetic, so for bf16 the values are converted on the
host there and copied bit for bit as int16 (or quantized from their exact fp32 values).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kvferry_kernels.kv_quant import QuantPages, kv_dtype_of

# Read once: triton decides at decoration time whether a kernel is interpreted.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_MAX_TILE_ELEMENTS = 4096  # heads x head_dim per program
# The kernel's QUANT modes.
_FULL, _INT8, _FP8 = 0, 1, 2
_QUANT_MODE = {"int8": _INT8, "fp8_e4m3": _FP8}


@triton.jit
def _round_half_even(y):
    """fp32 -> the nearest integer (as fp32), ties to even, like torch.round."""
    f = tl.floor(y)
    frac = y - f  # exact
    f_is_odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    up = (frac > 0.5) | ((frac == 0.5) & f_is_odd)
    return tl.where(up, f + 1.0, f)


@triton.jit
def _e4m3_bits(y):
    """fp32 with |y| <= 448 -> float8_e4m3fn bits (uint8), round to nearest even."""
    sign = (y.to(tl.uint32, bitcast=True) >> 24) & 0x80
    a = tl.abs(y)
    bits = a.to(tl.uint32, bitcast=True)
    # Normal (|y| >= 2^-6): keep 3 of 23 mantissa bits, rounding to even (the carry may
    # step the exponent), then rebias the exponent from 127 to 7 (120 << 3).
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - 960
    # Subnormal: multiples of 2^-9, the count is the encoding (8 is 2^-6, the first normal).
    subnormal = _round_half_even(a * 512.0).to(tl.uint32)
    magnitude = tl.where(a < 0.015625, subnormal, normal)
    return (magnitude | sign).to(tl.uint8)


@triton.jit
def _store_tile(
    x,  # [BLOCK_H, BLOCK_D] fp32 for QUANT, else any dtype
    cache_ptr,
    scale_ptr,
    page,
    in_page,
    offs_h,
    offs_d,
    store_mask,  # [BLOCK_H, BLOCK_D]
    head_mask,  # [BLOCK_H]
    stride_n,
    stride_p,
    stride_h,
    stride_d,
    stride_sn,
    stride_sp,
    stride_sh,
    QUANT: tl.constexpr,
):
    """Store one token's heads into its slot: as is (cast to the cache dtype), or quantized
    with a scale per head (int8 values, or fp8 bits into a uint8 view of the values)."""
    dst = (
        cache_ptr
        + page * stride_n
        + in_page * stride_p
        + offs_h[:, None] * stride_h
        + offs_d[None, :] * stride_d
    )
    if QUANT == 0:
        tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=store_mask)
    else:
        amax = tl.max(tl.abs(x), axis=1)  # [BLOCK_H]; masked lanes hold 0
        if QUANT == 1:
            bounded = tl.minimum(tl.maximum(tl.div_rn(amax, 127.0), 1.1754943508222875e-38),
                                 2.6793883890187504e36)  # kv_quant._SCALE_MIN, _SCALE_MAX
            scale = tl.where(amax > 0.0, bounded, 1.0)
            y = tl.div_rn(x, scale[:, None])  # [BLOCK_H, BLOCK_D]
            values = tl.minimum(tl.maximum(_round_half_even(y), -127.0), 127.0).to(tl.int8)
        else:
            bounded = tl.minimum(tl.maximum(tl.div_rn(amax, 448.0), 1.1754943508222875e-38),
                                 7.595588094610019e35)
            scale = tl.where(amax > 0.0, bounded, 1.0)
            y = tl.div_rn(x, scale[:, None])
            values = _e4m3_bits(tl.minimum(tl.maximum(y, -448.0), 448.0))
        tl.store(dst, values, mask=store_mask)
        s_dst = scale_ptr + page * stride_sn + in_page * stride_sp + offs_h * stride_sh
        tl.store(s_dst, scale, mask=head_mask)


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
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
    stride_ksn,
    stride_ksp,
    stride_ksh,
    stride_vsn,
    stride_vsp,
    stride_vsh,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    QUANT: tl.constexpr,  # 0 full precision, 1 int8, 2 fp8 e4m3 (scale pointers unused at 0)
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
    head_mask = offs_h < num_heads_to_store  # [BLOCK_H]
    store_mask = head_mask[:, None] & (offs_d[None, :] < HEAD_DIM)

    k = tl.load(
        k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd,
        mask=mask,
        other=0.0,
    )  # [BLOCK_H, BLOCK_D]
    if QUANT != 0:
        k = k.to(tl.float32)
    _store_tile(k, k_cache_ptr, k_scale_ptr, page, in_page, offs_h, offs_d, store_mask,
                head_mask, stride_kcn, stride_kcp, stride_kch, stride_kcd, stride_ksn, stride_ksp,
                stride_ksh, QUANT)

    v = tl.load(
        v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd,
        mask=mask,
        other=0.0,
    )  # [BLOCK_H, BLOCK_D]
    if QUANT != 0:
        v = v.to(tl.float32)
    _store_tile(v, v_cache_ptr, v_scale_ptr, page, in_page, offs_h, offs_d, store_mask,
                head_mask, stride_vcn, stride_vcp, stride_vch, stride_vcd, stride_vsn, stride_vsp,
                stride_vsh, QUANT)


def _check_inputs(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor | QuantPages,
    v_cache: torch.Tensor | QuantPages,
    slot_mapping: torch.Tensor,
) -> None:
    is_quant = isinstance(k_cache, QuantPages)
    if is_quant != isinstance(v_cache, QuantPages):
        raise ValueError("k_cache and v_cache must both be QuantPages or both tensors")
    k_dtype = k_cache.data.dtype if is_quant else k_cache.dtype
    v_dtype = v_cache.data.dtype if is_quant else v_cache.dtype
    if len(k_cache.shape) != 4 or k_cache.shape != v_cache.shape or k_dtype != v_dtype:
        raise ValueError(
            f"k_cache/v_cache must be equal [N, P, Hkv, D]; got "
            f"{tuple(k_cache.shape)} {k_dtype} and {tuple(v_cache.shape)} {v_dtype}"
        )
    if is_quant and any(p.scale.shape != p.data.shape[:3] for p in (k_cache, v_cache)):
        raise ValueError(
            f"QuantPages scales must be [N, P, Hkv] = {tuple(k_cache.shape[:3])}; got "
            f"{tuple(k_cache.scale.shape)} and {tuple(v_cache.scale.shape)}"
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
            "before importing kvferry_kernels.triton_kv_append"
        )


def _kernel_operands(
    cache: torch.Tensor | QuantPages,
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...], int]:
    """(values, scales, scale strides, QUANT mode) for one cache. fp8 values go in as their
    bytes (the kernel encodes them); a full-precision cache passes itself as an unused
    scale pointer."""
    if not isinstance(cache, QuantPages):
        return cache, cache, (0, 0, 0), _FULL
    mode = _QUANT_MODE[kv_dtype_of(cache)]
    data = cache.data.view(torch.uint8) if mode == _FP8 else cache.data
    return data, cache.scale, cache.scale.stride(), mode


def write_kv_triton(
    k: torch.Tensor,  # [T, Hkv, D], any strides
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor | QuantPages,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor | QuantPages,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64 (or int32), slot = block_id * block_size + offset
) -> None:
    """Write each token's K/V into its slot of the paged pool (in place, cast to the cache
    dtype, or quantized as `kv_quant.quantize` does into QuantPages, values and scales).
    Tokens with a negative slot are skipped."""
    _check_inputs(k, v, k_cache, v_cache, slot_mapping)
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    k_data, k_scale, k_scale_strides, quant = _kernel_operands(k_cache)
    v_data, v_scale, v_scale_strides, _ = _kernel_operands(v_cache)
    if _INTERPRET and quant != _FULL and torch.bfloat16 in (k.dtype, v.dtype):
        k, v = k.float(), v.float()  # exact, and what kv_quant.quantize computes in
    elif _INTERPRET and torch.bfloat16 in (k.dtype, v.dtype, k_data.dtype):
        k, v = k.to(k_data.dtype), v.to(k_data.dtype)
        if k_data.dtype == torch.bfloat16:
            k, v = k.view(torch.int16), v.view(torch.int16)
            k_data, v_data = k_data.view(torch.int16), v_data.view(torch.int16)
            k_scale, v_scale = k_data, v_data

    _, page_size, num_kv_heads, head_dim = k_cache.shape
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, _MAX_TILE_ELEMENTS // block_d))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _write_kv_kernel[grid](
        k,
        v,
        k_data,
        v_data,
        k_scale,
        v_scale,
        slot_mapping,
        *k.stride(),
        *v.stride(),
        *k_data.stride(),
        *v_data.stride(),
        *k_scale_strides,
        *v_scale_strides,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        PAGE_SIZE=page_size,
        QUANT=quant,
        num_warps=4,
    )


__all__ = ["write_kv_triton"]
