"""Triton paged decode attention: split-KV (flash-decoding) with GQA-grouped tiles.

Same contract as `paged_attention_ref.paged_decode_attention_ref`: one query token per
sequence attends over the `seq_lens[b]` cached positions named by `block_table[b]`.

Design:
- Stage 1 runs one program per (split, kv head, sequence). All query heads sharing that KV
  head form one tile (padded to >= 16 rows for `tl.dot`), so every K/V byte is read once per
  step. Each split keeps an fp32 online softmax and writes its partial (max, sum, acc).
- The splits of each (sequence, query head) are merged by log-sum-exp, by default in the
  same launch (but in a second kernel while a CUDA graph is captured: measured faster
  there, see `paged_decode_attention_triton`): each stage-1 program counts itself done on
  an int32 counter per (sequence, K/V head), and the program that finishes last merges all
  splits of its GROUP query heads (`_merge_splits`, the code stage 2 runs per head), writes
  the output and resets the counter to 0 (memory-ordering argument at
  `_count_done_and_merge`). `one_launch=False` runs the
  merge as a second kernel (stage 2) instead, kept for comparison
  (bench/bench_paged_attention.py --sections onelaunch).
- The grid is (num_splits, kv_heads, batch): it depends on shapes only, never on the values
  in `seq_lens`, so a step can be captured in a CUDA graph. Each sequence divides its own
  tiles over the splits; splits past its end are empty and write max = -inf, sum = 0,
  acc = 0, which the merge ignores. With one split, stage 1 writes the output directly.
- Loads of K/V and of the block table are masked by position, so padding entries of the
  block table and stale slots of a partly filled page are never read.

- Quantized caches (`kv_quant.QuantPages`: int8 or fp8 e4m3 values, a float32 scale per
  token and K/V head, strided views into the pool's bytes) are read as their values and
  scales and dequantized inside the kernel. K: the values, converted to q's dtype (exact:
  int8 and e4m3 values are all representable in fp16, bf16 and fp32), go into the dot
  unscaled, and each score column is multiplied by its token's K scale; that is one multiply
  per token instead of one per element. V: the tile is dequantized (values x scale per row,
  in fp32) before its dot. Scaling p by the V scale instead would be as cheap, but p x scale
  can fall under fp16's normal range (scales of ~1e-4 are common) and lose bits there.

- Attention mass (`mass=`, `paged_attention_ref.check_mass`): a split cannot know its
  probabilities before every split's max and sum are known, so the mass is a pass of its own
  after the attention, which is left as it is (the same bits). Each row's log2-sum-exp2 per
  query head comes from the splits' (max, sum) partials (with one split, stage 1 stores its
  own as one split's, `STORE_STATS`), merged as stage 2 merges them; then
  `_attention_mass_kernel` reads K again, one program per (tile of positions, sequence),
  forms the scores as stage 1 does (dequantizing alike), and adds exp2(score - lse) summed
  over every query head to its positions' mass: each entry has one owner, so a plain
  read-add-write, deterministic, no atomics. A call without `mass` launches nothing more.

`TRITON_INTERPRET=1` must be set before this module is imported to run it on CPU tensors.
The interpreter mishandles bf16 (raw integers), so bf16 inputs are upcast to fp32 there
(q only, for quantized caches). The interpreter loads fp8 e4m3 correctly (every finite
byte decodes as torch does; the NaN bytes 0x7f / 0xff read as +-480, and no write produces
them). It runs programs one at a time, split index outermost, so there the last program of
each (sequence, K/V head) is its highest split; its atomics are plain read-modify-writes,
which is all the counting needs.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvferry_kernels import query_runs
from kvferry_kernels.kv_quant import QuantPages
from kvferry_kernels.paged_attention_ref import check_mass

# Read once: triton decides at decoration time whether a kernel is interpreted.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_LOG2E = 1.4426950408889634
_CPU_NUM_SPLITS = 2  # fixed split count off-GPU: the interpreter pays per program
_MIN_TILES_PER_SPLIT = 4  # a split shorter than this costs more in overhead than it saves
_MAX_SPLITS = 64
# Resident programs per SM wanted when batch x K/V heads leaves SMs idle, by K/V head count
# (the nearest key at or below applies). Measured on an H200, bf16, batch 1, 16k and 32k
# tokens, inside CUDA graphs (bench/bench_paged_attention.py --sections splits, run of
# 2026-12-04, bench/results/bench_paged_attention_onelaunch_splits_h200.json): 1 and 2 K/V
# heads tie at every value (the 64-split cap binds), 4 is best at 2, 8 at 4 but within 1% of
# 2 (kept: 2 was also the best of an earlier run), 16 at 4 (2 is 14% slower), 32 at 8.
_PROGRAMS_PER_SM = {1: 2, 2: 2, 4: 2, 8: 2, 16: 4, 32: 8}
_MIN_DOT_ROWS = 16  # tl.dot needs M >= 16
# The split merge loads [heads, splits, D] fp32 tiles of at most this many elements; more
# splits than a tile holds take more loads. Inside the split kernel (one launch) 4096, 32
# registers a thread at 4 warps: a bigger tile made ptxas spill. Stage 2 holds nothing else:
# [64 splits, 128].
_MERGE_TILE_ELEMS = 4096
_STAGE2_TILE_ELEMS = 8192


class DecodeWorkspace(NamedTuple):
    """Per-split partial results of stage 1 (fp32) and the one-launch merge's counters.
    Reusable across steps of equal shape: every call leaves the counters at zero."""

    partial_out: torch.Tensor  # [B, Hq, num_splits, D], unnormalised acc
    partial_max: torch.Tensor  # [B, Hq, num_splits], running max of scores * log2(e)
    partial_sum: torch.Tensor  # [B, Hq, num_splits], softmax denominator at that max
    counters: torch.Tensor  # [B, Hkv] int32: splits done in the running launch; 0 between calls


class _KernelConfig(NamedTuple):
    block_n: int  # tokens per tile
    num_warps: int
    num_stages: int


def alloc_decode_workspace(
    batch: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_splits: int,
    device: torch.device | str,
) -> DecodeWorkspace:
    """Allocate the split-KV workspace: the partials need no initialisation, the counters
    start (and every call leaves them) at zero."""
    return DecodeWorkspace(
        partial_out=torch.empty(
            batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=device
        ),  # [B, Hq, S, D]
        partial_max=torch.empty(
            batch, num_q_heads, num_splits, dtype=torch.float32, device=device
        ),  # [B, Hq, S]
        partial_sum=torch.empty(
            batch, num_q_heads, num_splits, dtype=torch.float32, device=device
        ),  # [B, Hq, S]
        counters=torch.zeros(batch, num_kv_heads, dtype=torch.int32, device=device),  # [B, Hkv]
    )


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _pick_config(dtype: torch.dtype, on_gpu: bool) -> _KernelConfig:
    """Host-side config choice (autotune with several configs fails without a GPU)."""
    if not on_gpu:
        return _KernelConfig(block_n=64, num_warps=4, num_stages=1)
    # Checked by compiling for sm_90 with triton 3.6 (D=128): no spills (bf16: 158
    # registers), cp.async pipelining, 16-byte loads. Timed on an H200 (docs/performance.md):
    # no other tile config was better on every shape of the sweep. fp32 gets a shorter tile
    # because its exact ("ieee") dot runs on FMAs, not tensor cores.
    if dtype == torch.float32:
        return _KernelConfig(block_n=32, num_warps=4, num_stages=3)
    return _KernelConfig(block_n=64, num_warps=4, num_stages=3)


def choose_num_splits(
    batch: int, num_kv_heads: int, max_seq_len: int, block_n: int, device: torch.device
) -> int:
    """Split count from shapes only (CUDA-graph safe): fill the SMs when batch x kv_heads is
    small, but keep every split at least `_MIN_TILES_PER_SPLIT` tiles of the longest allowed
    sequence. `max_seq_len` is the block-table capacity, not the live maximum."""
    if _INTERPRET or device.type != "cuda":
        return max(1, min(_CPU_NUM_SPLITS, triton.cdiv(max(max_seq_len, 1), block_n)))
    num_sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return splits_for_occupancy(
        batch, num_kv_heads, max_seq_len, block_n, num_sms, programs_per_sm(num_kv_heads)
    )


def programs_per_sm(num_kv_heads: int) -> int:
    """The `_PROGRAMS_PER_SM` entry for `num_kv_heads`: the nearest key at or below."""
    return _PROGRAMS_PER_SM[max([k for k in _PROGRAMS_PER_SM if k <= num_kv_heads] or [1])]


def splits_for_occupancy(
    batch: int, num_kv_heads: int, max_seq_len: int, block_n: int, num_sms: int,
    programs_per_sm: int,
) -> int:
    """`choose_num_splits`'s formula for a given occupancy target (benchmarks sweep it):
    about `programs_per_sm` programs per SM, no split shorter than `_MIN_TILES_PER_SPLIT`
    tiles, and no splitting once batch x kv_heads alone fills the SMs."""
    parallel = batch * num_kv_heads
    if parallel >= num_sms:
        return 1
    max_tiles = triton.cdiv(max(max_seq_len, 1), block_n)
    wanted = triton.cdiv(programs_per_sm * num_sms, parallel)
    return max(1, min(wanted, max_tiles // _MIN_TILES_PER_SPLIT, _MAX_SPLITS))


def default_num_splits(
    batch: int, num_kv_heads: int, max_seq_len: int, dtype: torch.dtype, device: torch.device
) -> int:
    """The split count a call given neither `num_splits` nor `workspace` uses, for a block
    table of `max_seq_len` tokens: size a fixed workspace (alloc_decode_workspace) with it."""
    on_gpu = device.type == "cuda" and not _INTERPRET
    block_n = _pick_config(dtype, on_gpu).block_n
    return choose_num_splits(batch, num_kv_heads, max_seq_len, block_n, device)


@triton.jit
def _decode_stage1_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_table_ptr,
    seq_lens_ptr,
    run_rows_ptr,  # [B] int32 rows each program attends (RUN_ROWS > 1 only; else unused)
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    counters_ptr,
    qk_scale,
    num_splits,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_kn,
    stride_kp,
    stride_kh,
    stride_kd,
    stride_vn,
    stride_vp,
    stride_vh,
    stride_vd,
    stride_ksn,
    stride_ksp,
    stride_ksh,
    stride_vsn,
    stride_vsp,
    stride_vsh,
    stride_btb,
    stride_btp,
    stride_ob,
    stride_oh,
    stride_od,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_pod,
    stride_pmb,
    stride_pmh,
    stride_pms,
    stride_cb,
    stride_ch,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_GM: tl.constexpr,  # the one-launch merge's head tile, GROUP padded (1 if unused)
    SPLIT_CHUNK: tl.constexpr,  # splits per load of the one-launch merge (1 if unused)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    IS_QUANT: tl.constexpr,  # K/V are int8/fp8 values with scales (else scale pointers unused)
    ONE_LAUNCH: tl.constexpr,  # the last split of each (sequence, KV head) merges (no stage 2)
    RUN_ROWS: tl.constexpr,  # most rows one program attends (`run_rows`); 1: one row each
    STORE_STATS: tl.constexpr,  # SINGLE_SPLIT: also store (max, sum) as split 0's partials
):
    split = tl.program_id(0)
    kv_head = tl.program_id(1)
    b = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + b)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_d = offs_d < HEAD_DIM
    if RUN_ROWS > 1:
        # Tile row m is query head m % GROUP of row b + m // GROUP, whose length is
        # seq_len + m // GROUP; rows past the run (all, when run_rows[b] is 0) are masked.
        rows = tl.load(run_rows_ptr + b)
        row_j = offs_g // GROUP  # [BLOCK_G]
        mask_g = row_j < rows
        row_len = seq_len + row_j  # [BLOCK_G]
        longest = tl.where(rows > 0, seq_len + rows - 1, 0)
        heads = kv_head * GROUP + offs_g % GROUP
    else:
        rows = 1
        row_j = offs_g * 0
        mask_g = offs_g < GROUP
        row_len = seq_len
        longest = seq_len
        heads = kv_head * GROUP + offs_g  # [BLOCK_G] query heads of this KV head
    num_tiles = (longest + BLOCK_N - 1) // BLOCK_N
    tiles_per_split = (num_tiles + num_splits - 1) // num_splits
    tile_start = split * tiles_per_split
    tile_end = tl.minimum(tile_start + tiles_per_split, num_tiles)
    row_b = b + row_j  # [BLOCK_G] the batch row of each tile row

    q_ptrs = (q_ptr + row_b[:, None] * stride_qb + heads[:, None] * stride_qh
              + offs_d[None, :] * stride_qd)
    q = tl.load(q_ptrs, mask=mask_g[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    bt_row = block_table_ptr + b.to(tl.int64) * stride_btb
    k_head = k_cache_ptr + kv_head * stride_kh
    v_head = v_cache_ptr + kv_head * stride_vh
    k_scale_head = k_scale_ptr + kv_head * stride_ksh
    v_scale_head = v_scale_ptr + kv_head * stride_vsh

    # Every tile below starts before the longest length, so with one row each row sees a
    # finite score and m_i becomes finite on the first iteration: no (-inf) - (-inf). A
    # shorter row of a run can see only -inf in a tile; it stays at -inf (m_ref below).
    for tile in range(tile_start, tile_end):
        pos = tile * BLOCK_N + offs_n  # [BLOCK_N] logical positions
        mask_n = pos < longest
        page = tl.load(bt_row + (pos // PAGE_SIZE) * stride_btp, mask=mask_n, other=0)
        page = page.to(tl.int64)  # page * stride can pass 2^31 elements
        in_page = pos % PAGE_SIZE
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k_off = page * stride_kn + in_page * stride_kp  # [BLOCK_N]
        k = tl.load(
            k_head + k_off[:, None] + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0
        )  # [BLOCK_N, BLOCK_D]
        if IS_QUANT:
            k_sc = tl.load(
                k_scale_head + page * stride_ksn + in_page * stride_ksp, mask=mask_n, other=0.0
            )  # [BLOCK_N]
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
            s = s * (k_sc * qk_scale)[None, :]  # [BLOCK_G, BLOCK_N]
        else:
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if RUN_ROWS > 1:
            s = tl.where(pos[None, :] < row_len[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)  # nothing seen yet: 0
            alpha = tl.exp2(m_i - m_ref)
            p = tl.exp2(s - m_ref[:, None])  # [BLOCK_G, BLOCK_N]
        else:
            s = tl.where(mask_n[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])  # [BLOCK_G, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_off = page * stride_vn + in_page * stride_vp
        v = tl.load(
            v_head + v_off[:, None] + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0
        )  # [BLOCK_N, BLOCK_D]
        if IS_QUANT:
            v_sc = tl.load(
                v_scale_head + page * stride_vsn + in_page * stride_vsp, mask=mask_n, other=0.0
            )  # [BLOCK_N]
            v = (v.to(tl.float32) * v_sc[:, None]).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    row_mask = mask_g[:, None] & mask_d[None, :]
    if SINGLE_SPLIT:
        denom = tl.where(l_i > 0.0, l_i, 1.0)  # empty sequence: acc is 0, output 0
        o = acc / denom[:, None]
        o_ptrs = (out_ptr + row_b[:, None] * stride_ob + heads[:, None] * stride_oh
                  + offs_d[None, :] * stride_od)
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_mask)
        if STORE_STATS:  # for the attention mass's log-sum-exp
            pm_off = row_b * stride_pmb + heads * stride_pmh
            tl.store(part_max_ptr + pm_off, m_i, mask=mask_g)
            tl.store(part_sum_ptr + pm_off, l_i, mask=mask_g)
    else:
        po_ptrs = (
            part_out_ptr
            + row_b[:, None] * stride_pob
            + heads[:, None] * stride_poh
            + split * stride_pos
            + offs_d[None, :] * stride_pod
        )
        tl.store(po_ptrs, acc, mask=row_mask)
        pm_off = row_b * stride_pmb + heads * stride_pmh + split * stride_pms
        tl.store(part_max_ptr + pm_off, m_i, mask=mask_g)
        tl.store(part_sum_ptr + pm_off, l_i, mask=mask_g)
        if ONE_LAUNCH:
            if rows > 0:  # a row another program attends has no counter to count
                _count_done_and_merge(
                    counters_ptr + b * stride_cb + kv_head * stride_ch,
                    out_ptr + b * stride_ob + kv_head * GROUP * stride_oh,
                    part_out_ptr + b * stride_pob + kv_head * GROUP * stride_poh,
                    part_max_ptr + b * stride_pmb + kv_head * GROUP * stride_pmh,
                    part_sum_ptr + b * stride_pmb + kv_head * GROUP * stride_pmh,
                    num_splits, rows, stride_ob, stride_oh, stride_od, stride_pob, stride_poh,
                    stride_pos, stride_pod, stride_pmb, stride_pmh, stride_pms, GROUP, BLOCK_GM,
                    SPLIT_CHUNK, HEAD_DIM, BLOCK_D,
                )


@triton.jit
def _count_done_and_merge(
    counter_ptr,  # this (sequence, KV head)'s counter
    o_ptr,  # out at (sequence, first query head of the KV head, d = 0)
    po_ptr,  # partial_out at (sequence, that head, split 0, d = 0)
    pm_ptr,  # partial_max at (sequence, that head, split 0)
    ps_ptr,  # partial_sum at (sequence, that head, split 0)
    num_splits,
    rows,  # batch rows merged: the sequence's and the next rows - 1 (a run's)
    stride_ob,
    stride_oh,
    stride_od,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_pod,
    stride_pmb,
    stride_pmh,
    stride_pms,
    GROUP: tl.constexpr,
    BLOCK_GM: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Count this split done; the last of the (sequence, KV head) merges every split's
    partials of its GROUP query heads, for each of its `rows` rows, into `out`
    (`_merge_splits`, stage 2's code) and resets the counter to 0 for the next launch.

    Why the last program reads every split's partials in full:
    - Release: the partials were stored by all threads of each program; `debug_barrier`
      (bar.sync) orders them before the one thread that performs the scalar atomic, and a
      release at gpu scope is cumulative over what its thread has observed, so all of that
      program's stores become visible with its increment. (Triton put no CTA barrier
      before a release atomic until triton-lang/triton#10816, hence the explicit one.)
    - Every increment is a read-modify-write on one address, so each program's release
      heads a release sequence that the later increments continue: the acquire of the
      program that reads num_splits - 1 synchronizes with every other split's release,
      not only with the one just before it.
    - Acquire: Triton performs a scalar atomic in one thread and hands its result to the
      others through shared memory and a CTA barrier; the loads below are taken only after
      that (they depend on the result), so they happen after the acquire in every thread.
      They are `.cg` loads (L2, never a stale L1 line): the partials come from other SMs.
    - Reset: the last program alone writes the 0, after every increment of this launch
      (it has seen them all), so none is lost; the next launch on the stream sees 0.
    Checked in the PTX of triton 3.6 for sm_90: bar.sync; one thread's
    atom.global.gpu.acq_rel.add; st.shared; bar.sync; ld.shared; then ld.global.cg.
    """
    tl.debug_barrier()
    num_done = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if num_done == num_splits - 1:
        for j in range(0, rows):
            _merge_splits(
                o_ptr + j * stride_ob, po_ptr + j * stride_pob, pm_ptr + j * stride_pmb,
                ps_ptr + j * stride_pmb, num_splits, stride_oh, stride_od, stride_poh,
                stride_pos, stride_pod, stride_pmh, stride_pms, GROUP, BLOCK_GM, SPLIT_CHUNK,
                HEAD_DIM, BLOCK_D,
            )
        tl.store(counter_ptr, 0)


