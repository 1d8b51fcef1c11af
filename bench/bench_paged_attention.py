"""Benchmark the Triton paged decode attention on one GPU and write the results as JSON.

    python bench/bench_paged_attention.py --out results.json          # one H200, < 8 min
    python bench/bench_paged_attention.py --out dry.json --dry-run    # CPU, TRITON_INTERPRET=1
    python bench/bench_paged_attention.py --out f.json --sections onelaunch splits  # < 2 min

Needs only torch, triton and this repo's kernels/kvferry_kernels/. For each (Hq, Hkv) x batch
x context it
reports the kernel time (triton.testing.do_bench, which flushes L2 before every run; the
median of --repeats calls, with their range), the
achieved bandwidth counting K/V bytes read, that bandwidth as a fraction of the device's
copy bandwidth measured in the same run (copy bandwidth = bytes read + written / time), and
the speedup over a torch baseline timed in the same run (gather pages into contiguous K/V,
then F.scaled_dot_product_attention with enable_gqa). It also checks, on the GPU only:
native bf16 against the fp32 reference, a cache past 2^31 elements (attention and append),
and replay of a CUDA-graph-captured step with new lengths. The JSON file is rewritten after
every measurement, so a run cut short still leaves its results.

Two sections run only when named: `onelaunch` times the split merge inside the split kernel
against its second launch (do_bench, and inside CUDA graphs on a GPU), with the two outputs'
difference; `splits` times batch 1 at 1 to 8 programs per SM for each K/V head count inside
CUDA graphs and writes the best per head count ("splits_best"), which is what
`triton_paged_attention._PROGRAMS_PER_SM` is to hold.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# TRITON_INTERPRET must be set before triton is imported: parse flags first.
_PARSER = argparse.ArgumentParser(description=__doc__.split("\n")[0])
_PARSER.add_argument("--out", required=True, type=Path, help="where to write the JSON results")
_PARSER.add_argument("--dry-run", action="store_true", help="tiny CPU run under the interpreter")
_PARSER.add_argument("--time-budget-s", type=float, default=420.0, help="skip configs past this")
_PARSER.add_argument("--sections", nargs="+", default=["results", "sweep", "launch"],
                     choices=("results", "sweep", "launch", "onelaunch", "splits"),
                     help="results: the table; sweep: kernel configs and split counts; launch: "
                     "small shapes timed inside CUDA graphs (no launch overhead); onelaunch: "
                     "the merge in the split kernel vs a second launch; splits: programs per "
                     "SM per K/V head count (the last two only when named)")
_PARSER.add_argument("--repeats", type=int, default=3,
                     help="do_bench calls per shape and side; figures are their median [min-max]")
ARGS = _PARSER.parse_args()
if ARGS.dry_run:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "kernels"))
from bench import paged_attention_checks as checks  # noqa: E402
from bench.cuda_graph_timing import graph_ms  # noqa: E402
from kvferry_kernels import triton_paged_attention as tpa  # noqa: E402

DRY = ARGS.dry_run
DEVICE = torch.device("cpu" if DRY else "cuda")
DTYPE = torch.float32 if DRY else torch.bfloat16  # the interpreter cannot do bf16
BLOCK_SIZE, HEAD_DIM = 16, 128
HEAD_PAIRS = [(4, 2)] if DRY else [(32, 8), (64, 8), (32, 32)]
BATCHES = [1, 2] if DRY else [1, 8, 32, 128]
CONTEXTS = [32, 80] if DRY else [1024, 4096, 16384, 32768]
LONG_CONTEXTS = [64, 128] if DRY else [16384, 32768]  # the onelaunch and splits sections
SPLIT_KV_HEADS = [1, 2] if DRY else [1, 2, 4, 8, 16, 32]  # splits: Hq = 4 x Hkv
PROGRAMS_PER_SM = [1, 2, 4, 8]
DRY_NUM_SMS = 4  # the dry run's stand-in for the SM count
START = time.perf_counter()
REPORT: dict[str, Any] = {"results": [], "correctness": [], "config_sweep": [],
                          "launch_free": [], "one_launch": [], "splits": [], "splits_best": {}}


def save() -> None:
    REPORT["elapsed_s"] = round(time.perf_counter() - START, 2)
    ARGS.out.parent.mkdir(parents=True, exist_ok=True)
    ARGS.out.write_text(json.dumps(REPORT, indent=2))


def bench_ms(fn: Callable[[], object]) -> float:
    """Median ms; do_bench (L2 flushed per run) on GPU, a wall clock in the dry run."""
    if DRY:
        fn()
        t0 = time.perf_counter()
        for _ in range(2):
            fn()
        return (time.perf_counter() - t0) / 2 * 1e3
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def bench_reps(fn: Callable[[], object]) -> dict[str, Any]:
    """`--repeats` calls of bench_ms, interleaving nothing: median, min, max and all."""
    samples = [bench_ms(fn) for _ in range(ARGS.repeats)]
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples),
            "samples": samples}


def copy_bandwidth_gbps() -> float:
    num_bytes = (16 << 20) if DRY else (4 << 30)
    src = torch.empty(num_bytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    timed = bench_reps(lambda: dst.copy_(src))
    REPORT["copy_ms"] = timed
    return 2 * num_bytes / (timed["median"] * 1e-3) / 1e9  # read + write


def make_pool(batch: int, ctx: int, hkv: int, extra_blocks: int = 1) -> dict[str, torch.Tensor]:
    """Random K/V for `batch` full sequences of `ctx` tokens, pages shuffled over the pool."""
    blocks_per_seq = ctx // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq + extra_blocks
    shape = (num_blocks, BLOCK_SIZE, hkv, HEAD_DIM)  # [N, P, Hkv, D]
    k_cache = torch.empty(shape, dtype=DTYPE, device=DEVICE).normal_()
    v_cache = torch.empty(shape, dtype=DTYPE, device=DEVICE).normal_()
    perm = torch.randperm(num_blocks - extra_blocks, device=DEVICE) + extra_blocks
    block_table = perm.view(batch, blocks_per_seq).to(torch.int32)  # [B, ctx / P]
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEVICE)
    return {
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_table": block_table,
        "seq_lens": seq_lens,
    }


def torch_baseline(q: torch.Tensor, pool: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
    """Gather pages to contiguous K/V, then SDPA (all sequences full, so no mask needed)."""
    batch, hq, d = q.shape
    bt = pool["block_table"].long()
    k = pool["k_cache"][bt].flatten(1, 2).transpose(1, 2)  # [B, Hkv, ctx, D]
    v = pool["v_cache"][bt].flatten(1, 2).transpose(1, 2)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale, enable_gqa=True)
    return out.view(batch, hq, d)  # [B, Hq, D]


def free_bytes() -> int:
    return torch.cuda.mem_get_info()[0] if not DRY else 1 << 34


def skip_reason(kv_bytes: int) -> str | None:
    """Why a shape of `kv_bytes` of K/V is not measured: past the time budget, or more than
    the device can hold beside what is allocated; None: measure it."""
    if time.perf_counter() - START > ARGS.time_budget_s:
        return "time budget"
    if kv_bytes > 0.85 * free_bytes():
        return "memory"
    return None


def run_config(hq: int, hkv: int, batch: int, ctx: int) -> dict[str, Any]:
    row: dict[str, Any] = {
        "num_q_heads": hq,
        "num_kv_heads": hkv,
        "batch": batch,
        "context": ctx,
        "dtype": str(DTYPE),
        "block_size": BLOCK_SIZE,
    }
    kv_bytes = 2 * batch * ctx * hkv * HEAD_DIM * DTYPE.itemsize
    row["kv_bytes"] = kv_bytes
    if (skipped := skip_reason(kv_bytes)) is not None:
        return row | {"skipped": skipped}
    pool = make_pool(batch, ctx, hkv)
    q = torch.randn(batch, hq, HEAD_DIM, dtype=DTYPE, device=DEVICE)  # [B, Hq, D]
    scale = HEAD_DIM**-0.5
    splits = tpa.choose_num_splits(
        batch, hkv, ctx, tpa._pick_config(DTYPE, not DRY).block_n, DEVICE
    )
    ws = tpa.alloc_decode_workspace(batch, hq, hkv, HEAD_DIM, splits, DEVICE)
    out = torch.empty_like(q)
    args = (q, pool["k_cache"], pool["v_cache"], pool["block_table"], pool["seq_lens"], scale)
    timed = bench_reps(lambda: tpa.paged_decode_attention_triton(*args, workspace=ws, out=out))
    ms = timed["median"]
    gbps = kv_bytes / (ms * 1e-3) / 1e9
    row |= {
        "num_splits": splits,
        "triton_ms": ms,
        "triton_ms_range": [timed["min"], timed["max"]],
        "triton_gbps": gbps,
        "frac_of_copy_bw": gbps / REPORT["copy_bandwidth_gbps"],
    }
    # The baseline materialises a contiguous copy of K and V (plus SDPA's own scratch).
    if 2.2 * kv_bytes > free_bytes():
        row["torch_skipped"] = "memory"
    else:
        try:
            base = torch_baseline(q, pool, scale)
            row["max_abs_diff_vs_torch"] = (base.float() - out.float()).abs().max().item()
            base = None  # free before timing
            base_timed = bench_reps(lambda: torch_baseline(q, pool, scale))
            torch_ms = base_timed["median"]
            row |= {"torch_ms": torch_ms, "torch_ms_range": [base_timed["min"], base_timed["max"]],
                    "speedup_vs_torch": torch_ms / ms}
        except torch.cuda.OutOfMemoryError:
            row["torch_skipped"] = "out of memory"
    return row


def sweep_shape(hq: int, hkv: int, batch: int, ctx: int) -> None:
    pool = make_pool(batch, ctx, hkv)
    q = torch.randn(batch, hq, HEAD_DIM, dtype=DTYPE, device=DEVICE)  # [B, Hq, D]
    args = (q, pool["k_cache"], pool["v_cache"], pool["block_table"], pool["seq_lens"])
    kv_bytes = 2 * batch * ctx * hkv * HEAD_DIM * DTYPE.itemsize
    configs = [(64, 4, 3), (32, 4, 3), (64, 8, 3), (128, 8, 3), (64, 4, 2), (128, 4, 2),
               (64, 4, 4), (64, 8, 2), (32, 4, 2), (128, 8, 2)]
    original = tpa._pick_config
    try:
        for block_n, warps, stages in configs[:2] if DRY else configs:
            cfg = tpa._KernelConfig(block_n, warps, stages)
            tpa._pick_config = lambda dtype, on_gpu, cfg=cfg: cfg  # noqa: E731
            max_splits = max(1, ctx // block_n)
            for splits in (None, 32, 64, 128, 256) if batch == 1 else (None, 1, 2, 4):
                if splits is not None and splits > max_splits:
                    continue
                ms = bench_ms(
                    lambda s=splits: tpa.paged_decode_attention_triton(
                        *args, HEAD_DIM**-0.5, num_splits=s
                    )
                )
                row = {"heads": [hq, hkv], "batch": batch, "context": ctx,
                       "config": cfg._asdict(), "num_splits": splits, "ms": ms,
                       "gbps": kv_bytes / (ms * 1e-3) / 1e9}  # fmt: skip
                REPORT["config_sweep"].append(row)
    finally:
        tpa._pick_config = original


def sweep_configs() -> None:
    """Kernel configs and split counts on a few shapes, to inform `_pick_config` later."""
    shapes = [(32, 8, 8, 4096), (32, 8, 1, 16384), (32, 8, 1, 32768), (32, 32, 1, 16384),
              (32, 32, 1, 32768), (32, 8, 8, 16384)]
    for hq, hkv, batch, ctx in [(4, 2, 1, 64)] if DRY else shapes:
        if time.perf_counter() - START > ARGS.time_budget_s:
            REPORT["config_sweep"].append({"skipped": "time budget", "batch": batch})
            continue
        sweep_shape(hq, hkv, batch, ctx)
        release_memory()
        save()


def launch_free() -> None:
    """Small batch-1 shapes, where a launch costs as much as the work: both sides inside
    CUDA graphs (as the decode worker runs the kernel), L2 flushed before every call."""
    for hq, hkv in HEAD_PAIRS:
        for ctx in CONTEXTS[:2]:
            REPORT["launch_free"].append(launch_free_shape(hq, hkv, ctx))
            save()


def launch_free_shape(hq: int, hkv: int, ctx: int) -> dict[str, Any]:
    pool = make_pool(1, ctx, hkv)
    q = torch.randn(1, hq, HEAD_DIM, dtype=DTYPE, device=DEVICE)  # [B, Hq, D]
    scale = HEAD_DIM**-0.5
    splits = tpa.choose_num_splits(1, hkv, ctx, tpa._pick_config(DTYPE, True).block_n, DEVICE)
    ws = tpa.alloc_decode_workspace(1, hq, hkv, HEAD_DIM, splits, DEVICE)
    out = torch.empty_like(q)
    args = (q, pool["k_cache"], pool["v_cache"], pool["block_table"], pool["seq_lens"], scale)
    ours = graph_ms(lambda: tpa.paged_decode_attention_triton(*args, workspace=ws, out=out),
                    DEVICE, ARGS.repeats)
    theirs = graph_ms(lambda: torch_baseline(q, pool, scale), DEVICE, ARGS.repeats)
    return {"heads": [hq, hkv], "batch": 1, "context": ctx, "num_splits": splits,
            "triton_graph_ms": ours, "torch_graph_ms": theirs, "speedup_vs_torch": theirs / ours}


def one_launch() -> None:
    """The split merge done by the last split program (one launch) against a second launch,
    on long contexts where the split kernel's programs are few enough for the merge to show."""
    for hq, hkv in HEAD_PAIRS:
        for batch in BATCHES[:2]:
            for ctx in LONG_CONTEXTS:
                REPORT["one_launch"].append(one_launch_shape(hq, hkv, batch, ctx))
                release_memory()
                save()


