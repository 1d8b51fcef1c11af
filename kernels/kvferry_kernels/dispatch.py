"""Choose the attention backend by name.

"torch" is the batched torch implementation (CPU or GPU, no extra dependency); on CPU, given a
directory to build it in, full-precision pages are read in place by the C kernel
(`cpu_attention`) instead, where a compiler builds it. "triton" imports
the Triton kernels lazily, so importing this module never pulls in triton; on a machine
without a GPU it needs `TRITON_INTERPRET=1` set before the first `get_attention_backend`
call that names it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from kvferry_kernels import cpu_attention
from kvferry_kernels.paged_attention_ref import write_kv_ref
from kvferry_kernels.paged_attention_torch import paged_decode_attention_torch

# decode_attention(q, k_cache, v_cache, block_table, seq_lens, sm_scale, *, mass=None)
#     -> out [B, Hq, D]. Every backend takes mass= (None, or a float32 [B, >= max(seq_lens)]
#     buffer on q's device): each row's attention probabilities, summed over its query heads,
#     are added to mass[b, :seq_lens[b]] (paged_attention_ref.check_mass); out is unchanged.
DecodeAttentionFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
]
# write_kv(k, v, k_cache, v_cache, slot_mapping) -> None, in place
WriteKVFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
# run_rows(block_table, seq_lens, num_q_heads, num_kv_heads) -> [B] int32, no host sync
RunRowsFn = Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor]

BACKEND_NAMES = ("torch", "triton")


class AttentionBackend(NamedTuple):
    """The two paged-KV operations the model needs, from one implementation: the one
    interface between `kvferry.model.transformer` and the kernels (the core imports it from
    here; kvferry_kernels/ never imports kvferry). Both work on one layer's pages,
    k_cache / v_cache [num_blocks, block_size, kv_heads, head_dim]: full-precision tensors,
    or both `kv_quant.QuantPages` (int8 / fp8 values with their scales), which write_kv
    quantizes into and decode_attention dequantizes from."""

    name: str
    decode_attention: DecodeAttentionFn
    write_kv: WriteKVFn
    cpu_kernel: cpu_attention.CpuAttention | None = None  # reads fp32 CPU pages in place
    # Where set, decode_attention also takes run_rows= (computed once per step by this) and
    # then attends each run of rows, one sequence's query positions, with one read of its
    # K/V. The torch path and the C kernel find runs themselves (kvferry_kernels.query_runs).
    run_rows: RunRowsFn | None = None


def get_attention_backend(name: str, cpu_kernel_dir: Path | None = None) -> AttentionBackend:
    """Return the backend called `name`; raise ValueError naming it when unknown. With
    `cpu_kernel_dir`, "torch" builds (or finds) the C kernel there for fp32 CPU pages."""
    if name == "torch":
        # The batched torch path; paged_attention_ref's per-sequence loop is the tests' oracle.
        kernel = (cpu_attention.load(cpu_kernel_dir)
                  if cpu_kernel_dir is not None and cpu_attention.wanted() else None)
        if kernel is None:
            return AttentionBackend(name, paged_decode_attention_torch, write_kv_ref)
        return AttentionBackend(name, functools.partial(_in_place, kernel), write_kv_ref,
                                kernel)
    if name == "triton":
        from kvferry_kernels.triton_kv_append import write_kv_triton
        from kvferry_kernels.triton_paged_attention import (
            paged_decode_attention_triton,
            query_run_rows,
        )

        return AttentionBackend(name, paged_decode_attention_triton, write_kv_triton,
                                run_rows=query_run_rows)
    raise ValueError(f"unknown attention backend {name!r}; expected one of {BACKEND_NAMES}")


def _in_place(kernel: cpu_attention.CpuAttention, q: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
              sm_scale: float, *, mass: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel over pages it can read (fp32 on CPU), the torch path over any other;
    either adds the attention mass to `mass` where given."""
    if (isinstance(k_cache, torch.Tensor) and k_cache.dtype == torch.float32
            and k_cache.device.type == "cpu"):
        return kernel.paged(q, k_cache, v_cache, block_tables, seq_lens, sm_scale, mass=mass)
    return paged_decode_attention_torch(q, k_cache, v_cache, block_tables, seq_lens, sm_scale,
                                        mass=mass)


__all__ = ["BACKEND_NAMES", "AttentionBackend", "get_attention_backend"]