@triton.jit
def _merge_splits(
    o_ptr,  # out at (sequence, first query head, d = 0)
    po_ptr,  # partial_out at (sequence, that head, split 0, d = 0)
    pm_ptr,  # partial_max at (sequence, that head, split 0)
    ps_ptr,  # partial_sum at (sequence, that head, split 0)
    num_splits,
    stride_oh,
    stride_od,
    stride_poh,
    stride_pos,
    stride_pod,
    stride_pmh,
    stride_pms,
    GROUP: tl.constexpr,  # query heads merged together
    BLOCK_GM: tl.constexpr,  # GROUP padded to a power of two (no tl.dot here: no 16-row pad)
    SPLIT_CHUNK: tl.constexpr,  # splits per load: one [BLOCK_GM, SPLIT_CHUNK, BLOCK_D] tile
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Merge the split partials of GROUP query heads by log-sum-exp into `out`, SPLIT_CHUNK
    splits per load with an online rescale between loads (one load when they all fit).
    Empty splits (max -inf, sum 0) weigh nothing; an empty sequence gives 0."""
    offs_g = tl.arange(0, BLOCK_GM)
    offs_c = tl.arange(0, SPLIT_CHUNK)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    m_run = tl.full([BLOCK_GM], float("-inf"), dtype=tl.float32)
    l_run = tl.zeros([BLOCK_GM], dtype=tl.float32)
    acc = tl.zeros([BLOCK_GM, BLOCK_D], dtype=tl.float32)
    for s0 in range(0, num_splits, SPLIT_CHUNK):
        split = s0 + offs_c
        mask_gs = mask_g[:, None] & (split < num_splits)[None, :]  # [BLOCK_GM, SPLIT_CHUNK]
        ml_off = offs_g[:, None] * stride_pmh + split[None, :] * stride_pms
        m = tl.load(pm_ptr + ml_off, mask=mask_gs, other=float("-inf"), cache_modifier=".cg")
        l = tl.load(ps_ptr + ml_off, mask=mask_gs, other=0.0, cache_modifier=".cg")  # noqa: E741
        is_live = (m > float("-inf")) & (l > 0.0)
        m_new = tl.maximum(m_run, tl.max(tl.where(is_live, m, float("-inf")), axis=1))
        m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)  # no live split yet: 0
        alpha = tl.exp2(m_run - m_ref)  # m_run = -inf: 0 (acc and l_run are 0 then)
        w = tl.where(is_live, tl.exp2(tl.where(is_live, m, m_ref[:, None]) - m_ref[:, None]), 0.0)
        po_off = (offs_g[:, None, None] * stride_poh + split[None, :, None] * stride_pos
                  + offs_d[None, None, :] * stride_pod)
        part = tl.load(po_ptr + po_off, mask=mask_gs[:, :, None] & mask_d[None, None, :],
                       other=0.0, cache_modifier=".cg")  # [BLOCK_GM, SPLIT_CHUNK, BLOCK_D]
        part = tl.where(is_live[:, :, None], part * w[:, :, None], 0.0)
        acc = acc * alpha[:, None] + tl.sum(part, axis=1)
        l_run = l_run * alpha + tl.sum(w * l, axis=1)
        m_run = m_new
    o = acc / tl.where(l_run > 0.0, l_run, 1.0)[:, None]
    o_ptrs = o_ptr + offs_g[:, None] * stride_oh + offs_d[None, :] * stride_od
    tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])


@triton.jit
def _decode_stage2_kernel(
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    num_splits,
    stride_ob,
    stride_oh,
    stride_od,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_pod,
    stride_pmb,
    stride_pmh,
    stride_pms,
    SPLIT_CHUNK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    head = tl.program_id(0)
    b = tl.program_id(1)
    pm_off = b * stride_pmb + head * stride_pmh
    _merge_splits(
        out_ptr + b * stride_ob + head * stride_oh,
        part_out_ptr + b * stride_pob + head * stride_poh,
        part_max_ptr + pm_off,
        part_sum_ptr + pm_off,
        num_splits, stride_oh, stride_od, stride_poh, stride_pos, stride_pod, stride_pmh,
        stride_pms, 1, 1, SPLIT_CHUNK, HEAD_DIM, BLOCK_D,
    )


@triton.jit
def _attention_mass_kernel(
    q_ptr, k_cache_ptr, k_scale_ptr, block_table_ptr, seq_lens_ptr, lse_ptr, mass_ptr,
    qk_scale, num_kv_heads,
    stride_qb, stride_qh, stride_qd, stride_kn, stride_kp, stride_kh, stride_kd,
    stride_ksn, stride_ksp, stride_ksh, stride_btb, stride_btp, stride_lb, stride_lh,
    stride_mb,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    IS_QUANT: tl.constexpr,
):
    """mass[b, p] += sum over every query head h of exp2(score[h, p] - lse[b, h]), for the
    BLOCK_N positions p of tile program_id(0) of sequence program_id(1) below its length;
    scores formed as stage 1 forms them (log2 units), lse their log2-sum-exp2 per head.
    The program alone owns these mass entries: a plain read-add-write."""
    tile = tl.program_id(0)
    b = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    if tile * BLOCK_N < seq_len:
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        mask_g = offs_g < GROUP
        mask_n = pos < seq_len
        q_mask = mask_g[:, None] & (offs_d < HEAD_DIM)[None, :]
        kv_mask = mask_n[:, None] & (offs_d < HEAD_DIM)[None, :]
        page = tl.load(block_table_ptr + b.to(tl.int64) * stride_btb
                       + (pos // PAGE_SIZE) * stride_btp, mask=mask_n, other=0).to(tl.int64)
        k_off = page * stride_kn + (pos % PAGE_SIZE) * stride_kp  # [BLOCK_N]
        ks_off = page * stride_ksn + (pos % PAGE_SIZE) * stride_ksp
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        for kv_head in range(num_kv_heads):
            heads = kv_head * GROUP + offs_g  # [BLOCK_G]
            q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh
                        + offs_d[None, :] * stride_qd, mask=q_mask, other=0.0)
            k = tl.load(k_cache_ptr + kv_head * stride_kh + k_off[:, None]
                        + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
            if IS_QUANT:
                k_sc = tl.load(k_scale_ptr + kv_head * stride_ksh + ks_off, mask=mask_n,
                               other=0.0)  # [BLOCK_N]
                s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
                s = s * (k_sc * qk_scale)[None, :]  # [BLOCK_G, BLOCK_N]
            else:
                s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            lse = tl.load(lse_ptr + b * stride_lb + heads * stride_lh, mask=mask_g, other=0.0)
            p = tl.exp2(s - lse[:, None])
            total += tl.sum(tl.where(mask_g[:, None] & mask_n[None, :], p, 0.0), axis=0)
        mass_ptrs = mass_ptr + b.to(tl.int64) * stride_mb + pos
        tl.store(mass_ptrs, tl.load(mass_ptrs, mask=mask_n, other=0.0) + total, mask=mask_n)


def _log2_sum_exp2(part_max: torch.Tensor,  # [B, Hq, S], stage 1's max of scores in log2
                   part_sum: torch.Tensor,  # [B, Hq, S], its sum of exp2(score - max)
                   ) -> torch.Tensor:  # [B, Hq] float32
    """Each (row, query head)'s log2 of its softmax denominator, the splits merged as
    `_merge_splits` merges them (splits with max -inf or sum 0 weigh nothing); -inf for a
    row with no position. Tensor ops, no host sync."""
    is_live = (part_max > float("-inf")) & (part_sum > 0.0)
    top = torch.where(is_live, part_max, float("-inf")).amax(dim=-1, keepdim=True)
    ref = torch.where(top > float("-inf"), top, 0.0)  # [B, Hq, 1]
    weight = torch.exp2(torch.where(is_live, part_max, ref) - ref)
    total = torch.where(is_live, weight * part_sum, 0.0).sum(dim=-1, keepdim=True)
    return (ref + torch.log2(total)).squeeze(-1)


def _add_attention_mass(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor | QuantPages,  # [num_blocks, block_size, Hkv, D]
    block_table: torch.Tensor,  # [B, max_blocks]
    seq_lens: torch.Tensor,  # [B]
    sm_scale: float,
    stats: tuple[torch.Tensor, torch.Tensor],  # stage 1's (max, sum) partials [B, Hq, S]
    mass: torch.Tensor,  # [B, M] float32, added to
    cfg: _KernelConfig,
) -> None:
    """Launch `_attention_mass_kernel` over every tile a row of the table can hold."""
    batch, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    num_tiles = triton.cdiv(min(mass.shape[1], block_table.shape[1] * page_size), cfg.block_n)
    if num_tiles == 0:
        return
    lse = _log2_sum_exp2(*stats)  # [B, Hq]
    is_quant = isinstance(k_cache, QuantPages)
    k_data, k_scale = (k_cache.data, k_cache.scale) if is_quant else (k_cache, k_cache)
    _attention_mass_kernel[(num_tiles, batch)](
        q, k_data, k_scale, block_table, seq_lens, lse, mass, sm_scale * _LOG2E, num_kv_heads,
        *q.stride(), *k_data.stride(), *(k_scale.stride() if is_quant else (0, 0, 0)),
        *block_table.stride(), *lse.stride(), mass.stride(0),
        GROUP=group,
        BLOCK_G=max(_MIN_DOT_ROWS, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        PAGE_SIZE=page_size,
        BLOCK_N=cfg.block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        IS_QUANT=is_quant,
        num_warps=cfg.num_warps,
    )


def run_capacity(group: int) -> int:
    """Most rows of a run one program attends: as many as fill the 16-row tile that `tl.dot`
    needs anyway (GROUP query heads each), so a run costs no bigger tile than one row."""
    return max(1, _MIN_DOT_ROWS // group)


def query_run_rows(block_table: torch.Tensor, seq_lens: torch.Tensor, num_q_heads: int,
                   num_kv_heads: int) -> torch.Tensor:  # [B] int32
    """`run_rows` for `paged_decode_attention_triton`: computed on the tensors' device with
    no host sync (once per step serves every layer)."""
    return query_runs.run_rows(block_table, seq_lens, run_capacity(num_q_heads // num_kv_heads))


def _split_chunk(num_splits: int, block_gm: int, block_d: int, tile_elems: int) -> int:
    """Splits per load of the merge: all of them if a tile holds them, else a power of two."""
    fits = max(1, tile_elems // (block_gm * block_d))
    return min(triton.next_power_of_2(num_splits), triton.next_power_of_2(fits + 1) // 2)


def _check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor | QuantPages,
    v_cache: torch.Tensor | QuantPages,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    if q.dim() != 3 or len(k_cache.shape) != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"q must be [B, Hq, D] and k_cache/v_cache equal [N, P, Hkv, D]; got "
            f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
            f"v_cache {tuple(v_cache.shape)}"
        )
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"head_dim/heads mismatch: q {tuple(q.shape)}, cache "
            f"{tuple(k_cache.shape)} (Hq must be a multiple of Hkv)"
        )
    is_quant = isinstance(k_cache, QuantPages)
    if is_quant != isinstance(v_cache, QuantPages):
        raise ValueError("k_cache and v_cache must both be QuantPages or both tensors")
    if is_quant:
        if k_cache.data.dtype != v_cache.data.dtype or any(
            p.scale.shape != p.data.shape[:3] or p.scale.dtype != torch.float32
            for p in (k_cache, v_cache)
        ):
            raise ValueError(
                f"QuantPages must hold equal value dtypes and float32 scales [N, P, Hkv]; got "
                f"{k_cache.data.dtype} / {v_cache.data.dtype} values, scales "
                f"{tuple(k_cache.scale.shape)} / {tuple(v_cache.scale.shape)}"
            )
    elif not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(
            f"dtype mismatch: q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}"
        )
    if block_table.dim() != 2 or block_table.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError(
            f"block_table must be [B, max_blocks] and seq_lens [B] with B={batch}; "
            f"got {tuple(block_table.shape)} and {tuple(seq_lens.shape)}"
        )
    if block_table.dtype not in (torch.int32, torch.int64) or seq_lens.dtype not in (
        torch.int32,
        torch.int64,
    ):
        raise ValueError("block_table and seq_lens must be int32 or int64")
    if not _INTERPRET and q.device.type != "cuda":
        raise ValueError(
            "triton attention needs CUDA tensors, or TRITON_INTERPRET=1 set "
            "before importing kvferry_kernels.triton_paged_attention"
        )


def _check_workspace(
    ws: DecodeWorkspace,
    batch: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_splits: int,
) -> None:
    lead = (batch, num_q_heads, num_splits)
    partials = (ws.partial_out, ws.partial_max, ws.partial_sum)
    if (
        tuple(ws.partial_out.shape) != (*lead, head_dim)
        or tuple(ws.partial_max.shape) != lead
        or ws.partial_sum.shape != ws.partial_max.shape
        or ws.partial_sum.stride() != ws.partial_max.stride()
        or any(t.dtype != torch.float32 for t in partials)
    ):
        raise ValueError(
            f"workspace must be fp32 with partial_out {(*lead, head_dim)} and "
            f"partial_max/partial_sum {lead} of equal strides "
            "(see alloc_decode_workspace)"
        )
    counters = ws.counters
    if (
        not isinstance(counters, torch.Tensor)
        or tuple(counters.shape) != (batch, num_kv_heads)
        or counters.dtype != torch.int32
        or counters.device != ws.partial_out.device
    ):
        found = (
            f"{tuple(counters.shape)} {counters.dtype}"
            if isinstance(counters, torch.Tensor)
            else type(counters).__name__
        )
        raise ValueError(
            f"workspace.counters must be int32 [B, Hkv] = {(batch, num_kv_heads)}, zeroed, on "
            f"the partials' device; got {found} (see alloc_decode_workspace)"
        )


def paged_decode_attention_triton(
    q: torch.Tensor,  # [B, Hq, D], any strides
    k_cache: torch.Tensor | QuantPages,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor | QuantPages,  # [num_blocks, block_size, Hkv, D]
    block_table: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    sm_scale: float,
    num_splits: int | None = None,
    workspace: DecodeWorkspace | None = None,
    out: torch.Tensor | None = None,  # [B, Hq, D], q's dtype; written, not read
    *,
    one_launch: bool | None = None,
    run_rows: torch.Tensor | None = None,  # [B] int32 from `query_run_rows`
    mass: torch.Tensor | None = None,  # [B, >= max(seq_lens)] float32, added to
) -> torch.Tensor:  # [B, Hq, D]
    """Paged decode attention; same result as `paged_decode_attention_ref`.

    `num_splits` defaults to the workspace's split count when one is given, else to
    `choose_num_splits` on the block-table capacity. Passing a fixed `workspace` and `out`
    makes the call allocation-free and its grid fixed (CUDA-graph capturable).
    K/V caches are both tensors of q's dtype or both `kv_quant.QuantPages` (any q dtype).
    `one_launch` merges the splits inside the split kernel; False runs the merge as a second
    launch. Default: one launch, except while a CUDA graph is being captured. Measured on an
    H200 (bf16, batch 1, 8 K/V heads, 16-32k tokens): one launch is 1.3-1.4x faster called
    from Python, where the second launch's overhead shows, and 4-14% slower replayed from a
    graph, where launches cost nothing and the last program's serial merge does
    (docs/performance.md). A workspace serves one call at a time (one stream): its counters
    are shared by the launch in flight.
    `run_rows` (`query_run_rows` of the same block table and lengths): the rows of a run,
    one sequence's query positions, are attended by one program per K/V head and split,
    each K/V tile read once for all of them; None: one program per row.
    `mass` (`paged_attention_ref.check_mass`): each row's probabilities summed over its query
    heads are added to mass[b, :seq_lens[b]] by a pass after the attention (module
    docstring); the output is the same bits. Never inside a CUDA graph: it allocates.
    """
    _check_inputs(q, k_cache, v_cache, block_table, seq_lens)
    if run_rows is not None and (run_rows.shape != seq_lens.shape
                                 or run_rows.dtype != torch.int32
                                 or run_rows.device != seq_lens.device):
        raise ValueError(f"run_rows must be int32 {tuple(seq_lens.shape)} on "
                         f"{seq_lens.device} (see query_run_rows)")
    if mass is not None:
        check_mass(mass, q, seq_lens, block_table.shape[1] * k_cache.shape[1])
    is_quant = isinstance(k_cache, QuantPages)
    if _INTERPRET and q.dtype == torch.bfloat16:
        result = paged_decode_attention_triton(
            q.float(),
            k_cache if is_quant else k_cache.float(),
            v_cache if is_quant else v_cache.float(),
            block_table,
            seq_lens,
            sm_scale,
            num_splits=num_splits,
            workspace=workspace,
            one_launch=one_launch,
            run_rows=run_rows,
            mass=mass,
        )
        if out is None:
            return result.to(torch.bfloat16)
        return out.copy_(result)

    batch, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    on_gpu = q.device.type == "cuda" and not _INTERPRET
    cfg = _pick_config(q.dtype, on_gpu)
    if num_splits is None:
        num_splits = (
            workspace.partial_max.shape[2]
            if workspace is not None
            else default_num_splits(
                batch, num_kv_heads, block_table.shape[1] * page_size, q.dtype, q.device
            )
        )
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if out is None:
        out = torch.empty(batch, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(
            f"out must be {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)} {out.dtype}"
        )
    if batch == 0:
        return out
    if num_splits > 1:
        if workspace is None:
            workspace = alloc_decode_workspace(
                batch, num_q_heads, num_kv_heads, head_dim, num_splits, q.device
            )
        _check_workspace(workspace, batch, num_q_heads, num_kv_heads, head_dim, num_splits)
        ws = workspace
        po_strides, pm_strides = ws.partial_out.stride(), ws.partial_max.stride()
        counter_strides = ws.counters.stride()
    else:  # one split writes `out` directly; the workspace pointers are never dereferenced
        ws = DecodeWorkspace(out, out, out, out)
        po_strides, pm_strides, counter_strides = (0, 0, 0, 0), (0, 0, 0), (0, 0)
        if mass is not None:  # but for (max, sum), which the mass needs (STORE_STATS)
            stats = torch.empty(2, batch, num_q_heads, 1, dtype=torch.float32, device=q.device)
            ws = DecodeWorkspace(out, stats[0], stats[1], out)  # [B, Hq, 1] each
            pm_strides = stats[0].stride()
    if one_launch is None:
        one_launch = not (on_gpu and torch.cuda.is_current_stream_capturing())
    is_one_launch = num_splits > 1 and one_launch

    if is_quant:
        k_data, v_data, k_scale, v_scale = k_cache.data, v_cache.data, k_cache.scale, v_cache.scale
        k_scale_strides, v_scale_strides = k_scale.stride(), v_scale.stride()
    else:  # the scale pointers are never dereferenced
        k_data, v_data, k_scale, v_scale = k_cache, v_cache, k_cache, v_cache
        k_scale_strides = v_scale_strides = (0, 0, 0)
    block_d = triton.next_power_of_2(head_dim)
    block_gm = triton.next_power_of_2(group)
    _decode_stage1_kernel[(num_splits, num_kv_heads, batch)](
        q,
        k_data,
        v_data,
        k_scale,
        v_scale,
        block_table,
        seq_lens,
        seq_lens if run_rows is None else run_rows,
        out,
        ws.partial_out,
        ws.partial_max,
        ws.partial_sum,
        ws.counters,
        sm_scale * _LOG2E,
        num_splits,
        *q.stride(),
        *k_data.stride(),
        *v_data.stride(),
        *k_scale_strides,
        *v_scale_strides,
        *block_table.stride(),
        *out.stride(),
        *po_strides,
        *pm_strides,
        *counter_strides,
        GROUP=group,
        BLOCK_G=max(_MIN_DOT_ROWS, triton.next_power_of_2(group)),
        BLOCK_GM=block_gm if is_one_launch else 1,
        SPLIT_CHUNK=_split_chunk(num_splits, block_gm, block_d, _MERGE_TILE_ELEMS)
        if is_one_launch
        else 1,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        PAGE_SIZE=page_size,
        BLOCK_N=cfg.block_n,
        SINGLE_SPLIT=num_splits == 1,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        IS_QUANT=is_quant,
        ONE_LAUNCH=is_one_launch,
        RUN_ROWS=1 if run_rows is None else run_capacity(group),
        STORE_STATS=num_splits == 1 and mass is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if num_splits > 1 and not is_one_launch:
        _decode_stage2_kernel[(num_q_heads, batch)](
            out,
            ws.partial_out,
            ws.partial_max,
            ws.partial_sum,
            num_splits,
            *out.stride(),
            *po_strides,
            *pm_strides,
            SPLIT_CHUNK=_split_chunk(num_splits, 1, block_d, _STAGE2_TILE_ELEMS),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            num_warps=4 if on_gpu else 1,
        )
    if mass is not None:
        _add_attention_mass(q, k_cache, block_table, seq_lens, sm_scale,
                            (ws.partial_max, ws.partial_sum), mass, cfg)
    return out


__all__ = [
    "DecodeWorkspace",
    "alloc_decode_workspace",
    "choose_num_splits",
    "default_num_splits",
    "paged_decode_attention_triton",
    "programs_per_sm",
    "query_run_rows",
    "run_capacity",
    "splits_for_occupancy",
]
