"""Decode attention over a speculative step's rows: one sequence's k + 1 query positions
attended together (each K/V line read once for all of them, kernels/kvferry_kernels/query_runs.py)
against each row alone, in the same run, per kernel:

- c: the C kernel over fp32 pages (`CpuAttention.paged`, max_run=rows against max_run=1);
- torch-int8: the torch path over int8 pages (runs against `_attend_rows`);
- triton: on a CUDA device only, bf16 pages (`run_rows` against none).

The shape is the model's (K/V heads, head dim, query heads per K/V head), one torch thread on
CPU, blocks shuffled. Each round times every (context, kernel, mode) in turn, the two modes
of a pair back to back in alternating order; per round the median of `--calls` timed calls.
Printed: microseconds per call, median [min-max] over rounds, and alone / together paired by
round (above 1: grouping is faster). Usage:

    .venv/bin/python bench/bench_query_runs.py --model default [--contexts 256 1024 2048 4096]
        [--rows 5] [--rounds 5] [--kernels c torch-int8] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "kernels"))
from deploy.default_model import BENCH_MODEL_HELP, bench_model  # noqa: E402
from kvferry.model.config import load_model_config  # noqa: E402
from kvferry_kernels import cpu_attention  # noqa: E402
from kvferry_kernels.kv_quant import QuantPages, quantize  # noqa: E402
from kvferry_kernels.paged_attention_torch import (  # noqa: E402
    _attend_rows,
    paged_decode_attention_torch,
)

KERNELS = ("c", "torch-int8", "triton")
BLOCK_SIZE = 16


def _case(context: int, rows: int, kv_heads: int, head_dim: int, group: int,
          device: torch.device, seed: int):
    """Pages of one sequence of `context` tokens (its last `rows` positions the drafts),
    blocks shuffled among twice as many, and `rows` queries."""
    gen = torch.Generator().manual_seed(seed)
    used = -(-context // BLOCK_SIZE)
    num_blocks = 2 * used + 1
    pages = torch.randn(2, num_blocks, BLOCK_SIZE, kv_heads, head_dim, generator=gen)
    order = list(range(num_blocks))
    random.Random(seed).shuffle(order)
    table = torch.tensor(order[:used], dtype=torch.int32).repeat(rows, 1)
    lens = torch.arange(context - rows + 1, context + 1, dtype=torch.int32)
    q = torch.randn(rows, kv_heads * group, head_dim, generator=gen)
    return pages.to(device), table.to(device), lens.to(device), q.to(device)


def _pairs(kernel: str, case, scale: float) -> tuple[Callable[[], object], Callable[[], object]]:
    """(alone, together) calls of one kernel over one case."""
    pages, table, lens, q = case
    if kernel == "c":
        lib = cpu_attention.load(None)
        if lib is None:
            raise SystemExit("bench_query_runs: no C compiler for the kernel")
        rows = q.shape[0]
        return (lambda: lib.paged(q, pages[0], pages[1], table, lens, scale, max_run=1),
                lambda: lib.paged(q, pages[0], pages[1], table, lens, scale, max_run=rows))
    if kernel == "torch-int8":
        k, v = (QuantPages(*quantize(pages[i], "int8")) for i in (0, 1))
        return (lambda: _attend_rows(q, k, v, table, lens, scale),
                lambda: paged_decode_attention_torch(q, k, v, table, lens, scale))
    from kvferry_kernels.triton_paged_attention import (
        paged_decode_attention_triton,
        query_run_rows,
    )

    k, v, qb = pages[0].bfloat16(), pages[1].bfloat16(), q.bfloat16()
    runs = query_run_rows(table, lens, q.shape[1], k.shape[2])
    return (lambda: paged_decode_attention_triton(qb, k, v, table, lens, scale),
            lambda: paged_decode_attention_triton(qb, k, v, table, lens, scale, run_rows=runs))


def _time(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    """Median microseconds of `calls` calls (after one untimed)."""
    fn()
    times = []
    for _ in range(calls):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _summary(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help=BENCH_MODEL_HELP)
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 2048, 4096])
    p.add_argument("--rows", type=int, default=5, help="query positions: k + 1")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--kernels", nargs="+", choices=KERNELS, default=["c", "torch-int8"])
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.rounds < 3 or args.rows < 2 or min(args.contexts) < args.rows:
        p.error("--rounds must be >= 3, --rows >= 2, every context >= --rows")
    device = torch.device("cuda" if "triton" in args.kernels else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--kernels triton needs a CUDA device")
    torch.set_num_threads(1)
    cfg = load_model_config(bench_model(args.model))
    group = cfg.num_heads // cfg.num_kv_heads
    scale = cfg.head_dim**-0.5
    calls = {}
    for context in args.contexts:
        case = _case(context, args.rows, cfg.num_kv_heads, cfg.head_dim, group, device, context)
        for kernel in args.kernels:
            calls[context, kernel] = _pairs(kernel, case, scale)
    times: dict[tuple[int, str, str], list[float]] = {}
    for r in range(args.rounds):
        for (context, kernel), (alone, together) in calls.items():
            order = [("alone", alone), ("together", together)]
            for mode, fn in order if r % 2 == 0 else order[::-1]:
                times.setdefault((context, kernel, mode), []).append(
                    _time(fn, args.calls, device))
    rows = []
    print(f"{cfg.num_kv_heads} K/V heads of {cfg.head_dim}, G = {group}, {args.rows} rows, "
          f"{args.rounds} rounds; us per call, median [min-max]")
    for context, kernel in calls:
        alone, together = (times[context, kernel, m] for m in ("alone", "together"))
        ratio = [a / t for a, t in zip(alone, together, strict=True)]
        row = {"context": context, "kernel": kernel, "alone_us": _summary(alone),
               "together_us": _summary(together), "alone_over_together": _summary(ratio)}
        rows.append(row)
        s = {k: row[k] for k in ("alone_us", "together_us", "alone_over_together")}
        print(f"{kernel:>10} {context:>6}: alone {s['alone_us']['median']:8.1f} "
              f"[{s['alone_us']['min']:.1f}-{s['alone_us']['max']:.1f}]  together "
              f"{s['together_us']['median']:8.1f} [{s['together_us']['min']:.1f}-"
              f"{s['together_us']['max']:.1f}]  ratio {s['alone_over_together']['median']:.2f} "
              f"[{s['alone_over_together']['min']:.2f}-{s['alone_over_together']['max']:.2f}]")
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                        "device": str(device), "results": rows}, indent=1))


if __name__ == "__main__":
    main()