def one_launch_shape(hq: int, hkv: int, batch: int, ctx: int) -> dict[str, Any]:
    kv_bytes = 2 * batch * ctx * hkv * HEAD_DIM * DTYPE.itemsize
    row: dict[str, Any] = {"heads": [hq, hkv], "batch": batch, "context": ctx,
                           "dtype": str(DTYPE), "kv_bytes": kv_bytes}
    if (skipped := skip_reason(kv_bytes)) is not None:
        return row | {"skipped": skipped}
    pool = make_pool(batch, ctx, hkv)
    q = torch.randn(batch, hq, HEAD_DIM, dtype=DTYPE, device=DEVICE)  # [B, Hq, D]
    # The dry run forces two splits (its contexts are one tile) so that the merge runs.
    splits = 2 if DRY else tpa.default_num_splits(batch, hkv, ctx, DTYPE, DEVICE)
    ws = tpa.alloc_decode_workspace(batch, hq, hkv, HEAD_DIM, splits, DEVICE)
    args = (q, pool["k_cache"], pool["v_cache"], pool["block_table"], pool["seq_lens"],
            HEAD_DIM**-0.5)
    outs = {side: torch.empty_like(q) for side in ("one_launch", "two_launch")}

    def call(side: str) -> Callable[[], object]:
        return lambda: tpa.paged_decode_attention_triton(
            *args, workspace=ws, out=outs[side], one_launch=side == "one_launch")

    row["num_splits"] = splits
    samples: dict[str, list[float]] = {side: [] for side in outs}
    for _ in range(ARGS.repeats):  # the sides interleaved, so drift hits both alike
        for side in outs:
            samples[side].append(bench_ms(call(side)))
    for side in outs:
        row |= bandwidth_fields(side, statistics.median(samples[side]), kv_bytes)
        row[f"{side}_ms_range"] = [min(samples[side]), max(samples[side])]
        if not DRY:  # CUDA graphs need a GPU
            graph = graph_ms(call(side), DEVICE, ARGS.repeats)
            row |= bandwidth_fields(f"{side}_graph", graph, kv_bytes)
    for side in outs:
        call(side)()
    diff = outs["one_launch"].float() - outs["two_launch"].float()  # [B, Hq, D]
    row["max_abs_diff"] = diff.abs().max().item()
    row["speedup"] = row["two_launch_ms"] / row["one_launch_ms"]
    if not DRY:
        row["graph_speedup"] = row["two_launch_graph_ms"] / row["one_launch_graph_ms"]
    return row


