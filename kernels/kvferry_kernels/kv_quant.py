"""Quantized K/V pages: int8 and fp8 (e4m3) values with one float32 scale per token and K/V
head, stored in the same page as the values they scale.

Why a scale per (token, K/V head), for keys and values alike:
- a per-tensor scale (one per layer) lets one outlier channel or one loud token set the step
  for everything, and keys carry a few channels tens of times larger than the rest (the
  observation behind KVQuant's and KIVI's per-channel keys);
- per-channel key scales (KIVI, KVQuant) group tokens: a block's scale would change as
  tokens arrive, so the append would requantize, or keep a full-precision tail (KIVI's
  residual window). That buys accuracy at 2-4 bits; at 8 bits a per-token scale already
  brings the error under the model's own bf16 rounding (docs/performance.md), and
  every token is written once, in place, by the append that produces it;
- fp8 e4m3 uses the same layout. vLLM's fp8 cache has one scale per layer (1.0 unless a
  checkpoint or a calibration pass gives one); without a calibration set, a per-token scale
  is what keeps keys' outliers inside e4m3's range (448) and its 3 mantissa bits on the rest.

A page (one layer's K or V for one block) is bytes: `block_size * Hkv * D` values, then
`block_size * Hkv` float32 scales. Transports copy pages as bytes, so the scales travel with
their values and a page checksum covers both. `QuantPages` is the typed view of one layer's
K (or V) pages that kernels read and write.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")
_STORAGE = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
_QMAX = {"int8": 127.0, "fp8_e4m3": 448.0}
SCALE_DTYPE = torch.float32
# amax / qmax is kept within [_SCALE_MIN, _SCALE_MAX[dtype]] (for amax > 0). Below the
# smallest normal float32 the scale loses precision (x / scale then overshoots qmax and is
# clamped: int8 errors past scale / 2) or underflows to 0 (0 / 0: fp8 stores NaN codes for
# finite input). Above the largest float32 <= float32 max / qmax, qmax * scale overflows: a
# float32 amax near float32 max would read back as inf. Both bounds are float32 values, exact
# as written; the Triton append (kvferry_kernels/triton_kv_append.py) applies the same.
_SCALE_MIN = 2.0**-126
_SCALE_MAX = {"int8": 2.6793883890187504e36, "fp8_e4m3": 7.595588094610019e35}


class QuantPages(NamedTuple):
    """One layer's quantized K (or V) pages, as views into the pool's bytes."""

    data: torch.Tensor  # [num_blocks, block_size, Hkv, D] int8 or float8_e4m3fn
    scale: torch.Tensor  # [num_blocks, block_size, Hkv] float32

    @property
    def shape(self) -> torch.Size:  # the values' shape, as for a full-precision cache
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device


def is_quantized(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype in _STORAGE


def storage_dtype(kv_cache_dtype: str) -> torch.dtype:
    return _STORAGE[kv_cache_dtype]


def kv_dtype_of(pages: QuantPages) -> str:
    """The K/V cache dtype name of quantized pages ("int8" or "fp8_e4m3")."""
    return "int8" if pages.data.dtype == torch.int8 else "fp8_e4m3"


def page_bytes(block_size: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: str) -> int:
    """Bytes of one quantized page: the values, then their scales."""
    values = block_size * num_kv_heads * head_dim * _STORAGE[kv_cache_dtype].itemsize
    return values + block_size * num_kv_heads * SCALE_DTYPE.itemsize


def split_pages(pages: torch.Tensor, block_size: int, num_kv_heads: int, head_dim: int,
                kv_cache_dtype: str) -> QuantPages:
    """Typed views of byte pages [..., num_blocks, page_bytes] (uint8, last dim contiguous):
    values [..., num_blocks, block_size, Hkv, D] and scales [..., num_blocks, block_size, Hkv]."""
    storage = _STORAGE[kv_cache_dtype]
    n_values = block_size * num_kv_heads * head_dim * storage.itemsize
    if n_values % SCALE_DTYPE.itemsize:
        raise ValueError(f"a page's values ({n_values} B) must end on a 4-byte boundary")
    data = pages[..., :n_values].view(storage).unflatten(-1, (block_size, num_kv_heads, head_dim))
    scale = pages[..., n_values:].view(SCALE_DTYPE).unflatten(-1, (block_size, num_kv_heads))
    return QuantPages(data, scale)


def max_scale(kv_cache_dtype: str, dtype: torch.dtype) -> float:
    """The largest scale magnitude whose every code dequantizes to a finite value of `dtype`
    (the dtype pages are dequantized into): its largest finite value over the code's largest
    magnitude (127 for int8, 448 for fp8 e4m3). `quantize` of finite input never exceeds it;
    a page with a larger scale is corrupt or hostile (it would read back as inf)."""
    return torch.finfo(dtype).max / _QMAX[kv_cache_dtype]


def quantize(x: torch.Tensor, kv_cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (values [..., D] in the storage dtype, scales [...] float32):
    symmetric, one scale per vector (amax / qmax, kept between the smallest normal float32
    and the largest float32 <= float32 max / qmax; 1 for an all-zero vector). Raises
    ValueError when x holds inf or NaN (no finite scale and codes can store them)."""
    amax = x.float().abs().amax(dim=-1)  # [...]; NaN and inf propagate
    if not bool(torch.isfinite(amax).all()):
        num_bad = int((~torch.isfinite(amax)).sum())
        raise ValueError(f"quantize: {num_bad} of {amax.numel()} K/V vectors hold inf or NaN; "
                         f"only finite K/V can be stored as {kv_cache_dtype}")
    return _quantize(x, kv_cache_dtype)


def _quantize(x: torch.Tensor, kv_cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize` without the finite check (a NaN vector gets scale 1 and int8 codes 0)."""
    xf = x.float()
    qmax = _QMAX[kv_cache_dtype]
    amax = xf.abs().amax(dim=-1)
    bounded = (amax / qmax).clamp_(_SCALE_MIN, _SCALE_MAX[kv_cache_dtype])
    scale = torch.where(amax > 0, bounded, torch.ones_like(amax))
    scaled = xf / scale[..., None]
    if kv_cache_dtype == "int8":
        values = scaled.round_().clamp_(-qmax, qmax).to(torch.int8)
    else:
        values = scaled.clamp_(-qmax, qmax).to(torch.float8_e4m3fn)
    return values, scale


def dequantize(values: torch.Tensor, scale: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """values [..., D] and scales [...] -> [..., D] in `dtype` (computed in float32)."""
    return (values.float() * scale.float()[..., None]).to(dtype)


def fake_quantize(x: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    """What a stored vector reads back as: dequantize(quantize(x)), in x's dtype. Unchecked:
    it runs inside the model's step, also under CUDA-graph capture, where the host cannot
    read a flag; what is stored is checked where it is written (`quantize`, on CPU) and
    where it is received (`KvPool.pages_finite`)."""
    return dequantize(*_quantize(x, kv_cache_dtype), dtype=x.dtype)


def dequantize_pages(pages: QuantPages, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A whole layer's pages as full-precision [num_blocks, block_size, Hkv, D] (tests, and
    the reference that attends over dequantized K/V)."""
    return dequantize(pages.data, pages.scale, dtype)


__all__ = ["KV_CACHE_DTYPES", "QuantPages", "dequantize", "dequantize_pages", "fake_quantize",
           "is_quantized", "kv_dtype_of", "max_scale", "page_bytes", "quantize", "split_pages",
           "storage_dtype"]
