"""Correctness checks of bench/bench_paged_attention.py's run, each returning its report rows:
native dtype against the fp32 reference, a pool past 2^31 elements, CUDA-graph replay. Import
it after TRITON_INTERPRET is settled (the bench does)."""

from __future__ import annotations

import math
from typing import Any

import torch

from kvferry_kernels import triton_paged_attention as tpa
from kvferry_kernels.paged_attention_ref import paged_decode_attention_ref
from kvferry_kernels.triton_kv_append import write_kv_triton

Check = dict[str, Any]  # one row of the report's "correctness" list


def native_dtype(device: torch.device, dtype: torch.dtype, is_dry: bool) -> list[Check]:
    """Ragged batches in the bench dtype against the fp32 reference (GQA, MQA, D=80)."""
    cases = [
        ((32, 8, 128, 16), [1, 300, 1000, 4097]),
        ((10, 2, 80, 64), [65, 197, 2000]),
        ((16, 1, 128, 1), [130, 7]),
        ((32, 8, 128, 16), [0, 17]),
    ]
    found: list[Check] = []
    for (hq, hkv, d, p), lens in cases:
        lens = [min(n, 150) for n in lens] if is_dry else lens
        pages = [math.ceil(n / p) for n in lens]
        num_blocks = sum(pages) + 1
        k = torch.randn(num_blocks, p, hkv, d, device=device).to(dtype)  # [N, P, Hkv, D]
        v = torch.randn(num_blocks, p, hkv, d, device=device).to(dtype)
        k[0], v[0] = float("nan"), float("nan")  # padding entries point at block 0
        bt = torch.zeros(len(lens), max(pages) + 1, dtype=torch.int32, device=device)
        ids = (torch.randperm(num_blocks - 1, device=device) + 1).to(torch.int32).tolist()
        for b, n in enumerate(pages):
            bt[b, :n] = torch.tensor(ids[:n], dtype=torch.int32)
            ids = ids[n:]
        sl = torch.tensor(lens, dtype=torch.int32, device=device)
        q = torch.randn(len(lens), hq, d, device=device).to(dtype)
        ref = paged_decode_attention_ref(q.float(), k, v, bt, sl, d**-0.5)
        for splits in (None, 1, 4):
            got = tpa.paged_decode_attention_triton(q, k, v, bt, sl, d**-0.5, num_splits=splits)
            err = (got.float() - ref).abs().max().item()
            ok = bool(torch.allclose(got.float(), ref, atol=1e-2, rtol=2e-2))
            found.append(
                {
                    "check": "native dtype vs fp32 ref",
                    "dtype": str(dtype),
                    "heads": [hq, hkv],
                    "head_dim": d,
                    "block_size": p,
                    "lens": lens,
                    "num_splits": splits,
                    "max_abs_err": err,
                    "ok": ok,
                }
            )
    return found


def large_cache(device: torch.device, dtype: torch.dtype, block_size: int, head_dim: int
                ) -> list[Check]:
    """Pages past element 2^31 of the pool: any int32 offset overflow shows up here."""
    hkv, p = 8, block_size
    per_block = p * hkv * head_dim
    num_blocks = (1 << 31) // per_block + 64
    k = torch.empty(num_blocks, p, hkv, head_dim, dtype=dtype, device=device)
    v = torch.empty_like(k)
    high = torch.arange(num_blocks - 64, num_blocks, device=device)  # offsets >= 2^31
    k[high] = torch.randn(64, p, hkv, head_dim, device=device).to(dtype)
    v[high] = torch.randn(64, p, hkv, head_dim, device=device).to(dtype)
    bt = high.flip(0).view(2, 32).to(torch.int32)  # [2, 32]
    sl = torch.tensor([512, 300], dtype=torch.int32, device=device)
    q = torch.randn(2, 32, head_dim, device=device).to(dtype)
    ref = paged_decode_attention_ref(q.float(), k, v, bt, sl, head_dim**-0.5)
    got = tpa.paged_decode_attention_triton(q, k, v, bt, sl, head_dim**-0.5, num_splits=4)
    err = (got.float() - ref).abs().max().item()
    slots = high[-3:] * p + torch.tensor([0, 5, 15], device=device)  # last pages
    new_k = torch.randn(3, hkv, head_dim, device=device)
    write_kv_triton(new_k, new_k, k, v, slots)
    appended = k.view(-1, hkv, head_dim)[slots]
    found = [
        {
            "check": "cache > 2^31 elements",
            "numel": k.numel(),
            "max_abs_err": err,
            "append_exact": bool(torch.equal(appended, new_k.to(dtype))),
            "ok": bool(torch.allclose(got.float(), ref, atol=1e-2, rtol=2e-2))
            and bool(torch.equal(appended, new_k.to(dtype))),
        }
    ]
    del k, v
    torch.cuda.empty_cache()
    return found


def cuda_graph(device: torch.device, dtype: torch.dtype, head_dim: int,
               pool: dict[str, torch.Tensor]) -> list[Check]:
    """Capture one step with fixed buffers, then replay it with new lengths and queries."""
    hq, hkv, batch, max_ctx = 32, 8, 8, 2048  # the pool's shape
    q = torch.randn(batch, hq, head_dim, dtype=dtype, device=device)
    splits = tpa.choose_num_splits(batch, hkv, max_ctx, 64, device)
    ws = tpa.alloc_decode_workspace(batch, hq, hkv, head_dim, splits, device)
    out = torch.empty_like(q)
    args = (q, pool["k_cache"], pool["v_cache"], pool["block_table"], pool["seq_lens"])

    def step() -> None:
        tpa.paged_decode_attention_triton(*args, head_dim**-0.5, workspace=ws, out=out)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    worst = 0.0
    for lens in ([2048] * 8, [1, 17, 500, 2047, 0, 1024, 3, 64]):
        pool["seq_lens"].copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        graph.replay()
        ref = paged_decode_attention_ref(q.float(), *args[1:], head_dim**-0.5)
        worst = max(worst, (out.float() - ref).abs().max().item())
    return [
        {
            "check": "cuda graph replay",
            "num_splits": splits,
            "max_abs_err": worst,
            "ok": worst < 2e-2,
        }
    ]