def bandwidth_fields(name: str, ms: float, kv_bytes: int) -> dict[str, float]:
    """`name`_ms, the K/V bytes read per second, and that as a fraction of the copy
    bandwidth measured in this run."""
    gbps = kv_bytes / (ms * 1e-3) / 1e9
    return {f"{name}_ms": ms, f"{name}_gbps": gbps,
            f"{name}_frac_of_copy_bw": gbps / REPORT["copy_bandwidth_gbps"]}


def split_counts() -> None:
    """Batch 1 at each programs-per-SM target (the split count `choose_num_splits`'s formula
    gives for it), per K/V head count, inside CUDA graphs (the dry run times wall clock)."""
    num_sms = DRY_NUM_SMS if DRY else torch.cuda.get_device_properties(0).multi_processor_count
    block_n = tpa._pick_config(DTYPE, not DRY).block_n
    for hkv in SPLIT_KV_HEADS:
        timed: dict[int, list[float]] = {}  # programs per SM -> ms per context
        for ctx in LONG_CONTEXTS:
            if time.perf_counter() - START > ARGS.time_budget_s:
                REPORT["splits"].append({"num_kv_heads": hkv, "context": ctx,
                                         "skipped": "time budget"})
                continue
            for row in split_count_rows(hkv, ctx, num_sms, block_n):
                REPORT["splits"].append(row)
                timed.setdefault(row["programs_per_sm"], []).append(row["ms"])
                save()
            release_memory()
        full = {pps: ms for pps, ms in timed.items() if len(ms) == len(LONG_CONTEXTS)}
        if full:
            fastest = [min(ms[i] for ms in full.values()) for i in range(len(LONG_CONTEXTS))]
            rel = {pps: statistics.mean(m / f for m, f in zip(ms, fastest, strict=True))
                   for pps, ms in full.items()}
            REPORT["splits_best"][str(hkv)] = {
                "programs_per_sm": min(rel, key=rel.__getitem__),
                "ms_over_fastest": rel,  # mean over the contexts of ms / that context's best
                "table_now": tpa.programs_per_sm(hkv),
            }
        save()


def split_count_rows(hkv: int, ctx: int, num_sms: int, block_n: int) -> list[dict[str, Any]]:
    hq = 4 * hkv
    pool = make_pool(1, ctx, hkv)
    q = torch.randn(1, hq, HEAD_DIM, dtype=DTYPE, device=DEVICE)  # [B, Hq, D]
    out = torch.empty_like(q)
    args = (q, pool["k_cache"], pool["v_cache"], pool["block_table"], pool["seq_lens"],
            HEAD_DIM**-0.5)
    kv_bytes = 2 * ctx * hkv * HEAD_DIM * DTYPE.itemsize
    rows: list[dict[str, Any]] = []
    ms_by_splits: dict[int, float] = {}
    for pps in PROGRAMS_PER_SM:
        splits = tpa.splits_for_occupancy(1, hkv, ctx, block_n, num_sms, pps)
        if splits not in ms_by_splits:  # targets that give the same count share its time
            ws = tpa.alloc_decode_workspace(1, hq, hkv, HEAD_DIM, splits, DEVICE)
            fn = functools.partial(tpa.paged_decode_attention_triton, *args, workspace=ws,
                                   out=out)
            ms_by_splits[splits] = bench_ms(fn) if DRY else graph_ms(fn, DEVICE, ARGS.repeats)
        ms = ms_by_splits[splits]
        rows.append({"num_q_heads": hq, "num_kv_heads": hkv, "batch": 1, "context": ctx,
                     "programs_per_sm": pps, "num_splits": splits, "ms": ms,
                     "timer": "wall clock (dry run)" if DRY else "cuda graph",
                     "gbps": kv_bytes / (ms * 1e-3) / 1e9})
    return rows


def release_memory() -> None:
    if not DRY:
        torch.cuda.empty_cache()


def main() -> None:
    REPORT["meta"] = {
        "device": "cpu (dry run, TRITON_INTERPRET=1)" if DRY else torch.cuda.get_device_name(),
        "num_sms": None if DRY else torch.cuda.get_device_properties(0).multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dry_run": DRY,
        "kernel_config": tpa._pick_config(DTYPE, not DRY)._asdict(),
    }
    REPORT["copy_bandwidth_gbps"] = copy_bandwidth_gbps()
    save()
    report = REPORT["correctness"]
    report += checks.native_dtype(DEVICE, DTYPE, DRY)
    if not DRY:
        report += checks.large_cache(DEVICE, DTYPE, BLOCK_SIZE, HEAD_DIM)
        report += checks.cuda_graph(DEVICE, DTYPE, HEAD_DIM, make_pool(8, 2048, 8))
    save()
    for hq, hkv in HEAD_PAIRS if "results" in ARGS.sections else []:
        for batch in BATCHES:
            for ctx in CONTEXTS:
                REPORT["results"].append(run_config(hq, hkv, batch, ctx))
                release_memory()
                save()
    if "sweep" in ARGS.sections:
        sweep_configs()
    if "launch" in ARGS.sections and not DRY:  # CUDA graphs need a GPU
        launch_free()
    if "onelaunch" in ARGS.sections:
        one_launch()
    if "splits" in ARGS.sections:
        split_counts()
    save()
    failed = [c for c in REPORT["correctness"] if not c["ok"]]
    print(
        f"wrote {ARGS.out}: {len(REPORT['results'])} configs, copy bandwidth "
        f"{REPORT['copy_bandwidth_gbps']:.0f} GB/s, correctness failures: {len(failed)}"
    )
    for row in REPORT["one_launch"]:
        if "skipped" not in row:
            print(f"onelaunch {row['heads']} b{row['batch']} ctx {row['context']} splits "
                  f"{row['num_splits']}: two/one launch {row['speedup']:.3f}x (do_bench)"
                  + (f", {row['graph_speedup']:.3f}x (graph)" if "graph_speedup" in row else "")
                  + f", max abs diff {row['max_abs_diff']:.2e}")
    for hkv, best in REPORT["splits_best"].items():
        print(f"splits: {hkv} K/V heads: best {best['programs_per_sm']} programs per SM "
              f"(table now {best['table_now']})")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
